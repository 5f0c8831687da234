"""The specs that services shared by several stages take, and the one function building each from the params.

A service below the stages takes its typed config sections or, when it needs pieces of several sections and
resolved paths, one of these small frozen specs. Design decisions:

- **Built in one place.** `tracking_spec`, `source_paths` and `stage_folders` are the only readers of `Params`
  for what the specs hold; a stage entry (or a command, the flow) calls them and hands the spec down.
- **Paths resolved here**, as `Params.path` resolves them (relative to the project root, absolute ones as
  they are), so the services get `Path`s and never re-derive one.
- **A floor module, like the rest of pipeline.config**: the specs live here, not beside their services, so
  this module imports nothing above the config and a stage that builds a spec imports no more than it uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.config.loading import flatten
from pipeline.config.sections import Params
from pipeline.stage_files import RUN_FILE


@dataclass(frozen=True)
class TrackingSpec:
    """Where the pipeline's MLflow runs are kept and what a parent run records (pipeline.tracking.runs)."""

    root: Path
    """The project root: relative SQLite paths are anchored there, the git commit and dvc.lock read there."""
    profile: str
    experiment: str
    """`mlflow.experiment`."""
    configured_uri: str
    """`mlflow.tracking_uri` as the params write it (`tracking.runs.tracking_uri` gives the one in use)."""
    artifact_root: Path
    """`mlflow.artifact_root`: where a new experiment keeps its artifacts."""
    run_file: Path
    """reports/mlflow_run.json: the parent the later stages attach to."""
    flat_params: tuple[tuple[str, Any], ...]
    """Every param, flattened (`pipeline.config.flatten`): the parent run's params."""


@dataclass(frozen=True)
class SourcePaths:
    """Where a data stage reads its sources (pipeline.data.sources): no reader re-derives a path."""

    root: Path
    """The project root: shown paths are relative to it."""
    mirror: Path | None
    """The local mirror (`paths.mirror`), or None to read the Hugging Face Hub."""
    cache_dir: Path
    """`paths.cache_dir`: the Hub's downloads and the authors' evaluation files in Hub mode."""


@dataclass(frozen=True)
class StageFolders:
    """Where the stages' key figures are read from (pipeline.stages.figures): the folders of their outputs."""

    root: Path
    """The project root: shown paths are relative to it; the sources stage writes under it."""
    reports_dir: Path
    """`paths.reports_dir`: the stages' metrics and reports."""
    model_dir: Path
    """`paths.model_dir`: the merged agent and its merge report."""
    train_datasets: tuple[str, ...]
    """`data.train_datasets`: the datasets the `sample` figure adds up."""


def tracking_spec(params: Params) -> TrackingSpec:
    """The MLflow store, experiment and parent-run record of these params."""
    return TrackingSpec(
        root=params.root,
        profile=params.profile,
        experiment=params.mlflow.experiment,
        configured_uri=params.mlflow.tracking_uri,
        artifact_root=params.path(params.mlflow.artifact_root),
        run_file=params.path(params.paths.reports_dir) / RUN_FILE,
        flat_params=tuple(flatten(params).items()),
    )


def source_paths(params: Params) -> SourcePaths:
    """Where the data stages read their sources: the project root, the mirror, the Hub's cache."""
    return SourcePaths(root=params.root, mirror=params.mirror, cache_dir=params.path(params.paths.cache_dir))


def stage_folders(params: Params) -> StageFolders:
    """Where the stages' key figures are read from."""
    return StageFolders(
        root=params.root,
        reports_dir=params.path(params.paths.reports_dir),
        model_dir=params.path(params.paths.model_dir),
        train_datasets=tuple(params.data.train_datasets),
    )
