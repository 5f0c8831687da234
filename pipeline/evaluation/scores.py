"""Scoring and aggregation: every answer scored in both metrics modes, then the content of metrics.json.

Design decisions:
- **Both modes, always.** Every row is scored in `ours` and `reference` mode (`pipeline.metrics`);
  `evaluate.metrics_mode` picks the headline mode, and the other is reported beside it, under its name.
- **What a dataset reports.** The metrics method.md assigns it, plus SM (`metrics.reported_metrics`).
- **Averages.** ID/OOD averages use only the datasets a metric is assigned to (this reproduces the
  paper's averages), each with a stratified bootstrap CI (`metrics.bootstrap_ci_average`).
- **Deltas.** `prompt_r1` minus each other system, a paired bootstrap over the same rows.
- **Bootstrap.** `evaluate.bootstrap_samples` resamples at `evaluate.confidence`, seeded by the project's
  `seed`, so a rerun on the same answers gives the same CIs.
- Scores are reported in points (×100, two decimals).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pipeline import metrics as M
from pipeline.evaluation.systems import Answer
from pipeline.types import TRAINED, EvalRow, UsageStats

if TYPE_CHECKING:
    from pipeline.config import EvaluateConfig

SPLITS = ("id", "ood")
AVERAGED_METRICS = (*M.HEADLINE_METRICS, "sm")
"""Metrics averaged per split (and compared in the deltas)."""

Scores = dict[str, dict[str, dict[str, list[float]]]]
"""mode → dataset → metric → per-row scores (0..1), for one system."""


def other_mode(mode: str) -> str:
    """The metrics mode reported beside the headline `mode`."""
    return "reference" if mode == "ours" else "ours"


def score_system(answers: dict[str, list[Answer]], rows_by_ds: dict[str, list[EvalRow]],
                 ssim: M.SemanticSimilarity | None) -> Scores:
    """Every metric, both modes, for every row of every dataset."""
    out: Scores = {mode: {} for mode in M.MODES}
    for name, rows in rows_by_ds.items():
        preds = [a.prediction for a in answers[name]]
        golds = [r.answers for r in rows]
        for mode in M.MODES:
            out[mode][name] = M.score_rows(preds, golds, mode, ssim)
    return out


def _pts(x: float) -> float:
    return round(100.0 * x, 2)


def _ci_dict(mean: float, low: float, high: float) -> dict[str, float]:
    return {"mean": _pts(mean), "low": _pts(low), "high": _pts(high)}


def _split_groups(scores: dict[str, dict[str, list[float]]], datasets: Sequence[str],
                  metric: str) -> list[list[float]]:
    return [scores[d][metric] for d in datasets if metric in M.reported_metrics(d) and metric in scores[d]]


def aggregate(all_scores: dict[str, Scores], rows_by_ds: dict[str, list[EvalRow]],
              ev: EvaluateConfig, seed: int) -> dict[str, Any]:
    """metrics.json content: per dataset × system × metric, ID/OOD averages with CIs, deltas, both modes
    (bootstrap seeded by the run's `seed`)."""
    boot = {"samples": ev.bootstrap_samples, "confidence": ev.confidence, "seed": seed}
    split_ds = {s: [d for d in rows_by_ds if rows_by_ds[d][0].split == s] for s in SPLITS}
    systems = list(all_scores)

    def tables(mode: str) -> dict[str, Any]:
        per_dataset: dict[str, Any] = {}
        for d in rows_by_ds:
            per_dataset[d] = {}
            for system in systems:
                entry: dict[str, Any] = {}
                for metric in M.reported_metrics(d):
                    vals = all_scores[system][mode][d][metric]
                    entry[metric] = _ci_dict(*M.bootstrap_ci(vals, **boot))
                per_dataset[d][system] = entry
        averages: dict[str, Any] = {}
        for system in systems:
            averages[system] = {}
            for split in SPLITS:
                averages[system][split] = {}
                for metric in AVERAGED_METRICS:
                    groups = _split_groups(all_scores[system][mode], split_ds[split], metric)
                    if groups:
                        averages[system][split][metric] = _ci_dict(*M.bootstrap_ci_average(groups, **boot))
        deltas: dict[str, Any] = {}
        if TRAINED in systems:
            for base in systems:
                if base == TRAINED:
                    continue
                deltas[f"vs_{base}"] = {}
                for split in SPLITS:
                    deltas[f"vs_{base}"][split] = {}
                    for metric in AVERAGED_METRICS:
                        a = _split_groups(all_scores[TRAINED][mode], split_ds[split], metric)
                        b = _split_groups(all_scores[base][mode], split_ds[split], metric)
                        if a:
                            d, lo, hi = M.paired_bootstrap_delta(a, b, **boot)
                            deltas[f"vs_{base}"][split][metric] = {"delta": _pts(d), "low": _pts(lo),
                                                                   "high": _pts(hi)}
        return {"per_dataset": per_dataset, "averages": averages, "deltas": deltas}

    return {
        "mode": ev.metrics_mode,
        "rows_per_dataset": ev.rows_per_dataset,
        "systems": systems,
        "datasets": {s: split_ds[s] for s in SPLITS},
        "confidence": ev.confidence,
        **tables(ev.metrics_mode),
        other_mode(ev.metrics_mode): tables(other_mode(ev.metrics_mode)),
    }


def usage_by_system(all_answers: dict[str, dict[str, list[Answer]]]) -> dict[str, dict[str, float]]:
    """Environment usage totals per system (calls, cache hits, tokens, errors, cost), floats rounded."""
    out = {}
    for system, answers in all_answers.items():
        total = UsageStats()
        for rows in answers.values():
            for a in rows:
                total.merge(a.usage)
        out[system] = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in total.as_dict().items()}
    return out


def answer_outcomes(all_answers: dict[str, dict[str, list[Answer]]]) -> dict[str, dict[str, Any]]:
    """How each system's answers ended: rows and empty answers (no text after `str.strip()`), in all and per
    dataset, and stop reasons (`max_turns`, `no_action`, `answer`, …) over all rows, most frequent first."""
    out: dict[str, dict[str, Any]] = {}
    for system, answers in all_answers.items():
        reasons: dict[str, int] = {}
        for rows in answers.values():
            for a in rows:
                reasons[a.stop_reason or "unknown"] = reasons.get(a.stop_reason or "unknown", 0) + 1
        per_dataset = {d: {"rows": len(rows), "empty": sum(1 for a in rows if not a.prediction.strip())}
                       for d, rows in answers.items()}
        out[system] = {
            "rows": sum(e["rows"] for e in per_dataset.values()),
            "empty": sum(e["empty"] for e in per_dataset.values()),
            "stop_reasons": dict(sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0]))),
            "per_dataset": per_dataset,
        }
    return out
