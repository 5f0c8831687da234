"""summary.md: the evaluation's human-readable report, written from metrics.json's content.

The verdict and the metrics' definitions first (`verdict`), then the headline (what `dvc metrics show`
prints, in words), the setup, the averages, deltas, the plug-and-play matrix (when `evaluate.environments`
lists extra environments), per-dataset means, cost beside quality (per question and one-off), environment
usage, the paper's numbers beside ours (`paper`), and links to the MLflow runs, in tables. Each section is
one function returning its lines; `summary_markdown` puts them in order.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline import metrics as M
from pipeline.evaluation.matrix import matrix_markdown
from pipeline.evaluation.paper import paper_markdown
from pipeline.evaluation.plots import PLOT_METRIC
from pipeline.evaluation.scores import SPLITS, other_mode
from pipeline.evaluation.systems import SYSTEM_LABELS
from pipeline.evaluation.verdict import gepa_kept_seed, metric_label, system_label, verdict_markdown
from pipeline.tracking.headline import SPLIT_NAMES, best_other, headline

if TYPE_CHECKING:
    from pipeline.evaluation.plan import EvaluatePlan

SUMMARY_METRICS = ("em", "f1", "ssim", "sm")
"""The columns of summary.md's averages and deltas tables."""
HEADLINE_WHAT = {"f1_id": "prompt_r1's F1, in-distribution sets", "f1_ood": "prompt_r1's F1, out-of-distribution sets",
                 "env_tokens": "prompt_r1's environment tokens per question"}
QUALITY_COST_PNG = "plots/quality_vs_cost.png"
"""The picture summary.md embeds, relative to reports/eval/ (a Markdown viewer shows it beside the file)."""
DEFAULT_UI = "http://127.0.0.1:5000"
"""Where `mlflow ui` serves a local store."""


def summary_markdown(summary: dict[str, Any], plan: EvaluatePlan) -> str:
    """A short human-readable report of metrics.json: the verdict first (`verdict`), then the tables."""
    record = gepa_record(summary, plan.gepa_prompt)
    kept = gepa_kept_seed(record)
    lines = ["# Evaluation summary", "", *verdict_markdown(summary, plan, record), "", *headline_markdown(summary),
             "", *setup_markdown(summary, plan.evaluate.env_only_instruction), "", *averages_markdown(summary, kept)]
    if summary["deltas"]:
        lines += ["", *deltas_markdown(summary, kept)]
    if "matrix" in summary:
        lines += ["", *matrix_markdown(summary)]
    lines += ["", *per_dataset_markdown(summary)]
    if "cost" in summary:
        lines += ["", *cost_markdown(summary, kept)]
    lines += ["", *usage_markdown(summary, kept)]
    if "paper" in summary:
        lines += ["", *paper_markdown(summary["paper"])]
    links = mlflow_links_markdown()
    if links:
        lines += ["", *links]
    return "\n".join(lines) + "\n"


def setup_markdown(summary: dict[str, Any], env_only_instruction: str) -> list[str]:
    """summary.md's setup: rows per dataset, the metrics mode, the systems and the env_only prompt."""
    mode = summary["mode"]
    return [
        "## Setup",
        "",
        (f"{summary['rows_per_dataset']} rows per dataset; metrics mode `{mode}` "
        f"(the `{other_mode(mode)}` numbers are in metrics.json)."),
        "",
        "Systems: " + "; ".join(f"`{s}` = {SYSTEM_LABELS.get(s, s)}" for s in summary["systems"]) + ".",
        f"env_only prompt: the question, a blank line, then: \"{env_only_instruction}\"",
    ]


