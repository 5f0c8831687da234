"""`promptr1 doctor` steps 6-7: the environment server starts, then real evaluation rows go through it.

- `environment`: `pipeline.environment.servers.serve_environment`, as the train and evaluate stages use it
  (reuse a healthy server at the URL, else start llama.cpp / vLLM / the knowledge server; nothing for a paid
  API), then `GET <url>/models` with the key: a paid endpoint is only judged reachable once it answers.
  The server is held on the doctor's exit stack, so the rows and the verl step use it, and stopped at the end.
- `rows`: `--rows` real evaluation rows, math datasets first (a reasoning environment's worst case: long
  thinking, empty replies after `length`), then round-robin over the profile's evaluation sets; from the
  built sets (`data/rl/eval/`) when they exist, else the authors' files in the mirror. Each is sent as the
  env-only baseline sends it (question + `evaluate.env_only_instruction`) through `EnvironmentClient`
  with its response cache off, so the latencies are the server's. More failures than
  `environment.max_failure_rate` fail the step. So does the measured decode speed when it breaks the
  timeout rule of pipeline/environment/budget.py: the completion tokens of the replies that came back at the
  first try over their seconds (`decode_speed`; prefill and queueing included, as a run's calls have them),
  and the length retry's `max_tokens x length_retry_factor` tokens at that speed must finish within
  `environment.timeout_s`. The rule `promptr1 check` applies to the declared
  `environment.decode_tokens_per_s`, applied to what this server does under the doctor's load.
"""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from asyncio import FIRST_EXCEPTION
from typing import TYPE_CHECKING, Any

from pipeline.checks.doctor_state import BUILD_FIRST, Status, failed, passed, skipped
from pipeline.config import Params
from pipeline.environment.budget import longest_reply_seconds, longest_reply_tokens
from pipeline.stage_files import EVAL_SETS_DIR

if TYPE_CHECKING:
    from pipeline.checks.doctor_state import Doctor
    from pipeline.config import EnvironmentConfig
    from pipeline.environment.client import EnvironmentClient
    from pipeline.types import EnvironmentReply


# ------------------------------------------------------------------------------------------- 6. environment
def step_environment(doc: Doctor) -> tuple[Status, str, dict[str, Any]]:
    from pipeline.environment.client import resolve_api_key
    from pipeline.environment.probes import served_models
    from pipeline.environment.servers import serve_environment, started_server
    from pipeline.environment.spec import ServerSpec
    from pipeline.errors import EnvironmentUnavailable
    from pipeline.placement import started_here

    params, env = doc.params, doc.params.environment
    if env.backend == "vllm" and started_here(env) and not doc.gpus:
        return skipped(f"environment.backend=vllm serves {env.model} on a GPU: none on this machine")
    if env.backend == "knowledge":
        missing = [s for s in env.knowledge.sources if not params.path(s).exists()]
        if missing:
            return skipped(f"{BUILD_FIRST} (environment.knowledge.sources {missing} not built)")
    try:
        server = ServerSpec(environment=env, root=params.root, cache_dir=params.path(params.paths.cache_dir))
        url = doc.stack.enter_context(serve_environment(server))
        models = served_models(url, resolve_api_key(env), timeout_s=10.0)
    except EnvironmentUnavailable as exc:
        return failed(f"{exc}", url=env.url)
    if models is None:
        key = f", or it refuses the key in ${env.api_key_env}" if env.backend == "api" else ""
        return failed(
            f"no answer (HTTP 200) from {url}/models (environment.backend={env.backend}){key}: start the server "
            "there or fix environment.base_url / host / port",
            url=url,
        )
    doc.environment_url = url
    how = "started here" if started_server(url) is not None else "already running, reused"
    return passed(
        f"{env.backend} {env.served_name} at {url} ({how})", url=url, backend=env.backend, models=models
    )


