"""How far training got against where it must end: the one record behind "training is complete".

The train stage decides whether there is anything left to train (`pipeline.stages.train.training_progress`, at
its entry) and, for the verl backend, what a launch actually trained (`pipeline.train.verl.progress`, verified
from verl's own step lines). Both give a `TrainingProgress`; the stage writes it as tags on its MLflow run, first
before training (so a run killed mid-way records itself incomplete) and again when it ends. The register stage
reads those tags back from the newest train run (`TrainingProgress.from_tags`) and refuses a model whose
training did not reach its total, on the same figures the train stage used.

This module imports nothing of the pipeline: the register stage reads the record without the trainers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

TAG_PREFIX = "train.progress."


@dataclass(frozen=True)
class TrainingProgress:
    """Where training stands, against the step it must reach."""

    backend: str
    """`local` or `verl`."""
    resumed_from: int
    """The checkpoint's step the run started from (0: from scratch)."""
    last_step: int
    """The last step trained (before a run: the newest checkpoint's step)."""
    total_steps: int
    """The step training ends at: `train.steps` (local), or the total verl computes."""
    total_from: str
    """How `total_steps` was found, for messages (`train.steps`, `trainer.total_training_steps=3`, …)."""

    @property
    def complete(self) -> bool:
        """Whether no step is left to train."""
        return self.last_step >= self.total_steps

    def describe(self) -> str:
        return f"step {self.last_step} of {self.total_steps} ({self.total_from})"

    def tags(self) -> dict[str, str]:
        """The record as MLflow run tags."""
        return {f"{TAG_PREFIX}backend": self.backend, f"{TAG_PREFIX}resumed_from": str(self.resumed_from),
                f"{TAG_PREFIX}last_step": str(self.last_step), f"{TAG_PREFIX}total_steps": str(self.total_steps),
                f"{TAG_PREFIX}total_from": self.total_from[:500],
                f"{TAG_PREFIX}complete": "true" if self.complete else "false"}

    @classmethod
    def from_tags(cls, tags: Mapping[str, str]) -> TrainingProgress | None:
        """The record a train run carries, or None when it has none (a run from before the record existed)."""
        try:
            return cls(backend=tags[f"{TAG_PREFIX}backend"], resumed_from=int(tags[f"{TAG_PREFIX}resumed_from"]),
                       last_step=int(tags[f"{TAG_PREFIX}last_step"]),
                       total_steps=int(tags[f"{TAG_PREFIX}total_steps"]),
                       total_from=tags.get(f"{TAG_PREFIX}total_from", ""))
        except (KeyError, ValueError):
            return None
