"""The verl backend's resume check and progress watchdog, replaying verl's console lines.

The logs under tests/fixtures/verl_logs/ are the lines verl 0.9.1's trainer prints, as its code prints them
(`ray_trainer.py`: dataloader sizes, `Total training steps`, the checkpoint lookup and resume lines, the save
folder; `aggregate_logger.concat_dict_to_str`: the `step:N - key:value` line, Ray's `(TaskRunner pid=…)` prefix),
for a run of 2 epochs x 20 steps that saves and validates every 10 steps, resumed from `global_step_20`:

- resume_healthy.log: steps 21..40 (verl 0.9.1's own epoch-boundary handling);
- resume_restart_at_zero.log: the marker is missing, verl trains from scratch (verl issue 7952);
- resume_skipped_epoch.log: the restored dataloader is exhausted, no step is trained, exit 0 (verl issue 7401).

The stall and slow-save cases run a real child (`tests/verl_replay.py`) through the launcher's `_stream`, with
bounds of about a second.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from pipeline.config import WatchdogConfig, load_params
from pipeline.config.specs import tracking_spec
from pipeline.errors import TrainingIncomplete, TrainingStalled
from pipeline.train.plan import TrainPlan
from pipeline.train.verl.progress import RESUME_CHECK_MARK, ResumeCheck, VerlProgress, resumed_step
from pipeline.train.verl.schedule import VerlSchedule
from pipeline.train.verl.watchdog import STALL_MARK, ProgressWatchdog, StepBounds

REPO_ROOT = Path(__file__).resolve().parents[1]
LOGS = Path(__file__).parent / "fixtures" / "verl_logs"
REPLAY = Path(__file__).parent / "verl_replay.py"
SCHEDULE = VerlSchedule(total_steps=40, steps_per_epoch=20, save_freq=10, test_freq=10, val_before_train=True,
                        derivation="2 epoch(s) x 20 steps (2600 rows // data.train_batch_size 128)")


def verl_checkpoints(root: Path, *steps: int, marker: bool = True) -> Path:
    """verl's checkpoint layout: `global_step_N/actor/` and its marker naming the newest."""
    for step in steps:
        (root / f"global_step_{step}" / "actor").mkdir(parents=True)
    if marker and steps:
        (root / "latest_checkpointed_iteration.txt").write_text(str(max(steps)))
    return root


def replay(check: ResumeCheck, log: str, until_step: int | None = None, without: str | None = None) -> None:
    """Feed `check` the log's lines, up to step `until_step`'s, leaving out those that contain `without`."""
    for line in (LOGS / log).read_text(encoding="utf-8").splitlines():
        if until_step is not None and f"step:{until_step + 1} - " in line:
            return
        if without is None or without not in line:
            check.observe(line)


# ------------------------------------------------------------------------------------------- resume check
def test_resume_to_step_zero_is_stopped_at_its_first_step(tmp_path):
    """The defence behind the fit-start line (tests/test_verl_first_hour.py): without `Training from scratch`
    in the output, the restart is stopped at its first step line."""
    # the marker is gone: verl restarts from scratch although global_step_20 exists
    ckpt = verl_checkpoints(tmp_path / "ckpt", 10, 20, marker=False)
    assert resumed_step(ckpt) == 20
    check = ResumeCheck(SCHEDULE, resumed_step(ckpt), ckpt)
    with pytest.raises(TrainingIncomplete) as stopped:
        replay(check, "resume_restart_at_zero.log", without="Training from scratch")
    message = str(stopped.value)
    assert message.startswith(f"{RESUME_CHECK_MARK}: verl restarted at step 0")
    assert "first training step was 1" in message and "global_step_20" in message and "step 21" in message
    assert check.first == 1 and check.logged == 0  # stopped at the first step line, before a second one
    # verl saved the restart's step 1 (save_freq 1) and its marker before printing the line: set aside, and the
    # marker points at the checkpoint the launch should have resumed from, so the next launch does
    verl_checkpoints(ckpt, 1)
    assert resumed_step(ckpt) == 1
    assert check.undo_restart() == ("set aside global_step_1 as restarted-*; verl's marker points at global_step_20 "
                                    "again")
    assert (ckpt / "restarted-global_step_1" / "actor").is_dir() and resumed_step(ckpt) == 20


