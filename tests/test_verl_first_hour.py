"""The first GPU hour's failure modes on the verl path, each reproduced here without a GPU.

1. A private Ray (`train.verl.ray_address: ""`) is private: a real local Ray started by the doctor's probe and by
   verl's own `run_ppo` (with the launch's composed config) under a stale `ray_current_cluster` file, the one a
   crashed `ray start` leaves, starts a new instance instead of reaching for the dead address.
2. The watchdog bounds the start-up alone, until verl's fit-start line: a replayed launch that hangs before it is
   stopped within `startup_s`; docs/gpu.md's bounds per profile are the code's; the doctor's verl step suggests
   `train.verl.watchdog.rollout_s` from its measured rollout.
3. A wrong resume is caught at verl's fit-start line, before the validation pass that precedes step 1.
4. A finished run whose last step line was lost is accepted on verl's marker.
5. `promptr1 check` refuses the overrides that silence or change what the stage reads back from verl.
6. `reports/train/steps.csv` holds every launch of a training (a replayed stall and its resume, through the
   launcher itself, with a real MLflow store), and a launch that logged nothing to MLflow fails the stage.
7. benchmarks/gpu_actor_check.py's wheel set for an offline GPU machine: its manifest and size, the corrected
   requirements file, the Ray stand-in (never in the project's install), verl's import chain on it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pandas as pd
import pytest

from pipeline.config import WatchdogConfig, deep_merge, load_params, parse_override
from pipeline.errors import DataError, TrainingIncomplete, TrainingStalled
from pipeline.train.plan import TrainPlan
from pipeline.train.verl.progress import RESUME_CHECK_MARK, ResumeCheck, VerlProgress, resumed_step
from pipeline.train.verl.schedule import VerlSchedule, schedule_from_config
from pipeline.train.verl.watchdog import STALL_MARK, ProgressWatchdog, StepBounds

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))  # gpu_check_wheels, the wheel set's manifest logic
LOGS = Path(__file__).parent / "fixtures" / "verl_logs"
REPLAY = Path(__file__).parent / "verl_replay.py"
SCHEDULE = VerlSchedule(total_steps=40, steps_per_epoch=20, save_freq=10, test_freq=10, val_before_train=True,
                        derivation="2 epoch(s) x 20 steps (2600 rows // data.train_batch_size 128)")
PREFIX = "(TaskRunner pid=52731) "


def merged(*sets: str):
    overrides: dict = {}
    for item in sets:
        overrides = deep_merge(overrides, parse_override(item))
    return load_params(REPO / "params.yaml", overrides)


def verl_checkpoints(root: Path, *steps: int, marker: bool = True) -> Path:
    """verl's checkpoint layout: `global_step_N/actor/` and its marker naming the newest."""
    for step in steps:
        (root / f"global_step_{step}" / "actor").mkdir(parents=True, exist_ok=True)
    if marker and steps:
        (root / "latest_checkpointed_iteration.txt").write_text(str(max(steps)))
    return root


def replay_lines(check, log: str, until_step: int | None = None) -> None:
    for line in (LOGS / log).read_text(encoding="utf-8").splitlines():
        if until_step is not None and f"step:{until_step + 1} - " in line:
            return
        check.observe(line)


def stream(command: list[str], tmp_path: Path, progress) -> tuple[int, float]:
    """The launcher's own stream loop over `command`; (exit code, seconds)."""
    from pipeline.train.verl.backend import _stream

    t0 = time.monotonic()
    rc, _ = _stream(command, env={"PATH": "/usr/bin:/bin"}, cwd=tmp_path, log_file=tmp_path / "verl.log",
                    on_line=progress, watching=progress.watching)
    return rc, time.monotonic() - t0


# ------------------------------------------------------------------------------------------- 1. private Ray
@pytest.fixture()
def stale_ray_file(monkeypatch):
    """A `ray_current_cluster` file naming a dead GCS, as a `ray start` that crashed (or was never stopped and
    then died) leaves in Ray's temp folder; `RAY_TMPDIR` points this test's Ray at that folder. Short path:
    Ray's socket names must fit in 107 bytes."""
    folder = Path(tempfile.mkdtemp(prefix="rt"))
    with socket.socket() as sock:  # a port nothing listens on once closed
        sock.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{sock.getsockname()[1]}"
    (folder / "ray").mkdir()
    (folder / "ray" / "ray_current_cluster").write_text(dead)
    monkeypatch.setenv("RAY_TMPDIR", str(folder))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    yield dead
    shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.slow  # a Ray start: ~10-20 s on 2 busy cores
