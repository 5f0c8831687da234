"""The retraining flow run for real under `prefect_test_harness()` on a real DVC project in tmp_path.

The project is tests/demo_project.py's: git + DVC, the pipeline's stage names and report files, the
repository's params.yaml, trivial stage commands. The environment is a real HTTP server process
(`StaticEnvironment`) whose PIDs are checked after each run. The full flow over the real stages is the
lead's end-to-end test (tests/test_end_to_end.py) through the same `run_pipeline_flow`.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import yaml
from demo_project import DEMO_STAGES, StaticEnvironment, make_demo_project, pid_alive

from flows.artifacts import ARTIFACT_KEY
from flows.policies import StagePolicy
from flows.retrain import cli_flow_run, run_pipeline_flow
from pipeline.config import load_params
from pipeline.config.specs import stage_folders
from pipeline.stages.figures import key_figure

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def prefect_api(tmp_path_factory):
    """One temporary Prefect server (with a temporary PREFECT_HOME) for the module's flow runs."""
    import os

    from prefect.testing.utilities import prefect_test_harness

    os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    home = tmp_path_factory.mktemp("prefect-home")
    from prefect.settings import PREFECT_HOME, temporary_settings

    with temporary_settings(updates={PREFECT_HOME: str(home)}), prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture()
def demo(tmp_path, prefect_api):
    return make_demo_project(tmp_path / "project")


def _task_runs(state, expected: int, timeout_s: float = 30.0) -> dict[str, object]:
    """Task runs of a flow run by run name, once at least `expected` are recorded (events are async)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.client.schemas.sorting import TaskRunSort

    flow_filter = FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id]))
    deadline = time.monotonic() + timeout_s
    with get_client(sync_client=True) as client:
        while True:
            runs = client.read_task_runs(flow_run_filter=flow_filter, limit=200,
                                         sort=TaskRunSort.EXPECTED_START_TIME_ASC)
            final = [r for r in runs if r.state is not None and r.state.is_final()]
            if len(final) >= expected or time.monotonic() > deadline:
                return {r.name: r for r in runs}
            time.sleep(0.25)


def _artifact(state) -> str:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        ArtifactFilterKey,
        FlowRunFilter,
        TaskRunFilter,
    )
    from prefect.client.schemas.sorting import ArtifactSort

    # Every argument explicit: this server version rejects the sync client's nulls (422).
    with get_client(sync_client=True) as client:
        (artifact,) = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[ARTIFACT_KEY]),
                                           flow_run_id=ArtifactFilterFlowRunId(any_=[state.state_details.flow_run_id])),
            flow_run_filter=FlowRunFilter(), task_run_filter=TaskRunFilter(), sort=ArtifactSort.CREATED_DESC,
            limit=10, offset=0)
    return artifact.data


def _stage_artifacts(state) -> dict[str, object]:
    """The flow run's `stage-<name>` artifacts by key (the newest version of each)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        FlowRunFilter,
        TaskRunFilter,
    )
    from prefect.client.schemas.sorting import ArtifactSort

    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[state.state_details.flow_run_id])),
            flow_run_filter=FlowRunFilter(), task_run_filter=TaskRunFilter(), sort=ArtifactSort.CREATED_DESC,
            limit=100, offset=0)
    found: dict[str, object] = {}
    for artifact in artifacts:
        if artifact.key and artifact.key.startswith("stage-"):
            found.setdefault(artifact.key, artifact)
    return found


# What each demo stage's files say after a run with train.steps=2 (tests/demo_project.py), worked by hand.
DEMO_FIGURES = {
    "build": "8 training rows from 1 datasets, 4 evaluation rows in 1 sets",
    "train": "2 steps (last step 2), mean reward -0.750 → -0.500",  # -1 + 0.25 × step
    "merge": "step 2 (local-full) merged into models/agent, max logit difference 0",
    "evaluate": None,  # rows per set come from the repository's params.yaml: checked below
    "register": "promoted to @champion (model version 1): first model: no champion yet",
}


