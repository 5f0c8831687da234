"""What each data stage resolves from the params, once, at its entry (one plan per stage).

The stage entry (`run_sample`, `run_validate`, `run_build`) turns the params into one of these frozen
objects and hands it down: the readers and writers below get paths already resolved against the project
root and the few `data.*` values they use, never the whole params. A plan holds only what its stage reads,
so the keys a stage lists in dvc.yaml (tests/test_dvc_params.py) stay the ones its plan is made from; each
constructor has its own name (`for_sample`, ...), since that test follows a method by its name.
Open-r1's `grpo.py` is the model: the config is parsed once into typed arguments handed to `main`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.config import Params
from pipeline.config.specs import source_paths
from pipeline.data.sources import SourcePaths
from pipeline.paths import display_path
from pipeline.stage_files import SAMPLE_REPORTS_DIR, SUMMARY_FILE, VALIDATE_REPORTS_DIR


def sampled_path(sampled_dir: Path, dataset: str) -> Path:
    """`<paths.sampled_dir>/<dataset>.parquet`: what `sample` writes, `validate` and `build` read."""
    return sampled_dir / f"{dataset}.parquet"


def sample_metrics_path(reports_dir: Path, dataset: str) -> Path:
    """`<paths.reports_dir>/sample/<dataset>.json`: the sample stage's metrics file of one dataset."""
    return reports_dir / SAMPLE_REPORTS_DIR / f"{dataset}.json"


def validate_summary_path(reports_dir: Path) -> Path:
    """`<paths.reports_dir>/validate/summary.json`: what `validate` writes and `build` checks."""
    return reports_dir / VALIDATE_REPORTS_DIR / SUMMARY_FILE


@dataclass(frozen=True)
class SamplePlan:
    """Stage `sample` of one training dataset."""

    dataset: str
    sources: SourcePaths
    sampled_file: Path
    metrics_file: Path
    seed: int
    sample_size: int
    min_usable_fraction: float
    max_question_tokens: int
    allow_skip: tuple[str, ...]

    @classmethod
    def for_sample(cls, params: Params, dataset: str) -> SamplePlan:
        reports_dir = params.path(params.paths.reports_dir)
        return cls(
            dataset=dataset,
            sources=source_paths(params),
            sampled_file=sampled_path(params.path(params.paths.sampled_dir), dataset),
            metrics_file=sample_metrics_path(reports_dir, dataset),
            seed=params.seed,
            sample_size=params.data.sample_size,
            min_usable_fraction=params.data.min_usable_fraction,
            max_question_tokens=params.data.max_question_tokens,
            allow_skip=tuple(params.data.allow_skip),
        )


@dataclass(frozen=True)
class ValidatePlan:
    """Stage `validate`: the sampled files and the authors' evaluation files, and where the verdict goes."""

    sources: SourcePaths
    sampled_dir: Path
    reports_dir: Path
    train_datasets: tuple[str, ...]
    eval_datasets: tuple[str, ...]
    sample_size: int
    eval_rows: int
    max_question_tokens: int
    allow_skip: tuple[str, ...]

    @classmethod
    def for_validate(cls, params: Params) -> ValidatePlan:
        return cls(
            sources=source_paths(params),
            sampled_dir=params.path(params.paths.sampled_dir),
            reports_dir=params.path(params.paths.reports_dir),
            train_datasets=tuple(params.data.train_datasets),
            eval_datasets=tuple(params.eval_datasets),
            sample_size=params.data.sample_size,
            eval_rows=params.data.eval_rows,
            max_question_tokens=params.data.max_question_tokens,
            allow_skip=tuple(params.data.allow_skip),
        )

    @property
    def validate_dir(self) -> Path:
        return self.reports_dir / VALIDATE_REPORTS_DIR

    @property
    def summary_path(self) -> Path:
        return validate_summary_path(self.reports_dir)

    def shown(self, path: Path) -> str:
        return display_path(path, self.sources.root)


@dataclass(frozen=True)
class BuildPlan:
    """Stage `build`: the validated samples in, the RL files and the build summary out."""

    sources: SourcePaths
    sampled_dir: Path
    rl_dir: Path
    reports_dir: Path
    train_datasets: tuple[str, ...]
    eval_datasets: tuple[str, ...]
    allow_skip: tuple[str, ...]
    seed: int

    @classmethod
    def for_build(cls, params: Params) -> BuildPlan:
        return cls(
            sources=source_paths(params),
            sampled_dir=params.path(params.paths.sampled_dir),
            rl_dir=params.path(params.paths.rl_dir),
            reports_dir=params.path(params.paths.reports_dir),
            train_datasets=tuple(params.data.train_datasets),
            eval_datasets=tuple(params.eval_datasets),
            allow_skip=tuple(params.data.allow_skip),
            seed=params.seed,
        )

    def shown(self, path: Path) -> str:
        return display_path(path, self.sources.root)
