"""What a verl launch should train: its schedule, and the lines in which verl states its total and its start.

- **The schedule** (`VerlSchedule`, `verl_schedule`): the total verl computes, derived as verl derives it from
  the composed config (`pipeline.train.verl.config`, so `train.verl.extra_overrides` count):
  `trainer.total_training_steps` when set, else `trainer.total_epochs` × steps per epoch, where steps per
  epoch = training rows // `data.train_batch_size` (verl's train dataloader drops the last partial batch).
  When verl prints its own total (`Total training steps: N`, e.g. after `data.filter_overlong_prompts` dropped
  rows) that figure is the one a launch is held to.
- **verl's own lines** (`announced_total`, `fit_start`): `Total training steps: N`, and at the start of `fit`,
  before the checkpoint load and the validation before training (ray_trainer.py `_load_checkpoint`,
  `trainer.resume_mode=auto`), `Setting global step to N` or `Training from scratch`. The resume check
  (`pipeline.train.verl.progress`) and the watchdog (`pipeline.train.verl.watchdog`) read them.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.errors import DataError

if TYPE_CHECKING:
    from pipeline.train.plan import TrainPlan

_TOTAL_LINE = re.compile(r"Total training steps: (\d+)")
_FROM_SCRATCH = re.compile(r"(?:^|\s)Training from scratch$")
_GLOBAL_STEP = re.compile(r"(?:^|\s)Setting global step to (\d+)$")
FIT_START_LINES = "'Training from scratch' or 'Setting global step to N'"


@dataclass(frozen=True)
class VerlSchedule:
    """The steps verl 0.9.1 trains, and at which of them it validates and saves (ray_trainer.py `fit`)."""

    total_steps: int
    steps_per_epoch: int
    save_freq: int
    test_freq: int
    val_before_train: bool
    derivation: str
    """How `total_steps` follows from the config, for messages."""
    step_conversations: int = 0
    """Conversations one training step rolls out (`data.train_batch_size` × `rollout.n`)."""
    validation_conversations: int = 0
    """Conversations one validation pass rolls out (validation rows × `rollout.val_kwargs.n`)."""

    def saves_at(self, step: int) -> bool:
        return self.save_freq > 0 and (step % self.save_freq == 0 or step >= self.total_steps)

    def validates_at(self, step: int) -> bool:
        return self.test_freq > 0 and (step % self.test_freq == 0 or step >= self.total_steps)

    def epoch_boundary(self, step: int) -> bool:
        """Whether a resume at `step` starts a new epoch (verl 0.9.1 then skips restoring the dataloader)."""
        return step > 0 and self.steps_per_epoch > 0 and step % self.steps_per_epoch == 0


def schedule_from_config(value: Callable[[str], Any], train_rows: int, validation_rows: int = 0) -> VerlSchedule:
    """The schedule from a composed verl config (`value(key)`, `VerlRun.value`) and the training set's rows."""
    batch = int(value("data.gen_batch_size") or value("data.train_batch_size"))
    per_epoch = train_rows // batch  # StatefulDataLoader(drop_last=True)
    epochs = int(value("trainer.total_epochs"))
    explicit = value("trainer.total_training_steps")
    if explicit is not None:
        total, how = int(explicit), f"trainer.total_training_steps={int(explicit)}"
    else:
        total = per_epoch * epochs
        how = f"{epochs} epoch(s) x {per_epoch} steps ({train_rows} rows // data.train_batch_size {batch})"
    n = int(value("actor_rollout_ref.rollout.n") or 1)
    val_n = int(value("actor_rollout_ref.rollout.val_kwargs.n") or 1)
    return VerlSchedule(total_steps=total, steps_per_epoch=per_epoch, save_freq=int(value("trainer.save_freq")),
                        test_freq=int(value("trainer.test_freq")),
                        val_before_train=bool(value("trainer.val_before_train")), derivation=how,
                        step_conversations=int(value("data.train_batch_size")) * n,
                        validation_conversations=validation_rows * val_n)


def parquet_rows(path: Path) -> int:
    """Rows of a Parquet file (its footer only); DataError naming the file when it is not one."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path).metadata.num_rows
    except (OSError, pa.ArrowException) as exc:
        raise DataError(f"{path} is not a readable Parquet file ({exc}): run `dvc repro build` again") from None


def verl_schedule(plan: TrainPlan, val_files: list[Path] | None = None) -> VerlSchedule:
    """The schedule the plan's launch runs: our overrides composed with verl's config, the training set's rows."""
    from pipeline.train.verl.config import compose_plan
    from pipeline.train.verl.overrides import train_file

    path = train_file(plan)
    if not path.is_file():
        raise DataError(f"{path} not found: run `dvc repro build` (or `promptr1 build`) first")
    run = compose_plan(plan)
    val_rows = sum(parquet_rows(p) for p in (val_files or []) if p.is_file())
    schedule = schedule_from_config(run.value, parquet_rows(path), val_rows)
    if schedule.steps_per_epoch < 1 or schedule.total_steps < 1:
        raise DataError(f"{path} gives verl no training step ({parquet_rows(path)} rows, {schedule.derivation}): "
                        "build more rows or lower train.batch_size")
    return schedule


def fit_start(line: str) -> int | None:
    """The step verl says it resumes from at the start of `fit` (`Setting global step to N`; 0 for `Training
    from scratch`), or None for any other line."""
    text = line.rstrip()
    if _FROM_SCRATCH.search(text):
        return 0
    match = _GLOBAL_STEP.search(text)
    return int(match.group(1)) if match else None


def announced_total(line: str) -> int | None:
    """The total verl prints (`Total training steps: N`), or None for any other line."""
    total = _TOTAL_LINE.search(line)
    return int(total.group(1)) if total else None
