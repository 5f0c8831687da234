"""MLflow traces of agent trajectories: one trace per trajectory, one span per turn, the scores on the root.

What a user opens in the Traces tab of the evaluate run (and of the train run, for a sample of each step):
for every trajectory, what the agent wrote to the environment turn by turn, the environment's reply, its
tokens, latency and cost, and the final answer with its scores.

Design decisions:
- **Built after the fact, from the trajectory's record** (the JSON shape of
  `pipeline.agent.rollout.trajectory_record`, or a baseline's one-turn record with `prompt` and
  `environment`), not from spans opened around the live calls: a rollout runs many trajectories at once in
  worker threads and several event loops, where an ambient span context would file a call under the wrong
  trajectory; a trace made once the answer is scored can also carry the scores. The spans get a timeline
  rebuilt from the recorded times, ending now: the root lasts the conversation's own time (its first turn's
  start to its last turn's end; a batched system's wall time `seconds` only when the turns carry no
  timing), each turn starts when it started (`started_s`, when recorded; else right after the previous one).
- **Scores as assessments**: the final answer's scores (`f1`, `em`, `format`) are MLflow feedback of source
  CODE on the trace, so the Traces tab sorts and filters by them; the environment call's tokens carry MLflow's
  token-usage attribute (`TOKEN_USAGE`), so the trace's token usage is what the environment read and wrote.
- **Queueing apart from latency**: a turn that asked the environment has two child spans, `environment
  queue` (waiting for a free connection: `env_wait_s` minus the request's `latency_s`) and `environment`
  (the request itself, `latency_s`), so a slow turn shows whether the environment or the client's
  concurrency limit made it slow. A cached reply takes no time: its `environment` span is empty.
- **Shape.** Root span `<system> · <dataset> #<row>` (type AGENT): inputs = question and gold answers,
  outputs = prediction, stop reason and scores. Child span `turn <i>` per agent turn: CHAT_MODEL when the
  turn asked the environment (inputs = the agent's turn and its interaction prompt, outputs = the reply,
  attributes = agent tokens, environment tokens, latency, cost, cache hit, error), LLM for the final turn
  (outputs = the answer). Trace tags (strings) name system, dataset, row and whatever the caller adds, so
  `mlflow.search_traces(filter_string="tags.system = 'prompt_r1'")` finds them. Under an environment turn:
  the `environment queue` and `environment` spans (above).
- **Cache hits say so**: a trajectory whose every environment reply came from the response cache took
  no environment time (a "0s" row in the Traces tab); its name ends in ` (cached)` and its `env_cached`
  tag is `all` (`some` when part of its replies were cached, `none` otherwise).
- **Every text passes `clean_text`**, the project's one sanitiser for untrusted text
  (`pipeline.environment.sanitize.sanitize_text`: secrets redacted, ANSI sequences removed, other control
  characters escaped as `\\xNN`, newlines and tabs kept) with a span-sized cap of `MAX_TEXT_CHARS`, so an
  environment reply cannot leak a key, bloat the tracking store or garble a terminal that prints it.
- MLflow writes traces asynchronously; `flush_traces()` waits for them (call it before the run closes).
  MLflow's span API never raises (it hands back a no-op span on failure), so tracing cannot stop a stage.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from pipeline.environment.sanitize import sanitize_text

MAX_TEXT_CHARS = 4000
"""Longest text kept in a span; longer texts are cut and marked."""
TOKEN_USAGE = "mlflow.chat.tokenUsage"
"""MLflow's span attribute for a model call's tokens (`SpanAttributeKey.CHAT_USAGE`): MLflow sums it into the
trace's token usage, which the Traces tab shows and sorts by."""
ASSESSMENT_SOURCE = "pipeline.metrics"
"""The source id of the scores logged as assessments (source type CODE: computed, not judged)."""


def clean_text(text: object, limit: int = MAX_TEXT_CHARS) -> str:
    """`text` as a string safe for MLflow (`sanitize_text`), cut to `limit` characters with a marker."""
    return sanitize_text("" if text is None else str(text), limit)


