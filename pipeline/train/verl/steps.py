"""The steps record of a verl training: every launch's MLflow run, exported as one `reports/train/steps.csv`.

A training can take several launches of verl: the flow retries a stalled one, and `promptr1 train` after a
failure resumes from the last checkpoint. Each launch logs into its own MLflow run (the train stage opens one
per invocation, and verl's logger attaches to it through `MLFLOW_RUN_ID`), so the run of the last launch holds
only the steps after its resume point.

- **The ledger** `verl_launches.json` in the checkpoint folder lists each launch's run and the step it resumed
  from (`record_launch`, before verl starts). It lives beside the checkpoints it describes (the persisted DVC
  output `paths.checkpoint_dir`) and a launch from scratch starts a new one.
- **The export** (`export_steps_csv`) reads the metric histories of every listed run. A launch's steps after its
  resume point replace what earlier launches logged for them, logged or not (training went on from its
  checkpoint, so an earlier launch's later steps were redone); its figures at or before that point (verl logs the validation
  before training at the resume step) only fill what the earlier row lacks. verl's `critic/score/*` are also
  written, and logged to each run, as `reward/*` (step_metrics).
- **The check** (`steps_record_problem`): the training rows (those with `critic/score/mean`) must be exactly the
  steps from the ledger's first resume point to the verified last step, and hold every step this launch's output
  showed. When verl's MLflow logger fails to start it logs nothing and verl carries on ("Proceeding without
  MLflow tracking", verl/utils/tracking.py), which would otherwise give an empty file and an INFO line. The file
  is written either way, for inspection and so that a rerun does not launch verl past its last step (the stage
  then finds training complete); the stage fails with the steps missing, naming each launch's run.
"""

from __future__ import annotations

import collections
import csv
import json
import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from pipeline.errors import DataError

log = logging.getLogger(__name__)

LEDGER = "verl_launches.json"
STEPS_RECORD_MARK = "training steps record"
"""Start of the export check's message (the flow does not retry it: flows/policies.py)."""
TRAINING_METRIC = "critic/score/mean"
"""Present in every training step's metrics (verl's `compute_data_metrics`), absent from validation-only rows."""
VERL_REWARD_ALIASES = {"critic/score/mean": "reward/mean", "critic/score/max": "reward/max",
                       "critic/score/min": "reward/min"}
"""verl names GRPO's reward `critic/score/*`; the run and steps.csv also get it as `reward/*` (step_metrics)."""
_BATCH = 500


@dataclass(frozen=True)
class Launch:
    """One launch of verl within a training."""

    run_id: str
    """The MLflow run verl's logger wrote into."""
    resumed_from: int
    """The checkpoint step the launch resumed from (0: from scratch)."""


def read_launches(checkpoint_dir: Path) -> list[Launch]:
    """The ledger's launches, oldest first ([] when there is none or it is unreadable: logged)."""
    path = checkpoint_dir / LEDGER
    if not path.is_file():
        return []
    try:
        return [Launch(**entry) for entry in json.loads(path.read_text(encoding="utf-8"))["launches"]]
    except (ValueError, KeyError, TypeError) as exc:
        log.warning("%s is unreadable (%s): the steps record starts at this launch", path, exc)
        return []


