"""The paper's table beside ours: `paper_results.yaml` (data) against this run's metrics.json content.

Design decisions:
- **The published numbers are data** (`paper_results.yaml` beside this module, package data), not code:
  per-dataset EM/F1/SSim and the ID/OOD averages of Prompt-R1, and the averages of the environment alone.
- **Comparable or not, said per run.** A difference is shown only when the run is the paper's setup:
  agent Qwen3-4B, environment GPT-4o-mini, the full 128 rows per set. Otherwise every row still shows the
  paper's number and ours, and the difference column says why not (what differs: agent, environment,
  rows; the full reasons head the table).
- **Our numbers in the paper's metrics mode, and beside them what that mode hides.** The authors scored with
  their own script, which our `reference` mode reproduces (empty predictions and the reversed substring
  match included), so the comparison column reads that mode whichever mode the run reports as its headline:
  like with like. That script scores an empty prediction SSim 100 (and SM 100), so a system that often
  answers nothing looks good on SSim; each row therefore also shows how many of the rows behind it had an
  empty answer (the evaluate stage's `outcomes`) and our own scoring (`ours` mode, where an empty answer
  scores 0), and one line above the table says which column is which.
"""

from __future__ import annotations

from importlib import resources
from typing import TYPE_CHECKING, Any

import yaml

from pipeline.evaluation.verdict import metric_label

if TYPE_CHECKING:
    from pipeline.config import EnvironmentConfig

PAPER_FILE = "paper_results.yaml"


def load_paper_results() -> dict[str, Any]:
    """The published numbers (see `paper_results.yaml`)."""
    text = resources.files("pipeline.evaluation").joinpath(PAPER_FILE).read_text(encoding="utf-8")
    return yaml.safe_load(text)


def _model_name(ref: str) -> str:
    """`Qwen/Qwen3-4B`, `/models/Qwen3-4B/`, `pkg://x/Qwen3-4B.gguf` → `qwen3-4b`."""
    return ref.rstrip("/").rsplit("/", 1)[-1].removesuffix(".gguf").lower()


def not_comparable_reasons(agent_model: str, env: EnvironmentConfig, rows_per_dataset: int,
                           paper: dict[str, Any]) -> dict[str, str]:
    """Why this run (agent `agent_model`, environment `env`) cannot be compared number for number with the
    paper, by what differs (empty: it can)."""
    reasons = {}
    if _model_name(agent_model) != paper["agent"].lower():
        reasons["agent"] = f"agent is {_model_name(agent_model)}, not {paper['agent']}"
    env_names = {_model_name(env.model), _model_name(env.served_name)}
    if paper["environment"].lower() not in env_names:
        reasons["environment"] = f"environment is {env.served_name}, not {paper['environment']}"
    if rows_per_dataset < paper["rows_per_dataset"]:
        reasons["rows"] = f"{rows_per_dataset} rows per set, not {paper['rows_per_dataset']}"
    return reasons


OWN_MODE = "ours"
"""This project's scoring (an empty answer scores 0), shown beside the paper's."""


def _in_mode(summary: dict[str, Any], mode: str) -> dict[str, Any]:
    return summary if summary["mode"] == mode else summary[mode]


def _empty_answers(summary: dict[str, Any], system: str, datasets: list[str]) -> tuple[int, int] | None:
    """(empty answers, rows) of `system` over `datasets`, or None when the run did not count them."""
    counts = summary.get("outcomes", {}).get(system, {}).get("per_dataset")
    if counts is None:
        return None
    scored = [counts[d] for d in datasets if d in counts]
    return sum(c["empty"] for c in scored), sum(c["rows"] for c in scored)


def paper_comparison(summary: dict[str, Any], agent_model: str, env: EnvironmentConfig,
                     paper: dict[str, Any] | None = None) -> dict[str, Any]:
    """Rows (system, scope, metric, paper, ours, delta) and whether the run (agent `agent_model`, environment
    `env`) is comparable, with the reasons."""
    paper = load_paper_results() if paper is None else paper
    reasons = not_comparable_reasons(agent_model, env, summary["rows_per_dataset"], paper)
    ours, own = _in_mode(summary, paper["metrics_mode"]), _in_mode(summary, OWN_MODE)
    split_datasets = summary.get("datasets", {})
    rows = []
    for system, published in paper["systems"].items():
        if system not in summary["systems"]:
            continue
        scoped = [(split, vals, [split], list(split_datasets.get(split, [])))
                  for split, vals in published.get("averages", {}).items()]
        scoped += [(d, vals, [], [d]) for d, vals in published.get("per_dataset", {}).items()]
        for scope, vals, split, datasets in scoped:
            for metric, value in vals.items():
                mine = _mean(ours, system, scope, metric, bool(split))
                delta = None if (reasons or mine is None) else round(mine - value, 2)
                reporting = [d for d in datasets if metric in summary["per_dataset"].get(d, {}).get(system, {})]
                empty = _empty_answers(summary, system, reporting)
                rows.append({"system": system, "scope": scope, "metric": metric, "paper": value, "ours": mine,
                             "ours_own": _mean(own, system, scope, metric, bool(split)),
                             "empty": None if empty is None else empty[0],
                             "rows": None if empty is None else empty[1], "delta": delta})
    return {"source": paper["source"], "comparable": not reasons, "reasons": list(reasons.values()),
            "differs": list(reasons), "metrics_mode": paper["metrics_mode"], "own_mode": OWN_MODE, "rows": rows}


def _mean(tables: dict[str, Any], system: str, scope: str, metric: str, is_split: bool) -> float | None:
    entry = (tables["averages"].get(system, {}).get(scope) if is_split
             else tables["per_dataset"].get(scope, {}).get(system)) or {}
    return entry.get(metric, {}).get("mean")


def paper_markdown(comparison: dict[str, Any]) -> list[str]:
    """summary.md's section: the paper's numbers, ours in the paper's scoring, the empty answers and ours in our
    own scoring, and the difference or why not."""
    why = "; ".join(comparison["reasons"])
    own = comparison.get("own_mode", OWN_MODE)
    lines = ["## The paper's numbers beside ours", "",
             f"{comparison['source']}. "
             + ("Comparable run: the last column is ours (authors' scoring) minus the paper's." if comparison["comparable"]
                else f"Not comparable ({why}; differs: {', '.join(comparison['differs'])}): no difference is "
                     "given (–)."),
             "",
             (f"Which is which: **ours (authors' scoring)** is `{comparison['metrics_mode']}` mode, the authors' "
              "script the paper's figures were computed with (like with like; it scores an empty answer SSim 100 "
              f"and SM 100); **empty** counts the answers with no text among the rows behind the cell; **ours (our "
              f"scoring)** is `{own}` mode, where an empty answer scores 0."),
             "", ("| system | dataset / split | metric | paper | ours (authors' scoring) | empty | ours (our scoring) "
             "| ours − paper |"), "|---|---|---|---|---|---|---|---|"]
    for r in comparison["rows"]:
        ours = "–" if r["ours"] is None else f"{r['ours']:.2f}"
        own_cell = "–" if r.get("ours_own") is None else f"{r['ours_own']:.2f}"
        empty = "–" if r.get("empty") is None else f"{r['empty']}/{r['rows']}"
        if r["delta"] is not None:
            delta = f"{r['delta']:+.2f}"
        else:
            delta = "no score of ours" if r["ours"] is None else "–"  # the table's header sentence says why
        lines.append(f"| {r['system']} | {r['scope']} | {metric_label(r['metric'])} | {r['paper']:.2f} | {ours} | "
                     f"{empty} | {own_cell} | {delta} |")
    return lines