def test_the_private_probe_starts_its_own_ray_beside_a_stale_cluster_file(stale_ray_file):
    from pipeline.train.verl.resources import probe_private_ray

    result = probe_private_ray(merged("profile=paper-1node").train, num_gpus=6)
    assert result.address == "private" and result.gpus == 6
    assert result.owned_here() == ["0", "1", "2", "3", "4", "5"]  # pinned to train.verl.gpus, not the stale one's


_RUN_PPO = textwrap.dedent("""
    import json, sys
    import ray
    from omegaconf import OmegaConf
    from verl.trainer.main_ppo import run_ppo

    @ray.remote(num_cpus=0)
    class WhereAmI:
        def run(self, config):
            print("RAY " + json.dumps({"gcs": ray.get_runtime_context().gcs_address}), flush=True)

    run_ppo(OmegaConf.load(sys.argv[1]), WhereAmI)
""")


@pytest.mark.slow  # imports verl's driver and starts Ray: ~30 s on 2 busy cores
@pytest.mark.timeout(240)
def test_verls_own_ray_init_with_the_launch_config_starts_a_new_ray(stale_ray_file, tmp_path):
    """verl's `run_ppo` (main_ppo.py) calls `ray.init(**ray_kwargs.ray_init)` with the composed config of a
    paper-1node launch: with `address: local` it starts a private Ray; without it Ray reads the stale file and
    the launch reaches for a dead GCS."""
    from omegaconf import OmegaConf

    from pipeline.train.verl.backend import verl_launch
    from pipeline.train.verl.config import compose_verl

    plan = TrainPlan.from_params(merged("profile=paper-1node"))
    command, _ = verl_launch(plan, uri="sqlite:///x.db", run_id="0" * 32, val_files=[], environment_url=None,
                             agent_path=tmp_path / "agent", base_env={})
    assert "+ray_kwargs.ray_init.address='local'" in command
    cfg = compose_verl(command[3:])
    assert cfg.ray_kwargs.ray_init.address == "local"
    OmegaConf.save(cfg, tmp_path / "config.yaml")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run([sys.executable, "-c", _RUN_PPO, str(tmp_path / "config.yaml")], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=200, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    [line] = [ln for ln in done.stdout.splitlines() if "RAY {" in ln]
    gcs = json.loads(line.split("RAY ", 1)[1])["gcs"]
    assert gcs and gcs != stale_ray_file


def test_the_train_stage_start_probes_the_private_ray_on_a_host_with_gpus(tmp_path, monkeypatch):
    """`assert_resources` with `train.verl.ray_address: ""` on a host with GPUs probes the private Ray as verl
    will start it (the probe itself runs above, on a real Ray): a Ray that would own GPT-OSS's devices 6-7 is
    refused before the environment server loads. On a host without GPUs nothing is started."""
    from pipeline.errors import UserError
    from pipeline.train.verl import resources
    from pipeline.train.verl.resources import RayNode, RayProbe

    probed = []

    def probe(train, num_gpus=None):
        probed.append(train.verl.gpus)
        node = RayNode(node_id="n", ip="127.0.0.1", here=True, gpu_ids=tuple(str(g) for g in range(8)))
        return RayProbe(address="private", gpus=8.0, nodes=(node,))

    monkeypatch.setattr(resources, "probe_private_ray", probe)
    monkeypatch.setattr(resources, "host_gpu_count", lambda: 8)
    monkeypatch.setattr(resources, "free_bytes", lambda folder: 2**50)
    monkeypatch.setattr(resources, "verl_validation_error", lambda run: None)
    plan = TrainPlan.from_params(merged("profile=paper-1node", f"paths.checkpoint_dir={tmp_path / 'ckpt'}"))
    with pytest.raises(UserError, match=r"the Ray at 'private' owns CUDA devices \[0, 1, 2, 3, 4, 5, 6, 7\]"):
        resources.assert_resources(plan)
    assert probed == [[0, 1, 2, 3, 4, 5]]
    monkeypatch.setattr(resources, "host_gpu_count", lambda: 0)
    with pytest.raises(UserError, match=r"which has 0 GPU\(s\)"):
        resources.assert_resources(plan)  # refused by the device check alone
    assert len(probed) == 1


def test_only_a_private_ray_gets_the_local_address():
    from pipeline.train.verl.overrides import ray_overrides

    assert ray_overrides(merged("profile=paper-1node").train.verl) == ["+ray_kwargs.ray_init.address='local'"]
    assert ray_overrides(merged("profile=paper").train.verl) == []  # joined through RAY_ADDRESS


# ------------------------------------------------------------------------------------------- 2. watchdog
def tiny_bounds(resumed: bool | None = None, **allowances: float) -> StepBounds:
    cfg = WatchdogConfig(**{"startup_s": 1.0, "update_s": 1.0, "validation_s": 0.01, "checkpoint_s": 0.01,
                            **allowances})
    more = {} if resumed is None else {"resumed": resumed}
    return StepBounds(schedule=SCHEDULE, cfg=cfg, rollout_s=60.0, validation_rollout_s=0.0, **more)


def test_a_hang_before_the_fit_start_line_is_stopped_within_the_start_up_bound(tmp_path):
    """Start-up is bounded alone: with a 1 s start-up and a 60 s rollout worst case, a launch silent before
    `Setting global step to 20` is stopped after ~1 s, not after the first step's 60 s and more."""
    ckpt = verl_checkpoints(tmp_path / "ckpt", 20)
    progress = VerlProgress(ResumeCheck(SCHEDULE, 20, ckpt), ProgressWatchdog(tiny_bounds(), 20, grace_s=5.0))
    rc, seconds = stream([sys.executable, str(REPLAY), str(LOGS / "resume_healthy.log"), "--hang-before",
                          "Setting global step to", "--hang-s", "30"], tmp_path, progress)
    stalled = progress.stalled()
    assert rc != 0 and isinstance(stalled, TrainingStalled) and seconds < 15
    assert str(stalled).startswith(
        f"{STALL_MARK}: no fit-start line from verl ('Training from scratch' or 'Setting global step to N') for ")
    assert "beyond the start-up bound of 1 s (start-up until verl's fit-start line 1 s; " in str(stalled)


def test_after_the_fit_start_line_the_first_step_has_its_own_bound(tmp_path):
    """From the fit-start line on, the first step waits for the checkpoint load and the validation before
    training: a 2 s pause there passes a 1 s start-up; steps then pass at their own bound."""
    ckpt = verl_checkpoints(tmp_path / "ckpt", 20)
    bounds = tiny_bounds(True, checkpoint_s=3.0)
    assert bounds.parts(21, True) == {"rollout": 60.0, "update": 1.0, "checkpoint load": 3.0,
                                      "validation before training": 0.01}
    watchdog = ProgressWatchdog(bounds, 20, grace_s=5.0)
    progress = VerlProgress(ResumeCheck(SCHEDULE, 20, ckpt), watchdog)
    rc, _ = stream([sys.executable, str(REPLAY), str(LOGS / "resume_healthy.log"), "--pace", "0.01",
                    "--gap", "20=2.0"], tmp_path, progress)
    assert rc == 0 and progress.stalled() is None and progress.verify().complete


def profile_bounds(profile: str) -> list[str]:
    """One docs/gpu.md row for `profile`, computed: start-up, first step from scratch, first step after a
    resume, a plain step, a step that validates and saves."""
    from pipeline.train.verl.config import compose_plan

    params = merged(f"profile={profile}")
    plan = TrainPlan.from_params(params)
    run = compose_plan(plan)
    validates = run.value("trainer.test_freq") > 0 or run.value("trainer.val_before_train")
    sets = len(params.data.id_eval_datasets) + len(params.data.ood_eval_datasets)
    schedule = schedule_from_config(run.value, 10**6, sets * params.data.eval_rows if validates else 0)
    fresh = StepBounds.of(schedule, plan.train.verl.watchdog, plan.environment, plan.agent)
    resume_at = schedule.save_freq if schedule.save_freq < schedule.total_steps else 1
    resumed = StepBounds.of(schedule, plan.train.verl.watchdog, plan.environment, plan.agent, resume_at)
    plain = next(s for s in range(2, 100) if not (schedule.saves_at(s) or schedule.validates_at(s)))
    saving = next(s for s in range(1, 100) if schedule.saves_at(s))
    figures = [fresh.cfg.startup_s, fresh.seconds(1, True), resumed.seconds(resume_at + 1, True),
               fresh.seconds(plain, False), fresh.seconds(saving, False)]
    return [f"{s:,.0f} s" for s in figures]


def test_docs_state_the_watchdog_bounds_of_each_profile():
    text = (REPO / "docs" / "gpu.md").read_text(encoding="utf-8")
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `") and len(cells) == 6 and cells[1].endswith(" s"):
            rows[cells[0].strip("`")] = [c.split(" (")[0] for c in cells[1:]]
    assert set(rows) == {"smoke-1gpu", "paper-1node", "paper"}
    for profile, documented in rows.items():
        assert documented == profile_bounds(profile), profile
    # start-up is bounded alone: 1,800 s, where step 1's bound alone was once 54,900 s on paper-1node
    assert rows["paper-1node"][0] == "1,800 s"


@pytest.mark.slow  # composes verl's config twice and opens an MLflow store: 8-13 s on 2 busy cores
def test_the_doctor_suggests_the_watchdog_rollout_bound_from_its_step(tmp_path, monkeypatch):
    """The doctor's verl step (run_verl replaced by a stand-in that leaves what verl leaves: the log with the
    step line, the checkpoint, the dump) prints the `-S train.verl.watchdog.rollout_s` its rollout suggests.
    paper-1node: the doctor's 24 x 5 = 120 conversations took 95.43 s; the profile's 96 x 5 = 480 take, by the
    environment's worst case (5 turns, 64 in flight), (ceil(480*5/64) + 5) / (ceil(120*5/64) + 5) = 43/15 times
    as long: 95.43 x 43/15 x 2 = 547.1 s, rounded up to 600 s."""
    from pipeline.checks.doctor_state import Doctor
    from pipeline.checks.doctor_train import rollout_dir, step_verl
    from pipeline.train.verl import backend as verl_backend

    shutil.copy(REPO / "params.yaml", tmp_path / "params.yaml")
    shutil.copytree(REPO / "profiles", tmp_path / "profiles")
    (tmp_path / "data" / "rl").mkdir(parents=True)
    pd.DataFrame({"x": range(4)}).to_parquet(tmp_path / "data" / "rl" / "train.parquet")
    params = load_params(tmp_path / "params.yaml", {"profile": "paper-1node"})
    step_line = next(ln for ln in (LOGS / "resume_healthy.log").read_text().splitlines() if "step:21 - " in ln)

    def fake_run_verl(plan, uri, run):
        (plan.reports_dir / "train").mkdir(parents=True, exist_ok=True)
        (plan.reports_dir / "train" / "verl.log").write_text(step_line.replace("step:21", "step:1") + "\n")
        verl_checkpoints(plan.checkpoint_dir, 1)
        rollout_dir(tmp_path / "reports").mkdir(parents=True, exist_ok=True)
        (rollout_dir(tmp_path / "reports") / "1.jsonl").write_text('{"output": "x", "score": 0}\n')

    monkeypatch.setattr(verl_backend, "run_verl", fake_run_verl)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    doc = Doctor(params=params, gpus=[{"index": str(i)} for i in range(8)], environment_url="http://127.0.0.1:9/v1",
                 reports_dir=tmp_path / "reports")
    with doc.stack:
        status, detail, figures = step_verl(doc)
    assert status == "pass", detail
    assert figures["suggested_rollout_s"] == 600.0 and figures["profile_conversations"] == 480
    assert detail.endswith("its rollout (95.4 s) suggests `-S train.verl.watchdog.rollout_s=600` for the "
                           "profile's 480 conversations a step")
    assert (tmp_path / "params.yaml").read_text() == (REPO / "params.yaml").read_text()  # no params file written


# ------------------------------------------------------------------------------------------- 3. resume
def test_a_restart_at_zero_is_stopped_at_the_fit_start_line_before_the_validation(tmp_path):
    """The marker is gone, verl prints `Training from scratch`: stopped there, in a real child, although the
    validation before training (here 20 s before its `step:0` line) and step 1 have not come yet."""
    ckpt = verl_checkpoints(tmp_path / "ckpt", 20, marker=False)
    check = ResumeCheck(SCHEDULE, resumed_step(ckpt), ckpt)
    with pytest.raises(TrainingIncomplete) as stopped:
        stream([sys.executable, str(REPLAY), str(LOGS / "resume_restart_at_zero.log"), "--gap", "0=20"], tmp_path,
               VerlProgress(check, None))
    message = str(stopped.value)
    assert message.startswith(f"{RESUME_CHECK_MARK}: verl restarted at step 0: it printed 'Training from scratch'")
    assert "global_step_20" in message and "resumed from step 20" in message
    assert check.started_at == 0 and check.first is None  # no step line seen
    log_text = (tmp_path / "verl.log").read_text()
    assert "Training from scratch" in log_text and "step:0 -" not in log_text and "step:1 -" not in log_text
    assert check.undo_restart() == "verl's marker points at global_step_20 again"


def test_a_resume_at_another_checkpoint_is_stopped_at_the_fit_start_line(tmp_path):
    ckpt = verl_checkpoints(tmp_path / "ckpt", 10, 20)
    check = ResumeCheck(SCHEDULE, 20, ckpt)
    with pytest.raises(TrainingIncomplete, match=r"verl printed 'Setting global step to 10' at the start of "
                                                 r"training, but the launch resumed from checkpoint global_step_20"):
        check.observe(PREFIX + "Setting global step to 10")
    fresh = ResumeCheck(SCHEDULE, 0, tmp_path / "none")
    fresh.observe(PREFIX + "Checkpoint tracker file does not exist: /x/latest_checkpointed_iteration.txt")
    fresh.observe(PREFIX + "Training from scratch")
    assert fresh.started_at == 0


# ------------------------------------------------------------------------------------------- 4. last line
def test_a_run_whose_last_step_line_was_lost_is_complete_on_verls_marker(tmp_path):
    """The driver exits once `fit` returns; the last step's line can be lost. verl saved step 40 and wrote its
    marker after it: complete. Without that save (the marker at 30), the same output is a short run."""
    ckpt = verl_checkpoints(tmp_path / "ckpt", 10, 20)
    check = ResumeCheck(SCHEDULE, resumed_step(ckpt), ckpt)
    replay_lines(check, "resume_healthy.log", until_step=39)
    assert check.last == 39
    verl_checkpoints(ckpt, 30)
    with pytest.raises(TrainingIncomplete, match="short run: .*last step 39 is short of the 40"):
        check.verify()
    verl_checkpoints(ckpt, 40)
    progress = check.verify()
    assert progress.complete and (progress.resumed_from, progress.last_step, progress.total_steps) == (20, 40, 40)


# ------------------------------------------------------------------------------------------- 5. check
@pytest.mark.parametrize(("override", "named"), [
    ("trainer.logger=[mlflow]", "leaves out 'console'"),
    ("trainer.logger=[console]", "leaves out 'mlflow'"),
    ("trainer.resume_mode=disable", "trainer.resume_mode='disable' is refused"),
    ("trainer.resume_from_path=/ckpt/global_step_10", "trainer.resume_from_path='/ckpt/global_step_10' is refused"),
    ("trainer.del_local_ckpt_after_load=true", "trainer.del_local_ckpt_after_load=True is refused"),
    ("actor_rollout_ref.actor.checkpoint.async_save=true",
     "actor_rollout_ref.actor.checkpoint.async_save=True is refused"),
])
def test_promptr1_check_refuses_overrides_that_change_what_the_stage_reads(override, named):
    from typer.testing import CliRunner

    from pipeline.cli import app

    result = CliRunner().invoke(app, ["check", "--params", str(REPO / "params.yaml"), "-S", "profile=paper-1node",
                                      "-S", f"train.verl.extra_overrides={json.dumps([override])}"])
    assert result.exit_code == 2, result.output
    [line] = [ln for ln in result.output.splitlines() if named in ln]
    assert line.startswith("error: train.verl.extra_overrides: ")


def test_the_refusal_docs_gpu_md_shows_is_what_promptr1_check_prints():
    """docs/gpu.md section 1's command, read from the file and run as written."""
    import shlex

    from typer.testing import CliRunner

    from pipeline.cli import app

    text = (REPO / "docs" / "gpu.md").read_text(encoding="utf-8")
    [line] = [ln for ln in text.splitlines() if ln.startswith("promptr1 check") and "trainer.logger" in ln]
    result = CliRunner().invoke(app, ["check", "--params", str(REPO / "params.yaml"), *shlex.split(line)[2:]])
    assert result.exit_code == 2
    shown = text.split(line, 1)[1].splitlines()[1].removeprefix("# exit 2: ").removesuffix(" ...")
    assert shown in result.output


def test_promptr1_check_refuses_a_ray_address_beside_train_verl_ray_address():
    from typer.testing import CliRunner

    from pipeline.cli import app

    runner = CliRunner()
    result = runner.invoke(app, ["check", "--params", str(REPO / "params.yaml"), "-S", "profile=paper", "-S",
                                 'train.verl.extra_overrides=["+ray_kwargs.ray_init.address=auto"]'])
    assert result.exit_code == 2 and "ray_kwargs.ray_init.address is set by train.verl.ray_address" in result.output
    ok = runner.invoke(app, ["check", "--params", str(REPO / "params.yaml"), "-S", "profile=paper-1node"])
    assert ok.exit_code == 0, ok.output


# ------------------------------------------------------------------------------------------- 6. steps record
def step_line(step: int, score: float) -> str:
    return (f"{PREFIX}step:{step} - actor/kl_loss:{0.001 * step} - critic/score/mean:{score} - "
            f"critic/score/max:1.5 - critic/score/min:-1.5 - timing_s/gen:1.0")


def launch_log(path: Path, resumed_from: int, steps: dict[int, float], *extra: str) -> Path:
    start = ([f"{PREFIX}Checkpoint tracker file does not exist: x", f"{PREFIX}Training from scratch"]
             if resumed_from == 0 else [f"{PREFIX}Setting global step to {resumed_from}"])
    lines = [f"{PREFIX}Total training steps: 6", *extra, *start, *(step_line(s, v) for s, v in steps.items())]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture()
def six_step_plan(tmp_path, monkeypatch):
    """smoke-1gpu on a project in tmp_path: 6 steps, a save every 3, watchdog bounds of seconds, no health
    gate (the replayed figures are not a training's), MLflow in a SQLite file."""
    import mlflow

    shutil.copy(REPO / "params.yaml", tmp_path / "params.yaml")
    shutil.copytree(REPO / "profiles", tmp_path / "profiles")
    (tmp_path / "data" / "rl").mkdir(parents=True)
    pd.DataFrame({"x": range(24)}).to_parquet(tmp_path / "data" / "rl" / "train.parquet")
    params = load_params(tmp_path / "params.yaml", {"profile": "smoke-1gpu", "train": {
        "health": {"enabled": False},
        "verl": {"extra_overrides": ["trainer.total_training_steps=6"],
                 "watchdog": {"startup_s": 60, "update_s": 3, "rollout_s": 0.01, "validation_s": 0.5,
                              "checkpoint_s": 0.5}}}})
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    mlflow.set_tracking_uri(uri)
    experiment = mlflow.create_experiment("first-hour", artifact_location=(tmp_path / "art").as_uri())
    return TrainPlan.from_params(params), uri, experiment


def replayed_launch(plan, uri: str, experiment: str, log: Path, monkeypatch, *replay_args: str) -> str:
    """One launch through the launcher's `_launch` (ledger, stream, watchdog, resume check, export), with verl's
    command replaced by the replay of `log`; returns the launch's MLflow run id."""
    import mlflow

    from pipeline.train.verl import backend as verl_backend

    real = verl_backend.verl_launch

    def replay_launch(plan, **kwargs):
        _, env = real(plan, **kwargs)
        return [sys.executable, str(REPLAY), str(log), "--pace", "0.05", *replay_args], env

    monkeypatch.setattr(verl_backend, "verl_launch", replay_launch)
    with mlflow.start_run(experiment_id=experiment) as run:
        try:
            verl_backend._launch(plan, uri, run, [], "http://127.0.0.1:9/v1", plan.root / "agent")
        finally:
            run_id = run.info.run_id
    return run_id


@pytest.mark.slow  # three launches of a child that imports MLflow: ~20-30 s on 2 busy cores
@pytest.mark.timeout(240)
def test_steps_csv_holds_every_launch_of_a_training(six_step_plan, tmp_path, monkeypatch):
    """Launch 1 trains steps 1-4 from scratch and hangs (the watchdog stops it; verl had saved step 3); launch 2
    resumes from step 3 and trains 4-6. steps.csv holds steps 1-6, step 4 as launch 2 trained it. A launch 2
    whose MLflow logger failed (verl: 'Proceeding without MLflow tracking') fails the stage naming its steps."""
    from prefect.states import Failed

    from flows.dvc_steps import StageFailed
    from flows.policies import retry_unless_unhealthy
    from pipeline.train.verl.steps import LEDGER, STEPS_RECORD_MARK, read_launches

    plan, uri, experiment = six_step_plan
    first = launch_log(tmp_path / "launch1.log", 0, {1: -1.0, 2: -0.5, 3: 0.0, 4: 0.25})
    with pytest.raises(TrainingStalled):
        replayed_launch(plan, uri, experiment, first, monkeypatch, "--mlflow", "--hang-after", "4", "--hang-s", "30")
    verl_checkpoints(plan.checkpoint_dir, 3)  # what launch 1's verl saved at step 3 (save_freq 3)
    second = launch_log(tmp_path / "launch2.log", 3, {4: 0.5, 5: 0.75, 6: 1.0})
    run_2 = replayed_launch(plan, uri, experiment, second, monkeypatch, "--mlflow")
    frame = pd.read_csv(plan.steps_csv)
    assert frame["step"].tolist() == [1, 2, 3, 4, 5, 6]
    assert frame["reward/mean"].tolist() == [-1.0, -0.5, 0.0, 0.5, 0.75, 1.0]  # step 4: launch 2's
    launches = read_launches(plan.checkpoint_dir)
    assert [e.resumed_from for e in launches] == [0, 3] and launches[1].run_id == run_2

    # the same resume, with verl's MLflow logger failed: nothing of steps 4-6 in the run
    (plan.checkpoint_dir / "latest_checkpointed_iteration.txt").write_text("3")
    shutil.rmtree(plan.checkpoint_dir / "global_step_6", ignore_errors=True)
    (plan.checkpoint_dir / LEDGER).write_text(json.dumps({"launches": [dataclasses.asdict(launches[0])]}))
    silent = launch_log(tmp_path / "launch2b.log", 3, {4: 0.5, 5: 0.75, 6: 1.0},
                        f"{PREFIX}WARNING All MLflow initialization attempts failed. Proceeding without MLflow "
                        "tracking.")
    with pytest.raises(DataError) as failed:
        replayed_launch(plan, uri, experiment, silent, monkeypatch)
    message = str(failed.value)
    run_3 = read_launches(plan.checkpoint_dir)[-1].run_id
    assert message.startswith(f"{STEPS_RECORD_MARK}: ")
    assert f"MLflow holds no critic/score/mean for step(s) 4, 5, 6, which the run(s) {run_3} should hold" in message
    # written for inspection: launch 1's rows up to the resume point; its step 4 was redone, so it is not kept
    assert pd.read_csv(plan.steps_csv)["step"].tolist() == [1, 2, 3]
    assert retry_unless_unhealthy(None, None, Failed(data=StageFailed("train", 1, f"error: {message}"))) is False


def test_a_fresh_start_begins_a_new_ledger(tmp_path):
    from pipeline.train.verl.steps import Launch, record_launch

    assert [e.run_id for e in record_launch(tmp_path, Launch("a", 0))] == ["a"]
    assert [e.run_id for e in record_launch(tmp_path, Launch("b", 3))] == ["a", "b"]
    assert [e.run_id for e in record_launch(tmp_path, Launch("c", 0))] == ["c"]


def test_steps_record_names_missing_and_extra_steps():
    from pipeline.train.verl.steps import Launch, steps_record_problem

    launches = [Launch("run-a", 0), Launch("run-b", 3)]
    rows = {s: {"critic/score/mean": 0.0} for s in (1, 2, 3, 4, 6, 7)} | {0: {"val-core/x": 0.1}}
    problem = steps_record_problem(rows, launches, last_step=6, seen=[4, 5, 6])
    assert problem == ("MLflow holds no critic/score/mean for step(s) 5, which the run(s) run-b should hold (verl's "
                       "log says 'Proceeding without MLflow tracking' when its logger failed to start); it holds "
                       "training step(s) 7 beyond steps 1..6")
    assert steps_record_problem({s: {"critic/score/mean": 0.0} for s in range(1, 7)}, launches, 6, [4, 5, 6]) is None


# ------------------------------------------------------------------------------------------- 7. wheel set
DRY_RUN = REPO / "benchmarks" / "results" / "gpu_actor_check_dry_run.json"
MACHINE_TAGS = ("py3-none-any", "py2.py3-none-any", "py312-none-any", "cp312-cp312-manylinux", "cp39-abi3-manylinux")


def test_the_gpu_check_wheel_set_fits_and_matches_its_manifest(tmp_path):
    """The recorded set (scripts/gpu-check-wheels.sh, benchmarks/results/gpu_actor_check_dry_run.json): exactly
    the requirements file's pins plus the Ray stand-in, all built for the machine (cp312, manylinux x86_64), at most
    30 MiB; the stand-in rebuilt here from its sources is byte for byte the recorded one; every requirement the set
    declares is met; pip resolved it offline for the machine; the check ran on it in a fresh venv."""
    import gpu_check_wheels as wheels  # benchmarks/, on sys.path above

    record = json.loads(DRY_RUN.read_text(encoding="utf-8"))
    manifest = record["manifest"]
    assert manifest["problems"] == [] and manifest["total_bytes"] <= 30 * 2**20 == manifest["limit_mib"] * 2**20
    assert sum(w["bytes"] for w in manifest["wheels"]) == manifest["total_bytes"]
    listed = {w["name"]: w["version"] for w in manifest["wheels"]}
    assert len(listed) == len(manifest["wheels"])  # one version of each package
    assert listed == {**wheels.read_pins(), "ray": "2.60.0+standin"}
    assert all(w["tags"].startswith(MACHINE_TAGS) for w in manifest["wheels"]), manifest["wheels"]
    assert manifest["target"]["python_version"] == "3.12"
    standin = wheels.read_wheel(wheels.build_standin(tmp_path))
    [recorded] = [w for w in manifest["wheels"] if w["name"] == "ray"]
    assert (standin.sha256, standin.bytes) == (recorded["sha256"], recorded["bytes"])
    assert record["closure"]["unsatisfied"] == [] and set(record["closure"]["substituted"]) == {"ray"}
    resolution = record["offline_resolution"]
    assert resolution["returncode"] == 0 and len(resolution["would_install"]) == len(listed)
    for flag in ("--no-index", "--only-binary=:all:", "--python-version", "3.12", "manylinux_2_28_x86_64"):
        assert flag in resolution["command"]
    dry = record["cpu_dry_run"]
    assert dry["ok"] and dry["compare_equal"] and dry["update"]["ran"]
    assert dry["versions"]["ray"] == "2.60.0+standin" and dry["versions"]["transformers"] == "5.9.0"
    assert dry["versions"]["tokenizers"] == "0.22.2" and any(d.startswith("python: 3.11") for d in dry["differences"])
    script = (REPO / "scripts" / "gpu-check-wheels.sh").read_text(encoding="utf-8")
    assert '--python-version "$version"' in script and all(f"--platform {t}" in script for t in wheels.PLATFORMS)
    gathered = REPO / ".cache" / "gpu-check-wheels"
    if (gathered / "MANIFEST.json").is_file():  # a set gathered on this machine: the files are what it lists
        assert {w.file for w in wheels.wheels_in(gathered)} == {w["file"] for w in manifest["wheels"]}
        assert wheels.set_problems(wheels.wheels_in(gathered), wheels.read_pins()) == []


def test_the_requirements_file_lists_what_verl_and_the_pipeline_import():
    import gpu_check_wheels as wheels  # benchmarks/, on sys.path above

    pins = wheels.read_pins()
    for name in ("fastapi", "starlette", "uvicorn", "pydantic", "pydantic-core", "annotated-types",
                 "typing-inspection", "hydra-core", "tensordict", "verl"):
        assert name in pins, name
    assert (pins["transformers"], pins["tokenizers"], pins["verl"]) == ("5.9.0", "0.22.2", "0.9.1")
    assert "ray" not in pins and "wandb" not in pins
    header = wheels.REQUIREMENTS.read_text(encoding="utf-8").split("\n\n")[0]
    assert "bring pydantic" not in header and "none of torch, transformers and peft declares" in header


def test_the_ray_stand_in_never_reaches_the_project_install():
    import tomllib

    from setuptools import find_packages

    config = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    include = config["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = find_packages(where=str(REPO), include=include)
    assert packages and not [p for p in packages if p == "ray" or p.startswith(("ray.", "benchmarks"))]
    import ray

    assert not getattr(ray, "STAND_IN", False) and "site-packages" in ray.__file__


_CHAIN = textwrap.dedent("""
    import sys
    sys.modules["trl"] = None  # as benchmarks/gpu_actor_check.py does
    import ray
    assert ray.STAND_IN
    from verl.protocol import DataProto
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage
    from verl.workers.engine_workers import ActorRolloutRefWorker
    from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding
    import verl.model_merger.__main__
    import verl.single_controller.ray.base as needs_ray
    try:
        needs_ray.create_colocated_worker_cls  # importable, but a worker group is refused:
        ray.remote(object).remote()
    except ray.RayStandInError as refused:
        print("refused:", refused)
    print("chain ok")
""")


@pytest.mark.slow  # imports verl and torch in a child: ~10-20 s on 2 busy cores
def test_verls_import_chain_of_the_check_survives_the_ray_stand_in():
    env = {**os.environ, "PYTHONPATH": str(REPO / "benchmarks" / "gpu_check_ray")}
    done = subprocess.run([sys.executable, "-c", _CHAIN], env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "refused: ray.remote(object): this is the stand-in for Ray" in done.stdout and "chain ok" in done.stdout