def _turn_seconds(turn: Mapping[str, Any]) -> tuple[float, float]:
    """(the agent's generation, the environment's part: asking to reply, queueing included)."""
    env = turn.get("environment") or {}
    latency = float(env.get("latency_s") or 0.0)
    return float(turn.get("generation_s") or 0.0), max(latency, float(turn.get("env_wait_s") or 0.0))


def _environment_spans(turn_span: Any, env: Mapping[str, Any], start_ns: int, wait_s: float) -> None:
    """The `environment queue` and `environment` spans of one turn, from `start_ns` (the generation's end)."""
    import mlflow
    from mlflow.entities import SpanType

    latency_s = float(env.get("latency_s") or 0.0)
    queue_ns = int(max(0.0, wait_s - latency_s) * 1e9)
    queue = mlflow.start_span_no_context("environment queue", span_type=SpanType.UNKNOWN, parent_span=turn_span,
                                         attributes={"queue_s": round(queue_ns / 1e9, 4)}, start_time_ns=start_ns)
    queue.end(end_time_ns=start_ns + queue_ns)
    prompt_tokens, completion_tokens = int(env.get("prompt_tokens") or 0), int(env.get("completion_tokens") or 0)
    call = mlflow.start_span_no_context(
        "environment", span_type=SpanType.CHAT_MODEL, parent_span=turn_span, start_time_ns=start_ns + queue_ns,
        attributes={"latency_s": round(latency_s, 4), "cached": bool(env.get("cached")),
                    "retries": int(env.get("retries") or 0),
                    TOKEN_USAGE: {"input_tokens": prompt_tokens, "output_tokens": completion_tokens,
                                  "total_tokens": prompt_tokens + completion_tokens}})
    call.end(status="ERROR" if env.get("error") else "OK", end_time_ns=start_ns + queue_ns + int(latency_s * 1e9))


def _offset_ns(turn: Mapping[str, Any]) -> int:
    """When the turn started, in ns since the trajectory's start (0 when not recorded)."""
    return int(float(turn.get("started_s") or 0.0) * 1e9)


def _turn_span(parent: Any, index: int, turn: Mapping[str, Any], start_ns: int) -> int:
    """One turn's span under `parent`, from `start_ns`; returns its end time."""
    import mlflow
    from mlflow.entities import SpanType

    env = turn.get("environment")
    prompt = turn.get("interaction_prompt") or turn.get("prompt")
    inputs: dict[str, Any] = {}
    if turn.get("text") is not None:
        inputs["agent_turn"] = clean_text(turn["text"])
    if prompt:
        inputs["interaction_prompt"] = clean_text(prompt)
    attributes: dict[str, Any] = {"agent_tokens": int(turn.get("agent_tokens") or 0)}
    if turn.get("issues"):
        attributes["format_issues"] = [clean_text(i, 200) for i in turn["issues"]]
    if env:
        attributes.update({
            "env.prompt_tokens": int(env.get("prompt_tokens") or 0),
            "env.completion_tokens": int(env.get("completion_tokens") or 0),
            "env.latency_s": round(float(env.get("latency_s") or 0.0), 4),
            "env.queue_s": round(max(0.0, _turn_seconds(turn)[1] - float(env.get("latency_s") or 0.0)), 4),
            "env.cost_usd": float(env.get("cost_usd") or 0.0),
            "env.cached": bool(env.get("cached")),
            "env.retries": int(env.get("retries") or 0),
        })
        if env.get("error"):
            attributes["env.error"] = clean_text(env["error"], 500)
        outputs: dict[str, Any] = {"environment_reply": clean_text(env.get("text"))}
    else:
        outputs = {"answer": clean_text(turn.get("answer"))} if turn.get("answer") is not None else {}
    span = mlflow.start_span_no_context(
        f"turn {index}", span_type=SpanType.CHAT_MODEL if env else SpanType.LLM, parent_span=parent,
        inputs=inputs, attributes=attributes, start_time_ns=start_ns)
    generation_s, env_s = _turn_seconds(turn)
    if env:
        _environment_spans(span, env, start_ns + int(generation_s * 1e9), env_s)
    end_ns = start_ns + int((generation_s + env_s) * 1e9)
    span.end(outputs=outputs, status="ERROR" if env and env.get("error") else "OK", end_time_ns=end_ns)
    return end_ns


