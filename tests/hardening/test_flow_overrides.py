"""A flow killed with SIGKILL while its `-S` overrides are written into the params files leaves them
restorable: the next run puts params.yaml (and any profile it touched) back byte for byte.

Real processes: the overrides are applied by a separate Python process that is SIGKILLed, once at a known
point (applied, waiting) and then at random moments of an apply/restore loop (mid-apply, mid-restore,
mid-journal-write). The slow test kills the real flow (`python -m flows.retrain`) mid-stage and lets the
next real flow run restore the params.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from helpers import copy_params

from flows import dvc_steps
from flows.run_lock import workspace_lock
from pipeline.config import load_params
from pipeline.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
OVERRIDES = ["train.steps=3", "profile=paper", "profiles/paper.yaml:train.lr=2.0e-6"]

APPLY_AND_WAIT = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from flows import dvc_steps
    dvc_steps.apply_overrides(Path(sys.argv[1]), sys.argv[2:])
    print("applied", flush=True)
    time.sleep(600)
""")

APPLY_RESTORE_LOOP = textwrap.dedent("""
    import sys
    from pathlib import Path
    from flows import dvc_steps
    root = Path(sys.argv[1])
    print("ready", flush=True)
    while True:
        dvc_steps.restore_files(root, dvc_steps.apply_overrides(root, sys.argv[2:]))
""")


def _project(tmp_path: Path) -> Path:
    root = copy_params(tmp_path / "project", profiles=True)
    (root / ".dvc" / "tmp").mkdir(parents=True)
    return root


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes()
            for p in [root / "params.yaml", *sorted((root / "profiles").glob("*.yaml"))]}


def _leftovers(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob(".*.tmp"))


