"""Two pipeline runs compared on their parent MLflow runs alone, as a person does it in the MLflow UI.

Two micro runs are built from stage outputs real runs recorded (`benchmarks/results/pipeline_*`: the train
stage's steps.csv, the evaluate stage's metrics.json), with different params and commits, through the code
the stages run after their work: the train run's record (`pipeline.train.mlflow_record`), the evaluate run's MLflow
logging (`report.log_mlflow`) and the real register stage (tiny model, real SQLite registry). No training,
no environment. Then only the two parent runs are read back through `MlflowClient`.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest

from pipeline.config.specs import tracking_spec
from pipeline.tracking.headline import HEADLINE_METRICS, LAST_REWARD_METRIC
from pipeline.tracking.runs import KEY_PARAMS
from pipeline.train.plan import TrainPlan

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
RECORDED = {"a": "pipeline_avx512_final", "b": "pipeline_probe"}
"""Two real runs' recorded stage outputs (different trained agents, different scores)."""
OVERRIDES = {"a": {}, "b": {"train": {"lr": 2e-5, "group_size": 5}}}


def _git(project: Path, *args: str) -> None:
    subprocess.run(["git", *args], cwd=project, check=True, capture_output=True,
                   env={"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                        "GIT_COMMITTER_EMAIL": "t@t", "PATH": "/usr/bin:/bin:/usr/local/bin"})


def _train_parquet(path: Path, rows: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame({
        "data_source": ["hotpotqa"] * rows,
        "prompt": [[{"role": "user", "content": f"Question: q{i}?"}] for i in range(rows)],
        "reward_model": [{"ground_truth": [f"a{i}"], "style": "rule"} for i in range(rows)],
    }).to_parquet(path)


def _rows_and_predictions(summary: dict) -> tuple[dict, pd.DataFrame]:
    from pipeline.types import EvalRow

    rows = {d: [EvalRow(dataset=d, split=split, index=0, id=f"{d}-0", question=f"q {d}?", answers=["a"],
                        messages=[{"role": "user", "content": f"q {d}?"}])]
            for split, names in summary["datasets"].items() for d in names}
    preds = pd.DataFrame([{"system": s, "dataset": d, "split": r[0].split, "row": 0, "uid": r[0].id,
                           "question": r[0].question, "gold": ["a"], "prediction": "b", "trajectory": "[]"}
                          for s in summary["systems"] for d, r in rows.items()])
    return rows, preds


def _micro_run(project: Path, label: str, model_dir: Path) -> str:
    """One pipeline execution from recorded outputs; returns its parent run id."""
    from pipeline.config import load_params
    from pipeline.evaluation.plan import EvaluatePlan
    from pipeline.evaluation.report import log_mlflow
    from pipeline.stages.register import run_register
    from pipeline.tracking.runs import parent_run_id, stage_run
    from pipeline.train.mlflow_record import log_training_record

    (project / "run.txt").write_text(label)  # a new commit per execution
    _git(project, "add", "-A")
    _git(project, "commit", "-qm", f"run {label}")
    params = load_params(project / "params.yaml", {"paths": {"model_dir": str(model_dir)}, **OVERRIDES[label]})
    reports = project / "reports"
    (reports / "train").mkdir(parents=True, exist_ok=True)
    (reports / "eval").mkdir(parents=True, exist_ok=True)
    shutil.copy(RESULTS / f"{RECORDED[label]}_train_steps.csv", reports / "train" / "steps.csv")
    shutil.copy(RESULTS / f"{RECORDED[label]}_eval_metrics.json", reports / "eval" / "metrics.json")
    _train_parquet(project / "data" / "rl" / "train.parquet", rows=3 if label == "a" else 4)
    (reports / "mlflow_run.json").unlink(missing_ok=True)  # DVC removes the train stage's outputs first

    with stage_run(tracking_spec(params), "train", new_parent=True):
        log_training_record(TrainPlan.from_params(params))
    summary = json.loads((reports / "eval" / "metrics.json").read_text())
    rows, preds = _rows_and_predictions(summary)
    with stage_run(tracking_spec(params), "evaluate"):
        log_mlflow(summary, preds, rows, replace(EvaluatePlan.for_evaluate(params), out_dir=reports / "eval"), [])
    run_register(params)
    return parent_run_id(tracking_spec(params))


def _expected_metric_keys(summary: dict) -> set[str]:
    keys = {f"{s}/{split}/{m}" for s in summary["systems"] for split in ("id", "ood") for m in HEADLINE_METRICS}
    keys |= {f"delta_vs_{b}/{split}/{m}{end}" for b in summary["systems"][1:] for split in ("id", "ood")
             for m in HEADLINE_METRICS for end in ("", "_low", "_high")}
    return keys | {LAST_REWARD_METRIC, "promoted", "eval/rows_per_dataset"}


@pytest.mark.slow  # ~80 s on 2 busy cores: two MLflow stores filled, two real model registrations
def test_two_micro_runs_compare_on_their_parent_runs(tmp_path, repo_root, tiny_llama_dir, monkeypatch, capsys):
    import mlflow

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    project = tmp_path / "project"
    project.mkdir()
    shutil.copy(repo_root / "params.yaml", project / "params.yaml")
    (project / ".gitignore").write_text("mlflow.db\nmlartifacts/\nreports/\ndata/\n.cache/\n")  # outputs
    _git(project, "init", "-q")
    ids = {label: _micro_run(project, label, tiny_llama_dir) for label in RECORDED}
    assert ids["a"] != ids["b"]

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{project / 'mlflow.db'}")
    parents = {label: client.get_run(run_id) for label, run_id in ids.items()}
    summaries = {label: json.loads((RESULTS / f"{RECORDED[label]}_eval_metrics.json").read_text())
                 for label in RECORDED}
    table = []
    for label, run in parents.items():
        metrics, params = run.data.metrics, run.data.params
        missing = sorted(_expected_metric_keys(summaries[label]) - set(metrics))
        assert not missing, f"parent run {label} lacks headline metrics {missing}"
        assert not [k for k in KEY_PARAMS if k not in params], f"parent run {label} lacks key params"
    keys = sorted(_expected_metric_keys(summaries["a"]))
    for key in keys:
        table.append((key, parents["a"].data.metrics[key], parents["b"].data.metrics[key]))
    # where the inputs differ, the parents differ: the recorded scores and rewards, the params, the commit
    a, b = parents["a"].data, parents["b"].data
    for key in ("prompt_r1/id/f1", "prompt_r1/ood/ssim", "delta_vs_env_only/id/f1", LAST_REWARD_METRIC):
        assert a.metrics[key] != b.metrics[key], key
    assert a.metrics["prompt_r1/id/f1"] == summaries["a"]["averages"]["prompt_r1"]["id"]["f1"]["mean"]
    assert (a.metrics["delta_vs_env_only/id/f1_low"]
            == summaries["a"]["deltas"]["vs_env_only"]["id"]["f1"]["low"])
    steps = pd.read_csv(RESULTS / f"{RECORDED['b']}_train_steps.csv")
    assert b.metrics[LAST_REWARD_METRIC] == pytest.approx(steps["critic/score/mean"].iloc[-1])
    assert a.metrics["promoted"] == 1.0  # the first version is champion
    for key in ("train.lr", "train.group_size", "git_commit"):
        assert a.params[key] != b.params[key], key
    for key in ("profile", "agent.model", "environment.model", "train.steps", "reward.preset"):
        assert a.params[key] == b.params[key], key

    # the train run logs its params and its input, with the DVC md5 of data/rl/train.parquet
    train_run = client.search_runs([parents["b"].info.experiment_id], filter_string=(
        f"tags.mlflow.parentRunId = '{ids['b']}' AND tags.stage = 'train'"))[0]
    assert train_run.data.params["train.lr"] == "2e-05" and train_run.data.params["agent.model"]
    (train_input,) = train_run.inputs.dataset_inputs
    tags = {t.key: t.value for t in train_input.tags}
    from pipeline.tracking.runs import dvc_md5

    assert train_input.dataset.name == "train"
    assert tags["dvc.md5"] == dvc_md5(project / "data" / "rl" / "train.parquet") and len(tags["dvc.md5"]) == 32

    with capsys.disabled():
        width = max(len(k) for k, _, _ in table)
        print(f"\nparent runs a={ids['a'][:8]} ({RECORDED['a']}), b={ids['b'][:8]} ({RECORDED['b']})")
        print(f"{'param':<{width}}  {'a':>14}  {'b':>14}")
        for key in KEY_PARAMS:
            print(f"{key:<{width}}  {a.params[key][-14:]:>14}  {b.params[key][-14:]:>14}")
        print(f"{'metric':<{width}}  {'a':>14}  {'b':>14}")
        for key, va, vb in table:
            print(f"{key:<{width}}  {va:>14.4f}  {vb:>14.4f}")
