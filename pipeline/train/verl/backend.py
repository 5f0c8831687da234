"""Backend `verl`: GRPO on GPU nodes with verl 0.9.1, driven by our typed params (no fork, no bash blobs).

`build_overrides(plan)` turns the train plan (`pipeline.train.plan`) into the Hydra overrides of verl's own
`ppo_trainer.yaml`; `run_verl(plan, tracking_uri, run)` launches
`python -m verl.trainer.main_ppo <overrides>` on a joined Ray cluster or a private one,
streams its log, attaches verl's MLflow logger to our run and exports the step metrics of every launch of the
training to `reports/train/steps.csv` (pipeline/train/verl/steps.py).

Our code enters verl only at its documented extension points:
- the agent loop `pipeline.train.verl.agent_loop.PromptR1AgentLoop`, registered as `prompt_r1` by
  `pipeline/train/verl/agent_loop.yaml` (`actor_rollout_ref.rollout.agent.agent_loop_config_path`) and made the
  default loop, so rows without an `agent_name` column use it too;
- the reward function `pipeline/train/verl/reward.py:compute_score` (`reward.custom_reward_function`),
  with our reward preset and coefficients passed as `reward.custom_reward_function.reward_kwargs`;
- one extra config block, `prompt_r1` (environment endpoint, turn limits, cache path), that verl carries
  untouched to every agent-loop worker inside the trainer config. It replaces environment variables or
  side files, which would not reach Ray workers on other nodes.

Decisions:
- **Trainer: `trainer.use_v1=false` by default** (`train.verl.use_v1`). verl 0.9.1's default V1 trainer
  imports the `TransferQueue` package, which the pinned `verl==0.9.1` install does not bring (only the
  `verl[verl-core]` extra does). The legacy trainer (`verl.trainer.main_ppo_v0`, still shipped in 0.9.1,
  logs a deprecation warning) runs the same agent loop, reward loop and GRPO code without it. Set
  `train.verl.use_v1: true` after `pip install 'verl[verl-core]==0.9.1'`; `run_verl` checks the import
  first and says what to install.
- **Batch sizes are in questions**, as in verl: `data.train_batch_size` = `train.batch_size`,
  `ppo_mini_batch_size` = `train.mini_batch_size` (verl multiplies both by `rollout.n` = G), micro-batches
  per GPU = `train.micro_batch_size` (also used for the rollout and reference log-prob passes).
- **Lengths**: `data.max_response_length` = `agent.max_response_tokens` covers every turn including the
  environment's replies (mask 0); one agent turn is capped by `agent.max_turn_tokens` in the agent loop;
  `rollout.multi_turn.max_assistant_turns` = `agent.max_turns`.
- **MLflow**: `trainer.logger=[console,mlflow]`; verl's logger runs inside Ray actors, so
  `MLFLOW_TRACKING_URI` and `MLFLOW_RUN_ID` (our active child run) are set both in the launcher's
  environment and in the Ray job's `runtime_env`, and verl logs into our run instead of opening its own.
- **Health gate** (`train.health`, pipeline/train/verl/health_gate.py): every output line goes to a watch that
  judges each step from verl's step line and its rollout dump (`trainer.rollout_data_dir`); a breach stops
  verl's process group, sets the breaching step's checkpoints aside and fails the stage with one line.
- **Offline, on a local path**: before verl starts, the agent's weights are checked in this machine's
  Hugging Face cache (`pipeline.local_weights.cached_location`; missing: a UserError naming `promptr1 weights`).
  verl then gets the snapshot folder as `actor_rollout_ref.model.path` instead of the Hub id, and the launch
  runs with `HF_HUB_OFFLINE=1` and `TRANSFORMERS_OFFLINE=1` (`pipeline.local_weights.OFFLINE_ENV`). Those, with the
  driver's `HF_HOME`, tiktoken folders and the like (`OFFLINE_VARIABLES`, those set), go into the Ray job's
  `runtime_env` too, since Ray workers inherit the raylet's environment, not the driver's. On several nodes
  the snapshot folder must exist at the same path on each (the shared filesystem, or `promptr1 weights` with
  the same `HF_HOME` on every node). `verl_launch` builds the command line and environment.
- **Resume verified, progress watched** (pipeline/train/verl/progress.py): the same lines go to a check that
  verl resumes (its fit-start line) from the checkpoint the launch must resume from and that the last step
  reaches the total verl computes, and to a watchdog that stops verl's process group when its start-up or the
  next step line is overdue.
- **Secrets** (the environment API key) never go into overrides (verl prints its whole config): the
  variable named by `environment.api_key_env` must be set where `ray start` ran on every node, because
  Ray workers inherit the raylet's environment.

Multi-node (one head, N-1 workers; every node has this package installed, e.g. the project's Docker image,
the same path to the data and checkpoint folders (a shared filesystem), and the API key variable set):

    # on the head node, with exactly the training devices (train.verl.gpus; docs/gpu.md section 3)
    CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7 ray start --head --port=6379 --num-gpus=8
    # on each worker node
    CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7 ray start --address=<head-ip>:6379 --num-gpus=8
    # on the head node, from the project root
    promptr1 train -S profile=paper -S train.verl.nnodes=N -S train.verl.ray_address=auto

`ray_address: auto` joins the cluster started on this machine (`ray status` must list all nodes; the stage
start probes which devices it owns, pipeline/train/verl/resources.py); `ray_address: ""` lets verl start a private
single-node Ray instance instead, pinned to `train.verl.gpus` (`smoke-1gpu`, `paper-1node`), with
`ray.init(address="local")` (`pipeline.train.verl.overrides.ray_overrides`), so a cluster a `ray start` left here is not joined. With more than one node use
an MLflow tracking server (`MLFLOW_TRACKING_URI=http://…`) rather than the default SQLite file, since
verl's logger may run on any node. Checkpoints land in `paths.checkpoint_dir/global_step_N/actor/`
(`trainer.resume_mode=auto` resumes from the latest one); `promptr1 merge` converts them with verl's
model merger.
"""

