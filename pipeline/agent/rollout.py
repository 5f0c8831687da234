"""The multi-turn Prompt-R1 rollout: the agent and the environment take turns for many trajectories at once.

One loop serves training (local backend), evaluation and `promptr1 ask`:

    prompt ids = chat template + <think> opener                         (ConversationBuilder.start)
    repeat while some trajectory is active:
        policy generates one turn for every active trajectory, in one batch   (mask 1, log-probs)
        parse each turn; decide: answer / out of budget / no action / turn limit / ask the environment
        all environment calls go out together (asyncio.gather; the client's semaphore bounds them),
        each trajectory with its own environment history
        append each reply as mask-0 tokens: close turn, user <interaction_response>, assistant <think>
    reward_fn(trajectory) for each

Design decisions:
- **Turn rules are `pipeline.agent.protocol.TurnRules`**, the same object verl's agent loop uses: each
  turn's generation limit (`max_turn_tokens` clipped to what is left of `max_response_tokens`, which counts
  agent and environment tokens alike), the decision after each turn (`answer`, `token_budget`,
  `no_action`, `max_turns` or ask the environment; the last allowed turn never calls it) and how much of a
  reply fits. Only `prompt_too_long` is decided here: when `max_prompt_tokens` is given and the prompt
  alone exceeds it, the trajectory is not rolled out (verl's loop truncates instead, verl's own rule).
- **Generation runs in a worker thread** (`asyncio.to_thread`), so the event loop stays free for anything
  else in flight; the environment calls of one round run concurrently, and a round's generation waits for
  them (the agent needs the replies).
- **Timings per trajectory:** `generation_s` adds the wall time of every batch the trajectory was part of
  (it waited that long); `environment_s` adds its own environment calls' wall time (queueing included);
  `wall_s` runs from the rollout's start to the moment the trajectory finished, its own wall time. Each turn
  records when it started (`started_s`) and how long its environment call took from asking to reply
  (`env_wait_s`, queueing for a free connection included; the reply's `latency_s` is the request alone), so
  a trace can show the queue apart from the environment's latency.
- **Grouping:** trajectories are returned item-major (item0 x G, item1 x G, ...), the order GRPO groups in.
- **One record of a trajectory** (`trajectory_record`): the JSON shape that evaluation predictions and the
  served pyfunc model both output, kept beside the loop that fills the trajectory.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from pipeline.agent.policy import Generation, Policy
from pipeline.agent.protocol import STOP_STRINGS, ConversationBuilder, TurnRules, parse_turn
from pipeline.progress import LogProgress
from pipeline.progress import progress as progress_bar
from pipeline.types import EnvironmentReply, PromptItem, RewardBreakdown, StopReason, Trajectory, Turn

if TYPE_CHECKING:
    from pipeline.environment.client import EnvironmentClient

logger = logging.getLogger(__name__)


@dataclass
class _Live:
    """Rollout state of one trajectory beyond what Trajectory holds."""

    traj: Trajectory
    env_history: list[dict[str, str]] = field(default_factory=list)
    done: bool = False
    started: float = field(default_factory=time.perf_counter)
    """perf_counter at the rollout's start."""

    @property
    def context(self) -> list[int]:
        return self.traj.prompt_ids + self.traj.response_ids


def _finish(live: _Live, reason: StopReason, bar: Any) -> None:
    live.done = True
    live.traj.stop_reason = reason
    live.traj.wall_s = time.perf_counter() - live.started
    bar.update(1)


async def _timed_reply(env: EnvironmentClient, history: list[dict[str, str]], prompt: str
                       ) -> tuple[EnvironmentReply, float]:
    start = time.perf_counter()
    reply = await env.reply(list(history), prompt)
    return reply, time.perf_counter() - start


