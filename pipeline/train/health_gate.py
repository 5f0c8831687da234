"""The training health gate: judge each GRPO step's figures against `train.health`, stop the run on a breach.

Six figures, each the mean over a window of the last steps after a grace period, both scaled to the run's
total steps (why: see pipeline/config/health_gate.py):
- `zero_variance_share`: the share of groups whose G trajectories all scored the same. GRPO's advantage is 0
  for such a group, so a window of them taught nothing (all failed: the policy lost the format; all solved
  at every step: nothing left to learn from these questions either).
- `answer_drop`: how far the answer reward's window mean fell from the window before, judged only while the
  format reward's window mean rose by at least `min_format_rise`: the policy learns the tags, not the task.
- `length_ratio`: the window's mean response length over the first window's: responses collapsing.
- `kl`: the window's mean KL to the reference (`actor/kl_loss`): the policy running away.
- `answer_vanished`: the answer reward's window mean is 0 after an earlier step earned some: the policy found
  answers and switched to a behaviour that earns none (a GRPO update with a single loser can do that at once).
- `stop_shift`: one stop reason's share (`rollout/stop_*`) moved by more than `max_stop_shift` between the
  window before and the window: the whole behaviour switched (e.g. every rollout asking until the turn limit).

Design decisions:
- **A pure function over a sequence of per-step metric dicts** (`judge`), with one `MetricNames` per backend:
  the local trainer's dicts (pipeline/train/local/step_metrics.py) and verl's (its console step lines plus the
  figures our process computes from verl's rollout dump, pipeline/train/verl/health_gate.py) differ only in the
  response length (agent tokens locally; verl's `response_length/mean` counts the environment's tokens too).
  A figure whose metrics a backend lacks is not judged.
- **The breaching step is never the kept checkpoint.** The local loop judges a step before it checkpoints it
  (pipeline/train/local/backend.py); verl checkpoints before it logs, so its folders from the breaching step on are
  set aside (pipeline/train/checkpoint.py `set_aside_verl_steps`). Merge and a resume then use the newest
  checkpoint at or before the last healthy step.
- **One line** (`Breach.line`): figure, value, threshold, step, and the kept checkpoint; the MLflow train run
  gets tags `health.breach=<figure>` (+ value, threshold, step) and ends FAILED (the stage raises
  `TrainingUnhealthy`, a UserError: the CLI prints the line and exits 1, so `dvc repro` and the Prefect flow
  fail and the flow's failure automation fires). The register stage refuses a train run with the tag.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pipeline.config.health_gate import HealthConfig
from pipeline.errors import TrainingUnhealthy
from pipeline.tracking.runs import HEALTH_BREACH_TAG

BREACH_TAG = HEALTH_BREACH_TAG
"""MLflow tag on the train run naming the breached figure (pipeline/stages/register.py refuses such a run)."""
ZERO_VARIANCE_METRIC = "critic/score/zero_variance_group_frac"
"""Per-step share of groups whose trajectories all scored the same (both backends compute it with
`zero_variance_share`)."""


@dataclass(frozen=True)
class MetricNames:
    """Where one backend's per-step metric dict keeps each figure's input."""

    zero_variance: str
    answer: str
    format: str
    length: str
    kl: str
    stop_prefix: str = "rollout/stop_"
    """Prefix of the per-step stop-reason shares (pipeline/train/local/step_metrics.py); a backend without them is not
    judged on `stop_shift`."""


LOCAL_METRICS = MetricNames(ZERO_VARIANCE_METRIC, "reward/answer/mean", "reward/format/mean",
                            "response_length/agent_tokens_mean", "actor/kl_loss")
VERL_METRICS = MetricNames(ZERO_VARIANCE_METRIC, "reward/answer/mean", "reward/format/mean",
                           "response_length/mean", "actor/kl_loss")
"""verl logs `response_length/mean` and `actor/kl_loss` itself (verl/trainer/ppo/metric_utils.py,
ray_trainer.py); the zero-variance share and the reward parts come from its rollout dump."""


@dataclass(frozen=True)
class Breach:
    figure: str
    value: float
    threshold: float
    step: int
    detail: str

    def line(self, kept: str) -> str:
        """The one line a breach prints: figure, value, threshold, step, what is kept."""
        return (f"training health gate: {self.figure} {self.value:.4g} breaches {self.threshold:g} at step "
                f"{self.step} ({self.detail}); training stopped, {kept}")


def flat_groups(scores: Sequence[float], group_ids: Sequence[Any]) -> set[Any]:
    """The groups whose scores are all equal (to 1e-9): GRPO's advantage is 0 for each of their trajectories."""
    groups: dict[Any, list[float]] = {}
    for score, group in zip(scores, group_ids, strict=True):
        groups.setdefault(group, []).append(float(score))
    return {group for group, values in groups.items() if max(values) - min(values) <= 1e-9}


def zero_variance_share(scores: Sequence[float], group_ids: Sequence[Any]) -> float:
    """Share of groups whose scores are all equal (to 1e-9), over the groups present; 0.0 for no groups."""
    present = set(group_ids)
    if not present:
        return 0.0
    return len(flat_groups(scores, group_ids)) / len(present)