from __future__ import annotations

import collections
import contextlib
import importlib.util
import logging
import os
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from pipeline.environment.guard import guarded
from pipeline.errors import DataError, TrainingIncomplete, UserError
from pipeline.local_weights import OFFLINE_ENV, cached_location
from pipeline.placement import private_ray_devices
from pipeline.runtime import stop_process_group
from pipeline.stage_files import EVAL_SETS_DIR
from pipeline.train import health_gate
from pipeline.train.verl.health_gate import BreachSeen, VerlHealthWatch
from pipeline.train.verl.overrides import (
    build_overrides,
    eval_files,
    hydra_override,
    rollout_dump_dir,
    train_file,
)
from pipeline.train.verl.progress import VerlProgress
from pipeline.train.verl.steps import Launch, export_steps_csv, record_launch

if TYPE_CHECKING:
    from pipeline.config import TrainConfig
    from pipeline.train.completion import TrainingProgress
    from pipeline.train.plan import TrainPlan

log = logging.getLogger(__name__)

LOG_TAIL_LINES = 60
MLFLOW_FAILED_LINE = "Proceeding without MLflow tracking"
"""verl's warning when its MLflow logger could not start (verl/utils/tracking.py): the run trains on, unrecorded."""


RUNTIME_ENV_PREFIX = "+ray_kwargs.ray_init.runtime_env.env_vars"
OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "HF_HOME", "HF_HUB_CACHE",
                     "TIKTOKEN_ENCODINGS_BASE", "TIKTOKEN_RS_CACHE_DIR")
"""Where models and encodings load from, and whether the network may be asked: the driver's values reach
every Ray worker (`offline_runtime_env_overrides`)."""


def _mlflow_runtime_env_overrides(tracking_uri: str, run_id: str) -> list[str]:
    return [
        hydra_override(f"{RUNTIME_ENV_PREFIX}.MLFLOW_TRACKING_URI", tracking_uri),
        hydra_override(f"{RUNTIME_ENV_PREFIX}.MLFLOW_RUN_ID", run_id),
        hydra_override(f"{RUNTIME_ENV_PREFIX}.MLFLOW_DISABLE_TELEMETRY", "true"),
    ]


def offline_runtime_env_overrides(env: dict[str, str]) -> list[str]:
    """The driver's offline and cache variables (`OFFLINE_VARIABLES` that are set) for the Ray job's runtime_env.

    Ray workers inherit the environment of the raylet (`ray start` on each node), not the driver's: a
    driver run with `HF_HUB_OFFLINE=1` and its `HF_HOME` would otherwise have workers that look for the
    weights elsewhere, or try the Hub from an offline node and hang until their timeouts.
    """
    return [hydra_override(f"{RUNTIME_ENV_PREFIX}.{name}", env[name]) for name in OFFLINE_VARIABLES if env.get(name)]