def averages_markdown(summary: dict[str, Any], kept_seed: bool = False) -> list[str]:
    """summary.md's averages: each system's mean and CI per split, for `SUMMARY_METRICS`."""
    lines = ["## Averages", "", "| system | split | EM | F1 | SSim | SM |", "|---|---|---|---|---|---|"]
    for s in summary["systems"]:
        for split in SPLITS:
            av = summary["averages"][s][split]
            lines.append(f"| {system_label(s, kept_seed)} | {split} | "
                         + " | ".join(format_ci(av.get(m)) for m in SUMMARY_METRICS) + " |")
    return lines


def deltas_markdown(summary: dict[str, Any], kept_seed: bool = False) -> list[str]:
    """summary.md's deltas: prompt_r1 minus each other system, with its paired-bootstrap CI."""
    lines = ["## Deltas of prompt_r1 (paired bootstrap)", "", "| vs | split | EM | F1 | SSim | SM |",
             "|---|---|---|---|---|---|"]
    for vs, per_split in summary["deltas"].items():
        for split in SPLITS:
            cells = []
            for m in SUMMARY_METRICS:
                c = per_split[split].get(m)
                cells.append("–" if c is None else f"{c['delta']:+.2f} [{c['low']:+.2f}, {c['high']:+.2f}]")
            lines.append(f"| {system_label(vs.removeprefix('vs_'), kept_seed)} | {split} | " + " | ".join(cells) + " |")
    return lines


def per_dataset_markdown(summary: dict[str, Any]) -> list[str]:
    """summary.md's per-dataset means: one row per dataset and metric it reports, one column per system."""
    systems = summary["systems"]
    lines = ["## Per dataset (mean)", "", "| dataset | metric | " + " | ".join(systems) + " |",
             "|---|---|" + "---|" * len(systems)]
    for d, per_system in summary["per_dataset"].items():
        for m in M.reported_metrics(d):
            lines.append(f"| {d} | {metric_label(m)} | " + " | ".join(f"{per_system[s][m]['mean']:.2f}" for s in systems)
                         + " |")
    return lines


def usage_markdown(summary: dict[str, Any], kept_seed: bool = False) -> list[str]:
    """summary.md's environment usage: the calls each system sent this run, their tokens, errors and cost."""
    lines = ["## Environment usage (calls this run sent)", "", ("| system | calls | cache hits | prompt tok | completion tok | errors |"
             " cost USD |"), "|---|---|---|---|---|---|---|"]
    for s, u in summary["env_usage"].items():
        lines.append(f"| {system_label(s, kept_seed)} | {u['calls']} | {u['cache_hits']} | {u['prompt_tokens']} | {u['completion_tokens']} |"
                     f" {u['errors']} | {u['cost_usd']:.4f} |")
    return lines


def headline_markdown(summary: dict[str, Any]) -> list[str]:
    """summary.md's headline: what `dvc metrics show` prints, each figure said in words, the gains with the
    system they are measured against and their paired-bootstrap CI; the quality-against-cost picture."""
    values = headline(summary)
    lines = ["## Headline (`dvc metrics show`)", "", "| figure | value | what |", "|---|---|---|"]
    for key, value in values.items():
        what = HEADLINE_WHAT.get(key)
        if what is None:  # a gain: prompt_r1 minus the best other system on that split
            split = next(s for s, name in SPLIT_NAMES.items() if key == f"f1_gain_{name}")
            rival = best_other(summary, split)
            ci = summary["deltas"][f"vs_{rival}"][split]["f1"]
            what = (f"prompt_r1's F1 minus {rival}'s (the best other system), {split.upper()}; "
                    f"95% CI [{ci['low']:+.2f}, {ci['high']:+.2f}]")
        lines.append(f"| `{key}` | {value:g} | {what} |")
    if "cost" in summary:
        lines += ["", f"![F1 against environment tokens per question, per system and split]({QUALITY_COST_PNG})"]
    return lines