def _start(script: str, root: Path, expect: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", script, str(root), *OVERRIDES], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if line != expect:
        proc.kill()
        pytest.fail(f"child said {line!r}: {proc.communicate(timeout=30)[1][-2000:]}")
    return proc


def _kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL
    proc.communicate(timeout=30)


@pytest.mark.timeout(180)
def test_sigkilled_run_overrides_are_restored_by_the_next_run(tmp_path):
    root = _project(tmp_path)
    before = _snapshot(root)
    proc = _start(APPLY_AND_WAIT, root, "applied")
    _kill(proc)

    left = load_params(root / "params.yaml")
    assert left.train.steps == 3 and left.profile == "paper"  # the kill left the overrides in place
    assert (root / dvc_steps.OVERRIDE_JOURNAL).is_file()
    with pytest.raises(UserError, match="did not finish"):  # nobody stacks overrides on a dead run's
        dvc_steps.apply_overrides(root, ["train.steps=4"])

    with workspace_lock(root, 10.0):  # what the next flow run does first, under the lock
        restored = dvc_steps.recover_overrides(root)

    assert sorted(p.relative_to(root.resolve()).as_posix() for p in restored) == [
        "params.yaml", "profiles/paper.yaml"]
    assert _snapshot(root) == before
    assert not (root / dvc_steps.OVERRIDE_JOURNAL).exists()
    assert dvc_steps.recover_overrides(root) == []  # idempotent: nothing left to do


@pytest.mark.timeout(300)
def test_kill_at_random_moments_of_apply_and_restore(tmp_path):
    root = _project(tmp_path)
    before = _snapshot(root)
    rng = random.Random(13)
    caught_mid_run = 0
    for _ in range(5):
        proc = _start(APPLY_RESTORE_LOOP, root, "ready")
        time.sleep(rng.uniform(0.05, 1.5))
        _kill(proc)
        caught_mid_run += (root / dvc_steps.OVERRIDE_JOURNAL).exists()
        dvc_steps.recover_overrides(root)
        assert _snapshot(root) == before
        assert not (root / dvc_steps.OVERRIDE_JOURNAL).exists()
        assert _leftovers(root) == []
    assert caught_mid_run >= 1  # the kills did land while overrides were (being) applied


def test_file_edited_after_the_kill_is_not_overwritten(tmp_path):
    root = _project(tmp_path)
    proc = _start(APPLY_AND_WAIT, root, "applied")
    _kill(proc)
    edited = (root / "params.yaml").read_bytes() + b"# edited by hand after the crash\n"
    (root / "params.yaml").write_bytes(edited)

    with pytest.raises(UserError, match=r"params\.yaml was edited after a flow run .* was killed"):
        dvc_steps.recover_overrides(root)
    assert (root / "params.yaml").read_bytes() == edited
    assert (root / dvc_steps.OVERRIDE_JOURNAL).is_file()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_real_flow_killed_mid_stage_then_next_flow_run_restores_params(tmp_path):
    from demo_project import make_demo_project, pid_alive

    demo = make_demo_project(tmp_path / "project")
    before = _snapshot(demo)
    prefect = {"PREFECT_HOME": str(tmp_path / "prefect-home"), "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "240"}
    env = {**os.environ, **prefect, "PROMPTR1_DEMO_SLEEP": "build:300"}
    flow = subprocess.Popen([sys.executable, "-m", "flows.retrain", "--project-dir", str(demo),
                             "-S", "train.steps=7"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=(tmp_path / "flow.log").open("w"), start_new_session=True)
    marker = demo / ".dvc" / "tmp" / "demo-sleeping.pid"
    stage_group = None
    try:
        deadline = time.monotonic() + 240
        while not marker.exists() and time.monotonic() < deadline and flow.poll() is None:
            time.sleep(0.2)
        assert marker.exists(), f"the build stage never started: {(tmp_path / 'flow.log').read_text()[-3000:]}"
        stage_group = os.getpgid(int(marker.read_text()))
        assert load_params(demo / "params.yaml").train.steps == 7
        flow.send_signal(signal.SIGKILL)
        flow.wait(timeout=30)
    finally:
        if flow.poll() is None:
            flow.kill()
        if stage_group is not None:  # the stage runs in its own group; SIGKILL gave the flow no chance
            os.killpg(stage_group, signal.SIGKILL)
        # Prefect's ephemeral API server (a child of the flow, in the flow's group) outlives a SIGKILLed flow;
        # take it down too, or every run of this test leaves a uvicorn process behind.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(flow.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while pid_alive(int(marker.read_text())) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert load_params(demo / "params.yaml").train.steps == 7  # left behind by the kill

    env = {**os.environ, **prefect, "PROMPTR1_DEMO_FAIL": "build"}
    done = subprocess.run([sys.executable, "-m", "flows.retrain", "--project-dir", str(demo)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=400, check=False)
    assert done.returncode != 0 and "build" in done.stdout + done.stderr  # it ran until the failing stage
    assert _snapshot(demo) == before
    assert not (demo / dvc_steps.OVERRIDE_JOURNAL).exists()


# --- every stage command refuses to run on a dead run's overrides (flows/override_guard.py) ----------------

APPLY_LOCKED_AND_WAIT = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from flows import dvc_steps
    from flows.run_lock import workspace_lock
    root = Path(sys.argv[1])
    with workspace_lock(root, 0, flow_run="live-run"):
        dvc_steps.apply_overrides(root, sys.argv[2:])
        print("applied", flush=True)
        time.sleep(600)
""")


def _promptr1(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(Path(sys.executable).parent / "promptr1"), *args], cwd=root, capture_output=True,
                          text=True, timeout=180, check=False)


def test_stage_refuses_a_dead_runs_overrides_until_restored(tmp_path):
    root = _project(tmp_path)
    before = _snapshot(root)
    _kill(_start(APPLY_AND_WAIT, root, "applied"))  # a flow run SIGKILLed with its overrides applied

    refused = _promptr1(root, "register")
    assert refused.returncode == 1
    message = " ".join(refused.stderr.split())
    assert "was killed with its overrides `train.steps=3 profile=paper profiles/paper.yaml:train.lr=2.0e-6`" in message
    assert "params.yaml, profiles/paper.yaml" in message and "`promptr1 flow restore`" in message
    assert "Traceback" not in refused.stderr
    assert (root / dvc_steps.OVERRIDE_JOURNAL).is_file()  # nothing restored behind the user's back

    restored = _promptr1(root, "flow", "restore")
    assert restored.returncode == 0, restored.stderr
    assert restored.stdout.strip() == "restored params.yaml, profiles/paper.yaml"
    assert _snapshot(root) == before and not (root / dvc_steps.OVERRIDE_JOURNAL).exists()

    after = _promptr1(root, "register")  # past the guard: the stage itself now says what it misses
    assert after.returncode == 1 and "no merged agent" in after.stderr and "killed" not in after.stderr
    assert _promptr1(root, "flow", "restore").stdout.strip().startswith("nothing to restore")


def test_stage_of_a_live_run_is_not_refused(tmp_path):
    root = _project(tmp_path)
    live = _start(APPLY_LOCKED_AND_WAIT, root, "applied")  # a live flow run: it holds the workspace lock
    try:
        stage = _promptr1(root, "register")  # what DVC runs for that live flow
        assert stage.returncode == 1 and "no merged agent" in stage.stderr and "killed" not in stage.stderr
        busy = _promptr1(root, "flow", "restore")  # the live run's overrides are its own
        assert busy.returncode == 1 and "another pipeline run is using" in busy.stderr
        assert load_params(root / "params.yaml").train.steps == 3
    finally:
        _kill(live)
