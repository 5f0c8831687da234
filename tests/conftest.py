"""Shared fixtures: the ../shared/datasets mirror, quiet telemetry, params loading, heavy-test helpers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from demo_project import free_port

from pipeline.runtime import quiet_telemetry

REPO_ROOT = Path(__file__).resolve().parents[1]

# Telemetry off as every entry point sets it; tests also stay offline (no Hub) and need no Ray auth.
quiet_telemetry()
for _key, _value in {"RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}.items():
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


# --- Added by the environment helper: a REAL llama.cpp server shared by the whole test session. ---------
# Any test (agent, eval, train) can take `llama_server` to talk to the bundled SmolLM2-135M-Instruct GGUF
# through llama.cpp's OpenAI-compatible API; mark such tests @pytest.mark.slow.


@pytest.fixture(scope="session")
def llama_server(tmp_path_factory):
    """Base URL (ending in /v1) of a real llama.cpp server on 127.0.0.1:<free port>, for the session.

    Serves params.yaml's `environment.model` under `environment.served_name` ("smollm2-135m-instruct").
    Point a config at it with `params.environment.base_url = llama_server`. Started and stopped by
    `pipeline.environment.servers.serve_environment`; its log is in a session tmp dir.
    """
    from helpers import server_spec

    from pipeline.config import load_params
    from pipeline.environment.servers import serve_environment

    params = load_params(REPO_ROOT / "params.yaml", {
        "paths": {"cache_dir": str(tmp_path_factory.mktemp("llama_server"))},
        "environment": {"port": free_port(), "base_url": "", "concurrency": 8,
                        "server": {"n_ctx": 2048, "startup_timeout_s": 120, "parallel": 8}},
    })
    with serve_environment(server_spec(params)) as url:
        yield url


# --- Added by the local-train helper: a tiny random Llama with the real SmolLM2 tokenizer. ----------------
# 2 layers, hidden 64: ~3.2 M parameters, so training/merge tests run in seconds. Never the only proof:
# the slow tests use the real SmolLM2-135M-Instruct.


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """A Hugging Face model directory (safetensors, config, tokenizer with chat template) of a tiny Llama."""
    from demo_project import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


# --- Added by the data helper: data-stage params writing into a tmp folder, and the real stages run once. ---


def make_data_params(mirror: Path, folder: Path, **overrides):
    """Default params reading `mirror`, writing every data/report path under `folder`.

    Keyword overrides are deep-merged (e.g. `data={"sample_size": 8}`, `seed=7`).
    """
    from pipeline.config import deep_merge, load_params

    paths = {
        "mirror": str(mirror),
        "sampled_dir": str(folder / "data" / "sampled"),
        "rl_dir": str(folder / "data" / "rl"),
        "reports_dir": str(folder / "reports"),
        "cache_dir": str(folder / ".cache"),
    }
    return load_params(REPO_ROOT / "params.yaml", deep_merge({"paths": paths}, overrides))


@pytest.fixture(scope="session")
def built_data(shared_datasets, tmp_path_factory):
    """Params whose folders hold the REAL sample (all 8 sets) + validate + build outputs from ../shared.

    Runs the three stages once per session (~20 s); read-only for tests (copy before corrupting).
    """
    from pipeline.stages.build import run_build
    from pipeline.stages.sample import run_sample
    from pipeline.stages.validate import run_validate

    params = make_data_params(shared_datasets, tmp_path_factory.mktemp("built_data"))
    for dataset in params.data.train_datasets:
        run_sample(params, dataset)
    run_validate(params)
    run_build(params)
    return params


@pytest.fixture()
def data_params(shared_datasets, tmp_path):
    """Factory: `data_params(mirror=None, **overrides)` → params reading `mirror` (default ../shared) and
    writing under this test's tmp_path."""

    def factory(mirror: Path | None = None, **overrides):
        return make_data_params(mirror or shared_datasets, tmp_path, **overrides)

    return factory


@pytest.fixture()
def env_server():
    """Base URL of a real OpenAI-compatible stand-in environment (tests/fault_server.py, answers `echo: …`)."""
    from fault_server import FaultServer

    with FaultServer() as server:
        yield server.url


@pytest.fixture(autouse=True)
def _isolate_mlflow_uri_env():
    """mlflow.set_tracking_uri exports MLFLOW_TRACKING_URI; keep one test's store from leaking into the next."""
    saved = {k: os.environ.get(k) for k in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")}
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