# ------------------------------------------------------------------------------------------- 7. rows
def evaluation_rows(params: Params, n: int) -> tuple[list[dict[str, Any]], str] | None:
    """`n` real evaluation rows (dataset, task type, question), math datasets first, then round-robin;
    from the built sets (data/rl/eval/) if there, else the mirror's authors' files. None when neither is."""
    import pyarrow.parquet as pq

    from pipeline.config.specs import source_paths
    from pipeline.data.sources import authors_eval_path, get_spec, load_authors_eval

    names = list(params.eval_datasets)
    if not any(get_spec(name).task_type == "math" for name in names):
        names.append("gsm8k")  # the doctor always sends math rows (a reasoning environment's worst case)
    names.sort(key=lambda name: get_spec(name).task_type != "math")
    eval_dir = params.path(params.paths.rl_dir) / EVAL_SETS_DIR
    sources = source_paths(params)
    per_dataset: dict[str, list[str]] = {}
    source = "data/rl/eval" if any((eval_dir / f"{name}.parquet").is_file() for name in names) else "mirror"
    for name in names:
        built = eval_dir / f"{name}.parquet"
        if source == "data/rl/eval" and built.is_file():
            extra = pq.read_table(built, columns=["extra_info"]).column("extra_info").to_pylist()
            per_dataset[name] = [str(e["question"]) for e in extra]
        elif sources.mirror is not None and authors_eval_path(sources, get_spec(name)).is_file():
            per_dataset[name] = [row.question for row in load_authors_eval(sources, get_spec(name))]
    if not per_dataset:
        return None
    rows: list[dict[str, Any]] = []
    for index in range(max(len(q) for q in per_dataset.values())):
        for name, questions in per_dataset.items():
            if index < len(questions) and len(rows) < n:
                rows.append(
                    {"dataset": name, "task_type": get_spec(name).task_type, "question": questions[index]}
                )
    return rows, source


def _percentile(values: list[float], q: int) -> float | None:
    """The q-th percentile (inclusive method) of the latencies; None when no row was answered."""
    if len(values) <= 1:
        return values[0] if values else None
    return round(statistics.quantiles(values, n=100, method="inclusive")[q - 1], 3)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def decode_speed(replies: list[EnvironmentReply]) -> tuple[float, int, float, int] | None:
    """(tokens/s, completion tokens, seconds, replies counted) over the replies that came back at their first
    try with tokens (a retry's backoff is no decoding); None when there is none."""
    timed = [
        r for r in replies if not r.error and not r.retries and r.completion_tokens > 0 and r.latency_s > 0
    ]
    if not timed:
        return None
    tokens, seconds = sum(r.completion_tokens for r in timed), sum(r.latency_s for r in timed)
    return tokens / seconds, tokens, seconds, len(timed)


def speed_problem(env: EnvironmentConfig, measured: tuple[float, int, float, int]) -> str | None:
    """Why the measured decode speed breaks the timeout rule (pipeline/environment/budget.py), or None."""
    speed, tokens, seconds, count = measured
    needed_s = longest_reply_seconds(env, speed)
    if needed_s <= env.timeout_s:
        return None
    return (
        f"measured decode speed {speed:.1f} tokens/s ({tokens} completion tokens in {seconds:.1f} s over "
        f"{count} replies) breaks the timeout rule: the length retry's {longest_reply_tokens(env)} tokens "
        f"(environment.max_tokens={env.max_tokens} x length_retry_factor={env.length_retry_factor:g}) take "
        f"{needed_s:.0f} s at that speed, more than environment.timeout_s={env.timeout_s:g}; "
        f"environment.decode_tokens_per_s declares {env.decode_tokens_per_s:g}: set it to the measured "
        f"{speed:.1f} and raise timeout_s to >= {math.ceil(needed_s)}, or lower max_tokens"
    )


