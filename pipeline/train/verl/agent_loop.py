"""The Prompt-R1 multi-turn agent loop for verl 0.9.1 (`AgentLoopBase` subclass, registered as `prompt_r1`).

verl makes one loop object per trajectory and awaits `run(sampling_params, **row)`; `row` holds the
dataset columns (`raw_prompt`, `reward_model`, `extra_info`, `data_source`, …). One trajectory is
`pipeline.agent.episode.run_episode`, the conversation the local rollout runs too, with verl's server
manager as its generator:

    prompt ids  = ConversationBuilder.start(messages)               chat template + "<think>\\n"  (prompt)
    run_episode: each agent turn = server_manager.generate(prompt + response), one request per turn,
                 stopping at </interaction_prompt> or </answer>; parse, decide (TurnRules), ask the
                 environment, append its reply (mask 0)
    AgentLoopOutput from the filled Trajectory

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
- **One conversation loop.** The turns are `run_episode`'s, under `pipeline.agent.protocol.TurnRules`:
  this class only adapts verl's token-in/token-out server to the episode's generator (the turn's limit
  as `max_tokens`, the stop strings, the ids cut to the limit, log-probs aligned) and the filled
  trajectory to `AgentLoopOutput` (tests/test_protocol_parity.py drives both backends through the same
  scripted conversations and compares labels, masks and rewards).
- **Reward, once.** The loop leaves `reward_score` unset, so verl's reward loop calls our
  `pipeline.train.verl.reward.compute_score` (its parts become verl's reward extra info, in metrics and dumps); the turn
  texts travel in `extra_fields["prompt_r1_turns"]` (verl hands `extra_fields` to the reward function as
  `extra_info`), so the reward is computed from the exact turns and not from a re-parse of the decoded
  response.
- **Configuration and the environment client** come from `pipeline.train.verl.worker_client` (no verl
  there): `LoopSettings` from the trainer config's `prompt_r1` block (the serialised `AgentConfig` gives
  the turn settings), one client per worker process whose
  calls in flight are an even share of `environment.concurrency` and whose spend goes to the project's
  shared cost ledger (`<paths.cache_dir>/environment_ledger.json`), so `budget_usd` caps all workers and
  stages together. `actor_rollout_ref.rollout.multi_turn.max_assistant_turns` and `response_length`
  bound the loop.
- **`num_turns` counts agent turns** (our `Trajectory.num_turns`), not verl's tool loop count
  (user + assistant + 1), so `num_turns/mean` means the same for the local and the verl backend.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar
from uuid import uuid4

from omegaconf import OmegaConf
from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput

from pipeline.agent.episode import GenerateTurn, TurnGeneration, run_episode
from pipeline.agent.protocol import STOP_STRINGS, ConversationBuilder, TurnRules
from pipeline.train.verl.reward import TURNS_FIELD, as_answer_list
from pipeline.train.verl.worker_client import LoopSettings, environment_client
from pipeline.types import PromptItem, Trajectory


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
        self.max_turns = int(multi_turn_limit or self.settings.agent.max_turns)
        self.response_length = int(self.rollout_config.response_length)
        num_workers = int(OmegaConf.select(self.rollout_config, "agent.num_workers") or 1)
        self.env = environment_client(self.settings, num_workers)
        self.builder = self._builder_for(self.tokenizer, self.settings.agent.env_reply_max_chars)

    @classmethod
    def _builder_for(cls, tokenizer: Any, env_reply_max_chars: int) -> ConversationBuilder:
        builder = cls._builders.get(id(tokenizer))
        if builder is None or builder.tokenizer is not tokenizer or builder.env_reply_max_chars != env_reply_max_chars:
            builder = cls._builders[id(tokenizer)] = ConversationBuilder(tokenizer, env_reply_max_chars)
        return builder

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        messages = [dict(m) for m in kwargs["raw_prompt"]]
        want_logprobs = bool(sampling_params.get("logprobs"))
        traj = Trajectory(
            item=PromptItem(uid=str((kwargs.get("extra_info") or {}).get("id", "")), messages=messages,
                            gold_answers=gold_answers_of(kwargs), data_source=str(kwargs.get("data_source", ""))),
            prompt_ids=self._cap_text_prompt_length(self.builder.start(messages)),
            response_logprobs=[] if want_logprobs else None,
        )
        rules = TurnRules(max_turns=self.max_turns, max_turn_tokens=self.settings.agent.max_turn_tokens,
                          max_response_tokens=self.response_length)
        metrics: dict[str, Any] = {"num_preempted": 0}
        generate = self._generator(sampling_params, want_logprobs, metrics)
        await run_episode(traj, generate, self.env, self.builder, rules, started=time.perf_counter())

        usage = traj.usage
        extra_fields: dict[str, Any] = {
            TURNS_FIELD: [t.parsed.text for t in traj.turns],
            "prompt_r1_stop_reason": traj.stop_reason,
            "prompt_r1_env_calls": usage.calls + usage.cache_hits,
            "prompt_r1_env_errors": usage.errors,
            "prompt_r1_env_retries": usage.retries,
            "prompt_r1_env_truncated": usage.truncated,
            "prompt_r1_env_empty_after_length": usage.empty_after_length,
            "prompt_r1_env_cost_usd": usage.cost_usd,
        }
        metrics["generate_sequences"] = traj.generation_s
        metrics["tool_calls"] = traj.environment_s
        return AgentLoopOutput(
            prompt_ids=traj.prompt_ids,
            response_ids=traj.response_ids[: self.response_length],
            response_mask=traj.response_mask[: self.response_length],
            response_logprobs=traj.response_logprobs[: self.response_length] if want_logprobs else None,
            num_turns=traj.num_turns,
            metrics=metrics,
            extra_fields=extra_fields,
        )

    def _generator(self, sampling_params: dict[str, Any], want_logprobs: bool,
                   metrics: dict[str, Any]) -> GenerateTurn:
        """The episode's generator: one request to verl's server manager per agent turn (one request id per
        trajectory, so the server can keep its prefix cache), preemptions counted into `metrics`."""
        stop_ids = self.builder.stop_token_ids(self.tokenizer.eos_token_id)
        request_id = uuid4().hex

        async def generate(context: list[int], limit: int) -> TurnGeneration:
            turn_params = {
                **sampling_params,
                "max_tokens": limit,
                "stop": list(STOP_STRINGS),
                "include_stop_str_in_output": True,
                "stop_token_ids": sorted(set(sampling_params.get("stop_token_ids") or []) | set(stop_ids)),
            }
            started = time.perf_counter()
            output = await self.server_manager.generate(
                request_id=request_id, prompt_ids=context, sampling_params=turn_params
            )
            seconds = time.perf_counter() - started
            metrics["num_preempted"] += output.num_preempted if output.num_preempted is not None else 0
            agent_ids = list(output.token_ids)[:limit]
            logprobs = None
            if want_logprobs:  # aligned with the ids: a server that returned fewer gets 0.0 for the rest
                logprobs = list(output.log_probs or [])[: len(agent_ids)]
                logprobs += [0.0] * (len(agent_ids) - len(logprobs))
            return TurnGeneration(
                token_ids=agent_ids, logprobs=logprobs,
                text=self.tokenizer.decode(agent_ids, skip_special_tokens=True),
                hit_limit=len(agent_ids) >= limit, started=started, seconds=seconds,
            )

        return generate


def gold_answers_of(row: dict[str, Any]) -> list[str]:
    """Gold answers of a dataset row: `reward_model.ground_truth` (a list, array or string)."""
    reward_model = row.get("reward_model") or {}
    truth = reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
    if truth is None:
        truth = (row.get("extra_info") or {}).get("answers")
    return as_answer_list(truth)

