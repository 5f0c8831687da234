"""A GRPO group's next turn on the agent's llama.cpp server reads what is new, not its conversations again
(pipeline.agent.llama_launcher `agent_environment(grouped=True)`, what training rollouts use).

A group's G copies are asked for as `n` samples at the first turn; llama.cpp clears the slots of the extra
samples when they finish. With the default slot choice (the longest shared prefix) the second turn then
re-reads nearly every extra sample's conversation whole (the question's ~380-token Prompt-R1 prompt and
its first turn); with grouped slots the host-memory prompt cache hands the prompt back.

Real parts: the SmolLM2-135M GGUF served by `served_policy` (the launcher training uses), the real
`OpenAICompletionsPolicy` with the trainer's sampling (temperature 1, seeded, log-probs), llama.cpp's own
count of the prompt tokens it evaluated (`/metrics`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from demo_project import free_port
from helpers import agent_serving

from pipeline.agent.llama_launcher import GROUPED_SLOTS, agent_environment


def test_grouped_slots_are_an_agent_server_setting_only_training_asks_for(params, tmp_path):
    gguf = tmp_path / "agent-0123abcd-f16.gguf"
    serving = agent_serving(params)
    assert agent_environment(gguf, serving, 8, grouped=True).server.extra_args == GROUPED_SLOTS
    assert agent_environment(gguf, serving, 8).server.extra_args == []  # evaluation: the default choice


def _second_turn(params, tmp_path, grouped: bool) -> tuple[int, int, int]:
    """Two turns of 2 questions x G=4: the prompt tokens llama.cpp evaluated at the second, the new tokens
    there, and the tokens of the extra samples' own first turns."""
    from pipeline.agent.llama_launcher import served_policy
    from pipeline.agent.protocol import ConversationBuilder
    from pipeline.agent.template import render_user_message
    from pipeline.modelref import load_tokenizer, resolve_model

    params.root = tmp_path
    params.paths.cache_dir = str(tmp_path / ".cache")
    params.evaluate.agent_port = free_port()
    tokenizer = load_tokenizer(params.agent.model, params.root)
    gguf = Path(resolve_model(params.agent.model, params.root).location)
    builder = ConversationBuilder(tokenizer)
    questions, group = ["Which river flows through Vienna?", "Who painted the Sistine Chapel's ceiling?"], 4
    with served_policy(gguf, agent_serving(params), tokenizer, len(questions) * group, quiet=True,
                       grouped=grouped) as policy:
        policy.seed = 7
        prompts = [builder.start([{"role": "user", "content": render_user_message(q, "hotpotqa")}])
                   for q in questions for _ in range(group)]
        first = policy.generate(prompts, 16, 1.0, 1.0, [], True)
        assert len({tuple(g.token_ids) for g in first}) > len(questions)  # the copies sampled apart
        following = [builder.env_turn_ids("The answer is in the atlas.", g.token_ids) for g in first]
        second = [p + g.token_ids + f for p, g, f in zip(prompts, first, following, strict=True)]
        sent, cached = policy.prompt_tokens, policy.cached_prompt_tokens
        policy.generate(second, 2, 1.0, 1.0, [], True)
        evaluated = (policy.prompt_tokens - sent) - (policy.cached_prompt_tokens - cached)
    new = sum(len(f) for f in following)
    own = sum(len(g.token_ids) for k, g in enumerate(first) if k % group)
    return evaluated, new, own


@pytest.mark.slow
def test_a_group_s_second_turn_reads_new_tokens_not_the_question_again(params, tmp_path):
    evaluated, new, own = _second_turn(params, tmp_path / "grouped", grouped=True)
    default, _, _ = _second_turn(params, tmp_path / "default", grouped=False)
    prompt = 380  # the Prompt-R1 prompt of one question, about
    # Grouped: the new tokens, the extra samples' own first turns and at most one whole conversation (the
    # request's first, which finds nothing cached yet). Default: most extra samples re-read the prompt too.
    assert evaluated <= new + own + prompt + 64, (evaluated, new, own)
    assert default >= evaluated + 3 * prompt, (default, evaluated)
