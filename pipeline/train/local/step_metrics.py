"""What one GRPO step reports: its rollout metrics, `reports/train/steps.csv` and MLflow.

Design decisions:
- **verl's metric names** (`critic/score/mean`, `response_length/mean`, `actor/…`, `timing_s/…`) so local and
  verl curves compare directly; reward parts, stop reasons and environment usage are added under `reward/`,
  `rollout/` and `env/`. The reward also goes by its own name, `reward/mean` (`/max`, `/min`, `/std`): GRPO
  has no critic, and a person looking for the reward finds it there (verl's runs get it from
  `pipeline.train.verl.steps.export_steps_csv`).
- **steps.csv is rewritten atomically** (temp file + replace) after every step, one row per finished step.
  On resume, rows after the resumed checkpoint are dropped: those steps run again, and no step appears twice.
- **MLflow only inside an active run** and only finite numbers (NaN/inf would fail the logging call).
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import get_args

import pandas as pd
import torch

from pipeline.stage_files import STEPS_CSV
from pipeline.types import StopReason, Trajectory

WARMUP_CSV = "train/warmup.csv"
"""The format warm-up's metrics (pipeline.train.local.warmup), one row per warm-up step, beside steps.csv."""


def steps_csv_path(reports_dir: Path) -> Path:
    """`<paths.reports_dir>/train/steps.csv`: one row per training step."""
    return reports_dir / STEPS_CSV


def masked_stats(values: torch.Tensor, mask: torch.Tensor) -> tuple[float, float, float]:
    """(mean, max, min) of `values` where mask is set; zeros when nothing is."""
    sel = values[mask.bool()]
    if sel.numel() == 0:
        return 0.0, 0.0, 0.0
    return float(sel.mean()), float(sel.max()), float(sel.min())


def rollout_metrics(trajectories: list[Trajectory], scores: torch.Tensor, advantages: torch.Tensor,
                    mask: torch.Tensor) -> dict[str, float]:
    """Reward, advantage, length, turn, stop-reason and environment metrics of one step's rollouts."""
    rewards = [t.reward for t in trajectories]
    resp_len = [len(t.response_ids) for t in trajectories]
    agent_len = [sum(t.response_mask) for t in trajectories]
    turns = [t.num_turns for t in trajectories]
    adv_mean, adv_max, adv_min = masked_stats(advantages, mask)
    m: dict[str, float] = {
        # The reward under its own name (GRPO has no critic); verl's names stay as aliases below.
        "reward/mean": float(scores.mean()),
        "reward/max": float(scores.max()),
        "reward/min": float(scores.min()),
        "reward/std": float(scores.std()) if scores.numel() > 1 else 0.0,
        "critic/score/mean": float(scores.mean()),
        "critic/score/max": float(scores.max()),
        "critic/score/min": float(scores.min()),
        "critic/score/std": float(scores.std()) if scores.numel() > 1 else 0.0,
        "critic/score/count": float(scores.numel()),
        "critic/rewards/mean": float(scores.mean()),
        "critic/advantages/mean": adv_mean,
        "critic/advantages/max": adv_max,
        "critic/advantages/min": adv_min,
        # Trajectories whose group's rewards differ: the share of the batch that carries any learning signal.
        "critic/advantages/nonzero_frac": float(((advantages != 0) & (mask > 0)).any(dim=1).float().mean()),
        "response_length/mean": statistics.fmean(resp_len),
        "response_length/max": float(max(resp_len)),
        "response_length/min": float(min(resp_len)),
        "response_length/agent_tokens_mean": statistics.fmean(agent_len),
        "prompt_length/mean": statistics.fmean(len(t.prompt_ids) for t in trajectories),
        "num_turns/mean": statistics.fmean(turns),
        "num_turns/max": float(max(turns)),
        "num_turns/min": float(min(turns)),
    }
    parts = {
        "format": lambda r: r.format,
        "answer": lambda r: r.answer,
        "gated": lambda r: float(r.gated),
        "valid_intermediate_turns": lambda r: float(r.valid_intermediate_turns),
        "answer_tags": lambda r: r.answer_tags,
        "answer_nonempty": lambda r: r.answer_nonempty,
        "complete_final": lambda r: r.complete_final,
    }
    for name, get in parts.items():
        m[f"reward/{name}/mean"] = statistics.fmean(float(get(r)) for r in rewards)
    for reason in get_args(StopReason):
        m[f"rollout/stop_{reason}"] = sum(t.stop_reason == reason for t in trajectories) / len(trajectories)
    usage = {"calls": 0.0, "cache_hits": 0.0, "prompt_tokens": 0.0, "completion_tokens": 0.0, "errors": 0.0,
             "retries": 0.0, "truncated": 0.0, "empty_after_length": 0.0, "cost_usd": 0.0}
    for t in trajectories:
        for key in usage:
            usage[key] += float(getattr(t.usage, key))
    m.update({f"env/{k}": v for k, v in usage.items()})
    m["env/tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    m["env/failure_rate"] = usage["errors"] / usage["calls"] if usage["calls"] else 0.0
    return m


class StepsLog:
    """`reports/train/steps.csv`: one row per finished step, rewritten atomically each step."""

    def __init__(self, path: Path, keep_upto: int) -> None:
        self.path = path
        self.rows: list[dict[str, float]] = []
        if path.is_file() and path.stat().st_size > 0:
            frame = pd.read_csv(path)
            if "step" in frame.columns:
                # Steps after the resumed checkpoint will run again: drop their rows so no step repeats.
                frame = frame[frame["step"] <= keep_upto].drop_duplicates("step", keep="last")
                self.rows = frame.to_dict("records")
        self._write()

    def append(self, step: int, metrics: dict[str, float]) -> None:
        self.rows = [r for r in self.rows if int(r["step"]) != step]
        self.rows.append({"step": step, **metrics})
        self._write()

    def last(self) -> dict[str, float] | None:
        return self.rows[-1] if self.rows else None

    def _write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        frame = pd.DataFrame(self.rows)
        if frame.empty:
            frame = pd.DataFrame(columns=["step"])
        cols = ["step", *sorted(c for c in frame.columns if c != "step")]
        tmp = self.path.with_suffix(".csv.tmp")
        frame[cols].to_csv(tmp, index=False)
        tmp.replace(self.path)


def log_mlflow_metrics(metrics: dict[str, float], step: int) -> None:
    """Log `metrics` at `step` to the active MLflow run, if any (finite numbers only)."""
    import mlflow

    if mlflow.active_run() is None:
        return
    clean = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}
    mlflow.log_metrics(clean, step=step)


def set_run_tag(key: str, value: str) -> None:
    """Tag the active MLflow run, if any (what a run decided at run time, e.g. the rollout engine)."""
    import mlflow

    if mlflow.active_run() is not None:
        mlflow.set_tag(key, value)


def write_warmup_csv(path, rows: list[dict[str, float]]) -> None:
    """`reports/train/warmup.csv`: one row per warm-up step (columns `warmup/step`, `warmup/loss`, ...)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    frame = pd.DataFrame(rows)
    tmp = path.with_suffix(".csv.tmp")
    frame.to_csv(tmp, index=False)
    tmp.replace(path)
