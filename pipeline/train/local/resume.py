"""Resuming local training: which checkpoint belongs to the current params, and setting aside the ones that do not.

Design decisions:
- **A checkpoint carries the training config it was trained with** (`training_config`: agent, environment
  model and sampling, reward, GRPO and warm-up settings, seed, md5 of the training set). Only a checkpoint
  with the same config is resumed.
- **Some train params continue the same run** (`steps`, `save_every`, `keep_checkpoints`,
  `keep_stale_checkpoints`, `verl`, `backend`): they do not change what a step computes, so raising
  `train.steps` continues from the last checkpoint.
- **Stale checkpoints are set aside, not resumed and not deleted**: DVC re-runs train because params
  changed, and resuming someone else's run would silently keep the old model; deleting it would lose
  hours of training to a mistyped param (`persist: true` outputs are not in DVC's cache). The folder is
  renamed to a sibling `<checkpoint_dir>.stale-<UTC time>-<hash of its training config>` (a rename: no
  copy, same file system) with the old run's steps.csv inside, and the changed keys are logged. The
  sibling is outside the DVC output but beside it, so it stays inside the project wherever the (already
  confined, `output_path_problems`) checkpoint folder is, and a `.gitignore` of `*` keeps git from
  listing gigabytes of weights. At most `train.keep_stale_checkpoints` set-aside folders are kept (oldest
  removed first; 0 removes at once, the old behaviour).
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.train import checkpoint as ckpt

if TYPE_CHECKING:
    from pipeline.config import TrainConfig
    from pipeline.train.plan import TrainPlan

log = logging.getLogger(__name__)


# Params that do not change what a training step computes: changing them continues the same run.
_RESUMABLE_TRAIN_KEYS = {"steps", "save_every", "keep_checkpoints", "keep_stale_checkpoints", "verl", "backend"}
STALE_MARK = ".stale-"


def training_config(plan: TrainPlan) -> dict[str, Any]:
    """What the trained weights depend on: agent, environment model and sampling, reward, GRPO and
    warm-up settings, the seed, and the md5 of the training set. `train.steps` is left out on purpose:
    raising it continues the same run from its last checkpoint."""
    env = plan.environment
    train_set = plan.train_file
    digest = hashlib.md5(train_set.read_bytes()).hexdigest() if train_set.is_file() else "missing"
    environment = {"model": env.model, "served_name": env.served_name, "system_prompt": env.system_prompt,
                   "temperature": env.temperature, "max_tokens": env.max_tokens}
    if env.backend == "knowledge":  # its rules shape the replies: a `question` checkpoint never resumes as `terse`
        environment["knowledge"] = {"mode": env.knowledge.mode, "min_overlap": env.knowledge.min_overlap}
    return {
        "seed": plan.seed,
        "agent": plan.agent.model_dump(mode="json"),
        "environment": environment,
        "reward": plan.reward.model_dump(mode="json"),
        "train": {k: v for k, v in plan.train.model_dump(mode="json").items() if k not in _RESUMABLE_TRAIN_KEYS},
        "train_set_md5": digest,
    }


def _config_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    from pipeline.config import flatten_dict

    a, b = flatten_dict(old), flatten_dict(new)
    return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))


def usable_checkpoint(plan: TrainPlan) -> tuple[Path, ckpt.TrainerState] | None:
    """The latest checkpoint if it was trained with the current training config, else None."""
    folder = ckpt.latest_checkpoint(plan.checkpoint_dir)
    if folder is None:
        return None
    state = ckpt.TrainerState.read(folder)
    return (folder, state) if state.config == training_config(plan) else None


def reached_steps(step: int, train: TrainConfig) -> bool:
    """Whether training at `step` reached `train.steps`: the one rule for "no step left to train"."""
    return step >= train.steps


def discard_stale_checkpoints(plan: TrainPlan) -> Path | None:
    """Set checkpoints trained with other params aside so the run starts afresh (see the module docstring);
    return where they went (None: nothing stale, or `train.keep_stale_checkpoints` is 0 and they were removed)."""
    root = plan.checkpoint_dir
    folder = ckpt.latest_checkpoint(root)
    if folder is None or usable_checkpoint(plan) is not None:
        return None
    old_config = ckpt.TrainerState.read(folder).config
    changed = _config_changes(old_config, training_config(plan))
    log.warning("%s was trained with other params (%s): starting afresh", root,
                ", ".join(changed[:8]) + (" …" if len(changed) > 8 else ""))
    target = _stale_target(root, old_config)
    root.rename(target)
    (target / ".gitignore").write_text("*\n")
    steps_csv = plan.steps_csv
    if steps_csv.is_file():
        shutil.move(steps_csv, target / steps_csv.name)
    log.warning("old checkpoints set aside in %s", target)
    kept = _prune_stale(root, plan.train.keep_stale_checkpoints)
    return target if target in kept else None


def stale_folders(root: Path) -> list[Path]:
    """Set-aside checkpoint folders of `root`, oldest first."""
    return sorted(p for p in root.parent.glob(f"{root.name}{STALE_MARK}*") if p.is_dir())


def _stale_target(root: Path, config: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode("utf-8")).hexdigest()[:10]
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    target = root.with_name(f"{root.name}{STALE_MARK}{stamp}-{digest}")
    n = 1
    while target.exists():
        n += 1
        target = root.with_name(f"{root.name}{STALE_MARK}{stamp}-{digest}-{n}")
    return target


def _prune_stale(root: Path, keep: int) -> list[Path]:
    folders = stale_folders(root)
    for old in folders[: max(len(folders) - keep, 0)]:
        log.warning("removing %s (train.keep_stale_checkpoints=%d)", old, keep)
        shutil.rmtree(old)
    return folders[max(len(folders) - keep, 0):]
