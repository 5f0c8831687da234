"""The multi-turn Prompt-R1 rollout: one conversation per trajectory, many trajectories at once.

One loop serves training (local backend), evaluation, the served pyfunc and `promptr1 ask`:

    prompt ids = chat template + <think> opener                         (ConversationBuilder.start)
    one `run_episode` per trajectory (pipeline.agent.episode), all running together;
    each turn, the agent turns of every live episode are generated in one batch   (mask 1, log-probs)
    each episode parses its turn, decides (TurnRules) and asks the environment with its own history;
    the calls of one turn run concurrently (the client's semaphore bounds them)
    reward_fn(trajectory) for each

Design decisions:
- **The conversation is `pipeline.agent.episode.run_episode`**, the function verl's agent loop runs too;
  this module supplies its generator and runs the episodes. Turn rules are `TurnRules` (the generation
  limit, the decision after each turn, how much of a reply fits). Only `prompt_too_long` is decided here:
  when `max_prompt_tokens` is given and the prompt alone exceeds it, the trajectory is not rolled out
  (verl's loop truncates instead, verl's own rule).
- **The agent's settings are one `RolloutSettings`**: `AgentConfig`'s turn limits and sampling, built by
  `RolloutSettings.sampled` (the config's sampling: training) or `RolloutSettings.greedy` (temperature 0 and
  top_p 1: evaluation, `promptr1 ask`, the served model). A frozen value rather than the section itself:
  greedy callers sample differently from the section, and the rollout needs neither its model nor its dtype.
- **One batch per turn** (`_TurnBatches`): an episode's request waits until every live episode has asked
  for its next turn (or ended); then one `Policy.generate` runs over all of them in trajectory order. Every
  episode starts together and waits for the batch, so the episodes stay in lockstep: the batch of turn t
  holds exactly the trajectories still going at turn t, in the order they were created, and a seeded
  sampler draws the same tokens as any turn-by-turn batched loop. Results are handed back in trajectory
  order, so the environment calls of a turn also go out in that order.
- **Generation runs in a worker thread** (`asyncio.to_thread`), so the event loop stays free for the
  environment calls in flight; a turn's batch waits for them (the agent needs the replies).
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
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from pipeline.agent.episode import TurnGeneration, run_episode
from pipeline.agent.policy import Policy
from pipeline.agent.protocol import STOP_STRINGS, ConversationBuilder, TurnRules
from pipeline.progress import LogProgress
from pipeline.progress import progress as progress_bar
from pipeline.types import PromptItem, RewardBreakdown, Trajectory

if TYPE_CHECKING:
    from pipeline.config import AgentConfig
    from pipeline.environment.client import EnvironmentClient

logger = logging.getLogger(__name__)


class _TurnBatches:
    """The episodes' generator: one `Policy.generate` per turn over every live episode (see module doc)."""

    def __init__(
        self, policy: Policy, episodes: int, temperature: float, top_p: float, return_logprobs: bool, bar: Any
    ) -> None:
        self.policy = policy
        self.temperature = temperature
        self.top_p = top_p
        self.return_logprobs = return_logprobs
        self.bar = bar
        self.live = episodes
        """Episodes that have not ended: a batch runs once each of them is waiting for its turn."""
        self.waiting: dict[int, tuple[list[int], int, asyncio.Future[TurnGeneration]]] = {}
        self.turn = 0
        self.running: set[asyncio.Task[None]] = set()

    async def generate(self, index: int, context: list[int], limit: int) -> TurnGeneration:
        """Episode `index`'s next turn, generated in the batch of every live episode's request."""
        future: asyncio.Future[TurnGeneration] = asyncio.get_running_loop().create_future()
        self.waiting[index] = (context, limit, future)
        self._run_when_complete()
        return await future

    def leave(self) -> None:
        """An episode ended: the batches no longer wait for it."""
        self.live -= 1
        self._run_when_complete()

    def _run_when_complete(self) -> None:
        # a cancelled episode (another one failed) leaves its request behind: it is not generated
        self.waiting = {i: request for i, request in self.waiting.items() if not request[2].done()}
        if self.waiting and len(self.waiting) == self.live:
            batch = [self.waiting[i] for i in sorted(self.waiting)]
            self.waiting = {}
            task = asyncio.create_task(self._run(batch))
            self.running.add(task)
            task.add_done_callback(self.running.discard)

    async def _run(self, batch: list[tuple[list[int], int, asyncio.Future[TurnGeneration]]]) -> None:
        self.turn += 1
        self.bar.set_postfix(turn=self.turn, active=len(batch))
        limits = [limit for _, limit, _ in batch]
        start = time.perf_counter()
        try:
            generations = await asyncio.to_thread(
                self.policy.generate,
                [context for context, _, _ in batch],
                limits,
                self.temperature,
                self.top_p,
                list(STOP_STRINGS),
                self.return_logprobs,
            )
        except Exception as exc:  # noqa: BLE001 - raised in every episode of the batch
            for _, _, future in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        elapsed = time.perf_counter() - start
        for (_, _, future), gen in zip(batch, generations, strict=True):
            if not future.done():  # a cancelled episode no longer waits
                future.set_result(
                    TurnGeneration(
                        token_ids=gen.token_ids,
                        logprobs=gen.logprobs,
                        text=gen.text,
                        hit_limit=gen.finish_reason == "length",
                        started=start,
                        seconds=elapsed,
                    )
                )


