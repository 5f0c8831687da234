"""What summary.md says first: the verdict of this run, and each metric's definition, once.

Design decisions:
- **A verdict, not a table, opens the report, in at most three sentences**: which system has the best
  average F1 (the one metric every dataset reports), ID and OOD, with prompt_r1's paired difference to it,
  its bootstrap CI and whether the CI excludes zero (one sentence per split), then why the paper's ordering
  need not hold when the setup is not the paper's (one sentence).
- **Then why answers failed**: a table of stop reasons per system (`answer`, `max_turns`, `no_action`, …)
  and empty answers, so a column of zeros reads as "never answered", not as "answered wrong".
- **Why, when the setup is not the paper's**: the reasons come from the paper comparison (`paper`: agent,
  environment, rows differ) and each gets its consequence in words; the environment's and agent's size is
  read from their names (`135m` → 135M parameters) when the name says it.
- **GEPA that kept the seed** (no proposal beat the seed instruction on its val slice) makes `gepa` the
  `env_only` prompt under another name: the verdict says so, and the tables label its rows.
- **One spelling per metric** (`METRIC_LABELS`: SSim, never SSIM), used by every table and plot.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from pipeline.types import TRAINED

if TYPE_CHECKING:
    from pipeline.evaluation.plan import EvaluatePlan

VERDICT_METRIC = "f1"
METRIC_LABELS = {"em": "EM", "sm": "SM", "f1": "F1", "ssim": "SSim"}
METRIC_DEFINITIONS = (
    ("EM", "exact match: the prediction equals a gold answer after SQuAD normalisation (lower case, no punctuation "
           + "or articles)"),
    ("SM", "substring match: a normalised gold answer appears in the normalised prediction (the authors' "
           + "`reference` mode also counts the prediction inside the gold)"),
    ("F1", "token F1 between the normalised prediction and a gold answer"),
    ("SSim", "semantic similarity: cosine of the all-MiniLM-L6-v2 embeddings of prediction and gold, floored at 0"),
)
KEPT_SEED_LABEL = "gepa (kept the seed)"


def metric_label(metric: str) -> str:
    """EM, SM, F1, SSim: the one spelling of each metric."""
    return METRIC_LABELS.get(metric, metric.upper())


def gepa_kept_seed(record: dict[str, Any] | None) -> bool:
    """True when the gepa stage's record (data/gepa/prompt.json) kept the seed instruction (candidate 0)."""
    if not record:
        return False
    optimised, seed = record.get("optimised") or {}, record.get("seed") or {}
    return optimised.get("candidate") == 0 or optimised.get("instruction") == seed.get("instruction")


def system_label(system: str, kept_seed: bool) -> str:
    """A table's system cell: `gepa` says when its instruction is the seed's."""
    return KEPT_SEED_LABEL if system == "gepa" and kept_seed else system


def _size(name: str) -> str | None:
    """`smollm2-135m-instruct` → `135M`, `Qwen3-4B` → `4B`; None when the name gives no size."""
    match = re.search(r"(?<![a-z0-9.])(\d+(?:\.\d+)?)([mb])(?![a-z])", name.lower())
    return f"{match.group(1)}{match.group(2).upper()}" if match else None


def _ci(entry: dict[str, float]) -> str:
    return f"{entry['mean']:.2f} [{entry['low']:.2f}, {entry['high']:.2f}]"


def _split_verdict(summary: dict[str, Any], split: str) -> str | None:
    """One sentence: the best system on `split` by F1 and prompt_r1's paired difference to it."""
    scored = {s: summary["averages"][s].get(split, {}).get(VERDICT_METRIC) for s in summary["systems"]}
    scored = {s: e for s, e in scored.items() if e}
    if not scored:
        return None
    best = max(scored, key=lambda s: (scored[s]["mean"], s == TRAINED))
    label = split.upper()
    if TRAINED not in scored:
        return f"{label}: `{best}` has the best F1, {_ci(scored[best])}."
    if best == TRAINED:
        others = [s for s in scored if s != TRAINED]
        if not others:
            return f"{label}: `{TRAINED}` F1 {_ci(scored[TRAINED])} (no baseline to compare)."
        runner = max(others, key=lambda s: scored[s]["mean"])
        subject = (f"{label}: `{TRAINED}` wins with F1 {_ci(scored[TRAINED])}, ahead of `{runner}` "
                   f"({_ci(scored[runner])})")
        return subject + _delta_clause(summary, runner, split)
    subject = f"{label}: `{best}` wins with F1 {_ci(scored[best])}; `{TRAINED}` has {_ci(scored[TRAINED])}"
    return subject + _delta_clause(summary, best, split)


