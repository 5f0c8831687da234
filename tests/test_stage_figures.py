"""Each stage's key figure (pipeline.stages.figures), the stage's MLflow run (pipeline.tracking.links), the CLI line.

The fixture project is tests/fixtures/stage_outputs: files the real stages wrote, trimmed to the fields
that matter (sources → gepa and merge: a default-profile `dvc repro`; train: a 12-step local GRPO run;
evaluate and register: the end-to-end test's tiny run), with the repository's params.yaml copied beside
them. Every expected line below is worked out by hand from those files.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import yaml

from pipeline.config import load_params
from pipeline.config.specs import stage_folders, tracking_spec
from pipeline.stages.figures import FIGURES, key_figure

REPO = Path(__file__).resolve().parents[1]
FIXTURE = REPO / "tests" / "fixtures" / "stage_outputs"

EXPECTED = {
    # 12 dataset fingerprints + eval.json (12 evaluation files), all from the mirror.
    "sources": "12 sources fingerprinted from the mirror, 12 evaluation files",
    # 7 × 5120 + 589 rows; leaked 7 + 0 + 78 + 111 + 9 + 123 + 128 + 2.
    "sample": "8 datasets: 36429 rows written (458 leaked removed)",
    "sample@gsm8k": "gsm8k: 5120 rows written of 7473 (111 leaked removed)",
    # 600 rows in the source, 2 leaked, 9 more dropped: 589 < 5120, short by 4531.
    "sample@writingprompts": "writingprompts: 589 rows written of 600 (2 leaked removed, short by 4531)",
    "validate": "passed: 288 expectations on 20 files",
    "build": "36429 training rows from 8 datasets, 1536 evaluation rows in 12 sets",
    # val_score_optimised = val_score_seed: GEPA kept the seed, though 2 proposals won their minibatch.
    "gepa": ("kept the seed instruction (no proposal beat its val score 0.170): held-out F1 7.72 → 7.72 (+0.00); "
             "4 proposals, 2 better than their parent on a minibatch and scored on the val slice; 42 metric calls"),
    # steps.csv: 12 rows, critic/score/mean -0.14687… at step 1 and -0.20312… at step 12.
    "train": "12 steps (last step 12), mean reward -0.147 → -0.203",
    "merge": "step 2 (local-full) merged into models/agent, max logit difference 0",
    "evaluate": ("prompt_r1 F1 ID 0.00 [0.00, 0.00], OOD 0.00 [0.00, 0.00] (1 rows per set); "
                 "best other system env_only ID 4.03"),
    "register": "promoted to @champion (model version 1): no current champion: the first version becomes champion",
}
# The file each stage's figure is read from (one per stage; `sources` and `sample` read several).
STAGE_FILE = {
    "sources": "data/sources/eval.json",
    "sample": "reports/sample/hotpotqa.json",
    "sample@gsm8k": "reports/sample/gsm8k.json",
    "sample@writingprompts": "reports/sample/writingprompts.json",
    "validate": "reports/validate/summary.json",
    "build": "reports/build/summary.json",
    "gepa": "reports/gepa/metrics.json",
    "train": "reports/train/steps.csv",
    "merge": "models/agent/merge_report.json",
    "evaluate": "reports/eval/metrics.json",
    "register": "reports/promotion.json",
}


@pytest.fixture()
def project(tmp_path: Path) -> Path:
    """The fixture outputs in a project folder with the repository's params (a copy: tests may break files)."""
    root = tmp_path / "project"
    shutil.copytree(FIXTURE, root)
    shutil.copy(REPO / "params.yaml", root / "params.yaml")
    shutil.copytree(REPO / "profiles", root / "profiles")
    return root


def figure_of(root: Path, stage: str) -> str:
    """`key_figure` of `stage` with the folders the params at `root` name (as `promptr1` and the flow do)."""
    return key_figure(stage_folders(load_params(root / "params.yaml")), stage)


def test_every_dvc_stage_has_a_figure_and_a_test():
    dvc = yaml.safe_load((REPO / "dvc.yaml").read_text(encoding="utf-8"))
    assert set(dvc["stages"]) <= set(FIGURES)
    assert {stage.split("@")[0] for stage in EXPECTED} == set(FIGURES)


@pytest.mark.parametrize("stage", sorted(EXPECTED))
def test_key_figure_of_each_stage(project: Path, stage: str):
    assert figure_of(project, stage) == EXPECTED[stage]


