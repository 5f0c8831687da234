"""Backend `verl`: GRPO on GPU nodes with verl 0.9.1, driven by our typed params (no fork, no bash blobs).

`build_overrides(params)` turns `Params` into the Hydra overrides of verl's own `ppo_trainer.yaml`;
`train_verl(params, run)` launches `python -m verl.trainer.main_ppo <overrides>` on a running Ray cluster,
streams its log, attaches verl's MLflow logger to our run and exports the step metrics to
`reports/train/steps.csv`.

Our code enters verl only at its documented extension points:
- the agent loop `pipeline.train.verl_agent_loop.PromptR1AgentLoop`, registered as `prompt_r1` by
  `pipeline/train/agent_loop.yaml` (`actor_rollout_ref.rollout.agent.agent_loop_config_path`) and made the
  default loop, so rows without an `agent_name` column use it too;
- the reward function `pipeline/train/verl_reward.py:compute_score` (`reward.custom_reward_function`),
  with our reward preset and coefficients passed as `reward.custom_reward_function.reward_kwargs`;
- one extra config block, `prompt_r1` (environment endpoint, turn limits, cache path), that verl carries
  untouched to every agent-loop worker inside the trainer config. It replaces environment variables or
  side files, which would not reach Ray workers on other nodes.

Decisions:
- **Trainer: `trainer.use_v1=false` by default** (`train.verl.use_v1`). verl 0.9.1's default V1 trainer
  imports the `TransferQueue` package, which the pinned `verl==0.9.1` install does not bring (only the
  `verl[verl-core]` extra does). The legacy trainer (`verl.trainer.main_ppo_v0`, still shipped in 0.9.1,
  logs a deprecation warning) runs the same agent loop, reward loop and GRPO code without it. Set
  `train.verl.use_v1: true` after `pip install 'verl[verl-core]==0.9.1'`; `train_verl` checks the import
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
- **Secrets** (the environment API key) never go into overrides (verl prints its whole config): the
  variable named by `environment.api_key_env` must be set where `ray start` ran on every node, because
  Ray workers inherit the raylet's environment.

Multi-node (one head, N-1 workers; every node has this package installed, e.g. the project's Docker image,
the same path to the data and checkpoint folders (a shared filesystem), and the API key variable set):

    # on the head node
    ray start --head --port=6379 --num-gpus=8
    # on each worker node
    ray start --address=<head-ip>:6379 --num-gpus=8
    # on the head node, from the project root
    promptr1 train -S profile=paper -S train.verl.nnodes=N -S train.verl.ray_address=auto

`ray_address: auto` joins the cluster started on this machine (`ray status` must list all nodes);
`ray_address: ""` lets verl start a private single-node Ray instance instead. With more than one node use
an MLflow tracking server (`MLFLOW_TRACKING_URI=http://…`) rather than the default SQLite file, since
verl's logger may run on any node. Checkpoints land in `paths.checkpoint_dir/global_step_N/actor/`
(`trainer.resume_mode=auto` resumes from the latest one); `promptr1 merge` converts them with verl's
model merger.
"""

from __future__ import annotations

import collections
import csv
import importlib.util
import logging
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from pipeline.config import EnvironmentConfig, Params
from pipeline.environment.guard import guarded
from pipeline.errors import DataError, UserError
from pipeline.layout import cuda_visible_devices, training_gpus

log = logging.getLogger(__name__)

AGENT_NAME = "prompt_r1"
AGENT_LOOP_CONFIG = Path(__file__).with_name("agent_loop.yaml")
OVERRIDE_TABLE = Path(__file__).with_name("verl_overrides.yaml")
REWARD_FUNCTION_FILE = Path(__file__).with_name("verl_reward.py")
REWARD_FUNCTION_NAME = "compute_score"
LOG_TAIL_LINES = 60

_ENVIRONMENT_FIELDS_FOR_WORKERS = tuple(name for name in EnvironmentConfig.model_fields
                                        if name not in ("server", "knowledge"))
"""What the agent-loop workers need to build an `EnvironmentClient`: every field but the server launch blocks."""


