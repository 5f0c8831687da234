"""Shared fixtures: the ../shared/datasets mirror, quiet telemetry, params loading, heavy-test helpers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

for _key, _value in {
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DO_NOT_TRACK": "1",
    "GX_ANALYTICS_ENABLED": "false",
    "DVC_NO_ANALYTICS": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "disabled",
    "HF_HUB_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "TOKENIZERS_PARALLELISM": "false",
}.items():
    os.environ.setdefault(_key, _value)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def shared_datasets() -> Path:
    """The datasets mirror: ../shared/datasets beside the repo (CI clones with ../shared beside it)."""
    path = REPO_ROOT.parent / "shared" / "datasets"
    if not path.is_dir():
        pytest.fail(f"datasets mirror not found at {path}: clone the repo with ../shared beside it")
    return path


@pytest.fixture()
def params(shared_datasets):
    """The default-profile params, with the mirror pointed at ../shared/datasets (absolute)."""
    from pipeline.config import load_params

    return load_params(REPO_ROOT / "params.yaml", {"paths": {"mirror": str(shared_datasets)}})