def test_stage_names_as_dvc_spells_them(project: Path):
    assert figure_of(project, "dvc.yaml:sample@gsm8k") == EXPECTED["sample@gsm8k"]
    assert figure_of(project, "bogus") == "no figure (unknown stage 'bogus')"
    from flows.artifacts import stage_figure_and_run

    figure_line, run = stage_figure_and_run(project / "nowhere", "train")
    assert figure_line.startswith("no figure (params unreadable: ")
    assert run.open_hint.startswith("params unreadable: ")


@pytest.mark.parametrize("stage", sorted(STAGE_FILE))
def test_missing_file_says_so(project: Path, stage: str):
    (project / STAGE_FILE[stage]).unlink()
    assert figure_of(project, stage) == f"no figure ({STAGE_FILE[stage]} missing)"


@pytest.mark.parametrize("stage", sorted(STAGE_FILE))
@pytest.mark.parametrize("content", ["{not json", '{"other": "shape"}', "[1, 2]"])
def test_unreadable_file_says_so_never_raises(project: Path, stage: str, content: str):
    (project / STAGE_FILE[stage]).write_text(content)
    figure = figure_of(project, stage)
    if stage == "register" and content.startswith("{\""):
        # Any JSON object is a decision record; an unknown shape is shown as it is, never guessed at.
        assert figure == '{"other": "shape"}'
        return
    assert figure.startswith(f"no figure ({STAGE_FILE[stage]} unreadable: "), figure


def test_failures_and_skips_are_figures_too(project: Path):
    summary = project / "reports" / "validate" / "summary.json"
    data = json.loads(summary.read_text())
    summary.write_text(json.dumps({**data, "success": False, "expectations_failed": 3, "files_failed": 2}))
    assert figure_of(project, "validate") == ("FAILED: 3 of 288 expectations on 20 files failed (2 files); "
                                               "see reports/validate/data_docs/index.html")
    report = project / "reports" / "sample" / "popqa.json"
    data = json.loads(report.read_text())
    report.write_text(json.dumps({**data, "skipped": True, "rows_written": 0, "skip_reason": "no local source"}))
    assert figure_of(project, "sample@popqa") == "popqa: skipped (no local source)"
    assert figure_of(project, "sample") == "8 datasets: 31309 rows written (458 leaked removed), skipped: popqa"
    fingerprint = project / "data" / "sources" / "popqa.json"
    data = json.loads(fingerprint.read_text())
    fingerprint.write_text(json.dumps({**data, "source": "hub", "hub": {"id": "x/popqa", "revision": "unreachable"}}))
    assert figure_of(project, "sources") == EXPECTED["sources"] + ", 1 unreachable"
    steps = project / "reports" / "train" / "steps.csv"
    steps.write_text(steps.read_text().splitlines()[0] + "\n")
    assert figure_of(project, "train") == "no training step recorded"
    promotion = project / "reports" / "promotion.json"
    promotion.write_text(json.dumps({"promoted": False, "alias": "champion", "version": "2",
                                     "reasons": ["ID F1 +0.2 < margin 0.5", "OOD within tolerance"]}))
    assert figure_of(project, "register") == ("not promoted to @champion (model version 2): ID F1 +0.2 < margin "
                                               "0.5; OOD within tolerance")


def test_evaluation_figure_reads_mean_and_interval_in_order(project: Path):
    metrics = project / "reports" / "eval" / "metrics.json"
    data = json.loads(metrics.read_text())
    averages = data["averages"]
    averages["prompt_r1"]["id"]["f1"] = {"mean": 41.2, "low": 38.05, "high": 44.5}
    averages["prompt_r1"]["ood"]["f1"] = {"mean": 30.0, "low": 27.5, "high": 32.25}
    averages["gepa"]["id"]["f1"] = {"mean": 39.9, "low": 37.0, "high": 42.0}  # beats env_only's 4.03
    metrics.write_text(json.dumps({**data, "averages": averages, "rows_per_dataset": 128}))
    assert figure_of(project, "evaluate") == ("prompt_r1 F1 ID 41.20 [38.05, 44.50], OOD 30.00 [27.50, 32.25] "
                                               "(128 rows per set); best other system gepa ID 39.90")


def test_constants_match_the_stages_that_write_the_files():
    from pipeline.stages import figures as stage_figures
    from pipeline.stages import sources as fingerprint

    assert stage_figures.UNREACHABLE == fingerprint.UNREACHABLE