# ------------------------------------------------------------------------------------------- launch
def _preflight(plan: TrainPlan) -> list[Path]:
    """Fail fast, with what to do, before Ray and GPUs are involved; returns the existing eval files."""
    if not train_file(plan).is_file():
        raise DataError(f"{train_file(plan)} not found: run `dvc repro build` (or `promptr1 build`) first")
    if plan.train.verl.use_v1 and importlib.util.find_spec("transfer_queue") is None:
        raise UserError(
            "train.verl.use_v1=true needs the TransferQueue package: pip install 'verl[verl-core]==0.9.1', "
            "or set train.verl.use_v1=false (the legacy trainer)"
        )
    present = [p for p in eval_files(plan) if p.is_file()]
    missing = [p.name for p in eval_files(plan) if not p.is_file()]
    if missing:
        log.warning("validation sets not found, left out of verl validation: %s", ", ".join(missing))
    if not present and (plan.train.verl.val_before_train or plan.train.verl.test_freq > 0):
        raise DataError(f"no evaluation set under {plan.rl_dir / EVAL_SETS_DIR}: run the build stage")
    return present


def run_verl(plan: TrainPlan, uri: str, run: Any) -> TrainingProgress:
    """Run verl's PPO trainer (GRPO) with our agent loop and reward; `run` is the active MLflow child run,
    `uri` the MLflow tracking URI verl's logger writes to.

    The environment's lifecycle belongs to this stage, as in the local backend: started (or reused once it
    serves the configured model) and health-checked before verl starts, stopped however verl ends.
    Raises UserError (with the log tail) when verl exits non-zero, TrainingStalled when the watchdog stopped it,
    TrainingIncomplete when it did not train the steps it should have; returns the verified progress.
    """
    from pipeline.environment.servers import serve_environment

    val_files = _preflight(plan)
    _refuse_credentials_in_tracking_uri(uri)
    agent_path = cached_location("agent.model", plan.agent.model, plan.root)
    with serve_environment(plan.server) as url:  # started/reused and health-checked here, stopped on any exit
        return _launch(plan, uri, run, val_files, url, agent_path)


def _refuse_credentials_in_tracking_uri(uri: str) -> None:
    """verl prints and saves its whole config, and the overrides go to reports/ and MLflow: no secrets in it."""
    parts = urlsplit(uri)
    if parts.username or parts.password or "token=" in parts.query.lower():
        raise UserError("the MLflow tracking URI carries credentials; set MLFLOW_TRACKING_USERNAME / "
                        "MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) on every node instead")


def verl_launch(plan: TrainPlan, *, uri: str, run_id: str, val_files: list[Path], environment_url: str,
                agent_path: Path, base_env: Mapping[str, str]) -> tuple[list[str], dict[str, str]]:
    """(command line, environment) of `python -m verl.trainer.main_ppo` for this plan; pure, nothing started.

    verl loads the agent from `agent_path` (its verified local copy) with the offline variables set, in its own
    process and, through the Ray job's runtime_env, in every worker. `base_env` is the caller's environment.
    """
    env = dict(base_env)
    env.update({"MLFLOW_TRACKING_URI": uri, "MLFLOW_RUN_ID": run_id, "MLFLOW_DISABLE_TELEMETRY": "true",
                "HYDRA_FULL_ERROR": "1", "PYTHONUNBUFFERED": "1",
                "RAY_USAGE_STATS_ENABLED": env.get("RAY_USAGE_STATS_ENABLED", "0"), **OFFLINE_ENV})
    overrides = (build_overrides(plan, val_files=val_files, environment_url=environment_url, agent_path=agent_path)
                 + _mlflow_runtime_env_overrides(uri, run_id) + offline_runtime_env_overrides(env))
    return [sys.executable, "-m", "verl.trainer.main_ppo", *overrides], env


