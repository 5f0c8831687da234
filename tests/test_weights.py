"""`pipeline.weights`: which models the params need, and whether each is really on this machine.

The Hub itself is unreachable here, so Hub ids are tested against a real Hugging Face cache folder laid
out by hand (refs/main → snapshots/<commit>/…), which is exactly what `snapshot_download` reads offline.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.config import load_params
from pipeline.errors import UserError
from pipeline.weights import ensure_weights, required_models, run_weights, verify_local

ROOT = Path(__file__).resolve().parents[1]


def hub_cache(home: Path, repo_id: str, files: dict[str, bytes]) -> Path:
    """A Hugging Face cache entry for `repo_id` at a fixed commit, holding `files`."""
    repo = home / "hub" / f"models--{repo_id.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    for name, data in files.items():
        (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
        (snapshot / name).write_bytes(data)
    return snapshot


@pytest.fixture()
def hf_home(tmp_path, monkeypatch):
    home = tmp_path / "hf"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return home


def test_default_profile_needs_its_bundled_models_and_has_them():
    params = load_params(ROOT / "params.yaml")
    assert set(required_models(params)) == {"agent.model", "environment.model", "evaluate.ssim_model"}
    statuses = ensure_weights(params, fetch=False)
    assert [s.state for s in statuses] == ["present"] * 3, statuses


def test_api_environment_needs_no_environment_weights():
    params = load_params(ROOT / "params.yaml", {"environment": {"backend": "api", "base_url": "https://x.test/v1"}})
    assert "environment.model" not in required_models(params)


def test_hub_model_missing_from_cache_is_reported_with_its_key(hf_home):
    params = load_params(ROOT / "params.yaml", {"agent": {"model": "Qwen/Qwen3-4B"}})
    with pytest.raises(UserError, match=r"agent\.model='Qwen/Qwen3-4B' is missing: not in the Hugging Face cache"):
        run_weights(params, check_only=True)


def test_fetch_that_cannot_reach_the_hub_is_a_missing_model_not_a_crash(hf_home):
    params = load_params(ROOT / "params.yaml", {"agent": {"model": "Qwen/Qwen3-4B"}})
    status = next(s for s in ensure_weights(params, fetch=True) if s.key == "agent.model")
    assert status.state == "missing" and status.detail.startswith("download failed")


def test_hub_model_in_cache_is_verified_shard_by_shard(hf_home):
    index = {"weight_map": {"a.weight": "model-00001-of-00002.safetensors", "b.weight": "model-00002-of-00002.safetensors"}}
    snapshot = hub_cache(hf_home, "Qwen/Qwen3-4B", {
        "config.json": b"{}", "model.safetensors.index.json": json.dumps(index).encode(),
        "model-00001-of-00002.safetensors": b"x", "model-00002-of-00002.safetensors": b"y",
    })
    params = load_params(ROOT / "params.yaml", {"agent": {"model": "Qwen/Qwen3-4B"}})
    status = next(s for s in ensure_weights(params, fetch=False) if s.key == "agent.model")
    assert (status.state, status.detail) == ("present", str(snapshot))

    (snapshot / "model-00002-of-00002.safetensors").unlink()   # an interrupted download
    status = next(s for s in ensure_weights(params, fetch=False) if s.key == "agent.model")
    assert status.state == "invalid" and "model-00002-of-00002.safetensors" in status.detail


@pytest.mark.parametrize(("files", "problem"), [
    ({}, "has no config.json"),
    ({"config.json": b"{}"}, "has no weights"),
    ({"config.json": b"{}", "model.safetensors": b"x"}, None),
])
def test_verify_local_directory(tmp_path, files, problem):
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    result = verify_local(tmp_path)
    assert (result is None) if problem is None else (problem in result)


def test_verify_local_gguf_checks_the_magic(tmp_path):
    good, bad = tmp_path / "m.gguf", tmp_path / "n.gguf"
    good.write_bytes(b"GGUF\x03\x00")
    bad.write_bytes(b"<html>")
    assert verify_local(good) is None
    assert "GGUF magic" in verify_local(bad)