def _experiments(root: Path) -> list[dict]:
    out = subprocess.run([sys.executable, "-m", "dvc", "exp", "show", "--json"], cwd=root, check=True,
                         capture_output=True, text=True)
    rows = json.loads(out.stdout)
    return [exp for row in rows for exp in (row.get("experiments") or [])]


def test_flow_runs_each_stage_as_a_task_and_records_the_experiment(demo):
    env = StaticEnvironment(demo)
    params_before = (demo / "params.yaml").read_bytes()

    state = run_pipeline_flow(demo, overrides=["train.steps=2"], launcher=env, return_state=True)

    assert state.is_completed(), state.message
    summary = state.result()
    assert [s["stage"] for s in summary["stages"]] == DEMO_STAGES
    assert all(s["result"] == "reproduced" for s in summary["stages"])
    runs = _task_runs(state, expected=len(DEMO_STAGES) + 6)
    for name in [*DEMO_STAGES]:
        assert runs[name].state.is_completed(), name
    for prefix in ("fetch-weights", "start-environment", "check-environment", "stop-environment", "record-experiment",
                   "publish-report", "plan"):
        assert any(n.startswith(prefix) and r.state.is_completed() for n, r in runs.items()), prefix
    assert env.starts == 1 and not any(pid_alive(p) for p in env.pids)
    # Overrides live in the experiment, not in the workspace's params.yaml.
    assert (demo / "params.yaml").read_bytes() == params_before
    (experiment,) = _experiments(demo)
    assert experiment["name"] == summary["experiment"]
    exp_data = experiment["revs"][0]["data"]
    assert exp_data["params"]["params.yaml"]["data"]["train"]["steps"] == 2
    assert exp_data["metrics"]["reports/eval/metrics.json"]["data"]["id_avg_f1"] == 12.0
    # Each stage task shows its key figure: in its log line, its return value and its own artifact.
    rows = yaml.safe_load((demo / "params.yaml").read_text())["evaluate"]["rows_per_dataset"]
    figures = {**DEMO_FIGURES, "evaluate": (f"prompt_r1 F1 ID 12.00 [10.00, 14.00], OOD 7.00 [5.00, 9.00] ({rows} "
                                            "rows per set); best other system env_only ID 9.00")}
    assert {s["stage"]: s["key_figure"] for s in summary["stages"]} == figures
    folders = stage_folders(load_params(demo / "params.yaml"))
    assert {stage: key_figure(folders, stage) for stage in DEMO_STAGES} == figures  # read back from the files
    artifacts = _stage_artifacts(state)
    assert set(artifacts) == {f"stage-{stage}" for stage in DEMO_STAGES}
    for stage in DEMO_STAGES:
        artifact = artifacts[f"stage-{stage}"]
        assert artifact.task_run_id == runs[stage].id, stage
        assert f"- **Key figure:** {figures[stage]}" in artifact.data
        # The demo's train records a run id but there is no MLflow store: the artifact says what it found.
        mlflow = ("no MLflow run recorded (reports/mlflow_run.json missing)" if stage == "build"
                  else "tracking store sqlite:///mlflow.db not found (pipeline run demo-run-2)")
        assert f"- **MLflow:** {mlflow}" in artifact.data
    markdown = _artifact(state)
    assert f"| train | reproduced | {summary['stages'][1]['seconds']:.1f} | {figures['train']} |" in markdown
    assert "| agent+env | 12.0 |" in markdown
    assert "promoted to @champion (model version 1): first model" in markdown
    assert "demo-run-2" in markdown
    assert f"`{summary['experiment']}`" in markdown

    # Back to params.yaml's own values. Whether DVC now finds train stale depends on what `dvc exp save`
    # left in the workspace (DVC-version dependent); the invariant is that the flow reruns every stage
    # DVC reports stale and leaves nothing stale behind.
    from flows import dvc_steps

    stale_before = dvc_steps.stale_stages(demo)
    state = run_pipeline_flow(demo, launcher=env, return_state=True)
    assert state.is_completed(), state.message
    results = {s["stage"]: s["result"] for s in state.result()["stages"]}
    assert {stage for stage, result in results.items() if result != "up to date"} >= stale_before
    assert dvc_steps.stale_stages(demo) == set()
    starts = env.starts  # 1, plus 1 if the second run had a stage needing the environment to rerun
    assert starts == 1 + int(bool(stale_before & {"train", "evaluate"}))

    # Nothing to do: no DVC process per stage, no environment, no experiment.
    state = run_pipeline_flow(demo, launcher=env, return_state=True)
    summary = state.result()
    assert {s["result"] for s in summary["stages"]} == {"up to date"}
    assert all(not s["key_figure"].startswith("no figure") for s in summary["stages"])  # up to date: still shown
    assert env.starts == starts and summary["experiment"] is None
    assert len(_experiments(demo)) == 1 + int(bool(stale_before))


