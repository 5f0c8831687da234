"""The evaluate run as MLflow shows it: one trace per evaluated trajectory, and the predictions table.

- `log_traces`: every answer of every system becomes one trace (`pipeline.tracking.traces.log_trajectory_trace`):
  one span per turn, the prediction and its scores on the root (F1, EM and `answer_format` also as
  assessments, which the Traces tab sorts and filters by), tagged `stage=evaluate`, `system`,
  `dataset`, `split`, `row` and `uid`. Scores are the headline metrics mode's (`evaluate.metrics_mode`),
  only the metrics the dataset reports. The baselines are traced the same way: `env_only`/`gepa` as one
  environment turn, `agent_only` as one agent turn. MLflow writes traces from a bounded queue (1,000 by
  default) and drops what overflows it, so every `FLUSH_EVERY` traces the writer is waited for (the
  paper's evaluation makes 7,680). Writing costs ~0.1 s per trace to a SQLite store on 2 busy cores.
- `evaluation_table`: the predictions frame as the MLflow table of the run (`eval/predictions.json`): one
  row per system and question with inputs, prediction, scores in both modes, turns, stop reason,
  environment usage and the row's `trace_id`. The trajectory itself lives in the trace (and in
  `predictions.parquet`), so the table stays small; its texts pass `clean_text`.
"""

from __future__ import annotations

import json
import math

import pandas as pd

from pipeline import metrics as M
from pipeline.evaluation.scores import Scores
from pipeline.evaluation.systems import Answer
from pipeline.tracking.traces import clean_text, flush_traces, log_trajectory_trace
from pipeline.types import EvalRow

TraceIds = dict[tuple[str, str, int], str]
"""(system, dataset, row index) → trace id."""

ASSESSED = ("f1", "em")
"""The scores each trace carries as MLflow assessments, beside `format` (`answer_format`)."""
FLUSH_EVERY = 200
"""Traces queued before waiting for MLflow's background writer (below its queue size)."""
TABLE_TEXT_CHARS = 2000
"""Longest question or prediction kept in a cell of the MLflow table."""


def log_traces(all_answers: dict[str, dict[str, list[Answer]]], all_scores: dict[str, Scores],
               rows_by_ds: dict[str, list[EvalRow]], mode: str) -> TraceIds:
    """One trace per (system, dataset, row) in the active run, written in the background: the last ones are
    written once the caller calls `flush_traces`."""
    ids: TraceIds = {}
    for system, answers in all_answers.items():
        for name, rows in rows_by_ds.items():
            per_metric = all_scores[system][mode][name]
            for i, (row, ans) in enumerate(zip(rows, answers[name], strict=True)):
                scores = {m: per_metric[m][i] for m in M.reported_metrics(name)
                          if m in per_metric and not math.isnan(per_metric[m][i])}
                trace_id = log_trajectory_trace(
                    name=f"{system} · {name} #{row.index}",
                    tags={"stage": "evaluate", "system": system, "dataset": name, "split": row.split,
                          "row": row.index, "uid": row.id},
                    question=row.question, gold_answers=row.answers, turns=ans.trajectory,
                    prediction=ans.prediction, scores=scores, stop_reason=ans.stop_reason, seconds=ans.seconds,
                    assessments={**{m: scores[m] for m in ASSESSED if m in scores}, "format": answer_format(ans)})
                if trace_id is not None:
                    ids[(system, name, row.index)] = trace_id
                    if len(ids) % FLUSH_EVERY == 0:
                        flush_traces()
    return ids


def answer_format(answer: Answer) -> float:
    """1.0 when the answer ended in a well-formed final turn: an agent's last turn is a complete
    `<think>…</think><answer>…</answer>` (the protocol parser's `complete_final`, in the turn record); a
    baseline without agent turns gave a non-empty answer. 0.0 otherwise."""
    agent_turns = [t for t in answer.trajectory if "complete_final" in t]
    if agent_turns:
        return float(bool(agent_turns[-1]["complete_final"]))
    return float(bool((answer.prediction or "").strip()))


def evaluation_table(predictions: pd.DataFrame, trace_ids: TraceIds) -> pd.DataFrame:
    """The predictions frame without the trajectory, every text cell cleaned (`clean_text`, the project's
    sanitiser), golds as JSON, with each row's trace id."""
    table = predictions.drop(columns=["trajectory"], errors="ignore").copy()
    table = table.map(lambda v: clean_text(v, TABLE_TEXT_CHARS) if isinstance(v, str) else v)  # every text cell
    table["gold"] = table["gold"].map(lambda g: json.dumps([clean_text(x, 500) for x in g], ensure_ascii=False))
    table["trace_id"] = [trace_ids.get((s, d, int(r)), "")
                         for s, d, r in zip(table["system"], table["dataset"], table["row"], strict=True)]
    return table