# ------------------------------------------------------------------------------------------- overrides
def hydra_value(value: Any) -> str:
    """Render a Python value as a Hydra override value (strings always quoted, so any text round-trips)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list | tuple):
        return "[" + ",".join(hydra_value(v) for v in value) + "]"
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if isinstance(value, str):
        # Inside a quoted Hydra string only backslashes before a quote or at the end need escaping;
        # "${" would start an OmegaConf interpolation, so it is escaped too.
        text = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", value)
        text = re.sub(r"(\\+)$", lambda m: m.group(1) * 2, text)
        text = text.replace("${", "\\${")
        return f"'{text}'"
    raise TypeError(f"cannot render {value!r} ({type(value).__name__}) as a Hydra override")


def _kv(key: str, value: Any) -> str:
    return f"{key}={hydra_value(value)}"


def model_location(params: Params) -> str:
    """The agent model as verl can load it: a local Hugging Face directory or a Hub id (not a GGUF file)."""
    from pipeline.modelref import resolve_model

    resolved = resolve_model(params.agent.model, params.root)
    if resolved.gguf_file:
        raise UserError(
            f"agent.model {params.agent.model!r} is a GGUF file; the verl backend needs a Hugging Face model "
            "directory or Hub id (e.g. the paper profile's Qwen/Qwen3-4B), or use train.backend=local"
        )
    if resolved.is_local:
        return str(Path(resolved.location).resolve())
    return resolved.location


def train_file(params: Params) -> Path:
    return params.path(params.paths.rl_dir).resolve() / "train.parquet"


def eval_files(params: Params) -> list[Path]:
    """The evaluation sets the build stage writes, in params' order (ID then OOD)."""
    eval_dir = params.path(params.paths.rl_dir).resolve() / "eval"
    return [eval_dir / f"{name}.parquet" for name in params.eval_datasets]


def build_overrides(params: Params, *, val_files: list[Path] | None = None,
                    environment_url: str | None = None) -> list[str]:
    """verl Hydra overrides for `ppo_trainer.yaml` from our typed params, then `train.verl.extra_overrides`.

    `val_files` defaults to every evaluation set named by params (`train_verl` passes the existing ones).
    """
    val = [str(p) for p in (val_files if val_files is not None else eval_files(params))]
    computed = {
        "data.train_files": str(train_file(params)),
        "data.val_files": val,
        "actor_rollout_ref.model.path": model_location(params),
        "actor_rollout_ref.rollout.agent.agent_loop_config_path": str(AGENT_LOOP_CONFIG),
        "actor_rollout_ref.rollout.agent.default_agent_loop": AGENT_NAME,
        "reward.custom_reward_function.path": str(REWARD_FUNCTION_FILE),
        "reward.custom_reward_function.name": REWARD_FUNCTION_NAME,
        "trainer.default_local_dir": str(params.path(params.paths.checkpoint_dir).resolve()),
        "trainer.project_name": params.mlflow.experiment,
        "trainer.experiment_name": f"prompt-r1-{params.profile}",
    }
    overrides = [
        *(_kv(key, param_value(params, value)) for key, value in _override_table().items()),
        *(_kv(key, value) for key, value in computed.items()),
        *reward_kwargs_overrides(params),
        *_lora_overrides(params),
        *agent_loop_overrides(params, environment_url),
    ]
    return [*overrides, *params.train.verl.extra_overrides]


def _override_table() -> dict[str, Any]:
    """verl key → "$our.param" or a fixed value (pipeline/train/verl_overrides.yaml)."""
    return yaml.safe_load(OVERRIDE_TABLE.read_text(encoding="utf-8"))


def param_value(params: Params, value: Any) -> Any:
    """`"$a.b"` → the value of param `a.b`; anything else unchanged."""
    if not (isinstance(value, str) and value.startswith("$")):
        return value
    node: Any = params
    for part in value[1:].split("."):
        node = getattr(node, part)
    return node


def reward_kwargs_overrides(params: Params) -> list[str]:
    """`+reward.custom_reward_function.reward_kwargs.*`: the preset and every non-null coefficient."""
    r = params.reward
    prefix = "+reward.custom_reward_function.reward_kwargs"
    out = [_kv(f"{prefix}.preset", r.preset)]
    for name in ("alpha", "beta", "gamma", "delta", "eps"):
        value = getattr(r, name)
        if value is not None:
            out.append(_kv(f"{prefix}.{name}", float(value)))
    return out


