"""Model versions in a real SQLite registry: lineage tags and description, one model copy per version, the
retention rule for never-champion versions, and the flow report of a run that registered nothing.

The registrations are the real `register` stage (`run_register`) in a git project in tmp_path, under a real
pipeline run with a `train` child (`pipeline.tracking.runs.stage_run`), with a dvc.lock written as DVC writes it.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
from datetime import UTC, datetime
from pathlib import Path

import pytest
import yaml

from pipeline.config import load_params
from pipeline.config.specs import tracking_spec

GIT = ["git", "-c", "user.name=t", "-c", "user.email=t@example.invalid", "-c", "commit.gpgsign=false"]


def _metrics(root: Path, id_f1: float, ood: float) -> None:
    def ci(m: float) -> dict[str, float]:
        return {"mean": m, "low": m - 1.0, "high": m + 1.0}

    averages = {
        "id": {"em": ci(id_f1), "f1": ci(id_f1), "ssim": ci(50.0)},
        "ood": {"em": ci(ood), "f1": ci(ood), "ssim": ci(60.0)},
    }
    out = root / "reports" / "eval"
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.json").write_text(
        json.dumps({"mode": "ours", "rows_per_dataset": 4, "averages": {"prompt_r1": averages}})
    )


def _lock_model(root: Path, md5: str) -> None:
    """dvc.lock's `merge` entry for models/agent, with the directory's real size and file count."""
    files = [p for p in (root / "models" / "agent").rglob("*") if p.is_file()]
    out = {
        "path": "models/agent",
        "hash": "md5",
        "md5": md5,
        "size": sum(p.stat().st_size for p in files),
        "nfiles": len(files),
    }
    (root / "dvc.lock").write_text(yaml.safe_dump({"schema": "2.0", "stages": {"merge": {"outs": [out]}}}))


@pytest.fixture()
def project(tmp_path, repo_root, monkeypatch):
    """A git project with the repository's params and a small model in models/agent; a pipeline run with a
    train child recorded in reports/mlflow_run.json. Returns (params, the train run id, HEAD)."""
    from pipeline.tracking.runs import stage_run

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    shutil.copy(repo_root / "params.yaml", tmp_path / "params.yaml")
    (tmp_path / ".gitignore").write_text("mlflow.db\nmlartifacts/\nreports/\nmodels/\n.cache/\ndvc.lock\n")
    subprocess.run(["git", "init", "-q", "-b", "main"], cwd=tmp_path, check=True)
    subprocess.run([*GIT, "add", "-A"], cwd=tmp_path, check=True)
    subprocess.run([*GIT, "commit", "-q", "-m", "project"], cwd=tmp_path, check=True)
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=tmp_path, check=True, capture_output=True, text=True
    ).stdout.strip()
    model = tmp_path / "models" / "agent"
    model.mkdir(parents=True)
    (model / "weights.bin").write_bytes(hashlib.sha256(b"w").digest() * 4096)  # 128 KiB, found by name below
    (model / "notes.txt").write_text("a stand-in model: register copies files, it never loads them\n")
    params = load_params(tmp_path / "params.yaml")
    with stage_run(tracking_spec(params), "train", new_parent=True) as train:
        pass
    return params, train.info.run_id, head


def test_version_has_lineage_description_and_one_model_copy(project, tiny_llama_dir):
    import mlflow

    from pipeline.stages.register import run_register
    from pipeline.tracking.runs import parent_run_id

    params, train_run, head = project
    model = params.path(params.paths.model_dir)
    shutil.copytree(tiny_llama_dir, model, dirs_exist_ok=True)  # a real HF directory: config.json and all
    _lock_model(params.root, "0123456789abcdef0123456789abcdef.dir")
    _metrics(params.root, 30.0, 40.0)
    result = run_register(params)

    client = mlflow.MlflowClient()
    version = client.get_model_version(params.register.model_name, result["version"])
    assert version.tags["lineage.train_run_id"] == train_run
    assert version.tags["lineage.pipeline_run_id"] == parent_run_id(tracking_spec(params))
    assert version.tags["lineage.git_commit"] == head
    assert version.tags["lineage.model_dvc_md5"] == "0123456789abcdef0123456789abcdef.dir"
    assert result["lineage"] == {k: v for k, v in version.tags.items() if k.startswith("lineage.")}
    for said in (
        train_run,
        head,
        "0123456789abcdef0123456789abcdef.dir",
        "ID f1 30.00 [29.00, 31.00]",
        "Promotion: promoted — no current champion",
    ):
        assert said in version.description

    # One copy of the model in the whole artifact store: the registered pyfunc's.
    store = params.path(params.mlflow.artifact_root)
    copies = sorted(p.relative_to(store).as_posix() for p in store.rglob("model.safetensors"))
    assert len(copies) == 1, copies
    local = Path(mlflow.artifacts.download_artifacts(f"models:/{params.register.model_name}@champion"))
    assert (local / "artifacts" / "agent" / "config.json").is_file()


def test_dvc_hash_is_not_claimed_for_a_model_dvc_did_not_record(project):
    from pipeline.tracking.lineage import model_dvc_hash

    params, _, _ = project
    assert model_dvc_hash(params.path(params.paths.model_dir), params.root) == "unknown: dvc.lock has no entry for models/agent"
    _lock_model(params.root, "feedfeedfeedfeedfeedfeedfeedfeed.dir")
    assert model_dvc_hash(params.path(params.paths.model_dir), params.root) == "feedfeedfeedfeedfeedfeedfeedfeed.dir"
    (params.path(params.paths.model_dir) / "notes.txt").write_text("changed outside DVC\n")
    assert model_dvc_hash(params.path(params.paths.model_dir), params.root).startswith("unknown: models/agent (2 files, ")
    assert "is not what dvc.lock recorded (2 files" in model_dvc_hash(params.path(params.paths.model_dir), params.root)


def test_retention_deletes_the_oldest_never_champion_versions_and_their_files(project):
    import mlflow

    from pipeline.stages.register import run_register

    params, _, _ = project
    params.register.keep_versions = 1
    name = params.register.model_name
    client = mlflow.MlflowClient()
    store = params.path(params.mlflow.artifact_root)
    results = []
    for id_f1, ood in [(30.0, 40.0), (30.4, 40.0), (45.0, 41.0), (45.2, 41.0)]:
        _metrics(params.root, id_f1, ood)
        results.append(run_register(params))
        if len(results) == 1:  # a version registered by hand carries no decision: never the stage's to delete
            by_hand = params.root / "by-hand-model"
            by_hand.mkdir()
            assert str(client.create_model_version(name, by_hand.as_uri()).version) == "2"
    assert [(r["version"], r["decision"]) for r in results] == [
        ("1", "promoted"),
        ("3", "kept"),
        ("4", "promoted"),
        ("5", "kept"),
    ]
    assert [r["pruned_versions"] for r in results] == [[], [], [], ["3"]]
    left = {str(mv.version) for mv in client.search_model_versions(f"name = '{name}'")}
    # v1: champion once (kept for rollback); v2: by hand; v4: champion; v5: the newest never-champion
    assert left == {"1", "2", "4", "5"}
    assert str(client.get_model_version_by_alias(name, "champion").version) == "4"
    # v3's model files are gone from the artifact store; v1's, v4's and v5's are there
    assert len(list(store.rglob("weights.bin"))) == 3


def test_report_of_a_run_that_registered_nothing_names_the_champion_not_an_old_decision(project):
    import mlflow

    from flows.run_report import RunReport, stage_markdown, to_markdown
    from pipeline.stages.figures import promotion_line
    from pipeline.stages.register import run_register
    from pipeline.tracking.links import stage_mlflow_run
    from pipeline.tracking.runs import parent_run_id

    params, _, _ = project
    _metrics(params.root, 30.0, 40.0)
    first = run_register(params)
    version = mlflow.MlflowClient().get_model_version(params.register.model_name, "1")
    date = version.tags["promotion.date"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC", date)

    def report(result: str) -> RunReport:
        r = RunReport(
            flow_run="quiet-run",
            profile="default",
            overrides=[],
            environment_backend="llamacpp",
            forced=False,
            stages=[
                {"stage": s, "result": result, "seconds": 0.0, "key_figure": None}
                for s in ("train", "merge", "evaluate", "register")
            ],
        )
        r.read_results(params)
        return r

    idle = report("up to date")
    line = promotion_line(idle.promotion)
    assert line == f"no new version; champion is v1, promoted by run {first['run_id']} on {date}"
    # the old pipeline run is not this run's: the report and each stage's artifact say so in the same words
    last = parent_run_id(tracking_spec(params))
    assert not idle.mlflow_current and idle.mlflow.run_id == last
    experiment = mlflow.MlflowClient().get_run(last).info.experiment_id
    said = (f"up to date (last run {last}: [run {last}](http://127.0.0.1:5000/#/experiments/{experiment}/runs/{last}) "
            f"(served by `{idle.mlflow.ui_command} --port 5000`))")
    assert idle.mlflow.ui_command.startswith("MLFLOW_DISABLE_TELEMETRY=true mlflow ui --backend-store-uri ")
    idle.flow_run_id = "0c5b7e3a-1111-2222-3333-444455556666"
    markdown = to_markdown(idle)
    assert f"- **Promotion:** {line}" in markdown and "promoted to @champion" not in markdown
    assert f"- **MLflow:** {said}" in markdown
    assert markdown.startswith("# Prompt-R1 retraining — quiet-run (0c5b7e3a-1111-2222-3333-444455556666)\n")
    # the evaluation summary is the last run's: shown under a line saying so, its headings one level down
    summary_md = params.path(params.paths.reports_dir) / "eval" / "summary.md"
    summary_md.write_text("# Evaluation summary\n\nold verdict\n")
    idle = report("up to date")
    markdown = to_markdown(idle)
    assert f"_This run evaluated nothing: {said}. Its summary (reports/eval/summary.md) follows._" in markdown
    assert "\n## Evaluation summary\n\nold verdict" in markdown and "file://" not in markdown
    stage = stage_markdown("register", "up to date", 0.0, "kept", stage_mlflow_run(tracking_spec(params), "register"),
                           flow_run="quiet-run (0c5b7e3a)")
    assert "- **Flow run:** quiet-run (0c5b7e3a)" in stage
    assert "- **MLflow:** up to date (last run " in stage and "(http://127.0.0.1:5000/#/experiments/" in stage
    assert "old verdict" in to_markdown(report("reproduced"))  # a run that logged to MLflow shows the summary

    busy = report("reproduced")  # a run that did register: its own decision and its pipeline run
    assert promotion_line(busy.promotion).startswith("promoted to @champion (model version 1)")
    assert busy.mlflow.run_id == parent_run_id(tracking_spec(params))

    # a champion registered before versions carried promotion.date: its register run's start
    client = mlflow.MlflowClient()
    client.delete_model_version_tag(params.register.model_name, "1", "promotion.date")
    started = datetime.fromtimestamp(client.get_run(first["run_id"]).info.start_time / 1000, UTC)
    assert promotion_line(report("unchanged (dvc skipped it)").promotion) == (
        f"no new version; champion is v1, promoted by run {first['run_id']} on {started:%Y-%m-%d %H:%M} UTC"
    )
