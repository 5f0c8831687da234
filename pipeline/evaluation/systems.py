"""The systems the evaluate stage compares, run over the evaluation rows by one harness.

Design decisions:
- **Systems.** All systems answer the same rows and are scored by the same code:
  - `prompt_r1`: the merged agent (`paths.model_dir`) with the environment, through the same
    `rollout()` training uses, greedy (temperature 0), up to `agent.max_turns` turns of
    `evaluate.agent_max_turn_tokens` tokens (`config.evaluated_agent`, the settings the registered model
    serves with);
  - `env_only` ("w/o agent"): the environment answers the question directly: the question followed
    by `evaluate.env_only_instruction` (answer or complete the task; for short-answer questions reply
    with only the answer), one call, empty history, the method's system message;
  - `agent_only` ("w/o environment"): the merged agent answers alone in a single turn: the question
    followed by `evaluate.agent_only_instruction` (think, then `<answer>`), no interaction;
  - `base_agent` ("w/o RL"): the untrained `agent.model` with the environment, like `prompt_r1`;
  - `gepa`: the environment alone, as `env_only`, with the instruction the gepa stage optimised
    (`data/gepa/prompt.json`) in place of `evaluate.env_only_instruction`: the rival that needs no GPU.
  A prediction is the text inside the final `<answer>` tags for agents ('' when there is none, as the
  reward reads it) and the whole reply for the environment alone.
- **One harness** (`run_system`). A system is an `AnswerBatch`: an async function from a batch of rows to
  their answers, in row order. The harness walks ALL datasets' rows together, in batches that cross dataset
  boundaries (a batch is what the agent generates together: every live trajectory of a turn in one policy
  batch), with one event loop and one progress report per system (the rollout counts each finished
  trajectory on it). The agents run one batch at a time, its size the stage's choice
  (pipeline.agent.evaluation_policy.rollout_batch_size): one question per slot of llama.cpp's agent server,
  or `evaluate.batch_size` with the agent in this process. Measured there (2-core CPU, SmolLM2, fp32,
  prompts of ~400 tokens): a decode step costs 0.15 s for 4 rows, 0.31 s for 8, 0.99 s for 16 and 2.8 s
  for 48 (memory-bound), hence 8. The environment-only systems send one row per batch with
  `evaluate.batch_size` in flight (capped by `environment.concurrency`): a slow reply holds up nothing else.
  The agent's synchronous `generate` runs in a worker thread, as in `rollout()`.
- Loading models and starting the environment is the stage's job (`pipeline.stages.evaluate`): the functions
  here take a ready policy and environment client.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from pipeline.agent.protocol import ANSWER_CLOSE, THINK_OPENER, ConversationBuilder, parse_turn
from pipeline.agent.rollout import RolloutSettings, rollout, trajectory_record
from pipeline.config import evaluated_agent
from pipeline.progress import progress
from pipeline.types import TRAINED, EvalRow, PromptItem, Trajectory, UsageStats

if TYPE_CHECKING:
    from pipeline.config import AgentConfig, EnvironmentConfig, EvaluateConfig

BASELINES = ("env_only", "agent_only", "base_agent", "gepa")
"""Every baseline `evaluate.baselines` may name, in the order reports list them (after `prompt_r1`)."""
SYSTEM_LABELS = {
    TRAINED: "Prompt-R1 (trained agent + environment)",
    "env_only": "environment alone (w/o agent)",
    "agent_only": "agent alone (w/o environment)",
    "base_agent": "untrained agent + environment (w/o RL)",
    "gepa": "environment alone with the GEPA-optimised instruction",
}

SYSTEM_COLOURS = {TRAINED: "#1f77b4", "env_only": "#ff7f0e", "agent_only": "#2ca02c", "base_agent": "#d62728",
                  "gepa": "#9467bd"}
"""One colour per system, everywhere a system is drawn: the PNGs of reports/eval/plots/ and the DVC Vega
template .dvc/plots/grouped_bars.json (its colour scale lists these; tests/test_eval_verdict.py checks both)."""
OTHER_COLOUR = "#7f7f7f"
"""A system without its own colour (a matrix variant)."""


def system_colour(system: str) -> str:
    return SYSTEM_COLOURS.get(system, OTHER_COLOUR)


@dataclass
class Answer:
    """One system's answer to one row, with what it cost."""

    prediction: str
    turns: int = 1
    stop_reason: str = ""
    trajectory: list[dict[str, Any]] = field(default_factory=list)
    usage: UsageStats = field(default_factory=UsageStats)
    seconds: float = 0.0


