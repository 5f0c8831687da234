"""The health gate on the verl backend: judge each step from verl's own output while it runs, stop it on a breach.

What our process sees of a running verl trainer is its output stream (pipeline/train/verl/backend.py `_stream`):
- per training step, its console logger's line `step:N - key:value - …` (verl/utils/logger/aggregate_logger.py
  `concat_dict_to_str`; printed by the TaskRunner actor, so Ray prefixes it `(TaskRunner pid=…)`): verl's
  `compute_data_metrics` names (`critic/score/mean`, `response_length/mean`, …) and the actor's
  (`actor/kl_loss`, …);
- with `trainer.rollout_data_dir` set (verl_backend does when `train.health.enabled`), verl dumps each step's
  trajectories to `<dir>/<N>.jsonl` (prompt text, response, `score`, and our reward function's parts, e.g.
  `answer` and `format`: pipeline.train.verl.reward.compute_score returns them as reward extra info) and prints
  `Dumped generations to <dir>/<N>.jsonl` once the file is closed. verl logs no per-group figure, so the
  zero-variance share and the reward parts come from that file (`rollout_figures`; the G trajectories of a
  question share its prompt text).

The gate's grace and window scale with the run's total steps (pipeline/config/health_gate.py). verl decides its own
total: `len(train_dataloader) * trainer.total_epochs` (batches of `data.train_batch_size`, the last partial one
dropped), or `trainer.total_training_steps` when set (verl/trainer/ppo/ray_trainer.py `_create_dataloader`).
The watch starts from that total computed on the composed config and the training set's row count
(pipeline/train/verl/schedule.py `verl_schedule`, the total the resume check holds verl to too) and takes verl's own figure from its line
`Total training steps: N` once printed (it can be lower: `data.filter_overlong_prompts` drops rows first).

`VerlHealthWatch` is fed every line: a step is judged once both its step line and its dump line have been
seen (the dump is written by a background thread, before or after the step line), or without the dump's
figures when the next step's line arrives first. A breach raises `BreachSeen` from inside the stream loop,
whose handler takes verl's whole process group down (SIGTERM, then SIGKILL), as on Ctrl-C; verl_backend
then sets the breaching step's checkpoints aside and raises `TrainingUnhealthy` with the one line.

Why the stream and not the MLflow history: the console line is verl's own record of the step, it reaches this
process whatever node the trainer runs on, and reading it costs nothing; polling MLflow would add a lag and a
second failure mode (the tracking server) to the gate.
"""

from __future__ import annotations

import json
import logging
import math
import re
import statistics
from pathlib import Path

from pipeline.config.health_gate import HealthConfig
from pipeline.train.health_gate import (
    VERL_METRICS,
    ZERO_VARIANCE_METRIC,
    Breach,
    HealthGate,
    zero_variance_share,
)

log = logging.getLogger(__name__)

"""Folder under `paths.cache_dir` where verl dumps each step's trajectories (`trainer.rollout_data_dir`)."""
_STEP_LINE = re.compile(r"(?:^|\s)step:(\d+) - (.+)$")
_DUMP_LINE = re.compile(r"Dumped generations to (\S*?(\d+)\.jsonl)")
_NUMBER = re.compile(r"^(?:np\.\w+\(|tensor\()?\s*([-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|\.\d+|nan|inf))")
_TOTAL_LINE = re.compile(r"Total training steps: (\d+)")
TRAINING_KEY = "critic/score/mean"
"""A step line carrying this is a training step (validation-only lines, e.g. step 0, are not judged)."""


def parse_step_line(line: str) -> tuple[int, dict[str, float]] | None:
    """(step, metrics) from verl's console logger line, or None for any other line.

    Values are `pprint.pformat` of numbers: `0.25`, `3`, `nan`, and with numpy 2 `np.float64(0.25)`.
    """
    match = _STEP_LINE.search(line.rstrip())
    if not match:
        return None
    metrics: dict[str, float] = {}
    for item in match.group(2).split(" - "):
        key, sep, raw = item.rpartition(":")
        number = _NUMBER.match(raw.strip()) if sep else None
        if key and number:
            metrics[key.strip()] = float(number.group(1))
    return int(match.group(1)), metrics


def rollout_figures(rows: list[dict]) -> dict[str, float]:
    """The zero-variance share and mean reward parts of one step's dumped trajectories (verl's jsonl rows)."""
    if not rows:
        return {}
    out = {ZERO_VARIANCE_METRIC: zero_variance_share([float(r["score"]) for r in rows],
                                                     [r.get("input", "") for r in rows])}
    for part in ("answer", "format"):
        values = [float(r[part]) for r in rows if isinstance(r.get(part), (int, float)) and math.isfinite(r[part])]
        if values:
            out[f"reward/{part}/mean"] = statistics.fmean(values)
    return out


def read_rollout_dump(path: Path) -> list[dict]:
    """verl's `<N>.jsonl`; an unreadable line is skipped (the gate judges what it can)."""
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            log.warning("health gate: unreadable line in %s skipped", path)
    return rows


class BreachSeen(Exception):
    """Raised by `VerlHealthWatch` inside the stream loop (which then stops verl); carries the breach."""

    def __init__(self, breach: Breach) -> None:
        super().__init__(breach.figure)
        self.breach = breach


class VerlHealthWatch:
    """Feed verl's output lines (`__call__`); raises `BreachSeen` on a breach."""

    def __init__(self, cfg: HealthConfig, rollout_dir: Path | None, total_steps: int) -> None:
        self.gate = HealthGate(cfg, VERL_METRICS, total_steps)
        """Its `total_steps` starts as the composed config's total and becomes verl's own once printed."""
        self.rollout_dir = rollout_dir
        """verl's `trainer.rollout_data_dir`, or None when it dumps nothing (steps judged on their line)."""
        self.pending: dict[int, dict[str, float]] = {}
        self.dumped: dict[int, Path] = {}
        self.judged: set[int] = set()

    def __call__(self, line: str) -> None:
        if not self.gate.cfg.enabled:
            return
        total = _TOTAL_LINE.search(line)
        if total:
            self.gate.total_steps = int(total.group(1))
            return
        dump = _DUMP_LINE.search(line)
        if dump:
            step = int(dump.group(2))
            self.dumped[step] = Path(dump.group(1))
            if step in self.pending:
                self._judge(step)
            return
        parsed = parse_step_line(line)
        if parsed is None or TRAINING_KEY not in parsed[1]:
            return
        step, metrics = parsed
        for earlier in sorted(s for s in self.pending if s < step):
            self._judge(earlier)  # its dump never came: judged on verl's own metrics
        self.pending[step] = metrics
        if step in self.dumped or self.rollout_dir is None:
            self._judge(step)

    def _judge(self, step: int) -> None:
        metrics = self.pending.pop(step)
        if step in self.judged:
            return
        self.judged.add(step)
        path = self.dumped.pop(step, None)
        if path is not None and path.is_file():
            metrics.update(rollout_figures(read_rollout_dump(path)))
        breach: Breach | None = self.gate.observe(step, metrics)
        if breach is not None:
            raise BreachSeen(breach)
