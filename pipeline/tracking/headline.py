"""The few figures a person compares pipeline runs on: DVC's headline and the parent MLflow run's metrics.

A run's outputs hold thousands of numbers (metrics.json has every dataset × system × metric × mode with CI
bounds, costs and the paper's table); comparing two runs needs a handful. This module picks them, once, for
the two places people compare runs:

- **`reports/eval/headline.json`**, the only DVC metric (`dvc metrics show`, `dvc exp show`, `dvc metrics
  diff`): five values named so they read without a legend (`id` in-distribution, `ood` out-of-distribution), rounded to 0.1 point, so `dvc metrics show` prints
  one row within 120 columns (DVC pads every column to its key or value and 4 spaces; a 28-value row was 686
  characters wide). F1 (the one metric every dataset reports) of prompt_r1 per split (`f1_id`,
  `f1_ood`), prompt_r1's F1 minus the best other system's (`f1_gain_id`, `f1_gain_ood`; the system
  and the paired-bootstrap CI are in summary.md and metrics.json `deltas`), and the cost: prompt_r1's
  environment tokens per question (`env_tokens`). `HEADLINE_KEYS` lists them.
- **`reports/eval/figures.json`** (`figures`): the wider set, read on demand with `dvc metrics show
  reports/eval/figures.json` (not a declared metric, so it stays out of `dvc exp show` and `dvc metrics
  diff`): every system's ID and OOD F1, prompt_r1's EM and SSim, prompt_r1's F1 difference to each baseline
  (with the CI against `env_only`, the paper's "w/o agent" row), the last training step's mean reward and the
  rows per set, at most `MAX_FIGURES_VALUES`. Keys in both are words joined by `_`: no `/` or `.`, so no key
  reads as a file path and DVC does not nest them.
- **the parent MLflow run** (`parent_metrics`): the same figures with more room, under the names the
  evaluate run uses (`<system>/<split>/<metric>`, `delta_vs_<baseline>/<split>/<metric>[_low|_high]`): every
  system's ID/OOD EM, F1 and SSim, prompt_r1's differences to every baseline with both CI bounds. The train
  stage adds `reward/last_step_mean`, register adds `promoted` (`tracking.log_parent_metrics`).

Names say what they are: GRPO has no critic, so the reward is `reward/mean` in steps.csv and MLflow
(`pipeline.train.local.step_metrics`); verl's `critic/score/mean` stays beside it as an alias.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from pipeline.stage_files import FIGURES_FILE, HEADLINE_FILE
from pipeline.types import TRAINED

HEADLINE_KEYS = ("f1_id", "f1_gain_id", "f1_ood", "f1_gain_ood", "env_tokens")
"""headline.json's keys, in order: what `dvc metrics show` prints in one row of at most 120 columns."""
SPLIT_NAMES = {"id": "id", "ood": "ood"}
"""How a split reads in a headline key."""
MAX_FIGURES_VALUES = 30
"""Most values figures.json may hold: one `dvc metrics show reports/eval/figures.json` row."""
HEADLINE_METRICS = ("em", "f1", "ssim")
"""The paper's three headline metrics (method.md), reported per system and split on the parent run."""
SPLITS = ("id", "ood")
CI_BASELINE = "env_only"
"""The baseline whose difference to prompt_r1 headline.json gives with its CI (the paper's 'w/o agent')."""
REWARD_COLUMNS = ("reward/mean", "critic/score/mean")
"""steps.csv's per-step mean reward: our name first, verl's alias for files written before it existed."""
LAST_REWARD_METRIC = "reward/last_step_mean"
"""The parent run's metric: the mean reward of the last training step."""
PATH_LIKE = re.compile(r"[/\\]|\.(json|csv|parquet|yaml|md|png)$", re.IGNORECASE)


def last_step_reward(steps_csv: Path) -> float | None:
    """The mean reward of the last step in `steps_csv` (None when the file, the column or a value is missing)."""
    import pandas as pd

    if not steps_csv.is_file() or steps_csv.stat().st_size == 0:
        return None
    frame = pd.read_csv(steps_csv)
    column = next((c for c in REWARD_COLUMNS if c in frame.columns), None)
    if column is None or frame.empty or "step" not in frame.columns:
        return None
    value = float(frame.sort_values("step")[column].iloc[-1])
    return value if math.isfinite(value) else None


def _mean(entry: dict[str, Any] | None) -> float | None:
    return None if not entry else entry.get("mean")


