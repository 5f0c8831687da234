"""Abusive parameter sets: each is refused by `load_params` with one line naming the key, before anything runs.

Every stage loads params first, so a refusal here means nothing was written, deleted or started.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.config import ConfigError, load_params

ROOT = Path(__file__).resolve().parents[2]

ABUSIVE = [
    ("environment.concurrency", {"environment": {"concurrency": 0}}),
    ("environment.concurrency", {"environment": {"concurrency": -3}}),
    ("environment.timeout_s", {"environment": {"timeout_s": 0}}),
    ("environment.max_retries", {"environment": {"max_retries": 10_000}}),
    ("environment.max_tokens", {"environment": {"max_tokens": 0}}),
    ("environment.port", {"environment": {"port": 70000}}),
    ("environment.temperature", {"environment": {"temperature": -1}}),
    ("environment.budget_usd", {"environment": {"budget_usd": -5}}),
    ("environment.base_url", {"environment": {"backend": "api", "base_url": "https://user:tok@api.example.test/v1"}}),
    ("environment.server.extra_args", {"environment": {"server": {"extra_args": ["--host", "0.0.0.0"]}}}),
    ("environment.server.extra_args", {"environment": {"server": {"extra_args": ["--host=0.0.0.0"]}}}),
    ("environment.server.extra_args", {"environment": {"server": {"extra_args": ["--api-key", "sk-x"]}}}),
    ("environment.server.gpu_memory_utilization", {"environment": {"server": {"gpu_memory_utilization": 1.5}}}),
    ("environment.server.n_threads", {"environment": {"server": {"n_threads": 0}}}),
    ("environment.server.n_threads", {"environment": {"server": {"n_threads": "many"}}}),
    ("environment.max_failure_rate", {"environment": {"max_failure_rate": 2}}),
    ("train.lr", {"train": {"lr": 0}}),
    ("train.group_size", {"train": {"group_size": 1}}),
    ("train.batch_size", {"train": {"batch_size": 0}}),
    ("evaluate.confidence", {"evaluate": {"confidence": 1.5}}),
    ("evaluate.bootstrap_samples", {"evaluate": {"bootstrap_samples": 0}}),
    ("register.margin", {"register": {"margin": -1}}),
    ("paths.model_dir", {"paths": {"model_dir": "."}}),
    ("paths.checkpoint_dir", {"paths": {"checkpoint_dir": "../.."}}),
    ("paths.rl_dir", {"paths": {"rl_dir": "pipeline"}}),
    ("train.no_such_knob", {"train": {"no_such_knob": 1}}),
]


@pytest.mark.parametrize(("key", "overrides"), ABUSIVE, ids=[f"{k}-{i}" for i, (k, _) in enumerate(ABUSIVE)])
def test_abusive_params_are_refused_naming_the_key(key, overrides):
    with pytest.raises(ConfigError) as info:
        load_params(ROOT / "params.yaml", overrides)
    message = str(info.value)
    assert key in message, message
    assert "\n" not in message


def test_cli_prints_one_line_and_exits_1(tmp_path):
    done = subprocess.run([sys.executable, "-m", "pipeline.cli", "weights", "--check", "-S",
                           "environment.concurrency=0"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 1
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "environment.concurrency" in lines[0], done.stderr
