"""Resumable checkpoints of the local GRPO trainer, and the lookup the merge stage uses.

Layout under `params.paths.checkpoint_dir`:

    step_N/
      model/              full fine-tune: the policy (safetensors + config)        ┐ one of
      adapter/            LoRA: the PEFT adapter only (the base comes from params) ┘
      tokenizer/          the agent tokenizer (with its chat template)
      optimizer.pt        AdamW state
      rng.pt              python / numpy / torch (and CUDA) RNG states
      trainer_state.json  step, data position, base model, LoRA flag, the step's metrics
    latest                "step_N": the newest complete checkpoint
    warmup/model/         the weights right after the format warm-up (the KL reference; never pruned)

Design decisions:
- **Atomic**: a checkpoint is written into a hidden temporary folder beside its final place and renamed
  into place, then `latest` is replaced through a temporary file. A kill at any moment leaves either the
  old or the new checkpoint, never a half-written one that a resume would trust; stray temporary folders
  are removed at the next save.
- `latest` is the source of truth; when it is missing or stale, the newest complete `step_N/` (one with
  a `trainer_state.json`) is used instead.
- Only the newest `keep` checkpoints are kept: a full fine-tune of the 135M agent with AdamW state is
  ~1.6 GB per checkpoint.
- The format warm-up writes `step_0/` (flag `warmup_done`) and `warmup/model/` (pipeline.train.local.warmup).
- **Safe loading**: `optimizer.pt` and `rng.pt` hold only tensors, numbers, strings and containers, and are
  read with `torch.load(weights_only=True)`: a checkpoint folder someone else wrote cannot run code on
  resume (a pickle of arbitrary objects is refused with a message naming the file).
- verl writes `global_step_N/actor/` into the same folder instead (backend verl); `latest_verl_step`
  finds those for the merge stage.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import random
import re
import shutil
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline.errors import UserError
from pipeline.paths import display_path

log = logging.getLogger(__name__)

LATEST = "latest"
STATE_FILE = "trainer_state.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_VERL_STEP_DIR = re.compile(r"^global_step_(\d+)$")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""The torch dtype of each `agent.dtype` name: what the local trainer loads the agent in, and what a merged
model is reloaded and checked in."""


@dataclass
class TrainerState:
    """What a resume needs besides weights and optimizer: where training stood."""

    step: int
    """Optimizer steps (GRPO iterations) completed."""
    epoch: int = 0
    """Pass over the training set the data position is in."""
    position: int = 0
    """Rows of the current epoch's shuffled order already drawn."""
    seed: int = 42
    base_model: str = ""
    """params.agent.model at the time of training (merge and resume check it)."""
    lora: bool = False
    steps_target: int = 0
    """train.steps when this checkpoint was written."""
    metrics: dict[str, float] = field(default_factory=dict)
    """The metrics of the step this checkpoint ends."""
    config: dict[str, Any] = field(default_factory=dict)
    """The training-relevant params and the training set's md5 this run was started with
    (`local.training_config`); a resume or "already complete" only counts when they still match."""
    warmup_done: bool = False
    """The format warm-up (train.warmup) ran before GRPO; its weights are in `<root>/warmup/` and are the
    KL reference. A resumed run never repeats it."""

    @classmethod
    def read(cls, folder: Path) -> TrainerState:
        data = json.loads((folder / STATE_FILE).read_text())
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step}"


def complete_steps(root: Path) -> list[int]:
    """Steps with a complete checkpoint (a trainer_state.json), ascending."""
    if not root.is_dir():
        return []
    steps = []
    for child in root.iterdir():
        m = _STEP_DIR.match(child.name)
        if m and (child / STATE_FILE).is_file():
            steps.append(int(m.group(1)))
    return sorted(steps)


def latest_checkpoint(root: Path) -> Path | None:
    """The newest complete local checkpoint folder, or None."""
    marker = root / LATEST
    if marker.is_file():
        folder = root / marker.read_text().strip()
        if (folder / STATE_FILE).is_file():
            newest = complete_steps(root)
            # A `latest` older than a complete folder only happens after a crash between the rename and
            # the marker update: the newer folder is complete, so trust it.
            if not newest or TrainerState.read(folder).step >= newest[-1]:
                return folder
    steps = complete_steps(root)
    return step_dir(root, steps[-1]) if steps else None


