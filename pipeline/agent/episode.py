"""One Prompt-R1 conversation: the agent and the environment take turns until the trajectory ends.

`run_episode` is the one conversation loop of the project. The local rollout (`pipeline.agent.rollout`:
training on CPU, evaluation, `promptr1 ask`, the served pyfunc) runs one episode per trajectory of a batch,
and verl's agent loop (`pipeline.train.verl.agent_loop`: GPU training) runs one per trajectory it is given:

    repeat up to max_turns:
        limit      = TurnRules.token_limit(response so far)
        agent turn = generate(prompt + response, limit)                                   (mask 1)
        parse_turn(<think> opener + text); TurnRules.after_agent_turn: stop, or ask the environment
        reply      = environment.reply(this episode's history, interaction prompt)
        env ids    = TurnRules.fit_reply(ConversationBuilder.env_turn_ids(reply, agent ids))  (mask 0)

Design decisions:
- **Generation is injected** (`GenerateTurn`): the episode only says which ids to continue and how many
  tokens the turn may take. The local rollout answers with one batched `Policy.generate` over every live
  episode of the turn (so batch composition, order and the sampler's random stream are those of a
  turn-by-turn batched loop); verl's loop answers with its server manager, one request per call.
- **What a generator reports** (`TurnGeneration`): the sampled ids, their log-probs, the decoded text the
  turn is parsed from, whether the token limit cut it (local policies say so as finish reason `length`;
  verl's `TokenOutput` folds that into `completed`, so its adapter counts the ids against the limit) and
  the wall time of the generation (for a batch: the batch's, shared by its episodes).
- **The trajectory is the state.** The episode fills a `Trajectory` in place: ids, masks, log-probs, the
  turns with their timings, environment usage, stop reason and wall time. Each backend turns it into its
  own output (the rollout's list, verl's `AgentLoopOutput`).
- **Log-probs stay aligned with the ids**: 0.0 on environment tokens, NaN on agent tokens the generator
  gave no aligned log-probs for (a server whose tokens did not line up with the re-encoded ids; the
  trainer skips them).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipeline.agent.protocol import ConversationBuilder, TurnRules, parse_turn
from pipeline.types import StopReason, Trajectory, Turn

if TYPE_CHECKING:
    from pipeline.environment.client import EnvironmentClient

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TurnGeneration:
    """One agent turn as a generator returns it to the episode."""

    token_ids: list[int]
    """The sampled ids (at most the turn's limit), the stop string's or end-of-turn token included."""
    logprobs: list[float] | None
    """Log-prob of each sampled id under the sampling policy, when asked for."""
    text: str
    """The ids decoded without special tokens: what the turn is parsed from (after the `<think>` opener)."""
    hit_limit: bool
    """Generation stopped because it reached the turn's token limit."""
    started: float
    """`time.perf_counter()` when the generation began."""
    seconds: float
    """Wall time of the generation (of the whole batch when the generator batches episodes)."""


GenerateTurn = Callable[[list[int], int], Awaitable[TurnGeneration]]
"""`generate(context ids, token limit)`: the next agent turn after `context ids`, at most `limit` tokens."""


async def run_episode(
    traj: Trajectory,
    generate: GenerateTurn,
    env: EnvironmentClient,
    builder: ConversationBuilder,
    rules: TurnRules,
    *,
    started: float,
) -> Trajectory:
    """Roll out one conversation from `traj.prompt_ids` (see the module docstring); returns `traj`, filled.

    `started`: `time.perf_counter()` when the rollout began; turn start times and `wall_s` count from it.
    """
    history: list[dict[str, str]] = []
    stop: StopReason | None = None
    for turn_number in range(1, rules.max_turns + 1):
        limit = rules.token_limit(len(traj.response_ids))
        gen = await generate(traj.prompt_ids + traj.response_ids, limit)
        turn = _record_agent_turn(traj, gen, builder, started)
        decision = rules.after_agent_turn(
            turn.parsed,
            turn_number=turn_number,
            hit_limit=gen.hit_limit,
            limit=limit,
            response_tokens=len(traj.response_ids),
        )
        if decision.stop is not None:
            stop = decision.stop
            break
        stop = await _environment_turn(traj, turn, decision.prompt, history, env, builder, rules)
        if stop is not None:
            break
    traj.stop_reason = stop or "max_turns"
    traj.wall_s = time.perf_counter() - started
    return traj


def _record_agent_turn(traj: Trajectory, gen: TurnGeneration, builder: ConversationBuilder, started: float) -> Turn:
    """Parse the generated turn and add it to `traj` (a new `Turn`, its ids with mask 1); returns the turn."""
    traj.generation_s += gen.seconds
    parsed = parse_turn(builder.think_opener + gen.text)
    turn = Turn(
        parsed=parsed,
        agent_token_ids=list(gen.token_ids),
        agent_logprobs=gen.logprobs,
        generation_s=gen.seconds,
        started_s=gen.started - started,
    )
    traj.turns.append(turn)
    _append(traj, gen.token_ids, 1, gen.logprobs)
    return turn


async def _environment_turn(
    traj: Trajectory,
    turn: Turn,
    prompt: str,
    history: list[dict[str, str]],
    env: EnvironmentClient,
    builder: ConversationBuilder,
    rules: TurnRules,
) -> StopReason | None:
    """Ask the environment `prompt` with this episode's `history` (extended with the exchange) and add its
    reply to `traj` (ids with mask 0, cut to the room left); returns the stop reason when the reply filled it."""
    asked = time.perf_counter()
    reply = await env.reply(list(history), prompt)
    seconds = time.perf_counter() - asked
    traj.environment_s += seconds
    turn.env_wait_s = seconds
    traj.usage.add(reply)
    history += [
        {"role": "user", "content": prompt},
        {"role": "assistant", "content": reply.text},
    ]
    env_ids, stop = rules.fit_reply(builder.env_turn_ids(reply.text, turn.agent_token_ids), len(traj.response_ids))
    turn.env_reply = reply
    turn.env_token_ids = env_ids
    _append(traj, env_ids, 0, None)
    return stop


def _append(traj: Trajectory, ids: list[int], mask: int, logprobs: list[float] | None) -> None:
    """Extend the response with `ids` (mask 1 agent / 0 environment), keeping log-probs aligned."""
    traj.response_ids.extend(ids)
    traj.response_mask.extend([mask] * len(ids))
    if traj.response_logprobs is not None:
        if mask and logprobs is not None and len(logprobs) == len(ids):
            traj.response_logprobs.extend(logprobs)
        else:
            if mask:
                logger.debug("policy returned no log-probs for %d agent tokens: recorded as NaN", len(ids))
            traj.response_logprobs.extend([float("nan") if mask else 0.0] * len(ids))
