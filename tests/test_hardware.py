"""`auto` autocast asks the hardware; an explicit bfloat16 where bf16 is not native is kept, with a warning.
`environment.server.n_threads: auto` gives an environment server beside a llama.cpp agent server half the cores."""

from __future__ import annotations

import logging

import pytest
import torch

from pipeline import hardware
from pipeline.config import load_params
from pipeline.hardware import native_bf16, resolve_autocast


@pytest.fixture
def no_native_bf16(monkeypatch):
    monkeypatch.setattr(hardware, "native_bf16", lambda device_type: False)
    monkeypatch.setattr(hardware, "_warned", set())


@pytest.fixture
def with_native_bf16(monkeypatch):
    monkeypatch.setattr(hardware, "native_bf16", lambda device_type: True)
    monkeypatch.setattr(hardware, "_warned", set())


def test_auto_follows_the_machine():
    expected = "bfloat16" if native_bf16("cpu") else None
    assert resolve_autocast("auto", torch.device("cpu"), "train.autocast") == expected
    assert resolve_autocast("auto", "cpu", "train.autocast") == expected
    assert resolve_autocast(None, "cpu", "train.autocast") is None
    assert native_bf16("cuda") == (torch.cuda.is_available() and torch.cuda.is_bf16_supported())


def test_auto_without_native_bf16_is_float32(no_native_bf16, caplog):
    with caplog.at_level(logging.WARNING, logger="pipeline.hardware"):
        assert resolve_autocast("auto", "cpu", "train.autocast") is None
    assert not caplog.records


def test_auto_with_native_bf16_is_bfloat16(with_native_bf16, caplog):
    with caplog.at_level(logging.WARNING, logger="pipeline.hardware"):
        assert resolve_autocast("auto", "cpu", "evaluate.autocast") == "bfloat16"
        assert resolve_autocast("bfloat16", "cpu", "evaluate.autocast") == "bfloat16"
    assert not caplog.records


def test_explicit_bfloat16_without_native_bf16_warns_once(no_native_bf16, caplog):
    with caplog.at_level(logging.WARNING, logger="pipeline.hardware"):
        assert resolve_autocast("bfloat16", "cpu", "train.autocast") == "bfloat16"
        assert resolve_autocast("bfloat16", "cpu", "train.autocast") == "bfloat16"
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1
    assert "train.autocast" in warnings[0] and "no native bf16" in warnings[0] and "auto" in warnings[0]


def test_defaults_are_auto(tmp_path):
    from pathlib import Path

    params = load_params(Path(__file__).resolve().parents[1] / "params.yaml")
    assert params.train.autocast == "auto"
    assert params.evaluate.autocast == "auto"


def test_the_trainer_resolves_train_autocast(tiny_llama_dir, params, no_native_bf16):
    """The resolved dtype is what the update runs under: auto on a CPU without native bf16 is float32."""
    from pipeline.train.models import load_policy_models
    from pipeline.train.questions import QuestionSampler
    from pipeline.train.trainer import LocalTrainer

    params.agent.model = str(tiny_llama_dir)
    params.train.rollout_engine = "transformers"
    params.train.autocast = "auto"
    device = torch.device("cpu")
    models = load_policy_models(params, None, device)
    trainer = LocalTrainer(params, models, None, device, QuestionSampler(1, 0))
    assert trainer.autocast_dtype is None
    with trainer.autocast():
        assert not torch.is_autocast_enabled("cpu")
    params.train.autocast = "bfloat16"
    trainer = LocalTrainer(params, models, None, device, QuestionSampler(1, 0))
    with trainer.autocast():
        assert torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize(("cores", "alone", "beside"), [(1, 1, 1), (2, 2, 1), (3, 3, 1), (16, 16, 8)])
def test_server_threads_split_the_cores_beside_an_agent_server(monkeypatch, cores, alone, beside):
    monkeypatch.setattr(hardware, "usable_cores", lambda: cores)
    assert hardware.server_threads("auto") == alone
    assert hardware.server_threads("auto", beside_agent_server=True) == beside
    assert hardware.server_threads(3, beside_agent_server=True) == 3  # a number is kept as set


def test_usable_cores_is_the_affinity_mask():
    import os

    assert hardware.usable_cores() == len(os.sched_getaffinity(0))


def test_environment_beside_an_agent_server_gets_half_the_cores_on_a_copy(repo_root, monkeypatch):
    from pipeline.environment.servers import beside_agent_server, llamacpp_command

    monkeypatch.setattr(hardware, "usable_cores", lambda: 4)
    params = load_params(repo_root / "params.yaml")
    assert params.environment.server.n_threads == "auto"
    shared = beside_agent_server(params)

    def threads(p):
        cmd = llamacpp_command(p.environment, "m.gguf")
        return cmd[cmd.index("--n_threads") + 1]

    assert (threads(params), threads(shared)) == ("4", "2")
    assert params.environment.server.n_threads == "auto" and shared.root == params.root  # the original is kept
    fixed = load_params(repo_root / "params.yaml", {"environment": {"server": {"n_threads": 3}}})
    assert threads(beside_agent_server(fixed)) == "3"
    remote = load_params(repo_root / "params.yaml", {"environment": {"backend": "api",
                                                                "base_url": "https://api.example.test/v1"}})
    assert beside_agent_server(remote) is remote  # nothing is started for a paid API
