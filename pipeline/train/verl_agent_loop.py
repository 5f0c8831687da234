"""The Prompt-R1 multi-turn agent loop for verl 0.9.1 (`AgentLoopBase` subclass, registered as `prompt_r1`).

verl makes one loop object per trajectory and awaits `run(sampling_params, **row)`; `row` holds the
dataset columns (`raw_prompt`, `reward_model`, `extra_info`, `data_source`, …). One trajectory:

    prompt ids  = ConversationBuilder.start(messages)               chat template + "<think>\\n"  (prompt)
    repeat up to max_turns:
        agent ids  = server_manager.generate(prompt + response)     stop at </interaction_prompt> or </answer>
        turn       = parse_turn("<think>\\n" + decoded agent ids)                                (mask 1)
        TurnRules.after_agent_turn: stop (answer / token budget / no action / turn limit) or ask
        reply      = EnvironmentClient.reply(env history, interaction prompt)
        env ids    = ConversationBuilder.env_turn_ids(reply, agent ids)                          (mask 0)

Design decisions:
- **Our protocol, not a copy.** Tokens come from `pipeline.agent.protocol.ConversationBuilder`, turns are
  parsed by `parse_turn`, replies go through `EnvironmentClient`, and the reward parts come from
  `pipeline.reward`: the same code the local backend, evaluation and `promptr1 ask` run, so an agent trained
  on GPU sees exactly the token stream it meets at evaluation.
- **No continuous-token (CT) helpers.** verl's `ct_merge_context_msg` renders appended messages through the
  chat template's suffix diff; Prompt-R1 needs two things it does not model: every assistant turn is opened
  by template text (`<think>\\n`, mask 0) and an agent turn ends on a stop string rather than the
  end-of-turn token, so the closing `<|im_end|>` must be appended as context. `ConversationBuilder` does
  both append-only (sampled ids are never re-tokenised) and is tested against the whole-conversation
  rendering for SmolLM2 and Qwen3. The result is the same contract CT gives: append-only ids, mask 1 exactly
  on sampled tokens, rollout log-probs aligned (0.0 on mask-0 tokens).
- **Turn rules** are `pipeline.agent.protocol.TurnRules`, the object the local rollout uses: this loop
  only adapts it to verl's token-in/token-out server (tests/test_protocol_parity.py drives both loops
  through the same scripted conversations and compares labels, masks and rewards).
- **Reward, once.** The loop leaves `reward_score` unset, so verl's reward loop calls our
  `verl_reward.compute_score` (its parts become verl's reward extra info, in metrics and dumps); the turn
  texts travel in `extra_fields["prompt_r1_turns"]` (verl hands `extra_fields` to the reward function as
  `extra_info`), so the reward is computed from the exact turns and not from a re-parse of the decoded
  response.
- **Configuration and the environment client** come from `pipeline.train.verl_worker_client` (no verl
  there): `LoopSettings` from the trainer config's `prompt_r1` block, one client per worker process whose
  calls in flight are an even share of `environment.concurrency` and whose spend goes to the project's
  shared cost ledger (`<paths.cache_dir>/environment_ledger.json`), so `budget_usd` caps all workers and
  stages together. `actor_rollout_ref.rollout.multi_turn.max_assistant_turns` and `response_length`
  bound the loop.
- **`num_turns` counts agent turns** (our `Trajectory.num_turns`), not verl's tool loop count
  (user + assistant + 1), so `num_turns/mean` means the same for the local and the verl backend.
"""

from __future__ import annotations

from typing import Any, ClassVar
from uuid import uuid4

from omegaconf import OmegaConf
from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput
from verl.utils.profiler import simple_timer

from pipeline.agent.protocol import STOP_STRINGS, ConversationBuilder, TurnRules, parse_turn
from pipeline.train.verl_reward import TURNS_FIELD, as_answer_list
from pipeline.train.verl_worker_client import PARAMS_ENV_VAR, LoopSettings, environment_client
from pipeline.types import ParsedTurn, StopReason, UsageStats

__all__ = ["PARAMS_ENV_VAR", "LoopSettings", "PromptR1AgentLoop", "environment_client", "gold_answers_of"]