def test_failing_stage_fails_the_flow_stops_the_environment_keeps_earlier_outputs(demo, monkeypatch):
    env = StaticEnvironment(demo)
    params_before = (demo / "params.yaml").read_bytes()
    monkeypatch.setenv("PROMPTR1_DEMO_FAIL", "merge")

    state = run_pipeline_flow(demo, overrides=["train.steps=3"], launcher=env, return_state=True)

    assert state.is_failed()
    assert "merge" in state.message and "fails on purpose" in state.message
    assert env.starts == 1 and env.pids and not any(pid_alive(p) for p in env.pids)
    assert not (demo / ".dvc" / "tmp" / "demo-environment.pid").exists()
    # build and train finished and are recorded; nothing after merge ran.
    assert (demo / "data" / "demo" / "train.txt").is_file()
    assert (demo / "checkpoints" / "demo" / "latest").read_text() == "step_3\n"
    lock = (demo / "dvc.lock").read_text()
    assert "build:" in lock and "train:" in lock and "merge:" not in lock
    assert not (demo / "models").exists() and not (demo / "reports" / "eval").exists()
    assert (demo / "params.yaml").read_bytes() == params_before
    assert _experiments(demo) == []
    runs = _task_runs(state, expected=5)
    assert runs["merge"].state.is_failed()
    # The task's page says why without its logs: the state message and the artifact hold the stage's error.
    assert "stage 'merge' failed: demo stage merge fails on purpose (dvc exit code" in runs["merge"].state.message
    failed = _stage_artifacts(state)["stage-merge"]
    assert failed.task_run_id == runs["merge"].id
    assert "# merge: failed" in failed.data and "demo stage merge fails on purpose" in failed.data
    assert "evaluate" not in runs
    assert "stage 'merge' failed" in _artifact(state)

    # The fix is to rerun: DVC keeps build and train (same overrides), merge onwards runs.
    monkeypatch.delenv("PROMPTR1_DEMO_FAIL")
    state = run_pipeline_flow(demo, overrides=["train.steps=3"], launcher=env, return_state=True)
    assert state.is_completed(), state.message
    results = {s["stage"]: s["result"] for s in state.result()["stages"]}
    assert results["build"] == "up to date" and results["train"] == "up to date"
    assert results["merge"] == "reproduced"
    assert not any(pid_alive(p) for p in env.pids)


def test_flaky_evaluate_is_retried(demo, monkeypatch):
    env = StaticEnvironment(demo)
    monkeypatch.setenv("PROMPTR1_DEMO_FLAKY", "evaluate")
    policies = {"evaluate": StagePolicy(retries=1, retry_delays_s=(0.0,), needs_environment=True)}

    state = run_pipeline_flow(demo, launcher=env, policies=policies, return_state=True)

    assert state.is_completed(), state.message
    runs = _task_runs(state, expected=len(DEMO_STAGES) + 5)
    assert runs["evaluate"].run_count == 2
    assert runs["train"].run_count == 1
    assert env.starts == 1 and not any(pid_alive(p) for p in env.pids)