def cost_markdown(summary: dict[str, Any], kept_seed: bool = False) -> list[str]:
    """summary.md's cost section: per-question cost beside the average F1, then the one-off costs."""
    prices = summary["cost"]["prices"]
    lines = ["## Cost beside quality", "",
             (f"Environment cost of answering, counted over every reply a system used (cached or not), at "
              f"{prices['usd_per_million_prompt']} / {prices['usd_per_million_completion']} USD per million "
              "prompt / completion tokens. One-off: what it cost to make the system (GRPO training, GEPA search)."),
             "", ("| system | ID F1 | OOD F1 | env requests / q | env tokens / q | USD / q | USD (this eval) |"
                  " one-off | one-off env requests | one-off env tokens | one-off USD | one-off hours |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in summary["systems"]:
        inf = summary["cost"]["inference"][s]
        av = summary["averages"][s]
        f1 = [format_ci(av[split].get(PLOT_METRIC)) for split in SPLITS]
        once = summary["cost"]["one_off"].get(s)
        if once is None:
            once_cells = ["none" if s in ("env_only", "agent_only", "base_agent") else "not recorded", "–", "–",
                          "–", "–"]
        else:
            once_cells = [once["what"], str(once["env_requests"]),
                          str(once["prompt_tokens"] + once["completion_tokens"]), f"{once['usd']:.4f}",
                          f"{once['hours']:.4f}"]
        lines.append(f"| {system_label(s, kept_seed)} | {f1[0]} | {f1[1]} | {inf['env_requests_per_question']:.2f} | "
                     f"{inf['env_tokens_per_question']:.1f} | {inf['usd_per_question']:.6f} | {inf['usd']:.4f} | "
                     + " | ".join(once_cells) + " |")
    return lines


def format_ci(ci: dict[str, float] | None) -> str:
    """`mean [low, high]` in points, or a dash when the metric is not reported."""
    return "–" if ci is None else f"{ci['mean']:.2f} [{ci['low']:.2f}, {ci['high']:.2f}]"


def mlflow_links_markdown() -> list[str]:
    """Links to the active MLflow run (evaluate) and its parent, and to the registered model's page: the
    tracking server's pages, or `mlflow ui`'s local address for a SQLite store; [] without an active run."""
    import mlflow

    run = mlflow.active_run()
    if run is None:
        return []
    uri = mlflow.get_tracking_uri()
    ui = uri.rstrip("/") if uri.startswith(("http://", "https://")) else DEFAULT_UI
    experiment = run.info.experiment_id
    parent = mlflow.MlflowClient().get_run(run.info.run_id).data.tags.get("mlflow.parentRunId")
    lines = ["## MLflow", ""]
    if not uri.startswith(("http://", "https://")):
        lines += [("Local store: open it with `MLFLOW_DISABLE_TELEMETRY=true mlflow ui --backend-store-uri "
                  f"{_store_shown(uri)}`, then:"), ""]
    if parent:
        lines.append(f"- [pipeline run]({ui}/#/experiments/{experiment}/runs/{parent}) (`{parent}`)")
    lines.append(f"- [evaluate run]({ui}/#/experiments/{experiment}/runs/{run.info.run_id}): traces, predictions "
                 "table, these files")
    lines.append(f"- [registered models]({ui}/#/models): the version this evaluation became is in "
                 "reports/promotion.json once `register` ran")
    return lines


def _store_shown(uri: str) -> str:
    """A SQLite store's URI with the project's own folder left out when it lives there."""
    prefix = "sqlite:///"
    if uri.startswith(prefix):
        path = Path(uri[len(prefix):])
        try:
            return prefix + str(path.resolve().relative_to(Path.cwd().resolve()))
        except ValueError:
            return uri
    return uri


def gepa_record(summary: dict[str, Any], path: Path) -> dict[str, Any] | None:
    """data/gepa/prompt.json (`path`) when gepa was evaluated and the file is there (its seed/optimised
    instructions)."""
    if "gepa" not in summary["systems"] or not path.is_file():
        return None
    return json.loads(path.read_text(encoding="utf-8"))
