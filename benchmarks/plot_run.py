"""The two figures of benchmarks/README.md from a finished `dvc repro`: training curve, per-dataset F1.

    python benchmarks/plot_run.py PROJECT [--out docs/img]

PROJECT is a project folder after a run (it reads `reports/train/warmup.csv`, `reports/train/steps.csv` and
`reports/eval/metrics.json`). Writes `<out>/training_curve.png` (format warm-up loss per step; GRPO mean
reward per step) and `<out>/per_dataset_f1.png` (every system's F1 per evaluation set, 95% CI bars).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pandas as pd

ROOT = Path(__file__).resolve().parents[1]


def training_curve(project: Path, out: Path) -> Path:
    warm = pd.read_csv(project / "reports/train/warmup.csv")
    steps = pd.read_csv(project / "reports/train/steps.csv")
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.2))
    a.plot(warm["warmup/step"], warm["warmup/loss"], marker="o")
    a.set(title="format warm-up", xlabel="step", ylabel="loss")
    b.plot(steps["step"], steps["critic/score/mean"], marker="o", label="mean reward")
    b.fill_between(steps["step"], steps["critic/score/min"], steps["critic/score/max"], alpha=0.2, label="min-max")
    b.set(title="GRPO", xlabel="step", ylabel="reward")
    b.legend(fontsize=8)
    fig.tight_layout()
    path = out / "training_curve.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def per_dataset_f1(project: Path, out: Path) -> Path:
    from pipeline.evaluation.systems import system_colour

    metrics = json.loads((project / "reports/eval/metrics.json").read_text())
    datasets = list(metrics["per_dataset"])
    systems = metrics["systems"]
    width = 0.8 / len(systems)
    fig, ax = plt.subplots(figsize=(11, 3.6))
    for k, system in enumerate(systems):
        cells = [metrics["per_dataset"][d][system]["f1"] for d in datasets]
        xs = [i + (k - (len(systems) - 1) / 2) * width for i in range(len(datasets))]
        means = [c["mean"] for c in cells]
        errors = [[m - c["low"] for m, c in zip(means, cells, strict=True)],
                  [c["high"] - m for m, c in zip(means, cells, strict=True)]]
        ax.bar(xs, means, width, yerr=errors, capsize=2, label=system, color=system_colour(system))
    ax.set_xticks(range(len(datasets)), datasets, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("F1 (points), 95% CI")
    ax.set_title(f"F1 per evaluation set ({metrics['rows_per_dataset']} rows each)")
    ax.legend(fontsize=8, ncol=len(systems))
    fig.tight_layout()
    path = out / "per_dataset_f1.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("project", type=Path)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for path in (training_curve(args.project, args.out), per_dataset_f1(args.project, args.out)):
        print(f"written {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