HOLDER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from flows.run_lock import workspace_lock
    with workspace_lock(Path(sys.argv[1]), 0, flow_run="scheduled-run"):
        print("held", flush=True)
        time.sleep(60)
""")


def test_second_run_is_refused_while_one_runs(demo):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(demo)], cwd=REPO, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        env = StaticEnvironment(demo)
        state = run_pipeline_flow(demo, launcher=env, lock_timeout_s=0, return_state=True)
    finally:
        holder.kill()
        holder.wait()
    assert state.is_failed()
    assert "another pipeline run" in state.message and "scheduled-run" in state.message
    assert env.starts == 0 and not (demo / "dvc.lock").exists()


def test_prefect_concurrency_limit_is_taken_when_the_api_has_it(tmp_path, prefect_api):
    from prefect.client.orchestration import get_client
    from prefect.concurrency.sync import concurrency

    from flows.run_lock import CONCURRENCY_LIMIT_NAME, ensure_prefect_limit, run_lock

    ensure_prefect_limit(1)
    try:
        outcome: list[str] = []
        with run_lock(tmp_path, 0, flow_run="manual") as held:
            assert "Prefect concurrency slot" in held

            def other_run() -> None:
                try:
                    with concurrency(CONCURRENCY_LIMIT_NAME, timeout_seconds=1, strict=True):
                        outcome.append("acquired")
                except TimeoutError:
                    outcome.append("timed out")

            thread = threading.Thread(target=other_run)
            thread.start()
            thread.join(30)
        assert outcome == ["timed out"]
    finally:
        with get_client(sync_client=True) as client:
            client.delete_global_concurrency_limit_by_name(CONCURRENCY_LIMIT_NAME)


def test_cli_flow_run_prints_run_and_decision(demo, monkeypatch, capsys):
    run_pipeline_flow(demo, launcher=StaticEnvironment(demo))
    monkeypatch.chdir(demo)
    cli_flow_run(None, [], False)  # nothing to rerun: the default launcher is never needed
    out = capsys.readouterr().out
    steps = yaml.safe_load((demo / "params.yaml").read_text())["train"]["steps"]  # the repo's params.yaml
    # This run reproduced nothing: it names no MLflow run and no decision as its own (flows/run_report.py); the
    # demo's stages log to no registry, so the champion cannot be read from one and the line says why.
    assert (f"MLflow:     up to date (last run demo-run-{steps}: tracking store sqlite:///mlflow.db not found)"
            in out)
    assert "flow run:   " in out and "(" in out.split("flow run:   ", 1)[1].splitlines()[0]  # name (id)
    assert "promotion:  no new version; no MLflow registry at sqlite:///mlflow.db" in out
    assert "register   up to date" in out
    assert "register   up to date (0.0 s): promoted to @champion (model version 1): first model" in out


def test_terminated_flow_stops_the_running_stage(tmp_path):
    """SIGTERM to `python -m flows.retrain` (a process manager, `timeout`) must not orphan the stage."""
    import os
    import signal

    demo = make_demo_project(tmp_path / "project")
    params_before = (demo / "params.yaml").read_bytes()
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect-home"), "PROMPTR1_DEMO_SLEEP": "build:300"}
    flow = subprocess.Popen([sys.executable, "-m", "flows.retrain", "--project-dir", str(demo)], cwd=REPO,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    marker = demo / ".dvc" / "tmp" / "demo-sleeping.pid"
    try:
        deadline = time.monotonic() + 300  # Prefect's temporary server and DVC start first (slow on a busy machine)
        while not marker.exists() and time.monotonic() < deadline and flow.poll() is None:
            time.sleep(0.2)
        assert marker.exists(), "the build stage never started"
        stage_pid = int(marker.read_text())
        flow.send_signal(signal.SIGTERM)
        assert flow.wait(timeout=90) != 0
    finally:
        if flow.poll() is None:
            flow.kill()
    deadline = time.monotonic() + 10
    while pid_alive(stage_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pid_alive(stage_pid)
    assert (demo / "params.yaml").read_bytes() == params_before