@dataclass(frozen=True)
class RolloutSettings:
    """The agent's settings one rollout runs with: `AgentConfig`'s turn limits and sampling, as passed."""

    max_turns: int
    """Agent turns per trajectory at most."""
    max_turn_tokens: int
    """Tokens of one agent turn at most."""
    max_response_tokens: int
    """Tokens of the whole response (agent and environment turns) at most."""
    env_reply_max_chars: int
    """Characters of an environment reply kept in the conversation."""
    temperature: float
    """Sampling temperature of the agent turns (0: greedy)."""
    top_p: float
    """Nucleus sampling mass of the agent turns."""
    max_prompt_tokens: int | None = None
    """A prompt longer than this is not rolled out (`prompt_too_long`); None: no limit."""

    @classmethod
    def sampled(cls, agent: AgentConfig) -> RolloutSettings:
        """`agent`'s turn limits and sampling (training)."""
        return cls(**_turn_limits(agent), temperature=agent.temperature, top_p=agent.top_p)

    @classmethod
    def greedy(cls, agent: AgentConfig) -> RolloutSettings:
        """`agent`'s turn limits, decoded greedily: temperature 0, top_p 1 (evaluation, ask, the served model).
        It reads no sampling key, so a change of `agent.temperature` does not rerun what only decodes greedily."""
        return cls(**_turn_limits(agent), temperature=0.0, top_p=1.0)

    @property
    def turn_rules(self) -> TurnRules:
        """The episodes' turn rules (generation limit, decision after each turn, replies' fit)."""
        return TurnRules(
            max_turns=self.max_turns,
            max_turn_tokens=self.max_turn_tokens,
            max_response_tokens=self.max_response_tokens,
        )


def _turn_limits(agent: AgentConfig) -> dict[str, int | None]:
    return {"max_turns": agent.max_turns, "max_turn_tokens": agent.max_turn_tokens,
            "max_response_tokens": agent.max_response_tokens, "env_reply_max_chars": agent.env_reply_max_chars,
            "max_prompt_tokens": agent.max_prompt_tokens}


async def rollout(
    policy: Policy,
    env: EnvironmentClient,
    items: list[PromptItem],
    agent: RolloutSettings,
    *,
    group_size: int,
    return_logprobs: bool,
    reward_fn: Callable[[Trajectory], RewardBreakdown] | None,
    progress: bool | Any = False,
) -> list[Trajectory]:
    """Roll out `group_size` trajectories per item under `agent`'s settings; returns them grouped in item
    order (see module doc).

    `progress`: True draws a nested bar (terminal only); a bar object (`pipeline.progress`) is the caller's
    and gets one count per finished trajectory (the evaluation's one report per system).
    """
    builder = ConversationBuilder(policy.tokenizer, agent.env_reply_max_chars)
    started = time.perf_counter()
    trajectories = _new_trajectories(builder, items, group_size, return_logprobs)
    own_bar = isinstance(progress, bool)
    bar = _rollout_bar(progress, len(trajectories))
    try:
        going = _skip_long_prompts(trajectories, agent.max_prompt_tokens, started, bar)
        batches = _TurnBatches(policy, len(going), agent.temperature, agent.top_p, return_logprobs, bar)
        await _run_episodes(trajectories, going, batches, env, builder, agent.turn_rules, started, bar)
    finally:
        if own_bar:
            bar.close()

    if reward_fn is not None:
        for traj in trajectories:
            traj.reward = reward_fn(traj)
    return trajectories


