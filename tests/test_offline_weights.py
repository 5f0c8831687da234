"""The processes that load weights (verl's launch and Ray workers, the vLLM server) run offline on local paths.

Once `promptr1 weights` has put a model in the Hugging Face cache, `pipeline.local_weights.cached_location` finds its
snapshot folder offline, and verl and vLLM are started on that folder with `HF_HUB_OFFLINE=1` and
`TRANSFORMERS_OFFLINE=1`, instead of the Hub id. The Hub is unreachable here, so the cache is a real Hugging Face
cache folder laid out by hand in tmp_path (models--org--name/refs/main -> snapshots/<commit>/...), which is what
`snapshot_download(local_files_only=True)` reads. The commands are the ones our builders return (nothing runs).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from helpers import server_spec
from omegaconf import OmegaConf
from verl_cpu import compose_verl

from pipeline.config import load_params
from pipeline.errors import EnvironmentUnavailable, UserError
from pipeline.train.plan import TrainPlan

REPO = Path(__file__).resolve().parents[1]
COMMIT = "0123456789abcdef0123456789abcdef01234567"
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def cached_model(hub: Path, repo_id: str) -> Path:
    """A complete model in the Hugging Face cache at `hub`: refs/main names the commit whose snapshot holds it."""
    repo = hub / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text('{"model_type": "qwen3"}')
    (snapshot / "model.safetensors").write_bytes(b"weights")
    return snapshot


@pytest.fixture()
def hub(tmp_path, monkeypatch) -> Path:
    """An empty Hugging Face cache that huggingface_hub reads (offline, as the conftest sets)."""
    from huggingface_hub import constants

    folder = tmp_path / "hf" / "hub"
    folder.mkdir(parents=True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(folder))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return folder


def paper(tmp_path: Path, **sections):
    params = load_params(REPO / "params.yaml", {"profile": "paper", **sections})
    params.root = tmp_path
    return params


def test_a_hub_id_resolves_to_its_snapshot_folder_offline(hub, tmp_path):
    from pipeline.local_weights import cached_location

    with pytest.raises(UserError, match=r"agent\.model='Qwen/Qwen3-4B' is missing .*run `promptr1 weights`"):
        cached_location("agent.model", "Qwen/Qwen3-4B", tmp_path)
    snapshot = cached_model(hub, "Qwen/Qwen3-4B")
    assert cached_location("agent.model", "Qwen/Qwen3-4B", tmp_path) == snapshot
    (snapshot / "model.safetensors").unlink()  # an incomplete download is not handed to a trainer
    with pytest.raises(UserError, match=r"is invalid .*no weights"):
        cached_location("agent.model", "Qwen/Qwen3-4B", tmp_path)
    local = tmp_path / "my-model"  # a local folder is used where it is
    local.mkdir()
    (local / "config.json").write_text("{}")
    (local / "model.safetensors").write_bytes(b"w")
    assert cached_location("agent.model", "my-model", tmp_path) == local


def test_verl_launch_loads_the_agent_offline_from_its_snapshot(hub, tmp_path):
    """The launch command and environment as `verl_launch` builds them: verl's model path is the snapshot
    folder, not the Hub id; the launcher and (through the Ray job's runtime_env) every worker run offline."""
    from pipeline.train.verl.backend import verl_launch

    snapshot = cached_model(hub, "Qwen/Qwen3-4B")
    plan = TrainPlan.from_params(paper(tmp_path))
    base = {"PATH": "/usr/bin", "HF_HOME": str(tmp_path / "hf")}
    argv, env = verl_launch(
        plan,
        uri="sqlite:///m.db",
        run_id="0" * 32,
        val_files=[],
        environment_url="http://127.0.0.1:8000/v1",
        agent_path=snapshot,
        base_env=base,
    )
    assert argv[1:3] == ["-m", "verl.trainer.main_ppo"]
    assert {k: env[k] for k in OFFLINE} == OFFLINE and env["HF_HOME"] == base["HF_HOME"]
    assert "HF_HUB_OFFLINE" not in base  # the caller's environment is not changed
    assert not any("Qwen/Qwen3-4B" in arg for arg in argv)
    cfg = compose_verl(argv[3:])
    assert cfg.actor_rollout_ref.model.path == str(snapshot)
    workers = OmegaConf.to_container(cfg.ray_kwargs.ray_init.runtime_env.env_vars)
    assert {k: workers[k] for k in OFFLINE} == OFFLINE and workers["HF_HOME"] == base["HF_HOME"]


def test_verl_is_not_started_without_the_agent_weights(hub, tmp_path):
    """The train stage checks the agent's weights before it starts the environment or verl."""
    from types import SimpleNamespace

    from pipeline.train.verl import backend as verl_backend

    (tmp_path / "data/rl/eval").mkdir(parents=True)
    (tmp_path / "data/rl/train.parquet").write_bytes(b"")
    (tmp_path / "data/rl/eval/hotpotqa.parquet").write_bytes(b"")
    run = SimpleNamespace(info=SimpleNamespace(run_id="0" * 32))
    with pytest.raises(UserError, match=r"agent\.model='Qwen/Qwen3-4B' is missing.*`promptr1 weights`"):
        verl_backend.run_verl(TrainPlan.from_params(paper(tmp_path)), "sqlite:///m.db", run)


def test_vllm_serves_the_snapshot_folder_offline(hub, tmp_path, monkeypatch):
    """`vllm serve` gets the environment model's snapshot folder (served under its name), with both offline
    variables; without the weights it does not start."""
    from pipeline.environment import harmony
    from pipeline.environment.servers import server_command, server_env

    params = paper(tmp_path)
    spec = server_spec(params)
    with pytest.raises(EnvironmentUnavailable, match=r"run `promptr1 weights` before starting vLLM"):
        server_command(spec)
    snapshot = cached_model(hub, "openai/gpt-oss-20b")
    vocab = b"IQ== 0\n"
    monkeypatch.setattr(harmony, "ENCODING_FILES", {"o200k_base.tiktoken": hashlib.sha256(vocab).hexdigest()})
    monkeypatch.setenv("TIKTOKEN_ENCODINGS_BASE", str(tmp_path / "encodings"))
    (tmp_path / "encodings").mkdir()
    (tmp_path / "encodings" / "o200k_base.tiktoken").write_bytes(vocab)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    command = server_command(spec)
    assert command[:3] == ["vllm", "serve", str(snapshot)]
    assert command[command.index("--served-model-name") + 1] == params.environment.served_name
    env = server_env(spec)
    assert {k: env[k] for k in OFFLINE} == OFFLINE


def test_offline_variables_are_not_set_in_the_gpu_image():
    """The GPU profiles read their data from the Hub: only the processes that load weights run offline."""
    text = (REPO / "Dockerfile").read_text()
    gpu = text[text.index("AS gpu-build") :]
    assert "HF_HUB_OFFLINE" not in gpu and "TRANSFORMERS_OFFLINE" not in gpu
    assert load_params(REPO / "params.yaml", {"profile": "paper"}).paths.mirror == ""