def latest_verl_step(root: Path) -> Path | None:
    """verl's newest `global_step_N/actor` under `root` (its own marker file first), or None."""
    marker = root / "latest_checkpointed_iteration.txt"
    if marker.is_file():
        folder = root / f"global_step_{marker.read_text().strip()}" / "actor"
        if folder.is_dir():
            return folder
    if not root.is_dir():
        return None
    found = sorted((int(m.group(1)), child) for child in root.iterdir()
                   if (m := _VERL_STEP_DIR.match(child.name)) and (child / "actor").is_dir())
    return found[-1][1] / "actor" if found else None


def rng_state() -> dict[str, Any]:
    """Every RNG's state as tensors and plain numbers only (loadable with `weights_only=True`)."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": {"version": version, "internal": torch.tensor(internal, dtype=torch.int64), "gauss": gauss},
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    py, npy = state["python"], state["numpy"]
    random.setstate((py["version"], tuple(int(x) for x in py["internal"].tolist()), py["gauss"]))
    np.random.set_state((npy["kind"], npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"],
                         npy["cached"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def load_safely(path: Path) -> Any:
    """`torch.load(path, weights_only=True)`; a file that needs arbitrary unpickling is refused, naming it."""
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as exc:
        raise UserError(f"checkpoint file {path} holds objects beyond tensors and plain data; refusing to load "
                        f"it (it could run code): {str(exc).splitlines()[0]}") from None


def restore_optimizer_and_rng(optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """Resume the optimizer and every RNG from `folder` (optimizer.pt, rng.pt), loading both safely."""
    optimizer.load_state_dict(load_safely(folder / "optimizer.pt"))
    restore_rng_state(load_safely(folder / "rng.pt"))


def remove_partial_saves(root: Path) -> None:
    """Remove the temporary folders of saves that did not finish (killed, or the disk filled)."""
    for stray in root.glob(".tmp-step_*"):
        shutil.rmtree(stray, ignore_errors=True)


def folder_bytes(folder: Path) -> int:
    """Bytes of the files under `folder` (a checkpoint's size on disk)."""
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def save_checkpoint(
    root: Path,
    state: TrainerState,
    write_weights: Callable[[Path], None],
    optimizer: torch.optim.Optimizer | None,
    keep: int = 2,
) -> Path:
    """Write `step_N/` atomically, point `latest` at it, prune old ones; return the folder.

    `write_weights(folder)` saves the model (`folder/model`) or adapter (`folder/adapter`) and tokenizer.
    """
    root.mkdir(parents=True, exist_ok=True)
    remove_partial_saves(root)
    final = step_dir(root, state.step)
    tmp = root / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    write_weights(tmp)
    if optimizer is not None:
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save(rng_state(), tmp / "rng.pt")
    (tmp / STATE_FILE).write_text(json.dumps(asdict(state), indent=2, sort_keys=True))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    marker_tmp = root / f".{LATEST}.tmp"
    marker_tmp.write_text(final.name)
    os.replace(marker_tmp, root / LATEST)
    for old in complete_steps(root)[:-keep] if keep > 0 else []:
        shutil.rmtree(step_dir(root, old), ignore_errors=True)
    log.info("checkpoint %s written", display_path(final, Path.cwd()))
    return final


def set_aside_verl_steps(root: Path, from_step: int) -> Path | None:
    """After a health breach at `from_step`: hide verl's checkpoints of that step and later from merge and resume.

    verl saves a step's checkpoint before it logs the step, so the breaching step's `global_step_N/` may exist.
    Each such folder is renamed `breached-global_step_N/` (kept for inspection, invisible to `latest_verl_step`
    and verl's `resume_mode=auto`) and verl's marker is pointed at the newest remaining step, or removed.
    Returns the newest remaining `global_step_N/actor`, or None.
    """
    if not root.is_dir():
        return None
    for child in sorted(root.iterdir()):
        m = _VERL_STEP_DIR.match(child.name)
        if m and int(m.group(1)) >= from_step:
            target = root / f"breached-{child.name}"
            if target.exists():
                shutil.rmtree(target)
            os.replace(child, target)
            log.warning("health gate: %s set aside as %s", child.name, target.name)
    remaining = sorted(int(m.group(1)) for child in root.iterdir()
                       if (m := _VERL_STEP_DIR.match(child.name)) and (child / "actor").is_dir())
    marker = root / "latest_checkpointed_iteration.txt"
    if remaining:
        tmp = root / ".latest_checkpointed_iteration.tmp"
        tmp.write_text(str(remaining[-1]))
        os.replace(tmp, marker)
        return root / f"global_step_{remaining[-1]}" / "actor"
    marker.unlink(missing_ok=True)
    return None
