"""Prompt-R1's multi-turn loop expressed in TRL 1.16's `GRPOTrainer`, against our environment client: what fits,
what does not, with the code that tried (used by benchmarks/bench_vs_trl.py and tests/test_trl_multiturn.py).

TRL 1.16 offers three ways to go beyond one completion per prompt:
1. `tools=[...]` / `environment_factory=...`: TRL's own loop parses JSON tool calls out of the completion with the
   chat template's response schema, calls the tool, renders its result as a `tool` message and generates again.
   **Refused for Prompt-R1**: the constructor demands a chat template that "supports tool calling"
   (`supports_tool_calling`), which SmolLM2's does not (and, below transformers 5.13, the `jmespath` package for the
   legacy response parser: with verl's pin, transformers 5.10.4, that refusal comes first); and Prompt-R1's action is an `<interaction_prompt>` tag in
   free text, answered as a *user* `<interaction_response>` turn, not a JSON tool call answered by a `tool` message.
   `try_environment_factory` records the refusal.
2. `rollout_func` (experimental): a function that, given the prompts, returns `prompt_ids`, `completion_ids`,
   `logprobs` and optionally `env_mask` plus extra per-completion fields for the reward functions. **Prompt-R1's
   loop fits here**, because the loop is ours: `prompt_r1_rollout_func` runs `pipeline.agent.rollout.run_rollout`
   (the loop training, evaluation and `promptr1 ask` use) with the policy TRL is training and our
   `EnvironmentClient`, and hands TRL the whole multi-turn response.
3. subclassing (`_generate_and_score_completions`): anything, but then it is our trainer again.

What TRL can and cannot express, precisely (1.16.0 source):
- **masks of environment tokens: yes**, through `env_mask` (TRL turns it into `tool_mask`, and `_compute_loss`
  uses `completion_mask * tool_mask`), so environment tokens get no loss, no KL and no gradient, as in ours.
- **per-turn budgets: only inside our own loop.** TRL's own budgets are one `max_completion_length` for the whole
  completion and `max_tool_calling_iterations` (turns); no per-turn token limit, no budget shared by agent and
  environment tokens (`TurnRules`). With `rollout_func` TRL enforces nothing: `run_rollout` applies
  `max_turn_tokens` / `max_response_tokens` / `max_turns`, and TRL takes what it returns.
- **the reward on the last token: not expressible, and not needed for GRPO.** TRL's reward is one scalar per
  completion and its advantage is one number per completion broadcast over every unmasked token
  (`advantages.unsqueeze(1)`); verl puts the scalar on the last agent token and sums token rewards, which gives
  the same GRPO advantage on every agent token. A per-token or per-turn reward (PPO with a critic, turn-level
  credit) would need a subclass that fills `advantages` of shape (B, T).
- **sampling**: `rollout_func` must also return `logprobs`; TRL reads them only for vLLM importance-sampling
  correction, and recomputes old log-probs itself otherwise (as our trainer does).
- **group layout**: TRL's sampler already repeats each prompt G times, so the function rolls out one trajectory
  per entry (group_size 1) and TRL groups them by position, as our item-major order does.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import torch


def _items(prompts: list[Any]):
    """PromptItems for TRL's prompt entries (conversational: a list of messages)."""
    from pipeline.types import PromptItem

    items = []
    for i, prompt in enumerate(prompts):
        messages = [dict(m) for m in prompt] if not isinstance(prompt, str) else [{"role": "user", "content": prompt}]
        items.append(PromptItem(uid=f"trl{i}", messages=messages, gold_answers=[], data_source="trl"))
    return items


def prompt_r1_rollout_func(params: Any, env: Any, stats: dict[str, Any] | None = None,
                           policy_for: Callable[[Any], Any] | None = None) -> Callable[..., dict]:
    """A TRL `rollout_func` running Prompt-R1's loop (`run_rollout`) with the model TRL trains and `env` (our
    `EnvironmentClient`). Returns per completion: prompt ids, the whole multi-turn response (agent and
    environment tokens), the agent's sampling log-probs (0 on environment tokens), `env_mask` (1 agent / 0
    environment: our `response_mask`) and `prompt_r1_turns` (each turn's text, for the reward). `stats` (optional)
    collects what each call produced, for the benchmark's report. `policy_for(trainer)` picks the sampler
    (default: `TransformersPolicy` over the model TRL trains; a test passes a scripted agent)."""
    from pipeline.agent.policy import TransformersPolicy
    from pipeline.agent.rollout import RolloutSettings, run_rollout

    settings = RolloutSettings.sampled(params.agent)

    def rollout_func(prompts: list[Any], trainer: Any) -> dict[str, list]:
        model = trainer.model
        was_training = model.training
        model.eval()
        policy = (policy_for(trainer) if policy_for is not None
                  else TransformersPolicy(model, trainer.processing_class, seed=params.seed))
        try:
            with torch.no_grad():
                trajectories = run_rollout(
                    policy, env, _items(prompts), settings, group_size=1, return_logprobs=True, reward_fn=None,
                )
        finally:
            model.train(was_training)
        logprobs = [[0.0 if (m == 0 or math.isnan(lp)) else lp
                     for lp, m in zip(t.response_logprobs or [], t.response_mask, strict=True)] for t in trajectories]
        if stats is not None:
            stats.setdefault("calls", []).append({
                "turns": [len(t.turns) for t in trajectories],
                "agent_tokens": [sum(t.response_mask) for t in trajectories],
                "environment_tokens": [len(t.response_mask) - sum(t.response_mask) for t in trajectories],
                "env_mask": [list(t.response_mask) for t in trajectories],
            })
        return {
            "prompt_ids": [list(t.prompt_ids) for t in trajectories],
            "completion_ids": [list(t.response_ids) for t in trajectories],
            "logprobs": logprobs,
            "env_mask": [list(t.response_mask) for t in trajectories],
            "prompt_r1_turns": [json.dumps([turn.parsed.text for turn in t.turns]) for t in trajectories],
        }

    return rollout_func


