"""The evaluation report's pictures and its DVC plot's data, under `reports/eval/`.

- `plot_data.csv` (`plot_rows`): F1, the one metric every dataset reports (`PLOT_METRIC`), per dataset ×
  system with its split and CI bounds (the DVC plot: one panel per split, a group of bars per dataset,
  `.dvc/plots/grouped_bars.json`);
- `plots/<dataset>.png` (`write_plots`): bars with CI error bars for every metric the dataset reports;
- `plots/quality_vs_cost.png` (`write_quality_cost_plot`): one labelled point per system and split, F1 against
  the environment tokens per question.

Plots are drawn with matplotlib's Agg backend (no display), imported only when plotting.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from pipeline import metrics as M
from pipeline.evaluation.systems import system_colour
from pipeline.evaluation.verdict import metric_label

PLOT_METRIC = "f1"
"""The one metric every dataset reports: plot_data.csv's, the quality-cost points' and the F1 the report's
one-line views (the run description, the cost table) give."""


def plot_rows(summary: dict[str, Any]) -> pd.DataFrame:
    """plot_data.csv: F1 (the one metric every dataset reports) per dataset × system, with CI bounds."""
    split_of = {d: split for split, names in summary.get("datasets", {}).items() for d in names}
    rows = []
    for d, per_system in summary["per_dataset"].items():
        for system, entry in per_system.items():
            ci = entry[PLOT_METRIC]
            rows.append({"dataset_system": f"{d} | {system}", "dataset": d, "system": system,
                         "split": split_of.get(d, "").upper(), "metric": PLOT_METRIC, "score": ci["mean"],
                         "low": ci["low"], "high": ci["high"]})
    return pd.DataFrame(rows)


def write_plots(summary: dict[str, Any], out_dir: Path) -> list[Path]:
    """One PNG per dataset: grouped bars (metric × system) with CI error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    systems = summary["systems"]
    width = 0.8 / max(1, len(systems))
    for d, per_system in summary["per_dataset"].items():
        metrics_ = M.reported_metrics(d)
        fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(metrics_), 3.2))
        x = np.arange(len(metrics_))
        for k, system in enumerate(systems):
            cis = [per_system[system][m] for m in metrics_]
            means = np.array([c["mean"] for c in cis])
            err = np.array([[c["mean"] - c["low"] for c in cis], [c["high"] - c["mean"] for c in cis]])
            ax.bar(x + (k - (len(systems) - 1) / 2) * width, means, width, yerr=err, capsize=3, label=system,
                   color=system_colour(system))
        ax.set_xticks(x, [metric_label(m) for m in metrics_])
        ax.set_ylim(0, 105)
        ax.set_ylabel("score (points)")
        ax.set_title(f"{d} ({summary['mode']} mode, {int(summary['confidence'] * 100)}% bootstrap CI)", fontsize=9)
        ax.legend(fontsize=7, loc="upper right")
        fig.tight_layout()
        path = out_dir / f"{d}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


def write_quality_cost_plot(points: pd.DataFrame, path: Path) -> Path:
    """F1 against environment tokens per question: one labelled marker per system and split."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 4))
    for split, marker in (("id", "o"), ("ood", "s")):  # the split as the marker, the system as its colour
        sel = points[points["split"] == split]
        ax.scatter(sel["env_tokens_per_question"], sel[PLOT_METRIC], marker=marker, label=split.upper(),
                   c=[system_colour(s) for s in sel["system"]])
        for _, r in sel.iterrows():
            ax.annotate(r["system"], (r["env_tokens_per_question"], r[PLOT_METRIC]), fontsize=7,
                        xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("environment tokens per question")
    ax.set_ylabel(f"{metric_label(PLOT_METRIC)} (points)")
    ax.set_title("Quality against cost (one point per system and split)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
