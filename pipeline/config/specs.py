"""The specs that services shared by several stages take, built from the params in one place each.

A service below the stages takes its typed config sections, or a small frozen spec when it needs pieces of
several sections and resolved paths; the spec is defined beside its service, and the function here that
builds it from `Params` is the only one. Paths are resolved here, as `Params.path` resolves them, so the
services get `Path`s and never re-derive one. Not imported by `pipeline.config` itself: the specs' modules
import nothing of the config.
"""

from __future__ import annotations

from pipeline.config.sections import Params
from pipeline.stage_figures import StageFolders


def stage_folders(params: Params) -> StageFolders:
    """Where the stages' key figures are read from (`pipeline.stage_figures.key_figure`)."""
    return StageFolders(root=params.root, reports_dir=params.path(params.paths.reports_dir),
                        model_dir=params.path(params.paths.model_dir),
                        train_datasets=tuple(params.data.train_datasets))