def cache_status(turns: Sequence[Mapping[str, Any]]) -> str:
    """`all` when every environment reply of the trajectory came from the cache, `some`, or `none` (also when
    it asked the environment nothing)."""
    replies = [turn["environment"] for turn in turns if turn.get("environment")]
    hits = sum(1 for reply in replies if reply.get("cached"))
    return "all" if replies and hits == len(replies) else "some" if hits else "none"


def log_trajectory_trace(*, name: str, tags: Mapping[str, object], question: str, gold_answers: Sequence[str],
                         turns: Sequence[Mapping[str, Any]], prediction: str, scores: Mapping[str, float],
                         stop_reason: str = "", seconds: float = 0.0,
                         assessments: Mapping[str, float] | None = None) -> str | None:
    """Log one trajectory as one MLflow trace (in the active run's experiment, linked to the active run).

    `turns` are the trajectory's turn records; `scores` the final answer's scores; `assessments` the scores the
    Traces tab sorts and filters by, logged as feedback of source CODE. The root lasts the conversation's own
    time, from its first turn's start to its last turn's end; `seconds` (its wall time, which for a batched
    system can be the batch's) is used only when the turns carry no timing. Returns the trace id, or None when
    MLflow handed back a no-op span (tracing disabled or failed).
    """
    import mlflow
    from mlflow.entities import SpanType
    from mlflow.entities.span import NO_OP_SPAN_TRACE_ID

    cached = cache_status(turns)
    if cached == "all":
        name = f"{name} (cached)"
    first_ns = min((_offset_ns(turn) for turn in turns), default=0)
    turn_end_ns = first_ns
    for turn in turns:  # each turn's offset from the start: recorded, or right after the previous turn
        turn_end_ns = max(turn_end_ns, _offset_ns(turn)) + int(sum(_turn_seconds(turn)) * 1e9)
    own_ns = turn_end_ns - first_ns
    end_ns = time.time_ns()
    start_ns = end_ns - (own_ns if own_ns > 0 else int(seconds * 1e9))
    root = mlflow.start_span_no_context(
        name, span_type=SpanType.AGENT, start_time_ns=start_ns,
        inputs={"question": clean_text(question), "gold_answers": [clean_text(g, 500) for g in gold_answers]},
        tags={**{key: clean_text(value, 250) for key, value in tags.items()}, "env_cached": cached},
        attributes={"turns": len(turns), "stop_reason": stop_reason})
    if root.trace_id == NO_OP_SPAN_TRACE_ID:
        return None
    at = start_ns
    for index, turn in enumerate(turns, start=1):
        at = _turn_span(root, index, turn, max(at, start_ns + _offset_ns(turn) - first_ns))
    _attach_assessments(root.trace_id, assessments or {})
    root.end(outputs={"prediction": clean_text(prediction), "stop_reason": stop_reason,
                      "scores": {k: round(float(v), 4) for k, v in scores.items()}},
             end_time_ns=max(end_ns, at))
    return root.trace_id


def _attach_assessments(trace_id: str, assessments: Mapping[str, float]) -> None:
    """Put the scores on the still-open trace as feedback (source CODE), so they are written with it: one
    write per trace, where `mlflow.log_feedback` on a finished trace is one store write per score."""
    from mlflow.entities import AssessmentSource, AssessmentSourceType, Feedback
    from mlflow.tracing.trace_manager import InMemoryTraceManager

    if not assessments:
        return
    source = AssessmentSource(source_type=AssessmentSourceType.CODE, source_id=ASSESSMENT_SOURCE)
    with InMemoryTraceManager.get_instance().get_trace(trace_id) as trace:
        if trace is None:
            return
        for key, value in assessments.items():
            trace.info.assessments.append(Feedback(name=key, value=float(value), source=source, trace_id=trace_id))


def flush_traces() -> None:
    """Wait until every trace logged so far is written to the tracking store."""
    import mlflow

    mlflow.flush_trace_async_logging()
