"""`pipeline.weights`: which models the params need, and whether each is really on this machine.

The Hub itself is unreachable here, so Hub ids are tested against a real Hugging Face cache folder laid
out by hand (refs/main → snapshots/<commit>/…), which is exactly what `snapshot_download` reads offline.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.commands.weights import required_weights, run_weights
from pipeline.config import load_params
from pipeline.errors import UserError
from pipeline.local_weights import verify_local
from pipeline.weights import ensure_weights, required_models

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

    monkeypatch.setattr(constants, "HF_HOME", str(home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return home


def test_default_profile_needs_its_bundled_models_and_has_them():
    params = load_params(ROOT / "params.yaml")
    assert set(required_models(params.agent, params.environment, params.evaluate)) == {"agent.model", "environment.model", "evaluate.ssim_model"}
    statuses = ensure_weights(required_weights(params), fetch=False)
    assert [s.state for s in statuses] == ["present"] * 3, statuses


def test_api_environment_needs_no_environment_weights():
    params = load_params(ROOT / "params.yaml", {"environment": {"backend": "api", "base_url": "https://x.test/v1"}})
    assert "environment.model" not in required_models(params.agent, params.environment, params.evaluate)


def test_hub_model_missing_from_cache_is_reported_with_its_key(hf_home):
    params = load_params(ROOT / "params.yaml", {"agent": {"model": "Qwen/Qwen3-4B"}})
    with pytest.raises(UserError, match=r"agent\.model='Qwen/Qwen3-4B' is missing: not in the Hugging Face cache"):
        run_weights(params, check_only=True)


def test_fetch_that_cannot_reach_the_hub_is_a_missing_model_not_a_crash(hf_home):
    params = load_params(ROOT / "params.yaml", {"agent": {"model": "Qwen/Qwen3-4B"}})
    status = next(s for s in ensure_weights(required_weights(params), fetch=True) if s.key == "agent.model")
    assert status.state == "missing" and status.detail.startswith("download failed")


def test_hub_model_in_cache_is_verified_shard_by_shard(hf_home):
    index = {"weight_map": {"a.weight": "model-00001-of-00002.safetensors", "b.weight": "model-00002-of-00002.safetensors"}}
    snapshot = hub_cache(hf_home, "Qwen/Qwen3-4B", {
        "config.json": b"{}", "model.safetensors.index.json": json.dumps(index).encode(),
        "model-00001-of-00002.safetensors": b"x", "model-00002-of-00002.safetensors": b"y",
    })
    params = load_params(ROOT / "params.yaml", {"agent": {"model": "Qwen/Qwen3-4B"}})
    status = next(s for s in ensure_weights(required_weights(params), fetch=False) if s.key == "agent.model")
    assert (status.state, status.detail) == ("present", str(snapshot))

    (snapshot / "model-00002-of-00002.safetensors").unlink()   # an interrupted download
    status = next(s for s in ensure_weights(required_weights(params), fetch=False) if s.key == "agent.model")
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


# openai/gpt-oss-20b's files on the Hub (its repository listing): the top level is what vLLM and transformers
# load; original/ (~13.8 GB, OpenAI's own checkpoint format) and metal/ (Apple Metal) are read by neither.
GPT_OSS_20B_FILES = [
    ".gitattributes", "LICENSE", "README.md", "USAGE_POLICY", "chat_template.jinja", "config.json",
    "generation_config.json", "metal/model.bin", "model-00000-of-00002.safetensors",
    "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json",
    "original/config.json", "original/dtypes.json", "original/model.safetensors", "special_tokens_map.json",
    "tokenizer.json", "tokenizer_config.json",
]


def test_gpt_oss_download_skips_the_original_checkpoint():
    """The patterns as `snapshot_download` applies them (huggingface_hub's own `filter_repo_objects`)."""
    from huggingface_hub.utils import filter_repo_objects

    from pipeline.local_weights import HUB_IGNORE, HUB_PATTERNS

    fetched = set(filter_repo_objects(GPT_OSS_20B_FILES, allow_patterns=HUB_PATTERNS, ignore_patterns=HUB_IGNORE))
    assert fetched == {
        "chat_template.jinja", "config.json", "generation_config.json", "model-00000-of-00002.safetensors",
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json",
        "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"}


class _FileServer:
    """A real HTTP server on 127.0.0.1 serving `files` (name → bytes) under /encodings/, counting requests."""

    def __init__(self, files: dict[str, bytes]) -> None:
        import http.server
        import threading

        self.requests: list[str] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                outer.requests.append(self.path)
                data = files.get(self.path.removeprefix("/encodings/"))
                self.send_response(200 if data is not None else 404)
                self.send_header("Content-Length", str(len(data or b"")))
                self.end_headers()
                self.wfile.write(data or b"")

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/encodings/"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture()
def encodings(monkeypatch, hf_home):
    """harmony's encoding table pointed at a stand-in vocabulary (the real 3.6 MB file is not reachable here)
    and a local server; the folder is the default one under HF_HOME."""
    import hashlib

    from pipeline.environment import harmony

    vocab = b"IQ== 0\nIg== 1\n"
    monkeypatch.delenv("TIKTOKEN_ENCODINGS_BASE", raising=False)
    monkeypatch.setattr(harmony, "ENCODING_FILES", {"o200k_base.tiktoken": hashlib.sha256(vocab).hexdigest()})
    with _FileServer({"o200k_base.tiktoken": vocab}) as server:
        monkeypatch.setattr(harmony, "ENCODINGS_URL", server.url)
        yield server, hf_home / "tiktoken-encodings", vocab


def gpt_oss_params(hf_home):
    hub_cache(hf_home, "openai/gpt-oss-20b", {"config.json": b"{}", "model.safetensors": b"x"})
    return load_params(ROOT / "params.yaml", {"profile": "paper"})


def test_gpt_oss_weights_bring_the_harmony_encoding(encodings, hf_home):
    server, folder, vocab = encodings
    params = gpt_oss_params(hf_home)
    with pytest.raises(UserError, match=r"harmony encoding o200k_base\.tiktoken' is missing: .*run `promptr1 weights`"):
        run_weights(params, check_only=True)
    assert server.requests == []  # --check never downloads

    harmony = next(s for s in ensure_weights(required_weights(params), fetch=True) if "harmony" in s.ref)
    assert (harmony.key, harmony.state, harmony.detail) == ("environment.model", "fetched", str(folder))
    assert (folder / "o200k_base.tiktoken").read_bytes() == vocab
    assert server.requests == ["/encodings/o200k_base.tiktoken"]
    assert [s.state for s in ensure_weights(required_weights(params), fetch=False) if "harmony" in s.ref] == ["present"]


def test_harmony_encoding_with_the_wrong_digest_is_refused(encodings, hf_home, monkeypatch):
    from pipeline.environment import harmony

    _, folder, _ = encodings
    monkeypatch.setattr(harmony, "ENCODING_FILES", {"o200k_base.tiktoken": "0" * 64})
    status = next(s for s in ensure_weights(required_weights(gpt_oss_params(hf_home)), fetch=True) if "harmony" in s.ref)
    assert status.state == "missing" and "sha256" in status.detail
    assert list(folder.iterdir()) == []  # nothing half-written left behind


def test_only_a_vllm_served_gpt_oss_needs_the_encoding(hf_home):
    paper = load_params(ROOT / "params.yaml", {"profile": "paper"})
    other = load_params(ROOT / "params.yaml", {"profile": "smoke-1gpu"})
    api = load_params(ROOT / "params.yaml", {"profile": "paper", "environment": {
        "backend": "api", "base_url": "https://x.test/v1"}})
    assert [any("harmony" in s.ref for s in ensure_weights(required_weights(p), fetch=False)) for p in (paper, other, api)] == [
        True, False, False]