def agent_loop_overrides(params: Params, environment_url: str | None = None) -> list[str]:
    """The `+prompt_r1.*` block the agent-loop workers read (see verl_worker_client.LoopSettings).

    `environment_url` is the endpoint the stage started or health-checked; workers get exactly that one as
    `base_url`, so they never guess a host (on several nodes it must not be loopback: `promptr1 check`).
    """
    env = params.environment
    if environment_url:
        env = env.model_copy(update={"base_url": environment_url})
    out = [_kv(f"+prompt_r1.environment.{name}", getattr(env, name)) for name in _ENVIRONMENT_FIELDS_FOR_WORKERS]
    out += [
        _kv("+prompt_r1.agent.max_turns", params.agent.max_turns),
        _kv("+prompt_r1.agent.max_turn_tokens", params.agent.max_turn_tokens),
        _kv("+prompt_r1.agent.env_reply_max_chars", params.agent.env_reply_max_chars),
        _kv("+prompt_r1.cache_dir", str(params.path(params.paths.cache_dir).resolve())),
    ]
    return out


def _lora_overrides(params: Params) -> list[str]:
    lora = params.train.lora
    if not lora.enabled:
        return []
    return [
        _kv("actor_rollout_ref.model.lora_rank", lora.r),
        _kv("actor_rollout_ref.model.lora_alpha", lora.alpha),
        _kv("actor_rollout_ref.model.target_modules", list(lora.target_modules)),
    ]


def _mlflow_runtime_env_overrides(tracking_uri: str, run_id: str) -> list[str]:
    prefix = "+ray_kwargs.ray_init.runtime_env.env_vars"
    return [
        _kv(f"{prefix}.MLFLOW_TRACKING_URI", tracking_uri),
        _kv(f"{prefix}.MLFLOW_RUN_ID", run_id),
        _kv(f"{prefix}.MLFLOW_DISABLE_TELEMETRY", "true"),
    ]


# ------------------------------------------------------------------------------------------- launch
def _preflight(params: Params) -> list[Path]:
    """Fail fast, with what to do, before Ray and GPUs are involved; returns the existing eval files."""
    if not train_file(params).is_file():
        raise DataError(f"{train_file(params)} not found: run `dvc repro build` (or `promptr1 build`) first")
    if params.train.verl.use_v1 and importlib.util.find_spec("transfer_queue") is None:
        raise UserError(
            "train.verl.use_v1=true needs the TransferQueue package: pip install 'verl[verl-core]==0.9.1', "
            "or set train.verl.use_v1=false (the legacy trainer)"
        )
    present = [p for p in eval_files(params) if p.is_file()]
    missing = [p.name for p in eval_files(params) if not p.is_file()]
    if missing:
        log.warning("validation sets not found, left out of verl validation: %s", ", ".join(missing))
    if not present and (params.train.verl.val_before_train or params.train.verl.test_freq > 0):
        raise DataError(f"no evaluation set under {params.path(params.paths.rl_dir) / 'eval'}: run the build stage")
    return present


def train_verl(params: Params, run: Any) -> None:
    """Run verl's PPO trainer (GRPO) with our agent loop and reward; `run` is the active MLflow child run.

    The environment's lifecycle belongs to this stage, as in the local backend: started (or reused once it
    serves the configured model) and health-checked before verl starts, stopped however verl ends.
    Raises UserError (with the log tail) when verl exits non-zero.
    """
    from pipeline.environment.servers import environment_server

    val_files = _preflight(params)
    _refuse_credentials_in_tracking_uri(params)
    with environment_server(params) as url:  # started/reused and health-checked here, stopped on any exit
        _launch(params, run, val_files, url)


def _refuse_credentials_in_tracking_uri(params: Params) -> None:
    """verl prints and saves its whole config, and the overrides go to reports/ and MLflow: no secrets in it."""
    from pipeline.tracking import tracking_uri

    parts = urlsplit(tracking_uri(params))
    if parts.username or parts.password or "token=" in parts.query.lower():
        raise UserError("the MLflow tracking URI carries credentials; set MLFLOW_TRACKING_USERNAME / "
                        "MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) on every node instead")