async def rollout(
    policy: Policy,
    env: EnvironmentClient,
    items: list[PromptItem],
    *,
    group_size: int,
    max_turns: int,
    max_turn_tokens: int,
    max_response_tokens: int,
    env_reply_max_chars: int,
    temperature: float,
    top_p: float,
    return_logprobs: bool,
    reward_fn: Callable[[Trajectory], RewardBreakdown] | None,
    progress: bool | Any = False,
    max_prompt_tokens: int | None = None,
) -> list[Trajectory]:
    """Roll out `group_size` trajectories per item; returns them grouped in item order (see module doc).

    `progress`: True draws a nested bar (terminal only); a bar object (`pipeline.progress`) is the caller's
    and gets one count per finished trajectory (the evaluation's one report per system).
    """
    builder = ConversationBuilder(policy.tokenizer, env_reply_max_chars)
    rules = TurnRules(max_turns=max_turns, max_turn_tokens=max_turn_tokens, max_response_tokens=max_response_tokens)
    lives: list[_Live] = []
    started = time.perf_counter()
    for item in items:
        prompt_ids = builder.start(item.messages)
        for _ in range(group_size):
            traj = Trajectory(item=item, prompt_ids=list(prompt_ids),
                              response_logprobs=[] if return_logprobs else None)
            lives.append(_Live(traj, started=started))

    own_bar = isinstance(progress, bool)
    if not own_bar:  # the caller's bar (evaluation): one count per finished trajectory, not closed here
        bar = progress
    elif progress:
        bar = progress_bar(total=len(lives), desc="rollout", unit="traj", quiet=True)
    else:
        bar = LogProgress(total=len(lives), silent=True)
    try:
        if max_prompt_tokens is not None:
            for live in lives:
                if len(live.traj.prompt_ids) > max_prompt_tokens:
                    logger.warning("prompt of %s has %d tokens > max_prompt_tokens %d: not rolled out",
                                   live.traj.item.uid, len(live.traj.prompt_ids), max_prompt_tokens)
                    _finish(live, "prompt_too_long", bar)

        for turn_index in range(1, max_turns + 1):
            active = [live for live in lives if not live.done]
            if not active:
                break
            bar.set_postfix(turn=turn_index, active=len(active))
            limits = [rules.token_limit(len(live.traj.response_ids)) for live in active]
            start = time.perf_counter()
            generations: list[Generation] = await asyncio.to_thread(
                policy.generate, [live.context for live in active], limits, temperature, top_p,
                list(STOP_STRINGS), return_logprobs,
            )
            elapsed = time.perf_counter() - start

            asking: list[tuple[_Live, Turn, str]] = []
            for live, gen, limit in zip(active, generations, limits, strict=True):
                traj = live.traj
                traj.generation_s += elapsed
                parsed = parse_turn(builder.think_opener + gen.text)
                turn = Turn(parsed=parsed, agent_token_ids=list(gen.token_ids), agent_logprobs=gen.logprobs,
                            generation_s=elapsed, started_s=start - live.started)
                traj.turns.append(turn)
                _append(traj, gen.token_ids, 1, gen.logprobs)
                decision = rules.after_agent_turn(parsed, turn_number=turn_index, hit_limit=gen.finish_reason == "length",
                                                  limit=limit, response_tokens=len(traj.response_ids))
                if decision.stop is not None:
                    _finish(live, decision.stop, bar)
                else:
                    asking.append((live, turn, decision.prompt))

            if not asking:
                continue
            replies = await asyncio.gather(
                *(_timed_reply(env, live.env_history, prompt) for live, _, prompt in asking)
            )
            for (live, turn, prompt), (reply, seconds) in zip(asking, replies, strict=True):
                traj = live.traj
                traj.environment_s += seconds
                turn.env_wait_s = seconds
                traj.usage.add(reply)
                live.env_history += [{"role": "user", "content": prompt},
                                     {"role": "assistant", "content": reply.text}]
                env_ids, stop = rules.fit_reply(builder.env_turn_ids(reply.text, turn.agent_token_ids),
                                                len(traj.response_ids))
                turn.env_reply = reply
                turn.env_token_ids = env_ids
                _append(traj, env_ids, 0, None)
                if stop is not None:
                    _finish(live, stop, bar)

        for live in lives:  # only reachable with max_turns < 1
            if not live.done:
                _finish(live, "max_turns", bar)
    finally:
        if own_bar:
            bar.close()

    trajectories = [live.traj for live in lives]
    if reward_fn is not None:
        for traj in trajectories:
            traj.reward = reward_fn(traj)
    return trajectories


def _append(traj: Trajectory, ids: list[int], mask: int, logprobs: list[float] | None) -> None:
    """Extend the response with `ids` (mask 1 agent / 0 environment), keeping log-probs aligned."""
    traj.response_ids.extend(ids)
    traj.response_mask.extend([mask] * len(ids))
    if traj.response_logprobs is not None:
        if mask and logprobs is not None and len(logprobs) == len(ids):
            traj.response_logprobs.extend(logprobs)
        else:  # environment tokens (0.0: never read), or agent tokens the policy has no log-probs for (NaN:
            # a server whose tokens did not line up with the re-encoded ids; the trainer skips them)
            if mask:
                logger.debug("policy returned no log-probs for %d agent tokens: recorded as NaN", len(ids))
            traj.response_logprobs.extend([float("nan") if mask else 0.0] * len(ids))


def run_rollout(*args: Any, **kwargs: Any) -> list[Trajectory]:
    """Synchronous `rollout` (one `asyncio.run`); same arguments."""
    return asyncio.run(rollout(*args, **kwargs))


def trajectory_record(traj: Trajectory) -> list[dict[str, Any]]:
    """The turns of a trajectory as plain JSON-able dicts (texts, parts, flags, env reply; no token ids)."""
    out = []
    for turn in traj.turns:
        p = turn.parsed
        rec: dict[str, Any] = {
            "text": p.text, "think": p.think, "interaction_prompt": p.interaction_prompt, "answer": p.answer,
            "valid_intermediate": p.valid_intermediate, "complete_final": p.complete_final, "issues": p.issues,
            "agent_tokens": len(turn.agent_token_ids), "generation_s": round(turn.generation_s, 4),
            "started_s": round(turn.started_s, 4),
        }
        if turn.env_reply is not None:
            rec["environment"] = asdict(turn.env_reply)
            rec["env_wait_s"] = round(turn.env_wait_s, 4)
        out.append(rec)
    return out