AnswerBatch = Callable[[Sequence[EvalRow], Any], Awaitable[list[Answer]]]
"""A system: the answers to a batch of rows, in row order. Its second argument is the system's progress
bar: a system may count rows on it as they finish (the agent's rollout does, per trajectory); whatever it
did not count is counted when the batch returns."""


class _BatchBar:
    """One batch's view of the system's progress bar: forwards counts and remembers how many it made."""

    def __init__(self, bar: Any) -> None:
        self.bar = bar
        self.counted = 0

    def update(self, n: int = 1) -> None:
        self.counted += n
        self.bar.update(n)

    def set_postfix(self, *args: Any, **kwargs: Any) -> None:
        self.bar.set_postfix(*args, **kwargs)


def run_system(system: str, answer_batch: AnswerBatch, rows_by_ds: dict[str, list[EvalRow]],
               batch_size: int, in_flight: int = 1) -> dict[str, list[Answer]]:
    """All datasets' rows through `answer_batch`, `batch_size` at a time across datasets; answers per dataset.

    `in_flight` batches run at once (the next starts when one finishes): the environment-only systems send
    one row per batch, so a slow reply holds up nothing else. The agents' rollouts keep the default of 1.
    """
    flat = [(name, row) for name, rows in rows_by_ds.items() for row in rows]
    chunks = [[row for _, row in flat[start : start + batch_size]] for start in range(0, len(flat), batch_size)]

    async def every_row(bar: Any) -> list[Answer]:
        gate = asyncio.Semaphore(max(1, in_flight))

        async def one(chunk: list[EvalRow]) -> list[Answer]:
            async with gate:
                view = _BatchBar(bar)
                answers = await answer_batch(chunk, view)
                if len(answers) != len(chunk):
                    raise RuntimeError(f"{system}: {len(answers)} answers for a batch of {len(chunk)} rows")
                if view.counted < len(chunk):
                    bar.update(len(chunk) - view.counted)
                return answers

        done = await asyncio.gather(*(one(chunk) for chunk in chunks))
        return [answer for answers in done for answer in answers]

    with progress(total=len(flat), desc=f"evaluate {system}", unit="q") as bar:
        answers = asyncio.run(every_row(bar))
    out: dict[str, list[Answer]] = {name: [] for name in rows_by_ds}
    for (name, _), answer in zip(flat, answers, strict=True):
        out[name].append(answer)
    return out


def _answer_from(traj: Trajectory) -> Answer:
    return Answer(prediction=traj.answer, turns=traj.num_turns, stop_reason=traj.stop_reason,
                  trajectory=trajectory_record(traj), usage=traj.usage,
                  seconds=traj.wall_s or traj.generation_s + traj.environment_s)


def _prompt_items(rows: Sequence[EvalRow]) -> list[PromptItem]:
    return [PromptItem(uid=r.id, messages=r.messages, gold_answers=r.answers, data_source=r.dataset,
                       question=r.question) for r in rows]


def run_agent_with_environment(policy: Any, env: Any, rows_by_ds: dict[str, list[EvalRow]], agent: AgentConfig,
                               evaluate: EvaluateConfig, system: str,
                               batch_size: int | None = None) -> dict[str, list[Answer]]:
    """`rollout()` (greedy) on every dataset: the trained agent (`prompt_r1`) or the untrained one.
    `batch_size` questions together (default `evaluate.batch_size`)."""

    agent = evaluated_agent(agent, evaluate)

    async def answer_batch(chunk: Sequence[EvalRow], bar: Any) -> list[Answer]:
        trajs = await rollout(
            policy, env, _prompt_items(chunk), RolloutSettings.greedy(agent), group_size=1,
            return_logprobs=False, reward_fn=None, progress=bar,
        )
        return [_answer_from(t) for t in trajs]

    return run_system(system, answer_batch, rows_by_ds, batch_size or evaluate.batch_size)