def _mean(rows: Sequence[dict[str, float]], key: str) -> float | None:
    values = [float(r[key]) for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    return statistics.fmean(values) if values else None


def judge(steps: Sequence[tuple[int, dict[str, float]]], cfg: HealthConfig, names: MetricNames,
          total_steps: int) -> Breach | None:
    """Judge the last of `steps` ((step, metrics), ascending) of a run of `total_steps`: the first breached
    figure, or None.

    The grace and window scale with `total_steps` (`HealthConfig.schedule`); a run shorter than
    `cfg.min_steps` is never judged. Nothing is judged until `window` steps after the grace have run; earlier
    steps still serve as the answer/format comparison's previous window and the length baseline.
    """
    schedule = cfg.schedule(total_steps)
    if schedule is None or not steps:
        return None
    grace, size = schedule
    step = steps[-1][0]
    rows = [m for _, m in steps]
    judged = [m for s, m in steps if s > grace]
    if len(judged) < size:
        return None
    window = judged[-size:]
    before = rows[: len(rows) - size][-size:]

    share = _mean(window, names.zero_variance)
    if share is not None and share > cfg.max_zero_variance_share:
        return Breach("zero_variance_share", share, cfg.max_zero_variance_share, step,
                      f"mean share of groups whose trajectories all scored the same over the last {size} steps")
    if len(before) == size:
        answer_now, answer_then = _mean(window, names.answer), _mean(before, names.answer)
        format_now, format_then = _mean(window, names.format), _mean(before, names.format)
        if None not in (answer_now, answer_then, format_now, format_then):
            drop = answer_then - answer_now  # type: ignore[operator]
            rise = format_now - format_then  # type: ignore[operator]
            if rise >= cfg.min_format_rise and drop > cfg.max_answer_drop:
                return Breach("answer_drop", drop, cfg.max_answer_drop, step,
                              f"answer reward {answer_then:.3f} -> {answer_now:.3f} while format reward rose "
                              f"{format_then:.3f} -> {format_now:.3f}, windows of {size} steps")
    baseline, length = _mean(rows[: size], names.length), _mean(window, names.length)
    if baseline and length is not None and baseline > 0:
        ratio = length / baseline
        if ratio < cfg.min_length_ratio:
            return Breach("length_ratio", ratio, cfg.min_length_ratio, step,
                          f"mean response length {length:.1f} vs {baseline:.1f} over the first {size} steps")
    kl = _mean(window, names.kl)
    if kl is not None and kl > cfg.max_kl:
        return Breach("kl", kl, cfg.max_kl, step, f"mean {names.kl} over the last {size} steps")
    return _behaviour_switch(rows, window, before, cfg, names, step, size)


def _behaviour_switch(rows: Sequence[dict[str, float]], window: Sequence[dict[str, float]],
                      before: Sequence[dict[str, float]], cfg: HealthConfig, names: MetricNames, step: int,
                      size: int) -> Breach | None:
    """`answer_vanished` and `stop_shift` (module docstring): the policy's behaviour changed as a whole."""
    answer = _mean(window, names.answer)
    earlier = [float(r[names.answer]) for r in rows[: len(rows) - size]
               if isinstance(r.get(names.answer), (int, float)) and math.isfinite(r[names.answer])]
    if cfg.answer_vanished and answer is not None and answer <= 0.0 and any(v > 0 for v in earlier):
        return Breach("answer_vanished", answer, 0.0, step,
                      f"answer reward 0 over the last {size} steps after {max(earlier):.3f} at an earlier step")
    if not before:
        return None
    reasons = sorted({k for r in rows for k in r if k.startswith(names.stop_prefix)})
    for key in reasons:
        now, then = _mean(window, key), _mean(before, key)
        if now is not None and then is not None and abs(now - then) > cfg.max_stop_shift:
            return Breach("stop_shift", abs(now - then), cfg.max_stop_shift, step,
                          f"{key} {then:.3f} -> {now:.3f}, the {len(before)} steps before vs the last {size}")
    return None


class HealthGate:
    """Keeps a run's per-step metrics and judges each new step (`observe`)."""

    def __init__(self, cfg: HealthConfig, names: MetricNames, total_steps: int,
                 history: Sequence[tuple[int, dict[str, float]]] = ()) -> None:
        self.cfg = cfg
        self.names = names
        self.total_steps = total_steps
        """The run's planned total (train.steps; on verl the composed total): it scales grace and window."""
        self.steps: list[tuple[int, dict[str, float]]] = sorted(history, key=lambda item: item[0])

    def observe(self, step: int, metrics: dict[str, float]) -> Breach | None:
        self.steps = [s for s in self.steps if s[0] < step]
        self.steps.append((step, dict(metrics)))
        return judge(self.steps, self.cfg, self.names, self.total_steps)


def record_breach(breach: Breach) -> None:
    """Tag the active MLflow run (the train child) with the breach; no-op without one."""
    import mlflow

    if mlflow.active_run() is None:
        return
    mlflow.set_tags({BREACH_TAG: breach.figure, "health.breach_step": str(breach.step),
                     "health.breach_value": f"{breach.value:.6g}", "health.breach_threshold": f"{breach.threshold:g}"})


def stop_training(breach: Breach, kept: str) -> TrainingUnhealthy:
    """Record the breach on the MLflow run and return the error whose message is the one line."""
    record_breach(breach)
    return TrainingUnhealthy(breach.line(kept))