def step_rows(doc: Doctor) -> tuple[Status, str, dict[str, Any]]:
    from pipeline.environment.client import EnvironmentClient
    from pipeline.environment.ledger import LEDGER_FILE
    from pipeline.environment.spec import environment_with
    from pipeline.errors import EnvironmentUnhealthy

    if doc.environment_url is None:
        return skipped("no environment server (the environment step did not pass)")
    if doc.rows <= 0:
        return skipped("--rows 0")
    found = evaluation_rows(doc.params, doc.rows)
    if found is None:
        return skipped(f"no evaluation rows: {BUILD_FIRST} (or set paths.mirror to the datasets mirror)")
    rows, source = found
    params = doc.params
    cfg = environment_with(params.environment, cache=False, base_url=doc.environment_url)
    client = EnvironmentClient(cfg, None, ledger_path=params.path(params.paths.cache_dir) / LEDGER_FILE)
    prompts = [f"{r['question']}\n\n{params.evaluate.env_only_instruction}" for r in rows]

    started = time.perf_counter()
    try:
        answered = asyncio.run(_send_all(client, prompts, doc.rows_deadline_s))
    except EnvironmentUnhealthy as exc:
        return failed(f"{exc}", url=doc.environment_url)
    wall = time.perf_counter() - started
    replies = [r for r in answered if r is not None]
    late = len(answered) - len(replies)
    errors = [r.error for r in replies if r.error] + [f"not answered within {doc.rows_deadline_s:g} s"] * late
    figures = _row_figures(rows, source, replies, errors, late, wall)
    measured = decode_speed(replies)
    figures["decode_tokens_per_s"] = round(measured[0], 1) if measured else None
    figures["declared_decode_tokens_per_s"] = params.environment.decode_tokens_per_s
    detail = _rows_detail(figures, wall, late, measured, params.environment.decode_tokens_per_s)
    if len(errors) > params.environment.max_failure_rate * len(rows):
        return failed(
            f"{detail}; more than environment.max_failure_rate={params.environment.max_failure_rate:g} "
            f"failed (first: {errors[0]}): fix the environment at {doc.environment_url}",
            **figures,
        )
    slow = speed_problem(params.environment, measured) if measured else None
    if slow:
        return failed(f"{detail}; {slow}", **figures)
    return passed(detail, **figures)


async def _send_all(client: EnvironmentClient, prompts: list[str],
                    deadline_s: float) -> list[EnvironmentReply | None]:
    """Every prompt's reply, or None for one still unanswered at the deadline (its call cancelled); the
    client is closed afterwards."""
    tasks = [asyncio.ensure_future(client.reply([], prompt)) for prompt in prompts]
    try:
        done, pending = await asyncio.wait(tasks, timeout=deadline_s, return_when=FIRST_EXCEPTION)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        # task.result() re-raises EnvironmentUnhealthy (the client's failure window), caught by the step
        return [task.result() if task in done else None for task in tasks]
    finally:
        await client.aclose()


def _row_figures(rows: list[dict[str, Any]], source: str, replies: list[EnvironmentReply], errors: list[str],
                 late: int, wall: float) -> dict[str, Any]:
    """The step's figures: rows by task type and dataset, latency percentiles, failures, the replies' flags,
    tokens, wall time and cost."""
    latencies = sorted(r.latency_s for r in replies)
    by_type: dict[str, int] = {}
    for row in rows:
        by_type[row["task_type"]] = by_type.get(row["task_type"], 0) + 1
    return {
        "rows": len(rows),
        "source": source,
        "rows_by_task_type": by_type,
        "datasets": sorted({r["dataset"] for r in rows}),
        "p50_s": _percentile(latencies, 50),
        "p95_s": _percentile(latencies, 95),
        "max_s": round(latencies[-1], 3) if latencies else None,
        "failures": len(errors),
        "unanswered_at_deadline": late,
        "empty_after_length": sum(r.empty_after_length for r in replies),
        "truncated": sum(r.truncated for r in replies),
        "retries": sum(r.retries for r in replies),
        "completion_tokens": sum(r.completion_tokens for r in replies),
        "wall_s": round(wall, 1),
        "cost_usd": round(sum(r.cost_usd for r in replies), 6),
        "first_error": errors[0] if errors else None,
    }


def _rows_detail(figures: dict[str, Any], wall: float, late: int, measured: tuple[float, int, float, int] | None,
                 declared_speed: float) -> str:
    """The step's one-line summary of `figures` and the measured decode speed."""
    return (
        f"{figures['rows']} rows from {figures['source']} ({figures['rows_by_task_type'].get('math', 0)} math, "
        f"{len(figures['datasets'])} datasets) "
        f"in {wall:.1f} s: p50 {_seconds(figures['p50_s'])}, p95 {_seconds(figures['p95_s'])}, "
        f"{figures['failures']} failed{f' ({late} unanswered at the deadline)' if late else ''}, "
        f"{figures['empty_after_length']} empty after length, "
        f"{figures['truncated']} cut at max_tokens; decode "
        + (
            f"{measured[0]:.1f} tokens/s (declared {declared_speed:g})"
            if measured
            else "speed not measured (no reply with tokens at its first try)"
        )
    )