# ------------------------------------------------------------------------------------------------ the CLI


def test_every_stage_command_ends_with_its_figure():
    from pipeline.cli import STAGE_COMMANDS

    for name, command in STAGE_COMMANDS.items():
        if name != "sample":  # written out: `sample@<dataset>`, checked below
            assert command.stage == name


def test_real_sample_command_ends_with_its_line(project: Path, shared_datasets: Path, caplog):
    """`promptr1 sample gsm8k` for real (8 rows from the mirror): the last line is its figure, from its file."""
    from typer.testing import CliRunner

    from pipeline.cli import app

    args = ["sample", "gsm8k", "--params", str(project / "params.yaml"), "-S", f"paths.mirror={shared_datasets}",
            "-S", "data.sample_size=8"]
    with caplog.at_level(logging.INFO):
        result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    lines = [r.getMessage() for r in caplog.records if r.name == "pipeline.cli"]
    assert len(lines) == 1 and lines[0].startswith("sample@gsm8k done in ")
    # 7473 source rows, 111 in an evaluation file: the stage's own report, read back after it ran.
    assert lines[0].endswith(": gsm8k: 8 rows written of 7473 (111 leaked removed)")


# ----------------------------------------------------------------------------------------- MLflow runs


def test_stage_mlflow_run_is_the_stage_child_of_the_recorded_parent(project: Path, monkeypatch):
    import mlflow

    from pipeline.tracking import runs as tracking
    from pipeline.tracking.links import mlflow_line, mlflow_run_info, stage_mlflow_run

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    params = load_params(project / "params.yaml")
    (project / "reports" / "mlflow_run.json").unlink(missing_ok=True)
    assert stage_mlflow_run(tracking_spec(params), "evaluate").run_id is None
    assert mlflow_line(stage_mlflow_run(tracking_spec(params), "evaluate")) == "no MLflow run recorded (reports/mlflow_run.json missing)"

    with tracking.stage_run(tracking_spec(params), "train", new_parent=True) as train:
        pass
    with tracking.stage_run(tracking_spec(params), "evaluate") as first:
        pass
    with tracking.stage_run(tracking_spec(params), "evaluate") as retried:  # a retry: the newest is the stage's run
        pass
    parent = mlflow_run_info(tracking_spec(params))
    assert parent.run_id == json.loads((project / "reports" / "mlflow_run.json").read_text())["run_id"]

    evaluate = stage_mlflow_run(tracking_spec(params), "evaluate")
    assert evaluate.run_id == retried.info.run_id != first.info.run_id
    assert stage_mlflow_run(tracking_spec(params), "train").run_id == train.info.run_id
    experiment = mlflow.MlflowClient().get_run(evaluate.run_id).info.experiment_id
    # SQLite: the page `mlflow ui` serves, the command that serves it, and the hint as before
    assert evaluate.link == f"http://127.0.0.1:5000/#/experiments/{experiment}/runs/{evaluate.run_id}"
    assert evaluate.ui_command == "MLFLOW_DISABLE_TELEMETRY=true mlflow ui --backend-store-uri sqlite:///mlflow.db"
    assert mlflow_line(evaluate) == (f"[run {evaluate.run_id}]({evaluate.link}) (served by "
                                     f"`{evaluate.ui_command} --port 5000`)")
    assert evaluate.open_hint == (f"MLFLOW_DISABLE_TELEMETRY=true mlflow ui --backend-store-uri sqlite:///mlflow.db, then experiment "
                                  f"{params.mlflow.experiment}, run {evaluate.run_id}")
    build = stage_mlflow_run(tracking_spec(params), "build")
    assert build.run_id is None
    assert mlflow_line(build) == f"stage build logged no MLflow run under the pipeline run {parent.run_id}"
    (project / "mlflow.db").unlink()
    gone = stage_mlflow_run(tracking_spec(params), "evaluate")
    assert gone.run_id is None
    assert gone.open_hint == f"tracking store sqlite:///mlflow.db not found (pipeline run {parent.run_id})"


def test_ui_link_only_for_http_servers_and_never_with_credentials():
    from pipeline.tracking.links import ui_link

    assert ui_link("https://user:secret@mlflow.example:8443/", "7", "abc") == (
        "https://mlflow.example:8443/#/experiments/7/runs/abc")
    assert ui_link("sqlite:///mlflow.db", "7", "abc") is None
