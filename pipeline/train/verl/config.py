"""The config verl will actually run: our overrides composed with verl 0.9.1's own Hydra config.

`compose_plan(plan)` composes, for the train plan (`pipeline.train.plan`), `build_overrides(plan)` (our
params through `pipeline/train/verl/overrides.yaml`, the computed keys, then `train.verl.extra_overrides`, last
and winning) with verl's `trainer/config/ppo_trainer.yaml`, exactly as `python -m verl.trainer.main_ppo <overrides>` does,
so the layout check (`pipeline.checks.layout`) judges the composed values: a key set through `extra_overrides`
(`actor_rollout_ref.rollout.agent.num_workers`, `actor_rollout_ref.actor.ppo_mini_batch_size`, an FSDP
offload flag) cannot bypass it.

Design decisions:
- **Hydra's compose API on verl's installed config folder**, found with `importlib.util.find_spec`, without
  importing verl (which imports torch, Ray and tensordict: seconds to a minute on a small machine). Composing
  reads YAML only: no network, no GPU; a result is cached per override list (the check and `describe` share it).
- **Every problem names verl's key and ours.** `VerlRun.ours(key)` maps a verl key to the param that sets it
  (the override table, read backwards), or to `train.verl.extra_overrides` when that list sets it, since then
  the param no longer decides it.
- **verl's own validation** (`verl.utils.config.validate_config`, which also builds and validates
  `ActorConfig`) imports verl, so it runs at the verl stage's start (`pipeline.train.verl.resources`), not in
  `promptr1 check`.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.config import ConfigError
from pipeline.train.verl.overrides import OVERRIDE_TABLE, build_overrides

if TYPE_CHECKING:
    from pipeline.train.plan import TrainPlan

EXTRA_OVERRIDES = "train.verl.extra_overrides"
COMPUTED_KEYS = {
    "actor_rollout_ref.model.path": "agent.model",
    "actor_rollout_ref.model.lora_rank": "train.lora.r",
    "trainer.default_local_dir": "paths.checkpoint_dir",
}
"""verl keys `build_overrides` computes in code, and the param each one comes from."""


class ComposeError(ConfigError):
    """verl's Hydra config does not accept the overrides (an unknown key, a wrong type)."""


def verl_config_dir() -> Path:
    """verl's `trainer/config` folder (ppo_trainer.yaml), located without importing verl."""
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        raise ComposeError("verl is not installed: the verl backend needs `pip install verl==0.9.1`")
    return Path(next(iter(spec.submodule_search_locations))) / "trainer" / "config"


@functools.lru_cache(maxsize=16)
def _compose(overrides: tuple[str, ...]) -> Any:
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(verl_config_dir()), version_base=None):
            return compose(config_name="ppo_trainer", overrides=list(overrides))
    finally:
        GlobalHydra.instance().clear()


def compose_verl(overrides: list[str]) -> Any:
    """verl's `ppo_trainer` config with `overrides` applied (an OmegaConf DictConfig; do not modify it)."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        return _compose(tuple(overrides))
    except (HydraException, OmegaConfBaseException) as exc:
        raise ComposeError(f"verl's Hydra config refuses the overrides: {exc}") from None


def override_key(override: str) -> str:
    """The key a Hydra override sets: `+a.b=1`, `++a.b=1`, `~a.b` → `a.b`."""
    return override.split("=", 1)[0].lstrip("+~").strip()


@functools.cache
def our_keys() -> dict[str, str]:
    """verl key → the param of ours that sets it (override table and computed keys)."""
    import yaml

    table = yaml.safe_load(OVERRIDE_TABLE.read_text(encoding="utf-8"))
    mapped = {k: v[1:] for k, v in table.items() if isinstance(v, str) and v.startswith("$")}
    return {**mapped, **COMPUTED_KEYS}


@dataclass(frozen=True)
class VerlRun:
    """The composed config verl runs, and which of its keys `train.verl.extra_overrides` set."""

    cfg: Any
    overridden: frozenset[str]

    def value(self, key: str) -> Any:
        """A composed value (interpolations resolved); None when the key does not exist."""
        from omegaconf import OmegaConf

        return OmegaConf.select(self.cfg, key, default=None)

    def ours(self, *verl_keys: str) -> tuple[str, ...]:
        """Our keys that decide `verl_keys`, in order, without repeats; a key none of ours sets names nothing."""
        out: list[str] = []
        for key in verl_keys:
            mine = EXTRA_OVERRIDES if key in self.overridden else our_keys().get(key)
            if mine and mine not in out:
                out.append(mine)
        return tuple(out)

    def show(self, key: str) -> str:
        """`key=value` for messages."""
        return f"{key}={self.value(key)}"


def compose_plan(plan: TrainPlan) -> VerlRun:
    """Compose what `train` hands verl for this plan (raises ComposeError or UserError when it cannot)."""
    extra = plan.train.verl.extra_overrides
    cfg = compose_verl(build_overrides(plan))
    return VerlRun(cfg=cfg, overridden=frozenset(override_key(o) for o in extra))


def verl_validation_error(run: VerlRun) -> str | None:
    """verl 0.9.1's own config validation (`verl/utils/config.py::validate_config`, which also validates the
    actor's dataclass, `verl/workers/config/actor.py::ActorConfig.validate`) on the composed config; its
    message, or None when it passes. Imports verl (seconds): for stage start, not `promptr1 check`."""
    import warnings

    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    try:
        with warnings.catch_warnings():  # need_critic warns that GRPO has no critic: by design
            warnings.simplefilter("ignore", UserWarning)
            use_critic = need_critic(run.cfg)
        validate_config(run.cfg, use_reference_policy=need_reference_policy(run.cfg), use_critic=use_critic)
    except (AssertionError, ValueError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None
