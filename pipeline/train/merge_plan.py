"""The merge stage's plan: what its params decide, resolved once at the stage's entry and handed down.

`MergePlan.from_params` is the merge's one read of `Params` (the stage, pipeline/stages/merge.py, and
`promptr1 doctor`'s merge of its one-step checkpoint call it); `pipeline.train.merge.merge_checkpoint` and
everything below it read the plan: the checkpoint and model folders, and the sections and files the model
card names. A module of its own, not pipeline/train/plan.py, so the merge stage's code (and its dvc.yaml deps
and params) is not the train stage's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.stage_files import STEPS_CSV, TRAIN_FILE

if TYPE_CHECKING:
    from pipeline.config import AgentConfig, EnvironmentConfig, Params, RewardConfig, TrainConfig


@dataclass(frozen=True)
class MergePlan:
    """What the merge stage reads from params (see module docstring)."""

    root: Path
    agent: AgentConfig
    train: TrainConfig
    reward: RewardConfig
    environment: EnvironmentConfig
    """For the model card: the environment's model and backend."""
    train_datasets: tuple[str, ...]
    checkpoint_dir: Path
    model_dir: Path
    rl_dir: str
    """`paths.rl_dir` as written in params (the model card names the training file relative to the project)."""
    train_file: Path
    steps_csv: Path

    @classmethod
    def from_params(cls, params: Params) -> MergePlan:
        return cls(root=params.root, agent=params.agent, train=params.train, reward=params.reward,
                   environment=params.environment, train_datasets=tuple(params.data.train_datasets),
                   checkpoint_dir=params.path(params.paths.checkpoint_dir),
                   model_dir=params.path(params.paths.model_dir), rl_dir=str(params.paths.rl_dir),
                   train_file=params.path(params.paths.rl_dir) / TRAIN_FILE,
                   steps_csv=params.path(params.paths.reports_dir) / STEPS_CSV)
