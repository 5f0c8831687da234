"""`promptr1 ask "question"`: one greedy Prompt-R1 trajectory for one question, printed turn by turn.

The same pieces as training and evaluation, nothing special-cased: the environment server from params
(started, or reused when one already answers at the URL, and stopped again only if started here), the
agent generating through the engine `register.serve.agent_engine` (or `--engine`) selects
(pipeline/agent/engine.py: llama.cpp's server on a GGUF export, as in evaluation, when the base model is a
GGUF file; else transformers in this process), the authors' user message rendered by the template (the generic
multi-hop QA wording: dataset "hotpotqa"), and one call of `rollout` with group size 1 and temperature 0.
An empty or blank question is refused first (pipeline/agent/question.py), before any server or model starts.

Which agent: `--model` if given; else the merged model in `paths.model_dir` (`models/agent`) when the
pipeline has produced one; else `agent.model` from params (the untrained base model).

Printed with rich: each turn's think, interaction prompt and environment reply (with its tokens, latency,
cache/error state), the answer, then a summary: the agent's engine, tokens of the prompt / agent / environment,
environment calls and tokens, agent and environment tokens per second, wall time and cost.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.panel import Panel
from rich.table import Table

from pipeline.agent.question import question_problem
from pipeline.config import Params
from pipeline.errors import UserError
from pipeline.types import PromptItem, Trajectory

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from pipeline.agent.policy import Policy
    from pipeline.agent.serving_policy import AgentEngine
    from pipeline.config import AgentConfig, EnvironmentConfig

logger = logging.getLogger(__name__)

ASK_DATASET = "hotpotqa"
"""Whose instruction wording the question gets: the generic QA one (no dataset-specific wrapper)."""


@dataclass
class AskResult:
    """What `run_ask` measured (the CLI prints it; the benchmark records it)."""

    trajectory: Trajectory
    agent_ref: str
    load_s: float
    """Loading the agent (tokenizer + weights; llama.cpp: the GGUF export if not cached, the server's start)."""
    rollout_s: float
    """The rollout alone: generation + environment calls."""
    wall_s: float
    """Everything in run_ask, server start included."""
    engine: str = "transformers"
    """What generated the agent's turns: `llama.cpp` or `transformers`."""

    @property
    def agent_tokens(self) -> int:
        return sum(self.trajectory.response_mask)

    @property
    def env_tokens(self) -> int:
        return len(self.trajectory.response_mask) - self.agent_tokens

    @property
    def agent_tokens_per_s(self) -> float:
        t = self.trajectory.generation_s
        return self.agent_tokens / t if t > 0 else 0.0

    @property
    def env_tokens_per_s(self) -> float:
        """Environment completion tokens per second of environment latency (real calls only)."""
        u = self.trajectory.usage
        return u.completion_tokens / u.latency_s if u.latency_s > 0 else 0.0


def agent_model_ref(params: Params, model_ref: str | None) -> str:
    """`model_ref`, else the merged agent in paths.model_dir if present, else params.agent.model."""
    if model_ref:
        return model_ref
    merged = params.path(params.paths.model_dir)
    if (merged / "config.json").is_file():
        return str(merged)
    return params.agent.model


def run_ask(params: Params, question: str, model_ref: str | None = None, *,
            console: Console | None = None, engine: str | None = None) -> AskResult:
    """Answer `question` with the agent and the environment; print the trajectory (see module docstring).
    `engine`: auto | llama.cpp | transformers (default `register.serve.agent_engine`)."""
    from contextlib import ExitStack

    from pipeline.environment.client import CACHE_FILE
    from pipeline.environment.servers import serve_environment
    from pipeline.environment.spec import ServerSpec, environment_with

    problem = question_problem(question)
    if problem is not None:  # before any server or model: an empty question would get an invented answer
        raise UserError(f"promptr1 ask: {problem}")
    console = console or Console()
    wall = time.perf_counter()
    ref = agent_model_ref(params, model_ref)
    if model_ref is None and ref == params.agent.model:
        console.print(f"[yellow]No trained agent yet: {params.paths.model_dir} holds no merged model, so the "
                      f"untrained base model {ref} answers (it may not follow the Prompt-R1 tags). Train one "
                      "with `dvc repro` (or `promptr1 train && promptr1 merge`), or pass --model.[/yellow]")
    item = _ask_item(question)
    cache_dir = params.path(params.paths.cache_dir)
    server = ServerSpec(environment=params.environment, root=params.root, cache_dir=cache_dir)
    with serve_environment(server) as url, ExitStack() as stack:
        start = time.perf_counter()
        with console.status(f"loading agent {ref}"):
            agent_engine = stack.enter_context(_agent_engine(params, ref, engine, cache_dir))
        load_s = time.perf_counter() - start

        cfg = environment_with(params.environment, base_url=url)
        cache = cache_dir / CACHE_FILE if cfg.cache else None
        start = time.perf_counter()
        with console.status("agent and environment at work"):
            traj = asyncio.run(_ask_once(agent_engine.policy, cfg, cache, item, params.agent))
        rollout_s = time.perf_counter() - start
    result = AskResult(traj, ref, load_s, rollout_s, time.perf_counter() - wall, agent_engine.engine)
    print_trajectory(console, question, result, env_model=cfg.served_name)
    return result


def _ask_item(question: str) -> PromptItem:
    """The question as the one prompt item of the rollout, in `ASK_DATASET`'s instruction wording."""
    from pipeline.agent.template import render_user_message

    return PromptItem(
        uid="ask",
        messages=[{"role": "user", "content": render_user_message(question, ASK_DATASET)}],
        gold_answers=[],
        data_source=ASK_DATASET,
        question=question,
    )


def _agent_engine(params: Params, ref: str, engine: str | None, cache_dir: Path) -> AbstractContextManager[AgentEngine]:
    """The agent at `ref` on the engine `engine` picks (default `register.serve.agent_engine`); a llama.cpp
    server, when one starts, stops when the block ends."""
    from pipeline.agent.llama_launcher import AgentServing
    from pipeline.agent.serving_policy import agent_policy

    serve = params.register.serve
    serving = AgentServing.from_sections(
        params.agent, params.environment, params.evaluate, root=params.root, cache_dir=cache_dir
    )
    return agent_policy(ref, serving, engine or serve.agent_engine, threads=serve.agent_threads)


async def _ask_once(policy: Policy, cfg: EnvironmentConfig, cache: Path | None, item: PromptItem,
                    agent: AgentConfig) -> Trajectory:
    """One greedy rollout of `item` against the environment at `cfg` (its client closed afterwards)."""
    from pipeline.agent.rollout import RolloutSettings, rollout
    from pipeline.environment.client import EnvironmentClient

    env = EnvironmentClient(cfg, cache)
    try:
        (traj,) = await rollout(
            policy, env, [item], RolloutSettings.greedy(agent), group_size=1,
            return_logprobs=False, reward_fn=None,
        )
        return traj
    finally:
        await env.aclose()


def print_trajectory(console: Console, question: str, result: AskResult, env_model: str = "") -> None:
    """The trajectory turn by turn, the answer, and a summary table."""
    traj = result.trajectory
    console.print(Panel(question, title="question", border_style="cyan"))
    for number, turn in enumerate(traj.turns, start=1):
        parsed = turn.parsed
        console.rule(f"turn {number} · {len(turn.agent_token_ids)} agent tokens")
        if parsed.think is not None:
            console.print(Panel(parsed.think or "(empty)", title="think", border_style="magenta"))
        if parsed.interaction_prompt is not None:
            console.print(Panel(parsed.interaction_prompt or "(empty)", title="interaction prompt",
                                border_style="yellow"))
        if parsed.think is None and parsed.interaction_prompt is None and parsed.answer is None:
            console.print(Panel(parsed.text or "(nothing)", title="raw turn (no protocol tags)",
                                border_style="red"))
        if parsed.issues:
            console.print(f"[dim]format issues: {'; '.join(parsed.issues)}[/dim]")
        reply = turn.env_reply
        if reply is not None:
            state = "cached" if reply.cached else f"{reply.latency_s:.2f} s"
            if reply.error:
                state += f", error: {reply.error}"
            console.print(Panel(
                reply.text or "(empty)", border_style="green" if reply.error is None else "red",
                title=f"environment {env_model} · {reply.completion_tokens} tokens · {state}",
            ))
    answer = traj.answer
    console.print(Panel(answer or "(no answer)", title=f"answer · stopped: {traj.stop_reason}",
                        border_style="bold cyan" if answer else "red"))

    usage = traj.usage
    table = Table(title="summary", show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    rows = [
        ("agent", result.agent_ref if len(result.agent_ref) < 60 else "…" + result.agent_ref[-58:]),
        ("agent engine", result.engine),
        ("turns", str(traj.num_turns)),
        ("prompt tokens", str(len(traj.prompt_ids))),
        ("agent tokens (mask 1)", str(result.agent_tokens)),
        ("environment tokens in context (mask 0)", str(result.env_tokens)),
        ("environment calls (+ cache hits)", f"{usage.calls} (+{usage.cache_hits})"),
        ("environment prompt / completion tokens", f"{usage.prompt_tokens} / {usage.completion_tokens}"),
        ("environment errors / retries", f"{usage.errors} / {usage.retries}"),
        ("agent generation", f"{traj.generation_s:.2f} s · {result.agent_tokens_per_s:.1f} tokens/s"),
        ("environment latency", f"{usage.latency_s:.2f} s · {result.env_tokens_per_s:.1f} tokens/s"),
        ("agent load", f"{result.load_s:.1f} s"),
        ("wall time", f"{result.wall_s:.1f} s"),
        ("cost", f"${usage.cost_usd:.6f}"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)
