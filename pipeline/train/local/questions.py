"""The training questions of the local backend: rows of `data/rl/train.parquet` and the order they are drawn in.

Design decisions:
- **verl's RLHFDataset schema** is read as the build stage writes it (`prompt`, `reward_model`, `data_source`,
  `extra_info`), so the local and the verl backend train on the same file; a missing column is a `DataError`
  naming the file, not a KeyError deep in a step.
- **Seeded shuffle per epoch** (`numpy` generator seeded with `[seed, epoch]`), epoch after epoch. The sampler's
  (epoch, position) is saved in checkpoints, so a resumed run draws exactly the questions the killed run would
  have drawn next; `restore` rewinds to the start of a step that could not finish.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from pipeline.errors import DataError
from pipeline.types import PromptItem


def prompt_item_from_row(row: dict[str, Any], index: int) -> PromptItem:
    """One row of the verl RL parquet (data/rl/train.parquet) → a PromptItem."""
    extra = row.get("extra_info") or {}
    reward_model = row.get("reward_model") or {}
    truth = reward_model.get("ground_truth")
    gold = [str(truth)] if isinstance(truth, str) else [str(a) for a in (list(truth) if truth is not None else [])]
    messages = [{"role": str(m["role"]), "content": str(m["content"])} for m in list(row["prompt"])]
    return PromptItem(
        uid=str(extra.get("id") or f"row{index}"),
        messages=messages,
        gold_answers=gold,
        data_source=str(row.get("data_source", "")),
        question=str(extra.get("question") or ""),
    )


class QuestionSampler:
    """Draws questions in a seeded shuffled order, epoch after epoch; its position is checkpointable."""

    def __init__(self, n_rows: int, seed: int, epoch: int = 0, position: int = 0) -> None:
        if n_rows <= 0:
            raise DataError("the training set is empty")
        self.n_rows, self.seed, self.epoch, self.position = n_rows, seed, epoch, position
        self._order = self._permutation(epoch)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.n_rows)

    def restore(self, epoch: int, position: int) -> None:
        """Go back to a saved position (e.g. the start of a step that could not finish)."""
        self.epoch, self.position = epoch, position
        self._order = self._permutation(epoch)

    def next_batch(self, k: int) -> list[int]:
        out: list[int] = []
        while len(out) < k:
            if self.position >= self.n_rows:
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            take = min(k - len(out), self.n_rows - self.position)
            out.extend(int(i) for i in self._order[self.position : self.position + take])
            self.position += take
        return out


def load_training_set(path: Path) -> pd.DataFrame:
    """The training set at `path` (`<paths.rl_dir>/train.parquet`), checked for verl's RLHFDataset columns."""
    if not path.is_file():
        raise DataError(f"{path}: training set missing; run `promptr1 build` (dvc repro build) first")
    frame = pd.read_parquet(path)
    missing = {"prompt", "reward_model", "data_source"} - set(frame.columns)
    if missing:
        raise DataError(f"{path}: missing columns {sorted(missing)} (expected verl's RLHFDataset schema)")
    return frame
