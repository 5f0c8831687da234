"""The paper's table beside ours: `paper_results.yaml` (data) against this run's metrics.json content.

Design decisions:
- **The published numbers are data** (`paper_results.yaml` beside this module, package data), not code:
  per-dataset EM/F1/SSim and the ID/OOD averages of Prompt-R1, and the averages of the environment alone.
- **Comparable or not, said per run.** A difference is shown only when the run is the paper's setup:
  agent Qwen3-4B, environment GPT-4o-mini, the full 128 rows per set. Otherwise every row still shows the
  paper's number and ours, and the difference column says why not (what differs: agent, environment,
  rows; the full reasons head the table).
- **Our numbers in the paper's metrics mode.** The authors scored with their own script, which our
  `reference` mode reproduces (empty predictions and the reversed substring match included), so the
  comparison reads that mode whichever mode the run reports as its headline.
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


def _ours_in_paper_mode(summary: dict[str, Any], mode: str) -> dict[str, Any]:
    return summary if summary["mode"] == mode else summary[mode]


def paper_comparison(summary: dict[str, Any], agent_model: str, env: EnvironmentConfig,
                     paper: dict[str, Any] | None = None) -> dict[str, Any]:
    """Rows (system, scope, metric, paper, ours, delta) and whether the run (agent `agent_model`, environment
    `env`) is comparable, with the reasons."""
    paper = load_paper_results() if paper is None else paper
    reasons = not_comparable_reasons(agent_model, env, summary["rows_per_dataset"], paper)
    ours = _ours_in_paper_mode(summary, paper["metrics_mode"])
    rows = []
    for system, published in paper["systems"].items():
        if system not in summary["systems"]:
            continue
        scoped = [(split, (ours["averages"][system].get(split) or {}), vals)
                  for split, vals in published.get("averages", {}).items()]
        scoped += [(d, ours["per_dataset"].get(d, {}).get(system, {}), vals)
                   for d, vals in published.get("per_dataset", {}).items()]
        for scope, our_entry, vals in scoped:
            for metric, value in vals.items():
                mine = our_entry.get(metric, {}).get("mean")
                delta = None if (reasons or mine is None) else round(mine - value, 2)
                rows.append({"system": system, "scope": scope, "metric": metric, "paper": value, "ours": mine,
                             "delta": delta})
    return {"source": paper["source"], "comparable": not reasons, "reasons": list(reasons.values()),
            "differs": list(reasons),
            "metrics_mode": paper["metrics_mode"], "rows": rows}


def paper_markdown(comparison: dict[str, Any]) -> list[str]:
    """summary.md's section: the paper's numbers, ours (same metrics mode), and the difference or why not."""
    why = "; ".join(comparison["reasons"])
    lines = ["## The paper's numbers beside ours", "",
             f"{comparison['source']}. Ours in `{comparison['metrics_mode']}` mode (the authors' scoring). "
             + ("Comparable run: the last column is ours minus the paper's." if comparison["comparable"]
                else f"Not comparable ({why}): no difference is given."),
             "", "| system | dataset / split | metric | paper | ours | ours − paper |", "|---|---|---|---|---|---|"]
    for r in comparison["rows"]:
        ours = "–" if r["ours"] is None else f"{r['ours']:.2f}"
        if r["delta"] is not None:
            delta = f"{r['delta']:+.2f}"
        else:
            delta = "no score of ours" if r["ours"] is None else f"not comparable ({', '.join(comparison['differs'])})"
        lines.append(f"| {r['system']} | {r['scope']} | {metric_label(r['metric'])} | {r['paper']:.2f} | {ours} | {delta} |")
    return lines