def run_agent_only(policy: Any, rows_by_ds: dict[str, list[EvalRow]], evaluate: EvaluateConfig,
                   batch_size: int | None = None) -> dict[str, list[Answer]]:
    """The agent answers alone in one turn (no environment): greedy, stops at `</answer>`."""
    builder = ConversationBuilder(policy.tokenizer)
    instruction = evaluate.agent_only_instruction

    async def answer_batch(chunk: Sequence[EvalRow], _bar: Any) -> list[Answer]:
        prompts = [builder.start([{"role": "user", "content": f"Question: {r.question}\n{instruction}"}])
                   for r in chunk]
        start = time.perf_counter()
        gens = await asyncio.to_thread(policy.generate, prompts,
                                       max_new_tokens=evaluate.agent_max_turn_tokens, temperature=0.0,
                                       top_p=1.0, stop=[ANSWER_CLOSE], return_logprobs=False)
        per_row = (time.perf_counter() - start) / max(1, len(chunk))
        answers = []
        for gen in gens:
            text = THINK_OPENER + gen.text  # the builder opened the turn, as the rollout parses it
            parsed = parse_turn(text)
            answers.append(Answer(
                prediction=parsed.answer or "", turns=1,
                stop_reason="answer" if parsed.answer is not None else "no_answer",
                trajectory=[{"text": text, "think": parsed.think, "answer": parsed.answer,
                             "complete_final": parsed.complete_final, "issues": parsed.issues,
                             "agent_tokens": len(gen.token_ids), "generation_s": round(per_row, 4)}],
                seconds=per_row,
            ))
        return answers

    return run_system("agent_only", answer_batch, rows_by_ds, batch_size or evaluate.batch_size)


def env_only_prompt(question: str, instruction: str) -> str:
    """The user message when the environment answers alone: the question, a blank line, the instruction.

    The `env_only` baseline appends `evaluate.env_only_instruction`; `gepa` appends the instruction the gepa
    stage optimised, through this same function, so the two differ in the instruction only.
    """
    return f"{question}\n\n{instruction}"


def run_env_only(env: Any, rows_by_ds: dict[str, list[EvalRow]], evaluate: EvaluateConfig, concurrency: int,
                 instruction: str | None = None, system: str = "env_only") -> dict[str, list[Answer]]:
    """The environment answers each question directly (one call, no agent); a batch's calls run together.

    `instruction` defaults to `evaluate.env_only_instruction`; the `gepa` system passes the optimised one.
    `concurrency`: the environment's (`environment.concurrency`).
    """
    instruction = evaluate.env_only_instruction if instruction is None else instruction

    async def one(row: EvalRow) -> Answer:
        prompt = env_only_prompt(row.question, instruction)
        start = time.perf_counter()
        reply = await env.reply([], prompt)
        waited = time.perf_counter() - start  # queueing for a free connection included (a cache hit: ~0)
        usage = UsageStats()
        usage.add(reply)
        prediction = "" if reply.error else reply.text.strip()
        return Answer(prediction=prediction, turns=1, stop_reason="error" if reply.error else "answer",
                      trajectory=[{"prompt": prompt, "environment": asdict(reply), "env_wait_s": round(waited, 4)}],
                      usage=usage, seconds=waited)

    async def answer_batch(chunk: Sequence[EvalRow], _bar: Any) -> list[Answer]:
        return list(await asyncio.gather(*(one(r) for r in chunk)))

    # One row per batch, `evaluate.batch_size` in flight (at most what the client sends at once): a slow reply
    # holds up nothing else, and a kill leaves at most that many calls unanswered (uncached).
    in_flight = min(concurrency, evaluate.batch_size)
    return run_system(system, answer_batch, rows_by_ds, 1, in_flight=in_flight)


def evaluation_environment(environment: EnvironmentConfig, evaluate: EvaluateConfig) -> EnvironmentConfig:
    """`environment` with the evaluation's sampling (`evaluate.env_temperature`, `evaluate.env_cache`): the
    conditions every evaluated system, and GEPA's task model, answer under."""
    from pipeline.environment.spec import environment_with

    return environment_with(environment, temperature=evaluate.env_temperature, cache=evaluate.env_cache)