def best_other(summary: dict[str, Any], split: str) -> str | None:
    """The system `f1_gain_<split>` is measured against: the one other than prompt_r1 with the highest average
    F1 on `split`; None without one."""
    scored = {s: _mean((summary["averages"][s].get(split) or {}).get("f1")) for s in summary["systems"] if s != TRAINED}
    scored = {s: v for s, v in scored.items() if v is not None}
    return max(scored, key=lambda s: scored[s]) if scored else None


def headline(summary: dict[str, Any]) -> dict[str, float]:
    """headline.json's content (module docstring): `HEADLINE_KEYS`, those the run has, in that order."""
    out: dict[str, float] = {}
    averages = summary["averages"]
    for split, name in SPLIT_NAMES.items():
        mine = _mean((averages.get(TRAINED, {}).get(split) or {}).get("f1"))
        if mine is not None:
            out[f"f1_{name}"] = mine
        best = best_other(summary, split)
        delta = (summary.get("deltas", {}).get(f"vs_{best}", {}).get(split) or {}).get("f1") if best else None
        if delta is not None:
            out[f"f1_gain_{name}"] = delta["delta"]
    tokens = summary.get("cost", {}).get("inference", {}).get(TRAINED, {}).get("env_tokens_per_question")
    out = {k: round(float(out[k]), 1) for k in HEADLINE_KEYS if k in out}
    if tokens is not None:
        out["env_tokens"] = round(float(tokens))
    check_headline(out, HEADLINE_FILE, len(HEADLINE_KEYS))
    return out


def figures(summary: dict[str, Any], last_reward: float | None = None) -> dict[str, float]:
    """figures.json's content (module docstring): flat, at most `MAX_FIGURES_VALUES` values, no path-like key."""
    out: dict[str, float] = {}
    averages = summary["averages"]
    for system in summary["systems"]:
        for split in SPLITS:
            value = _mean((averages[system].get(split) or {}).get("f1"))
            if value is not None:
                out[f"{system}_{split}_f1"] = value
    for metric in ("em", "ssim"):
        for split in SPLITS:
            value = _mean((averages.get(TRAINED, {}).get(split) or {}).get(metric))
            if value is not None:
                out[f"{TRAINED}_{split}_{metric}"] = value
    for vs, per_split in summary.get("deltas", {}).items():
        baseline = vs.removeprefix("vs_")
        for split in SPLITS:
            delta = (per_split.get(split) or {}).get("f1")
            if delta is None:
                continue
            out[f"delta_vs_{baseline}_{split}_f1"] = delta["delta"]
            if baseline == CI_BASELINE:
                out[f"delta_vs_{baseline}_{split}_f1_low"] = delta["low"]
                out[f"delta_vs_{baseline}_{split}_f1_high"] = delta["high"]
    if last_reward is not None:
        out["reward_last_step_mean"] = last_reward
    out["rows_per_dataset"] = float(summary["rows_per_dataset"])
    check_headline(out, FIGURES_FILE, MAX_FIGURES_VALUES)
    return out


def check_headline(values: dict[str, float], name: str = HEADLINE_FILE, most: int = len(HEADLINE_KEYS)) -> None:
    """Refuse a file `dvc metrics show` could not show in one terminal row (too many or path-like keys)."""
    if len(values) > most:
        raise ValueError(f"{name} would hold {len(values)} values, more than {most}: {', '.join(values)}")
    for key, value in values.items():
        if PATH_LIKE.search(key) or "." in key:
            raise ValueError(f"{name} key {key!r} looks like a path (no '/', '\\' or '.' in a key)")
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise TypeError(f"{name} key {key!r} is {value!r}, not a number")


def parent_metrics(summary: dict[str, Any]) -> dict[str, float]:
    """The evaluation's figures for the parent run (module docstring): per system and split EM, F1, SSim;
    prompt_r1's difference to each baseline with its CI bounds."""
    out: dict[str, float] = {}
    for system in summary["systems"]:
        for split in SPLITS:
            entry = summary["averages"][system].get(split) or {}
            for metric in HEADLINE_METRICS:
                value = _mean(entry.get(metric))
                if value is not None:
                    out[f"{system}/{split}/{metric}"] = value
    for vs, per_split in summary.get("deltas", {}).items():
        for split in SPLITS:
            for metric in HEADLINE_METRICS:
                delta = (per_split.get(split) or {}).get(metric)
                if delta is not None:
                    out[f"delta_{vs}/{split}/{metric}"] = delta["delta"]
                    out[f"delta_{vs}/{split}/{metric}_low"] = delta["low"]
                    out[f"delta_{vs}/{split}/{metric}_high"] = delta["high"]
    out["eval/rows_per_dataset"] = float(summary["rows_per_dataset"])
    return {k: float(v) for k, v in out.items() if v is not None and math.isfinite(float(v))}
