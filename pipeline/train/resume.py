"""Resuming local training: which checkpoint belongs to the current params, and when training is complete.

Design decisions:
- **A checkpoint carries the training config it was trained with** (`training_config`: agent, environment
  model and sampling, reward, GRPO and warm-up settings, seed, md5 of the training set). Only a checkpoint
  with the same config is resumed.
- **Some train params continue the same run** (`steps`, `save_every`, `keep_checkpoints`, `verl`, `backend`):
  they do not change what a step computes, so raising `train.steps` continues from the last checkpoint.
- **Stale checkpoints are removed, not resumed**: DVC re-runs train because params changed, and resuming
  someone else's run would silently keep the old model. The changed keys are logged; the old checkpoint
  stays in DVC's cache for the commit that produced it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from pipeline.config import Params
from pipeline.train import checkpoint as ckpt
from pipeline.train.step_metrics import steps_csv_path

log = logging.getLogger(__name__)


# Params that do not change what a training step computes: changing them continues the same run.
_RESUMABLE_TRAIN_KEYS = {"steps", "save_every", "keep_checkpoints", "verl", "backend"}


def training_config(params: Params) -> dict[str, Any]:
    """What the trained weights depend on: agent, environment model and sampling, reward, GRPO and
    warm-up settings, the seed, and the md5 of the training set. `train.steps` is left out on purpose:
    raising it continues the same run from its last checkpoint."""
    import hashlib

    env = params.environment
    train_set = params.path(params.paths.rl_dir) / "train.parquet"
    digest = hashlib.md5(train_set.read_bytes()).hexdigest() if train_set.is_file() else "missing"
    return {
        "seed": params.seed,
        "agent": params.agent.model_dump(mode="json"),
        "environment": {"model": env.model, "served_name": env.served_name, "system_prompt": env.system_prompt,
                        "temperature": env.temperature, "max_tokens": env.max_tokens},
        "reward": params.reward.model_dump(mode="json"),
        "train": {k: v for k, v in params.train.model_dump(mode="json").items() if k not in _RESUMABLE_TRAIN_KEYS},
        "train_set_md5": digest,
    }


def _config_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    from pipeline.config import flatten_dict

    a, b = flatten_dict(old), flatten_dict(new)
    return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))


def _usable_checkpoint(params: Params) -> tuple[Path, ckpt.TrainerState] | None:
    """The latest checkpoint if it was trained with the current training config, else None."""
    folder = ckpt.latest_checkpoint(params.path(params.paths.checkpoint_dir))
    if folder is None:
        return None
    state = ckpt.TrainerState.read(folder)
    return (folder, state) if state.config == training_config(params) else None


def training_complete(params: Params) -> bool:
    """True when a checkpoint of the current training config reached train.steps and steps.csv exists."""
    found = _usable_checkpoint(params)
    return found is not None and found[1].step >= params.train.steps and steps_csv_path(params).is_file()


def discard_stale_checkpoints(params: Params) -> None:
    """Checkpoints trained with other params are removed so the run starts afresh (DVC re-ran train
    because params changed; resuming someone else's run would silently keep the old model). The old
    checkpoint stays in DVC's cache for the commit that produced it."""
    import shutil

    root = params.path(params.paths.checkpoint_dir)
    folder = ckpt.latest_checkpoint(root)
    if folder is None or _usable_checkpoint(params) is not None:
        return
    changed = _config_changes(ckpt.TrainerState.read(folder).config, training_config(params))
    log.warning("%s was trained with other params (%s): starting afresh", root,
                ", ".join(changed[:8]) + (" …" if len(changed) > 8 else ""))
    shutil.rmtree(root)
    steps_csv_path(params).unlink(missing_ok=True)