def run_rollout(*args: Any, **kwargs: Any) -> list[Trajectory]:
    """Synchronous `rollout` (one `asyncio.run`); same arguments."""
    return asyncio.run(rollout(*args, **kwargs))


def _new_trajectories(
    builder: ConversationBuilder, items: list[PromptItem], group_size: int, return_logprobs: bool
) -> list[Trajectory]:
    """`group_size` empty trajectories per item, item-major, each starting from the item's prompt ids."""
    trajectories: list[Trajectory] = []
    for item in items:
        prompt_ids = builder.start(item.messages)
        for _ in range(group_size):
            trajectories.append(
                Trajectory(
                    item=item, prompt_ids=list(prompt_ids), response_logprobs=[] if return_logprobs else None
                )
            )
    return trajectories


def _rollout_bar(progress: bool | Any, total: int) -> Any:
    """The caller's bar (evaluation: one count per finished trajectory, not closed here), or an own one."""
    if not isinstance(progress, bool):
        return progress
    if progress:
        return progress_bar(total=total, desc="rollout", unit="traj", quiet=True)
    return LogProgress(total=total, silent=True)


def _skip_long_prompts(
    trajectories: list[Trajectory], max_prompt_tokens: int | None, started: float, bar: Any
) -> list[int]:
    """Mark the trajectories whose prompt exceeds `max_prompt_tokens` `prompt_too_long` (finished, counted on
    the bar); returns the indices of the others, the ones to roll out."""
    going = []
    for index, traj in enumerate(trajectories):
        if max_prompt_tokens is not None and len(traj.prompt_ids) > max_prompt_tokens:
            logger.warning(
                "prompt of %s has %d tokens > max_prompt_tokens %d: not rolled out",
                traj.item.uid,
                len(traj.prompt_ids),
                max_prompt_tokens,
            )
            traj.stop_reason = "prompt_too_long"
            traj.wall_s = time.perf_counter() - started
            bar.update(1)
        else:
            going.append(index)
    return going


async def _run_episodes(
    trajectories: list[Trajectory],
    going: list[int],
    batches: _TurnBatches,
    env: EnvironmentClient,
    builder: ConversationBuilder,
    rules: TurnRules,
    started: float,
    bar: Any,
) -> None:
    """One `run_episode` per trajectory in `going`, all together; the first failure cancels the others."""

    async def episode(index: int) -> None:
        try:
            await run_episode(
                trajectories[index],
                lambda ids, limit: batches.generate(index, ids, limit),
                env,
                builder,
                rules,
                started=started,
            )
            bar.update(1)
        finally:
            batches.leave()

    tasks = [asyncio.create_task(episode(index)) for index in going]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def trajectory_record(traj: Trajectory) -> list[dict[str, Any]]:
    """The turns of a trajectory as plain JSON-able dicts (texts, parts, flags, env reply; no token ids)."""
    out = []
    for turn in traj.turns:
        p = turn.parsed
        rec: dict[str, Any] = {
            "text": p.text,
            "think": p.think,
            "interaction_prompt": p.interaction_prompt,
            "answer": p.answer,
            "valid_intermediate": p.valid_intermediate,
            "complete_final": p.complete_final,
            "issues": p.issues,
            "agent_tokens": len(turn.agent_token_ids),
            "generation_s": round(turn.generation_s, 4),
            "started_s": round(turn.started_s, 4),
        }
        if turn.env_reply is not None:
            rec["environment"] = asdict(turn.env_reply)
            rec["env_wait_s"] = round(turn.env_wait_s, 4)
        out.append(rec)
    return out
