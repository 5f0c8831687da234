"""`auto` autocast asks the hardware; an explicit bfloat16 where bf16 is not native is kept, with a warning.
`environment.server.n_threads: auto` starts llama.cpp servers with the usable cores."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from pipeline import hardware
from pipeline.config import load_params
from pipeline.hardware import native_bf16, resolve_autocast
from pipeline.train.plan import TrainPlan


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
    from pipeline.train.local.models import load_policy_models
    from pipeline.train.local.questions import QuestionSampler
    from pipeline.train.local.trainer import LocalTrainer

    params.agent.model = str(tiny_llama_dir)
    params.train.rollout_engine = "transformers"
    params.train.autocast = "auto"
    device = torch.device("cpu")
    plan = TrainPlan.from_params(params)
    models = load_policy_models(plan.require_agent_model(), plan.agent, plan.train, None, device)
    trainer = LocalTrainer(TrainPlan.from_params(params), models, None, device, QuestionSampler(1, 0))
    assert trainer.autocast_dtype is None
    with trainer.autocast():
        assert not torch.is_autocast_enabled("cpu")
    params.train.autocast = "bfloat16"
    trainer = LocalTrainer(TrainPlan.from_params(params), models, None, device, QuestionSampler(1, 0))
    with trainer.autocast():
        assert torch.is_autocast_enabled("cpu")


def test_server_threads_auto_leaves_out_busy_cores_once_per_process_and_a_number_is_kept(monkeypatch, caplog):
    samples = []
    monkeypatch.setattr(hardware, "usable_cores", lambda: 16)
    monkeypatch.setattr(hardware, "_auto_threads", None)
    monkeypatch.setattr(hardware, "busy_cores", lambda: samples.append(2.9) or 2.9)
    with caplog.at_level("WARNING", logger=hardware.logger.name):
        assert hardware.server_threads("auto") == 13
        assert hardware.server_threads(3) == 3
        assert hardware.server_threads("auto") == 13
    # The load is sampled and said once per process, at its first automatic start.
    assert len(samples) == 1
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "~3 of 16 cores busy" in warnings[0] and "13 thread(s)" in warnings[0]
    monkeypatch.setattr(hardware, "_auto_threads", None)
    monkeypatch.setattr(hardware, "busy_cores", lambda: 40.0)  # never fewer than one thread
    assert hardware.server_threads("auto") == 1
    monkeypatch.setattr(hardware, "_auto_threads", None)
    monkeypatch.setattr(hardware, "busy_cores", lambda: 0.1)
    assert hardware.server_threads("auto") == 16


def test_busy_cores_sees_a_spinning_process():
    import subprocess
    import sys

    idle = hardware.busy_cores()
    spinner = subprocess.Popen([sys.executable, "-c", "import time\nwhile True:\n    time.time()"])
    try:
        time.sleep(0.3)
        busy = hardware.busy_cores()
    finally:
        spinner.kill()
        spinner.wait()
    assert busy >= 0.75 and busy > idle, (idle, busy)


def test_usable_cores_is_the_affinity_mask():
    import os

    assert hardware.usable_cores() == len(os.sched_getaffinity(0))


def test_servers_are_started_with_the_resolved_thread_count(repo_root, monkeypatch):
    from pipeline.environment.servers import llamacpp_command

    monkeypatch.setattr(hardware, "usable_cores", lambda: 4)
    monkeypatch.setattr(hardware, "_auto_threads", None)  # not decided yet in this process
    monkeypatch.setattr(hardware, "busy_cores", lambda: 0.0)

    def threads(overrides):
        p = load_params(repo_root / "params.yaml", overrides)
        cmd = llamacpp_command(p.environment, "m.gguf")
        return cmd[cmd.index("--n_threads") + 1]

    assert threads({}) == "4"  # the default is auto
    assert threads({"environment": {"server": {"n_threads": 3}}}) == "3"