def _launch(params: Params, run: Any, val_files: list[Path], environment_url: str) -> None:
    """Start verl's trainer against the running environment at `environment_url` and wait for it."""
    from pipeline.tracking import tracking_uri

    run_id = run.info.run_id
    uri = tracking_uri(params)
    overrides = (build_overrides(params, val_files=val_files, environment_url=environment_url)
                 + _mlflow_runtime_env_overrides(uri, run_id))

    reports = params.path(params.paths.reports_dir) / "train"
    reports.mkdir(parents=True, exist_ok=True)
    (reports / "verl_overrides.txt").write_text("\n".join(overrides) + "\n", encoding="utf-8")
    params.path(params.paths.checkpoint_dir).mkdir(parents=True, exist_ok=True)

    env = dict(os.environ)
    env.update({"MLFLOW_TRACKING_URI": uri, "MLFLOW_RUN_ID": run_id, "MLFLOW_DISABLE_TELEMETRY": "true",
                "HYDRA_FULL_ERROR": "1", "PYTHONUNBUFFERED": "1",
                "RAY_USAGE_STATS_ENABLED": env.get("RAY_USAGE_STATS_ENABLED", "0")})
    if params.train.verl.ray_address:
        env["RAY_ADDRESS"] = params.train.verl.ray_address
    else:  # a private Ray started by verl here: it sees only the training GPUs the layout assigns
        env.pop("RAY_ADDRESS", None)
        gpus = training_gpus(params)
        if gpus and params.train.verl.gpus:
            env["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices(gpus)

    # Under the owner guard: verl and its process group stop even if this process is SIGKILLed.
    command = guarded([sys.executable, "-m", "verl.trainer.main_ppo", *overrides])
    log.info("launching verl (%d overrides, listed in %s) on Ray %r", len(overrides),
             reports / "verl_overrides.txt", params.train.verl.ray_address or "local")
    rc, tail = _stream(command, env=env, cwd=params.root, log_file=reports / "verl.log")
    if rc != 0:
        hint = ""
        if "Could not find any running Ray instance" in tail:
            hint = " (no Ray cluster: run `ray start --head` first, or set train.verl.ray_address='')"
        elif "EnvironmentUnhealthy" in tail:
            hint = (" (the environment failed too often: see environment.max_failure_rate; the last checkpoint"
                    f" in {params.paths.checkpoint_dir} is kept and `promptr1 train` resumes from it)")
        raise UserError(f"verl training failed with exit code {rc}{hint}; see {reports / 'verl.log'}. "
                        f"Last lines:\n{tail}")
    rows = export_steps_csv(run_id, reports / "steps.csv")
    log.info("verl finished: %d logged steps written to %s", rows, reports / "steps.csv")
    import mlflow

    mlflow.log_artifact(str(reports / "steps.csv"), artifact_path="train")
    mlflow.log_artifact(str(reports / "verl_overrides.txt"), artifact_path="train")


def _stream(command: list[str], *, env: dict[str, str], cwd: Path, log_file: Path) -> tuple[int, str]:
    """Run `command`, mirroring its output to the log and `log_file`; (exit code, last lines)."""
    tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL_LINES)
    child_log = logging.getLogger("verl")
    with open(log_file, "w", encoding="utf-8") as sink:
        process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True, bufsize=1, start_new_session=True)
        try:
            assert process.stdout is not None
            for line in process.stdout:
                sink.write(line)
                line = line.rstrip("\n")
                tail.append(line)
                child_log.info("%s", line)
            rc = process.wait()
        except BaseException:
            # Ctrl-C or a failure here: take the whole verl process group down with us.
            try:
                os.killpg(process.pid, signal.SIGTERM)
                process.wait(timeout=30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(process.pid, signal.SIGKILL)
            raise
    return rc, "\n".join(tail)


VERL_REWARD_ALIASES = {"critic/score/mean": "reward/mean", "critic/score/max": "reward/max",
                       "critic/score/min": "reward/min"}
"""verl names GRPO's reward `critic/score/*`; the run and steps.csv also get it as `reward/*` (step_metrics)."""


def export_steps_csv(run_id: str, path: Path) -> int:
    """Write the run's per-step metrics (verl's names, plus `reward/*` for verl's `critic/score/*`, also logged
    to the run) as `step,<metric>,…`; returns the number of steps."""
    import mlflow
    from mlflow.entities import Metric

    client = mlflow.MlflowClient()
    logged = client.get_run(run_id).data.metrics
    by_step: dict[int, dict[str, float]] = collections.defaultdict(dict)
    aliases: list[Metric] = []
    for key in sorted(logged):
        for m in client.get_metric_history(run_id, key):
            by_step[m.step][key] = m.value
            alias = VERL_REWARD_ALIASES.get(key)
            if alias is not None and alias not in logged:
                by_step[m.step][alias] = m.value
                aliases.append(Metric(alias, m.value, m.timestamp, m.step))
    for i in range(0, len(aliases), 500):
        client.log_batch(run_id, metrics=aliases[i : i + 500])
    keys = sorted({k for row in by_step.values() for k in row})
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=["step", *keys])
        writer.writeheader()
        for step in sorted(by_step):
            writer.writerow({"step": step, **by_step[step]})
    return len(by_step)