def record_launch(checkpoint_dir: Path, launch: Launch) -> list[Launch]:
    """Add `launch` to the ledger (a fresh start replaces it); returns the training's launches, oldest first."""
    earlier = [] if launch.resumed_from == 0 else read_launches(checkpoint_dir)
    launches = [*(e for e in earlier if e.run_id != launch.run_id), launch]
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    tmp = checkpoint_dir / f".{LEDGER}.tmp"
    tmp.write_text(json.dumps({"launches": [asdict(e) for e in launches]}, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, checkpoint_dir / LEDGER)
    return launches


def _run_rows(client, run_id: str) -> dict[int, dict[str, float]]:
    """One run's metrics by step, with the `reward/*` aliases (logged to the run where it lacks them)."""
    from mlflow.entities import Metric

    logged = client.get_run(run_id).data.metrics
    by_step: dict[int, dict[str, float]] = collections.defaultdict(dict)
    aliases: list[Metric] = []
    for key in sorted(logged):
        for m in client.get_metric_history(run_id, key):
            by_step[m.step][key] = m.value
            alias = VERL_REWARD_ALIASES.get(key)
            if alias is not None and alias not in logged:
                by_step[m.step][alias] = m.value
                aliases.append(Metric(alias, m.value, m.timestamp, m.step))
    for i in range(0, len(aliases), _BATCH):
        client.log_batch(run_id, metrics=aliases[i : i + _BATCH])
    return by_step


def training_rows(launches: Sequence[Launch]) -> dict[int, dict[str, float]]:
    """Every launch's metrics by step, later launches replacing the steps they trained (module docstring)."""
    import mlflow

    client = mlflow.MlflowClient()
    rows: dict[int, dict[str, float]] = {}
    for launch in launches:
        rows = {step: row for step, row in rows.items() if step <= launch.resumed_from}  # redone from here on
        for step, metrics in _run_rows(client, launch.run_id).items():
            if step > launch.resumed_from or step not in rows:
                rows[step] = dict(metrics)
            else:
                for key, value in metrics.items():
                    rows[step].setdefault(key, value)
    return rows


def steps_record_problem(rows: dict[int, dict[str, float]], launches: Sequence[Launch], last_step: int,
                         seen: Iterable[int]) -> str | None:
    """Why the exported rows do not hold the steps the training went through, or None. The training rows must be
    steps `launches[0].resumed_from + 1` … `last_step`, every one, including those this launch's output showed
    (`seen`)."""
    trained = {step for step, metrics in rows.items() if TRAINING_METRIC in metrics}
    start = launches[0].resumed_from if launches else 0
    expected = set(range(start + 1, last_step + 1)) | set(seen)
    missing, extra = sorted(expected - trained), sorted(trained - expected)
    if not missing and not extra:
        return None
    parts = []
    if missing:
        owners = sorted({_owner(launches, step) for step in missing})
        parts.append(f"MLflow holds no {TRAINING_METRIC} for step(s) {_span(missing)}, which the run(s) "
                     f"{', '.join(owners)} should hold (verl's log says 'Proceeding without MLflow tracking' when its "
                     "logger failed to start)")
    if extra:
        parts.append(f"it holds training step(s) {_span(extra)} beyond steps {start + 1}..{last_step}")
    return "; ".join(parts)


def _owner(launches: Sequence[Launch], step: int) -> str:
    """The run of the last launch that resumed before `step`: the one that trained it."""
    owner = [e.run_id for e in launches if e.resumed_from < step]
    return owner[-1] if owner else "(none in the ledger)"


def _span(steps: list[int]) -> str:
    return ", ".join(map(str, steps)) if len(steps) <= 8 else f"{steps[0]}..{steps[-1]} ({len(steps)} steps)"


def write_steps_csv(rows: dict[int, dict[str, float]], path: Path) -> int:
    """`step,<metric>,…`, one row per step; returns the number of rows."""
    keys = sorted({k for row in rows.values() for k in row})
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=["step", *keys])
        writer.writeheader()
        for step in sorted(rows):
            writer.writerow({"step": step, **rows[step]})
    return len(rows)


def export_steps_csv(launches: Sequence[Launch], path: Path, *, last_step: int, seen: Iterable[int] = ()) -> int:
    """Write every launch's steps to `path` (module docstring); returns the rows written. Raises DataError,
    after writing the file, when the training rows do not match the steps the training went through."""
    rows = training_rows(launches)
    written = write_steps_csv(rows, path)
    problem = steps_record_problem(rows, launches, last_step, seen)
    if problem is not None:
        raise DataError(f"{STEPS_RECORD_MARK}: {path} does not hold every training step: {problem}; the "
                        f"launches are listed in {LEDGER} beside the checkpoints")
    return written
