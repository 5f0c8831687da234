"""A git + DVC project with this repository's dvc.yaml, its DVC plot templates and offline page, and the plot files
a run writes, made from recorded outputs: what `dvc plots show` renders (tests/test_dvc_plots.py and
benchmarks/check_plots_offline.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORDED = ROOT / "benchmarks" / "results" / "pipeline_avx512_final_eval_metrics.json"
"""A default-profile evaluation (five systems, 12 sets, costs)."""
GEPA_RECORD = ROOT / "tests" / "fixtures" / "gepa" / "prompt.json"
"""A real gepa record: its val history is a flat best score of 0.17 (it kept the seed)."""


def dvc_env(home: Path) -> dict[str, str]:
    return {
        **os.environ,
        "DVC_NO_ANALYTICS": "1",
        "HOME": str(home),
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@t",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@t",
    }


def plots_project(root: Path) -> Path:
    """`root` as a DVC project whose plot outputs are the recorded run's; returns `root`."""
    from pipeline.evaluation.costs import quality_cost_rows
    from pipeline.evaluation.plots import PLOT_METRIC, plot_rows
    from pipeline.stages.gepa import history_frame

    root.mkdir(parents=True, exist_ok=True)
    for name in ("dvc.yaml", "params.yaml"):
        shutil.copy(ROOT / name, root / name)
    env = dvc_env(root)
    subprocess.run(["git", "init", "-q"], cwd=root, check=True, env=env)
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], cwd=root, check=True, env=env)
    shutil.copy(ROOT / ".dvc" / "config", root / ".dvc" / "config")  # html_template, relative to .dvc/
    for folder in ("plots", "offline"):
        shutil.copytree(ROOT / ".dvc" / folder, root / ".dvc" / folder)
    summary = json.loads(RECORDED.read_text())
    reports = root / "reports"
    (reports / "eval").mkdir(parents=True, exist_ok=True)
    (reports / "gepa").mkdir(parents=True, exist_ok=True)
    (reports / "train").mkdir(parents=True, exist_ok=True)
    plot_rows(summary).to_csv(reports / "eval" / "plot_data.csv", index=False)
    quality_cost_rows(summary, PLOT_METRIC).to_csv(reports / "eval" / "quality_cost.csv", index=False)
    history_frame(json.loads(GEPA_RECORD.read_text())).to_csv(reports / "gepa" / "history.csv", index=False)
    shutil.copy(
        ROOT / "tests" / "fixtures" / "stage_outputs" / "reports" / "train" / "steps.csv",
        reports / "train" / "steps.csv",
    )
    return root


def show_plots(root: Path) -> Path:
    """Run `dvc plots show` in `root`; the page it wrote."""
    subprocess.run(
        [sys.executable, "-m", "dvc", "plots", "show"],
        cwd=root,
        check=True,
        capture_output=True,
        text=True,
        env=dvc_env(root),
    )
    return root / "dvc_plots" / "index.html"
