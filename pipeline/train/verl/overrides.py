"""Our params as verl 0.9.1 Hydra overrides of its `ppo_trainer.yaml`: the mapping, nothing that runs verl.

Split from `pipeline.train.verl.backend` (which launches verl) so that the layout check (`pipeline.checks.layout` through
`pipeline.train.verl.config`) composes exactly the overrides the launch uses without importing the launcher,
its health watch or the environment servers: the stages that run the check then do not depend on them in
dvc.yaml.

- `pipeline/train/verl/overrides.yaml` maps verl keys to our params (`"$a.b"`) or fixed values;
- values computed here: file paths, the model location, reward kwargs, LoRA, the `prompt_r1` block that
  the agent-loop workers read (`pipeline.train.verl.worker_client.LoopSettings`), which Ray verl starts (`ray_overrides`),
  then `train.verl.extra_overrides` last.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from pipeline.config import EnvironmentConfig
from pipeline.errors import UserError

if TYPE_CHECKING:
    from pipeline.config import LoraConfig, RewardConfig, VerlConfig
    from pipeline.train.plan import TrainPlan

ROLLOUT_DIR = "verl_rollouts"
"""Folder under `paths.cache_dir` where verl dumps each step's trajectories for the health gate."""

AGENT_NAME = "prompt_r1"
AGENT_LOOP_CONFIG = Path(__file__).with_name("agent_loop.yaml")
OVERRIDE_TABLE = Path(__file__).with_name("overrides.yaml")
REWARD_FUNCTION_FILE = Path(__file__).with_name("reward.py")
REWARD_FUNCTION_NAME = "compute_score"
RAY_INIT_ADDRESS = "ray_kwargs.ray_init.address"
PRIVATE_RAY_ADDRESS = "local"
"""`ray.init(address="local")` always starts a new Ray instance (ray/_private/services.py
`canonicalize_bootstrap_address`); with no address Ray joins the cluster named in `ray_current_cluster` of its
temp folder, which the last `ray start` on the machine wrote, whether that cluster still runs or not."""

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


def hydra_override(key: str, value: Any) -> str:
    """`key=value`, the value rendered by `hydra_value`."""
    return f"{key}={hydra_value(value)}"


def model_location(plan: TrainPlan) -> str:
    """The agent model as verl can load it: a local Hugging Face directory or a Hub id (not a GGUF file)."""
    resolved = plan.require_agent_model()
    if resolved.gguf_file:
        raise UserError(
            f"agent.model {plan.agent.model!r} is a GGUF file; the verl backend needs a Hugging Face model "
            "directory or Hub id (e.g. the paper profile's Qwen/Qwen3-4B), or use train.backend=local"
        )
    if resolved.is_local:
        return str(Path(resolved.location).resolve())
    return resolved.location


def train_file(plan: TrainPlan) -> Path:
    return plan.rl_dir.resolve() / plan.train_file.name


def rollout_dump_dir(plan: TrainPlan) -> Path:
    """Where verl dumps each step's trajectories for the health gate (verl_health.py): the git-ignored cache."""
    return plan.cache_dir.resolve() / ROLLOUT_DIR


def eval_files(plan: TrainPlan) -> list[Path]:
    """The evaluation sets the build stage writes, in params' order (ID then OOD)."""
    return [plan.rl_dir.resolve() / path.relative_to(plan.rl_dir) for path in plan.eval_files]


def build_overrides(plan: TrainPlan, *, val_files: list[Path] | None = None,
                    environment_url: str | None = None, agent_path: Path | None = None) -> list[str]:
    """verl Hydra overrides for `ppo_trainer.yaml` from the train plan, then `train.verl.extra_overrides`.

    `val_files` defaults to every evaluation set named by params (`run_verl` passes the existing ones);
    `agent_path`, the agent's verified local copy (`pipeline.local_weights.cached_location`), replaces its reference
    as verl's model path, so workers that run offline never look a Hub id up.
    """
    val = [str(p) for p in (val_files if val_files is not None else eval_files(plan))]
    model = model_location(plan)  # also refuses a GGUF agent
    computed = {
        "data.train_files": str(train_file(plan)),
        "data.val_files": val,
        "actor_rollout_ref.model.path": str(agent_path) if agent_path is not None else model,
        "actor_rollout_ref.rollout.agent.agent_loop_config_path": str(AGENT_LOOP_CONFIG),
        "actor_rollout_ref.rollout.agent.default_agent_loop": AGENT_NAME,
        "reward.custom_reward_function.path": str(REWARD_FUNCTION_FILE),
        "reward.custom_reward_function.name": REWARD_FUNCTION_NAME,
        "trainer.default_local_dir": str(plan.checkpoint_dir.resolve()),
        "trainer.project_name": plan.experiment,
        "trainer.experiment_name": f"prompt-r1-{plan.profile}",
    }
    if plan.train.health.enabled:  # each step's trajectories, for the health gate's group figures
        computed["trainer.rollout_data_dir"] = str(rollout_dump_dir(plan))
    overrides = [
        *(hydra_override(key, param_value(plan, value)) for key, value in _override_table().items()),
        *(hydra_override(key, value) for key, value in computed.items()),
        *reward_kwargs_overrides(plan.reward),
        *_lora_overrides(plan.train.lora),
        *agent_loop_overrides(plan, computed["actor_rollout_ref.model.path"], environment_url),
        *ray_overrides(plan.train.verl),
    ]
    return [*overrides, *plan.train.verl.extra_overrides]