def prompt_r1_reward(params: Any) -> Callable[..., list[float]]:
    """Our Prompt-R1 reward over the turns the rollout function returned (`gold`: the dataset's JSON answers)."""
    from pipeline.agent.protocol import THINK_OPENER, parse_turn
    from pipeline.reward import compute_reward

    def reward(prompts: list[Any], completions: list[Any], prompt_r1_turns: list[str], gold: list[str],
               **_: Any) -> list[float]:
        out = []
        for turns, answers in zip(prompt_r1_turns, gold, strict=True):
            parsed = [parse_turn(THINK_OPENER + text) if not text.startswith(THINK_OPENER) else parse_turn(text)
                      for text in json.loads(turns)]
            out.append(compute_reward(parsed, json.loads(answers), params.reward).total)
        return out

    reward.__name__ = "prompt_r1_reward"
    return reward


def try_environment_factory(model: Any, tokenizer: Any, args: Any, dataset: Any) -> str:
    """TRL's own tool loop with a Prompt-R1-like environment: returns TRL's refusal (or 'accepted'), with the verdict
    of TRL's own template check (`supports_tool_calling`), which the constructor applies after the jmespath check."""
    from trl import GRPOTrainer

    class PromptR1Environment:
        """What TRL's `environment_factory` would call: `reset`, and one tool method (the environment)."""

        def reset(self, **_: Any) -> None:
            return None

        def ask_environment(self, interaction_prompt: str) -> str:
            """Ask the large language model.

            Args:
                interaction_prompt: the request for the large language model.

            Returns:
                Its reply.
            """
            return ""

    from trl.chat_template_utils import supports_tool_calling

    template = "supports tool calling" if supports_tool_calling(tokenizer) else "does not support tool calling"
    try:
        GRPOTrainer(model=model, reward_funcs=[lambda completions, **_: [0.0] * len(completions)], args=args,
                    train_dataset=dataset, processing_class=tokenizer, environment_factory=PromptR1Environment)
    except (ValueError, ImportError) as exc:
        return f"refused: {type(exc).__name__}: {exc} (TRL's template check: the chat template {template})"
    return f"accepted (the chat template {template})"


def run_multiturn_step(params: Any, env: Any, model: Any, tokenizer: Any, rows: list[dict[str, Any]],
                       args: Any, policy_for: Callable[[Any], Any] | None = None) -> dict[str, Any]:
    """One TRL GRPO step with `prompt_r1_rollout_func`; returns the rollout stats, the loss mask TRL's loss applied
    (`completion_mask * tool_mask`),
    TRL's logged metrics and the environment calls made."""
    from datasets import Dataset
    from trl import GRPOTrainer

    stats: dict[str, Any] = {}
    data = Dataset.from_dict({"prompt": [r["messages"] for r in rows], "gold": [json.dumps(r["gold"]) for r in rows]})
    trainer = GRPOTrainer(model=model, reward_funcs=[prompt_r1_reward(params)], args=args, train_dataset=data,
                          processing_class=tokenizer,
                          rollout_func=prompt_r1_rollout_func(params, env, stats, policy_for))
    seen: list[list[list[int]]] = []
    compute_loss = trainer._compute_loss

    def recording_loss(model: Any, inputs: dict[str, Any]) -> Any:  # instrumentation: TRL's own method, observed
        mask = inputs["completion_mask"] * inputs["tool_mask"] if "tool_mask" in inputs else inputs["completion_mask"]
        seen.append(mask.tolist())  # the loss mask `_compute_loss` builds
        return compute_loss(model, inputs)

    trainer._compute_loss = recording_loss
    calls_before = env.usage.calls if hasattr(env, "usage") else None
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return {"rollout": stats, "loss_mask": seen, "logs": logs,
            "environment_calls": (env.usage.calls - calls_before) if calls_before is not None else None}