class PromptR1AgentLoop(AgentLoopBase):
    """Agent ↔ environment trajectories for GRPO (see the module docstring)."""

    _builders: ClassVar[dict[int, ConversationBuilder]] = {}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # verl also passes `tools` (and the YAML entry's `name`); this loop calls no tools.
        kwargs.pop("tools", None)
        kwargs.pop("name", None)
        super().__init__(*args, **kwargs)
        self.settings = LoopSettings.from_trainer_config(self.config)
        multi_turn_limit = OmegaConf.select(self.rollout_config, "multi_turn.max_assistant_turns")
        self.max_turns = int(multi_turn_limit or self.settings.max_turns)
        self.response_length = int(self.rollout_config.response_length)
        num_workers = int(OmegaConf.select(self.rollout_config, "agent.num_workers") or 1)
        self.env = environment_client(self.settings, num_workers)
        self.builder = self._builder_for(self.tokenizer, self.settings.env_reply_max_chars)

    @classmethod
    def _builder_for(cls, tokenizer: Any, env_reply_max_chars: int) -> ConversationBuilder:
        builder = cls._builders.get(id(tokenizer))
        if builder is None or builder.tokenizer is not tokenizer or builder.env_reply_max_chars != env_reply_max_chars:
            builder = cls._builders[id(tokenizer)] = ConversationBuilder(tokenizer, env_reply_max_chars)
        return builder

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        messages = [dict(m) for m in kwargs["raw_prompt"]]
        prompt_ids = self._cap_text_prompt_length(self.builder.start(messages))
        want_logprobs = bool(sampling_params.get("logprobs"))
        stop_ids = self.builder.stop_token_ids(self.tokenizer.eos_token_id)
        request_id = uuid4().hex

        response_ids: list[int] = []
        response_mask: list[int] = []
        response_logprobs: list[float] = []
        turns: list[ParsedTurn] = []
        history: list[dict[str, str]] = []
        usage = UsageStats()
        metrics: dict[str, Any] = {}
        stop_reason: StopReason = "max_turns"

        rules = TurnRules(max_turns=self.max_turns, max_turn_tokens=self.settings.max_turn_tokens,
                          max_response_tokens=self.response_length)
        for turn_number in range(1, self.max_turns + 1):
            limit = rules.token_limit(len(response_mask))  # >= 1: a full response has ended the loop
            turn_params = {
                **sampling_params,
                "max_tokens": limit,
                "stop": list(STOP_STRINGS),
                "include_stop_str_in_output": True,
                "stop_token_ids": sorted(set(sampling_params.get("stop_token_ids") or []) | set(stop_ids)),
            }
            with simple_timer("generate_sequences", metrics):
                output = await self.server_manager.generate(
                    request_id=request_id, prompt_ids=prompt_ids + response_ids, sampling_params=turn_params
                )
            num_preempted = output.num_preempted if output.num_preempted is not None else 0
            metrics["num_preempted"] = metrics.get("num_preempted", 0) + num_preempted
            agent_ids = list(output.token_ids)[:limit]
            response_ids += agent_ids
            response_mask += [1] * len(agent_ids)
            if want_logprobs:
                logprobs = list(output.log_probs or [])[: len(agent_ids)]
                response_logprobs += logprobs + [0.0] * (len(agent_ids) - len(logprobs))

            text = self.tokenizer.decode(agent_ids, skip_special_tokens=True)
            turn = parse_turn(self.builder.think_opener + text)
            turns.append(turn)
            decision = rules.after_agent_turn(turn, turn_number=turn_number, hit_limit=len(agent_ids) >= limit,
                                              limit=limit, response_tokens=len(response_mask))
            if decision.stop is not None:
                stop_reason = decision.stop
                break

            with simple_timer("tool_calls", metrics):
                reply = await self.env.reply(history, decision.prompt)
            usage.add(reply)
            history += [{"role": "user", "content": decision.prompt},
                        {"role": "assistant", "content": reply.text}]
            env_ids, stop = rules.fit_reply(self.builder.env_turn_ids(reply.text, agent_ids), len(response_mask))
            response_ids += env_ids
            response_mask += [0] * len(env_ids)
            if want_logprobs:
                response_logprobs += [0.0] * len(env_ids)
            if stop is not None:
                stop_reason = stop
                break

        extra_fields: dict[str, Any] = {
            TURNS_FIELD: [t.text for t in turns],
            "prompt_r1_stop_reason": stop_reason,
            "prompt_r1_env_calls": usage.calls + usage.cache_hits,
            "prompt_r1_env_errors": usage.errors,
            "prompt_r1_env_retries": usage.retries,
            "prompt_r1_env_truncated": usage.truncated,
            "prompt_r1_env_empty_after_length": usage.empty_after_length,
            "prompt_r1_env_cost_usd": usage.cost_usd,
        }
        metrics.setdefault("num_preempted", -1)
        return AgentLoopOutput(
            prompt_ids=prompt_ids,
            response_ids=response_ids[: self.response_length],
            response_mask=response_mask[: self.response_length],
            response_logprobs=response_logprobs[: self.response_length] if want_logprobs else None,
            num_turns=len(turns),
            metrics=metrics,
            extra_fields=extra_fields,
        )


def gold_answers_of(row: dict[str, Any]) -> list[str]:
    """Gold answers of a dataset row: `reward_model.ground_truth` (a list, array or string)."""
    reward_model = row.get("reward_model") or {}
    truth = reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
    if truth is None:
        truth = (row.get("extra_info") or {}).get("answers")
    return as_answer_list(truth)