def ray_overrides(verl: VerlConfig) -> list[str]:
    """Which Ray verl's `ray.init(**ray_kwargs.ray_init)` (verl/trainer/main_ppo.py `run_ppo`) reaches: for a
    private Ray (`train.verl.ray_address: ""`) the address `local`, so a cluster a `ray start` left on this
    machine, or its stale address file, is never joined; a joined cluster is found through `RAY_ADDRESS`,
    which the launch sets to `train.verl.ray_address`."""
    return [] if verl.ray_address else [hydra_override(f"+{RAY_INIT_ADDRESS}", PRIVATE_RAY_ADDRESS)]


def _override_table() -> dict[str, Any]:
    """verl key → "$our.param" or a fixed value (pipeline/train/verl/overrides.yaml)."""
    return yaml.safe_load(OVERRIDE_TABLE.read_text(encoding="utf-8"))


def param_value(plan: TrainPlan, value: Any) -> Any:
    """`"$a.b"` → the value of param `a.b` (the plan holds `seed` and the `agent` and `train` sections under
    their params names); anything else unchanged."""
    if not (isinstance(value, str) and value.startswith("$")):
        return value
    node: Any = plan
    for part in value[1:].split("."):
        node = getattr(node, part)
    return node


def reward_kwargs_overrides(r: RewardConfig) -> list[str]:
    """`+reward.custom_reward_function.reward_kwargs.*`: the preset and every non-null coefficient."""
    prefix = "+reward.custom_reward_function.reward_kwargs"
    out = [hydra_override(f"{prefix}.preset", r.preset)]
    for name in ("alpha", "beta", "gamma", "delta", "eps"):
        value = getattr(r, name)
        if value is not None:
            out.append(hydra_override(f"{prefix}.{name}", float(value)))
    return out


def agent_loop_overrides(plan: TrainPlan, agent_model: str, environment_url: str | None = None) -> list[str]:
    """The `+prompt_r1.*` block the agent-loop workers read (see pipeline.train.verl.worker_client.LoopSettings): the
    environment, the whole agent section (`AgentConfig.model_dump()`, read back with `AgentConfig.from_dump`)
    and the cache folder.

    `agent_model` is the model verl loads (`actor_rollout_ref.model.path`): the agent section carries it as
    its `model`, so the block names the same local snapshot and never a Hub id an offline worker cannot reach.

    `environment_url` is the endpoint the stage started or health-checked; workers get exactly that one as
    `base_url`, so they never guess a host (on several nodes it must not be loopback: `promptr1 check`).
    """
    from pipeline.environment.spec import environment_with

    env = plan.environment
    if environment_url:
        env = environment_with(env, base_url=environment_url)
    out = [hydra_override(f"+prompt_r1.environment.{name}", getattr(env, name)) for name in _ENVIRONMENT_FIELDS_FOR_WORKERS]
    agent = plan.agent.model_dump(mode="json") | {"model": agent_model}
    out += [hydra_override(f"+prompt_r1.agent.{name}", value) for name, value in agent.items()]
    out.append(hydra_override("+prompt_r1.cache_dir", str(plan.cache_dir.resolve())))
    return out


def _lora_overrides(lora: LoraConfig) -> list[str]:
    if not lora.enabled:
        return []
    return [
        hydra_override("actor_rollout_ref.model.lora_rank", lora.r),
        hydra_override("actor_rollout_ref.model.lora_alpha", lora.alpha),
        hydra_override("actor_rollout_ref.model.target_modules", list(lora.target_modules)),
    ]