def _launch(plan: TrainPlan, uri: str, run: Any, val_files: list[Path], environment_url: str,
            agent_path: Path) -> TrainingProgress:
    """Start verl's trainer against the running environment at `environment_url` and wait for it."""
    run_id = run.info.run_id
    command, env = verl_launch(plan, uri=uri, run_id=run_id, val_files=val_files, environment_url=environment_url,
                               agent_path=agent_path, base_env=os.environ)
    overrides = command[3:]

    reports = plan.reports_dir / "train"
    reports.mkdir(parents=True, exist_ok=True)
    (reports / "verl_overrides.txt").write_text("\n".join(overrides) + "\n", encoding="utf-8")
    plan.checkpoint_dir.mkdir(parents=True, exist_ok=True)

    _point_at_ray(plan.train, env)
    # Under the owner guard: verl and its process group stop even if this process is SIGKILLed.
    command = guarded(command)
    log.info("launching verl (%d overrides, listed in %s) on Ray %r", len(overrides),
             reports / "verl_overrides.txt", plan.train.verl.ray_address or "local")
    health_cfg = plan.train.health
    progress = VerlProgress.for_launch(plan, val_files)
    # The gate scales its grace and window with the same total the resume check holds verl to, until verl
    # prints its own count.
    watch = VerlHealthWatch(health_cfg, rollout_dump_dir(plan) if health_cfg.enabled else None,
                            progress.check.schedule.total_steps)
    launches = record_launch(plan.checkpoint_dir, Launch(run_id=run_id, resumed_from=progress.check.resumed_from))

    def on_line(line: str) -> None:
        if MLFLOW_FAILED_LINE in line:
            log.error("verl's MLflow logger did not start (%s): this launch's steps will be missing from %s",
                      line.strip(), plan.steps_csv)
        progress(line)
        watch(line)

    try:
        rc, tail = _stream(command, env=env, cwd=plan.root, log_file=reports / "verl.log", on_line=on_line,
                           watching=progress.watching)
    except BreachSeen as seen:  # verl's process group is already stopped (_stream)
        from pipeline.train.checkpoint import set_aside_verl_steps

        kept = set_aside_verl_steps(plan.checkpoint_dir, seen.breach.step)
        raise health_gate.stop_training(seen.breach, f"kept checkpoint {kept.parent.name}" if kept is not None
                                   else "no checkpoint kept (none was saved before the breach)") from None
    except TrainingIncomplete as restarted:  # stopped at its first step (verl_progress): keep the resume point
        raise TrainingIncomplete(f"{restarted}; {progress.check.undo_restart()}") from None
    stalled = progress.stalled()
    if stalled is not None:
        raise stalled
    if rc != 0:
        raise _failed_launch(rc, tail, plan.checkpoint_dir, reports / "verl.log")
    verified = progress.verify()
    rows = export_steps_csv(launches, plan.steps_csv, last_step=verified.last_step, seen=progress.check.seen)
    log.info("verl finished: %d logged steps of %d launch(es) written to %s", rows, len(launches), plan.steps_csv)
    import mlflow

    mlflow.log_artifact(str(plan.steps_csv), artifact_path="train")
    mlflow.log_artifact(str(reports / "verl_overrides.txt"), artifact_path="train")
    return verified


def _point_at_ray(train: TrainConfig, env: dict[str, str]) -> None:
    """The launch's environment for its Ray: `RAY_ADDRESS` for a joined cluster; for the private Ray verl
    starts here (address `local`, pipeline.train.verl.overrides.ray_overrides) only the training GPUs the layout assigns."""
    if train.verl.ray_address:
        env["RAY_ADDRESS"] = train.verl.ray_address
        return
    env.pop("RAY_ADDRESS", None)
    devices = private_ray_devices(train)
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = devices


def _failed_launch(rc: int, tail: str, checkpoint_dir: Path, log_file: Path) -> UserError:
    """The error for a verl that exited `rc` != 0, with a hint for the causes its last lines name."""
    hint = ""
    if "Could not find any running Ray instance" in tail:
        hint = " (no Ray cluster: run `ray start --head` first, or set train.verl.ray_address='')"
    elif "EnvironmentUnhealthy" in tail:
        hint = (" (the environment failed too often: see environment.max_failure_rate; the last checkpoint"
                f" in {checkpoint_dir} is kept and `promptr1 train` resumes from it)")
    return UserError(f"verl training failed with exit code {rc}{hint}; see {log_file}. Last lines:\n{tail}")


def _stream(command: list[str], *, env: dict[str, str], cwd: Path, log_file: Path,
            on_line: Callable[[str], None] | None = None,
            watching: Callable[[subprocess.Popen], contextlib.AbstractContextManager[None]] | None = None,
            ) -> tuple[int, str]:
    """Run `command`, mirroring its output to the log and `log_file`; (exit code, last lines).

    `on_line` sees every line (the health gate, the resume check); an exception it raises stops the process group
    and propagates. `watching(process)` is held while the output is read (the progress watchdog, which may stop
    the process group itself; the output then ends and the exit code is returned).
    """
    tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL_LINES)
    child_log = logging.getLogger("verl")
    with open(log_file, "w", encoding="utf-8") as sink:
        process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True, bufsize=1, start_new_session=True)
        try:
            assert process.stdout is not None
            with watching(process) if watching is not None else contextlib.nullcontext():
                for line in process.stdout:
                    sink.write(line)
                    line = line.rstrip("\n")
                    tail.append(line)
                    child_log.info("%s", line)
                    if on_line is not None:
                        on_line(line)
            rc = process.wait()
        except BaseException:
            # Ctrl-C or a failure here: take the whole verl process group down with us.
            stop_process_group(process, 30.0)
            raise
    return rc, "\n".join(tail)