def test_resume_to_step_zero_stops_the_real_process_and_is_not_retried(tmp_path):
    """Through the launcher's stream: the child replaying the restart is stopped at its fit-start line
    (`Training from scratch`), before its validation and first step; the flow's retry policy does not retry it
    (the rerun would meet the same missing marker)."""
    from prefect.states import Failed

    from flows.dvc_steps import StageFailed
    from flows.policies import retry_unless_unhealthy
    from pipeline.train.verl.backend import _stream

    ckpt = verl_checkpoints(tmp_path / "ckpt", 20, marker=False)
    progress = VerlProgress(ResumeCheck(SCHEDULE, resumed_step(ckpt), ckpt), None)
    t0 = time.monotonic()
    with pytest.raises(TrainingIncomplete) as stopped:
        _stream([sys.executable, str(REPLAY), str(LOGS / "resume_restart_at_zero.log"), "--pace", "0.3"],
                env={"PATH": "/usr/bin:/bin"}, cwd=tmp_path, log_file=tmp_path / "verl.log", on_line=progress)
    assert time.monotonic() - t0 < 20
    log_text = (tmp_path / "verl.log").read_text()
    assert "Training from scratch" in log_text and "step:0 -" not in log_text and "step:1 -" not in log_text
    assert retry_unless_unhealthy(None, None, Failed(data=StageFailed("train", 1, f"error: {stopped.value}"))) is False


def test_skipped_epoch_fails_naming_the_resume_and_the_total(tmp_path):
    ckpt = verl_checkpoints(tmp_path / "ckpt", 10, 20)
    check = ResumeCheck(SCHEDULE, resumed_step(ckpt), ckpt)
    replay(check, "resume_skipped_epoch.log")  # nothing wrong is visible while it runs
    with pytest.raises(TrainingIncomplete) as failed:
        check.verify()
    message = str(failed.value)
    assert message.startswith(f"{RESUME_CHECK_MARK}: skipped epoch: verl exited 0 having logged no training step")
    assert "global_step_20" in message and "last step 20 is short of the 40" in message
    assert "step 20 = 1 epoch(s) x 20 steps" in message


def test_healthy_resume_is_verified_and_a_short_one_is_not(tmp_path):
    ckpt = verl_checkpoints(tmp_path / "ckpt", 10, 20)
    check = ResumeCheck(SCHEDULE, resumed_step(ckpt), ckpt)
    replay(check, "resume_healthy.log")
    progress = check.verify()
    assert (progress.resumed_from, progress.last_step, progress.total_steps, progress.complete) == (20, 40, 40, True)
    assert check.verl_total == 40 and check.logged == 20

    short = ResumeCheck(SCHEDULE, 20, ckpt)
    replay(short, "resume_healthy.log", until_step=33)
    with pytest.raises(TrainingIncomplete, match=r"short run: verl exited 0 having logged 13 training step\(s\) "
                       r"\(21\.\.33\) after resuming from checkpoint global_step_20 .*last step 33 is short of the 40"):
        short.verify()


def test_verl_s_printed_total_is_the_one_a_launch_is_held_to(tmp_path):
    """Rows dropped by verl (filter_overlong_prompts) make its total smaller than the derived one: verl's counts."""
    smaller = VerlSchedule(**{**SCHEDULE.__dict__, "total_steps": 60, "derivation": "3 epoch(s) x 20 steps"})
    check = ResumeCheck(smaller, 20, tmp_path)
    replay(check, "resume_healthy.log")  # prints `Total training steps: 40`
    progress = check.verify()
    assert progress.complete and progress.total_steps == 40 and progress.total_from.startswith("verl's log")


# ------------------------------------------------------------------------------------------- watchdog
def tiny_bounds(**allowances: float) -> StepBounds:
    cfg = WatchdogConfig(**{"startup_s": 3.0, "update_s": 1.0, "validation_s": 0.01, "checkpoint_s": 0.01,
                            **allowances})
    return StepBounds(schedule=SCHEDULE, cfg=cfg, rollout_s=0.0, validation_rollout_s=0.0)


def run_replay(tmp_path: Path, bounds: StepBounds, *args: str) -> tuple[int, VerlProgress, list, float]:
    from pipeline.train.verl.backend import _stream

    ckpt = verl_checkpoints(tmp_path / "ckpt", 20)
    progress = VerlProgress(ResumeCheck(SCHEDULE, 20, ckpt), ProgressWatchdog(bounds, 20, grace_s=5.0))
    started: list = []

    def watching(process):
        started.append(process)
        return progress.watching(process)

    t0 = time.monotonic()
    rc, _ = _stream([sys.executable, str(REPLAY), str(LOGS / "resume_healthy.log"), *args],
                    env={"PATH": "/usr/bin:/bin"}, cwd=tmp_path, log_file=tmp_path / "verl.log", on_line=progress,
                    watching=watching)
    return rc, progress, started, time.monotonic() - t0


def gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"


def test_a_stall_stops_the_process_group_within_the_bound_and_is_retried(tmp_path):
    from prefect.states import Failed

    from flows.dvc_steps import StageFailed
    from flows.policies import retry_unless_unhealthy

    rc, progress, started, seconds = run_replay(tmp_path, tiny_bounds(), "--pace", "0.02", "--hang-after", "23",
                                                "--spawn-child")
    stalled = progress.stalled()
    assert rc != 0 and isinstance(stalled, TrainingStalled)
    assert seconds < 10  # the bound of step 24 is 1 s (update only); the child would have slept 600 s
    message = str(stalled)
    assert re.match(rf"{STALL_MARK}: no verl step line for \d+ s, beyond step 24's bound of 1 s \(rollout 0 s "
                    r"\+ update 1 s; train.verl.watchdog\)", message)
    assert "global_step_20 in" in message and "a retry resumes from it" in message
    log_text = (tmp_path / "verl.log").read_text()
    assert "step:23 -" in log_text and "step:24 -" not in log_text
    child = int(log_text.split("replay child pid ", 1)[1].split()[0])
    deadline = time.monotonic() + 5
    while not (gone(started[0].pid) and gone(child)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone(started[0].pid) and gone(child)  # the whole group, not only its leader
    assert retry_unless_unhealthy(None, None, Failed(data=StageFailed("train", 1, f"error: {stalled}"))) is True
    health = StageFailed("train", 1, "error: training health gate: kl 2.1 breaches 1 at step 14 (...)")
    assert retry_unless_unhealthy(None, None, Failed(data=health)) is False


def test_a_slow_checkpoint_save_does_not_trip_the_watchdog(tmp_path):
    """Step 30 saves (save_freq 10): its line comes 2 s after step 29's, beyond a plain step's 1 s bound but
    within the save step's 1 + 2 s; the run ends healthy. The same pause before a step that does not save trips."""
    bounds = tiny_bounds(checkpoint_s=2.0)
    assert bounds.seconds(30, first=False) == pytest.approx(3.01) and bounds.seconds(29, first=False) == 1.0
    rc, progress, _, _ = run_replay(tmp_path, bounds, "--pace", "0.02", "--gap", "30=2.0")
    assert rc == 0 and progress.stalled() is None
    assert progress.verify().complete

    rc, progress, _, _ = run_replay(tmp_path / "control", bounds, "--pace", "0.02", "--gap", "29=2.0")
    assert rc != 0 and "beyond step 29's bound" in str(progress.stalled())


# ------------------------------------------------------------------------------------------- from the profile
@pytest.fixture()
def smoke_plan(tmp_path):
    """The smoke-1gpu profile on a project in tmp_path with a 16-row training set (4 steps of 4 questions)."""
    shutil.copy(REPO_ROOT / "params.yaml", tmp_path / "params.yaml")
    shutil.copytree(REPO_ROOT / "profiles", tmp_path / "profiles")
    (tmp_path / "data" / "rl" / "eval").mkdir(parents=True)
    pd.DataFrame({"x": range(18)}).to_parquet(tmp_path / "data" / "rl" / "train.parquet")
    return TrainPlan.from_params(load_params(tmp_path / "params.yaml", {"profile": "smoke-1gpu"}))


def test_step_bounds_of_the_smoke_profile_by_hand(smoke_plan):
    """smoke-1gpu: 4 questions x G=4 = 16 conversations of at most 3 turns, 16 calls in flight, each at most
    60 s x (1 + 1/4) = 75 s: (ceil(16 x 3 / 16) + 3) x 75 = 450 s of rollout; the profile saves at step 3 and
    never validates; `trainer.total_training_steps=3` although 18 rows // 4 = 4 steps per epoch. The start-up
    is bounded alone, until verl's fit-start line; a resumed launch's first step also loads the checkpoint."""
    from pipeline.train.verl.schedule import verl_schedule

    schedule = verl_schedule(smoke_plan)
    assert (schedule.total_steps, schedule.steps_per_epoch) == (3, 4)
    assert schedule.derivation == "trainer.total_training_steps=3"
    bounds = StepBounds.of(schedule, smoke_plan.train.verl.watchdog, smoke_plan.environment, smoke_plan.agent)
    assert bounds.rollout_s == 450.0 and bounds.validation_rollout_s == 0.0
    assert bounds.startup_parts() == {"start-up until verl's fit-start line": 1800}  # alone, before step 1's
    assert bounds.seconds(1, first=True) == 450 + 900  # from the fit-start line: no load, no validation before
    resumed = StepBounds.of(schedule, smoke_plan.train.verl.watchdog, smoke_plan.environment, smoke_plan.agent,
                            resumed_from=1)
    assert resumed.seconds(2, first=True) == 450 + 900 + 900  # the checkpoint load
    assert bounds.seconds(2, first=False) == 450 + 900
    assert bounds.seconds(3, first=False) == 450 + 900 + 900
    measured = smoke_plan.train.verl.watchdog.model_copy(update={"rollout_s": 100.0})
    assert StepBounds.of(schedule, measured, smoke_plan.environment, smoke_plan.agent).seconds(2, False) == 1000


def test_a_training_set_verl_cannot_train_on_is_named(smoke_plan):
    from pipeline.errors import DataError
    from pipeline.train.verl.schedule import verl_schedule

    pd.DataFrame({"x": range(3)}).to_parquet(smoke_plan.train_file)  # fewer rows than one batch of 4
    with pytest.raises(DataError, match=r"train.parquet gives verl no training step \(3 rows"):
        verl_schedule(smoke_plan)
    smoke_plan.train_file.write_bytes(b"not parquet")
    with pytest.raises(DataError, match=r"train.parquet is not a readable Parquet file"):
        verl_schedule(smoke_plan)


def test_train_stage_calls_verl_training_complete_on_verl_s_total(smoke_plan, tmp_path):
    """The stage's "nothing to do" decision for backend verl: verl's checkpoint against the total verl computes.
    Without it the stage relaunched verl past its last step (verl then trains one step beyond the total)."""
    from pipeline.stages.train import training_complete, training_progress

    plan = smoke_plan
    plan.steps_csv.parent.mkdir(parents=True)
    plan.steps_csv.write_text("step,reward/mean\n1,0.1\n2,0.2\n3,0.3\n")
    verl_checkpoints(plan.checkpoint_dir, 2)
    assert not training_complete(plan) and training_progress(plan).describe() == (
        "step 2 of 3 (trainer.total_training_steps=3)")
    verl_checkpoints(plan.checkpoint_dir, 3)
    assert training_complete(plan)
    os.remove(plan.steps_csv)
    assert not training_complete(plan)


def test_register_refuses_a_train_run_that_did_not_reach_its_total(tmp_path, monkeypatch):
    import json

    import mlflow

    from pipeline.errors import UserError
    from pipeline.stages.register import check_training_complete, run_register
    from pipeline.tracking.runs import stage_run
    from pipeline.train.completion import TrainingProgress

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    shutil.copy(REPO_ROOT / "params.yaml", tmp_path / "params.yaml")
    (tmp_path / "agent").mkdir()
    params = load_params(tmp_path / "params.yaml", {"paths": {"model_dir": str(tmp_path / "agent")}})
    metrics = {"mode": "ours", "rows_per_dataset": 4, "averages": {"prompt_r1": {
        "id": {m: {"mean": 30.0, "low": 29.0, "high": 31.0} for m in ("em", "f1", "ssim")},
        "ood": {m: {"mean": 40.0, "low": 39.0, "high": 41.0} for m in ("em", "f1", "ssim")}}}}
    (tmp_path / "reports" / "eval").mkdir(parents=True)
    (tmp_path / "reports" / "eval" / "metrics.json").write_text(json.dumps(metrics))

    short = TrainingProgress("verl", 20, 20, 40, "2 epoch(s) x 20 steps")
    with pytest.raises(RuntimeError), stage_run(tracking_spec(params), "train", new_parent=True):
        mlflow.set_tags(short.tags())  # recorded before training; the run then died
        raise RuntimeError("killed")
    with pytest.raises(UserError, match=r"ended at step 20 of 40 \(2 epoch\(s\) x 20 steps\): training is not "
                       "complete"):
        run_register(params)
    assert not (tmp_path / "reports" / "promotion.json").exists()
    time.sleep(0.05)
    with stage_run(tracking_spec(params), "train"):  # the rerun resumed and reached the total
        mlflow.set_tags(TrainingProgress("verl", 20, 40, 40, "2 epoch(s) x 20 steps").tags())
    check_training_complete(tracking_spec(params))