def _delta_clause(summary: dict[str, Any], other: str, split: str) -> str:
    delta = summary.get("deltas", {}).get(f"vs_{other}", {}).get(split, {}).get(VERDICT_METRIC)
    if delta is None:
        return "."
    clear = delta["low"] > 0 or delta["high"] < 0
    how = ("the CI excludes 0: a real difference on these rows" if clear
           else "the CI includes 0: within noise at this many rows")
    return (f": Δ {delta['delta']:+.2f} [{delta['low']:+.2f}, {delta['high']:+.2f}] points (`{TRAINED}` − "
            f"`{other}`, paired bootstrap); {how}.")


def _why_not_paper(summary: dict[str, Any], plan: EvaluatePlan) -> str | None:
    """Why this run's numbers are not the paper's: each differing part of the setup and what it does."""
    paper = summary.get("paper")
    if not paper or paper.get("comparable"):
        return None
    differs = set(paper.get("differs", []))
    parts = []
    if "environment" in differs:
        env = plan.environment
        size = _size(env.served_name) or _size(str(env.model))
        what = f"a {size}-parameter environment" if size else f"the environment `{env.served_name}`"
        parts.append(f"{what} instead of GPT-4o-mini, whose replies rarely state the answer, so relaying them "
                     "cannot beat asking it directly (`env_only`)")
    if "agent" in differs:
        size = _size(str(plan.agent.model))
        what = f"a {size}-parameter agent" if size else "a smaller agent"
        trained = plan.trained
        parts.append(f"{what} instead of Qwen3-4B, trained {trained.steps} GRPO steps of "
                     f"{trained.batch_size} questions × {trained.group_size} trajectories, far too "
                     "little to learn what to ask")
    if "rows" in differs:
        parts.append(f"{summary['rows_per_dataset']} rows per set instead of 128, so the CIs are wide")
    if not parts:
        return None
    return ("Not the paper's setup, so its ordering need not hold: " + "; ".join(parts)
            + " (the paper profile runs its setup: docs/gpu.md).")


STOP_REASON_MEANINGS = {
    "answer": "an answer given (the agent closed <answer> tags; a baseline got its reply)",
    "max_turns": "the turn limit, no answer",
    "no_action": "a turn with neither an answer nor a request",
    "token_budget": "the response token budget spent",
    "prompt_too_long": "the prompt alone over the limit",
    "no_answer": "a reply with no <answer> tags",
    "error": "the environment failed",
}


def stop_reasons_markdown(summary: dict[str, Any], kept_seed: bool = False) -> list[str]:
    """A table: per system, how many answers ended for each stop reason, and how many were empty."""
    outcomes = summary.get("outcomes")
    if not outcomes:
        return []
    totals: dict[str, int] = {}
    for entry in outcomes.values():
        for reason, n in entry["stop_reasons"].items():
            totals[reason] = totals.get(reason, 0) + n
    reasons = sorted(totals, key=lambda r: (-totals[r], r))
    lines = ["## How the answers ended", "",
             "Rows per system by stop reason (" + "; ".join(f"`{r}`: {STOP_REASON_MEANINGS[r]}" for r in reasons
                                                         if r in STOP_REASON_MEANINGS)
             + "), and the answers with no text.", "",
             "| system | rows | " + " | ".join(reasons) + " | empty answers |",
             "|---|---|" + "---|" * len(reasons) + "---|"]
    for system, entry in outcomes.items():
        counts = [str(entry["stop_reasons"].get(r, 0)) for r in reasons]
        lines.append(f"| {system_label(system, kept_seed)} | {entry['rows']} | " + " | ".join(counts)
                     + f" | {entry['empty']} |")
    return lines


def verdict_markdown(summary: dict[str, Any], plan: EvaluatePlan,
                     gepa_record: dict[str, Any] | None = None) -> list[str]:
    """summary.md's opening: the verdict (at most three sentences), how the answers ended, then the metric
    definitions."""
    sentences = [s for s in (_split_verdict(summary, split) for split in ("id", "ood")) if s]
    why = _why_not_paper(summary, plan)
    if why:
        sentences.append(why)
    kept = "gepa" in summary["systems"] and gepa_kept_seed(gepa_record)
    lines = ["## Verdict", "", " ".join(sentences), ""]
    table = stop_reasons_markdown(summary, kept)
    if table:
        lines += [*table, ""]
    if kept:
        lines += [("GEPA kept the seed instruction (no proposal beat it on its val slice), so `gepa` asked the "
                  "environment exactly as `env_only` did: its rows equal `env_only`'s."), ""]
    lines += ["## Metrics", ""]
    lines += [f"- **{name}**: {text}." for name, text in METRIC_DEFINITIONS]
    lines += ["", ("Each is the max over a row's gold answers, in points (0–100). A dataset reports the metrics the "
               "paper gives it (EM and F1 for QA and math, F1 and SSim for generation) and SM; an ID or OOD "
               "average is the mean over the datasets that report the metric. Brackets hold "
               f"{int(summary['confidence'] * 100)}% bootstrap CIs; a difference (Δ) is `prompt_r1` minus "
               "the other system on the same rows, with a paired bootstrap CI.")]
    return lines
