"""`dvc repro` end to end in a temporary copy of the project, with the smallest settings.

Real parts throughout: the real DVC pipeline (every stage through `promptr1`), the real datasets mirror,
Great Expectations, the real SmolLM2 agent trained for one GRPO step against a real llama.cpp environment
server, a real SQLite MLflow store and registry. Then a second `dvc repro` must rerun nothing but the
always-changed `sources` stage (the fingerprints it writes are unchanged, so everything after it is skipped).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from demo_project import copy_project, free_port, one_step_run, project_env

pytestmark = pytest.mark.slow


def smallest_params(raw: dict, mirror: Path, port: int) -> dict:
    """The default profile shrunk to a smoke run: few rows, one GRPO step, short generations."""
    one_step_run(raw, mirror, sample_size=64)
    raw["agent"].update(max_turns=3, max_turn_tokens=40, max_response_tokens=400, max_prompt_tokens=1024)
    raw["environment"].update(port=port, max_tokens=24)
    raw["evaluate"].update(rows_per_dataset=1, agent_max_turn_tokens=16, bootstrap_samples=50)
    return raw


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, check=False, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    return proc


def test_dvc_repro_end_to_end(tmp_path: Path, repo_root: Path, shared_datasets: Path) -> None:
    project = tmp_path / "project"
    copy_project(repo_root, project)
    params_file = project / "params.yaml"
    raw = yaml.safe_load(params_file.read_text())
    params_file.write_text(yaml.safe_dump(smallest_params(raw, shared_datasets, free_port()), sort_keys=False))

    env = project_env()
    _run(["git", "init", "-q"], project, env, 30)
    _run(["git", "add", "-A"], project, env, 30)
    _run(["git", "commit", "-qm", "snapshot"], project, env, 30)

    started = time.perf_counter()
    console = _run(["dvc", "repro"], project, env, 1500)
    first = time.perf_counter() - started
    # A console worth reading: in a pipe, one start and one "done in … s: <figure>" line per stage, no
    # progress-bar fragments, no third-party INFO chatter, no absolute paths (<= 150 lines).
    lines = (console.stdout + console.stderr).splitlines()
    assert len(lines) <= 150, "\n".join(lines)
    assert not [ln for ln in lines if "\r" in ln or "it/s]" in ln], "progress-bar fragments in a pipe"
    # the register stage logs the agent from code: MLflow's CloudPickle warning never reaches the console
    assert not [ln for ln in lines if "cloudpickle" in ln.lower()], "register printed a CloudPickle warning"
    assert not [ln for ln in lines if " INFO great_expectations" in ln or " INFO httpx" in ln]
    assert str(project) not in console.stdout + console.stderr
    stages_done = [ln.split("pipeline.cli: ", 1)[1].split(" done in ")[0] for ln in lines if " done in " in ln]
    assert {"sources", "validate", "build", "gepa", "train", "merge", "evaluate", "register"} <= set(stages_done)

    # data stages
    for name in raw["data"]["train_datasets"]:
        assert (project / "data/sampled" / f"{name}.parquet").is_file()
        report = json.loads((project / "reports/sample" / f"{name}.json").read_text())
        assert report["rows_written"] > 0
    assert json.loads((project / "reports/validate/summary.json").read_text())["success"] is True
    assert (project / "data/rl/train.parquet").is_file()
    assert len(list((project / "data/rl/eval").glob("*.parquet"))) == 12
    # training, merge
    steps = (project / "reports/train/steps.csv").read_text().splitlines()
    assert steps[0].startswith("step") and len(steps) == 2
    assert (project / "models/agent/config.json").is_file()
    # evaluation
    metrics = json.loads((project / "reports/eval/metrics.json").read_text())
    assert metrics
    assert (project / "reports/eval/predictions.parquet").is_file()
    # registry
    promotion = json.loads((project / "reports/promotion.json").read_text())
    assert promotion["promoted"] is True  # the first version becomes champion

    import mlflow

    uri = f"sqlite:///{project / 'mlflow.db'}"
    client = mlflow.MlflowClient(tracking_uri=uri, registry_uri=uri)
    version = client.get_model_version_by_alias(raw["register"]["model_name"], raw["register"]["alias"])
    assert str(version.version) == "1"
    parent_id = json.loads((project / "reports/mlflow_run.json").read_text())["run_id"]
    children = client.search_runs(
        [client.get_run(parent_id).info.experiment_id],
        filter_string=f"tags.mlflow.parentRunId = '{parent_id}'",
    )
    # one repro, one parent run: the gepa stage opened it, train continued it
    assert {r.data.tags.get("stage") for r in children} >= {"gepa", "train", "evaluate", "register"}
    note = client.get_run(parent_id).data.tags["mlflow.note.content"]
    assert re.search(r"GEPA (kept the seed instruction|chose a proposal) ", note) and "Registered" in note

    # nothing changed: nothing reruns but `sources` (always_changed: it re-fingerprints the raw sources,
    # writes byte-identical files, so every stage after it is skipped)
    started = time.perf_counter()
    proc = _run(["dvc", "repro"], project, env, 300)
    second = time.perf_counter() - started
    assert "didn't change, skipping" in proc.stdout + proc.stderr
    assert re.findall(r"Running stage '([^']+)'", proc.stdout) == ["sources"]
    print(f"dvc repro: first {first:.1f}s, second (no change) {second:.1f}s")

    # The Prefect flow over the same real pipeline: a parameter override reruns only what it touches
    # (evaluate, and register, whose input metrics.json records the confidence), each stage a task; the
    # environment is started for evaluate and stopped after. The override keeps one row per set, so the
    # rerun costs what the first evaluation did.
    from prefect.testing.utilities import prefect_test_harness

    from flows.retrain import run_pipeline_flow

    os.environ["PREFECT_HOME"] = str(tmp_path / "prefect-home")
    cwd = os.getcwd()
    try:
        os.chdir(project)
        with prefect_test_harness():
            summary = run_pipeline_flow(project, overrides=["evaluate.confidence=0.9"])
    finally:
        os.chdir(cwd)
    results = {s["stage"]: s["result"] for s in summary["stages"]}
    assert results["train"] == "up to date" and results["build"] == "up to date"
    assert results["evaluate"] == "reproduced" and results["register"] == "reproduced"
    assert summary["promotion"] is not None and summary["experiment"]
    assert yaml.safe_load(params_file.read_text())["evaluate"]["confidence"] == 0.95  # params restored
    assert len(client.search_model_versions(f"name = '{raw['register']['model_name']}'")) == 2
