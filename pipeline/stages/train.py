"""Stage `train` (`promptr1 train`): GRPO on the agent with the backend params name, tracked in MLflow.

- backend `local` → `pipeline.train.local.backend.train_local` (transformers on CPU / one GPU);
- backend `verl`  → `pipeline.train.verl.backend.run_verl` (Ray cluster of GPU nodes).

The two backends share only `pipeline/train/` itself (plan, checkpoints, completion, health gate, MLflow
record); neither imports the other, and this stage is the one place that picks between them.

Both run inside `tracking.stage_run(plan.tracking, "train", new_parent=True)`: a trained model starts a new
pipeline execution (parent run), recorded in `reports/mlflow_run.json` for the later stages.

The stage ends by describing itself (`tracking.describe_stage`): model, backend, steps, last reward; and
by logging its params, its input dataset and the last step's reward on the parent (`pipeline.train.mlflow_record`).
The trajectory log reaches MLflow as a sanitised copy (`pipeline.environment.sanitize`): it holds the
environment's replies, untrusted text.

Rerunning is safe: both backends resume from their last checkpoint. Whether training is complete is decided
once, at the entry, by `training_progress` below: the newest checkpoint against the total
(`train.steps` on the local backend; on verl the total verl computes, `pipeline.train.verl.schedule.verl_schedule`). When
it is complete (and `reports/train/steps.csv` and `reports/mlflow_run.json` are present) the stage does
nothing, so a forced `dvc repro` neither opens an empty MLflow run nor relaunches verl past its last step; if
the run file is missing it opens one and logs the recorded curve into it, so the stage's outputs are always
valid. The same figures go onto the train run as `train.progress.*` tags (incomplete before training, the
verified figures after), which the register stage reads (pipeline/train/completion.py).
"""

from __future__ import annotations

import logging
import math
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.config import Params
from pipeline.environment.sanitize import sanitized_json_copy
from pipeline.stage_files import RUN_FILE
from pipeline.tracking import runs as tracking
from pipeline.train.completion import TrainingProgress
from pipeline.train.mlflow_record import log_training_record

if TYPE_CHECKING:
    from pipeline.train.plan import TrainPlan

log = logging.getLogger(__name__)


def run_train(params: Params) -> None:
    """Train the agent (see module docstring). The one place that reads `Params` for what lies below it:
    the train plan (pipeline.train.plan) is resolved here, and whether training is complete decided once."""
    from pipeline.train.plan import TrainPlan

    plan = TrainPlan.from_params(params)
    complete = training_complete(plan)
    if complete and (plan.reports_dir / RUN_FILE).is_file():
        log.info("train: already complete at %s (checkpoints in %s); nothing to do",
                 training_progress(plan).describe(), params.paths.checkpoint_dir)
        return
    if plan.train.backend == "verl" and not complete:  # GPUs here and in Ray, disk, verl's validation
        from pipeline.train.verl.resources import assert_resources

        assert_resources(plan)
    with tracking.stage_run(plan.tracking, "train", new_parent=True) as run:
        import mlflow

        mlflow.set_tag("train.backend", plan.train.backend)
        if complete:
            _relog_curve(plan.steps_csv)
            log_training_record(plan, training_progress(plan))
            return
        if plan.train_file.is_file():  # recorded incomplete first: a run killed mid-way stays so for register
            mlflow.set_tags(training_progress(plan).tags())
        if plan.train.backend == "verl":
            _train_verl(plan, run)
        else:
            _train_local(plan, run)


def training_progress(plan: TrainPlan) -> TrainingProgress:
    """Where training stands before a run, on the figures register reads back (pipeline/train/completion.py).

    local: the newest checkpoint of the current training config against `train.steps`; verl: the checkpoint verl
    would resume from against the total verl computes (`pipeline.train.verl.schedule.verl_schedule`).
    """
    if plan.train.backend == "verl":
        from pipeline.train.verl.progress import resumed_step
        from pipeline.train.verl.schedule import verl_schedule

        schedule = verl_schedule(plan)
        step = resumed_step(plan.checkpoint_dir)
        return TrainingProgress(backend="verl", resumed_from=step, last_step=step, total_steps=schedule.total_steps,
                                total_from=schedule.derivation)
    from pipeline.train.local.resume import usable_checkpoint

    found = usable_checkpoint(plan)
    step = found[1].step if found is not None else 0
    return TrainingProgress(backend="local", resumed_from=step, last_step=step, total_steps=plan.train.steps,
                            total_from="train.steps")


def training_complete(plan: TrainPlan) -> bool:
    """True when training reached its total (`training_progress`) and steps.csv exists (the stage then has
    nothing to do; checked once, at its entry). A verl plan without its training set is not complete: the
    stage's own check names the missing file."""
    if plan.train.backend == "verl" and not plan.train_file.is_file():
        return False
    return training_progress(plan).complete and plan.steps_csv.is_file()


def _train_verl(plan: TrainPlan, run) -> None:
    """Launch verl (pipeline.train.verl.backend) inside the open train run, then record and describe it."""
    from pipeline.stage_files import TRAJECTORIES_FILE
    from pipeline.train.verl.backend import run_verl

    if plan.train.warmup.steps > 0:
        log.warning("train.warmup is a local-backend feature: ignored with backend verl")
    progress = run_verl(plan, tracking.tracking_uri(plan.tracking), run)
    log_training_record(plan, progress)
    tracking.describe_stage("train", describe_training(plan, {}))
    # verl keeps its rollouts in its own logs; the DVC output exists, empty, for every backend.
    empty_log = plan.steps_csv.with_name(TRAJECTORIES_FILE)
    empty_log.parent.mkdir(parents=True, exist_ok=True)
    empty_log.touch()


def _train_local(plan: TrainPlan, run) -> None:
    """Train with the local backend (pipeline.train.local.backend) inside the open train run, then record it: the
    steps.csv curve, a sanitised copy of the trajectory log, the last step's figures as `final/*`."""
    import mlflow

    from pipeline.stage_files import TRAJECTORIES_FILE
    from pipeline.train.local.backend import train_local

    final = train_local(plan, run)
    log_training_record(plan, training_progress(plan))
    tracking.describe_stage("train", describe_training(plan, final))
    csv = plan.steps_csv
    if csv.is_file():
        mlflow.log_artifact(str(csv), artifact_path="train")
    if csv.with_name(TRAJECTORIES_FILE).is_file():
        with tempfile.TemporaryDirectory() as tmp:
            copy = sanitized_json_copy(csv.with_name(TRAJECTORIES_FILE), Path(tmp))
            mlflow.log_artifact(str(copy), artifact_path="train")
    summary = {f"final/{k}": v for k, v in final.items()
               if k.startswith(("critic/score", "reward/", "actor/")) and math.isfinite(v)}
    if summary:
        mlflow.log_metrics(summary)


def describe_training(plan: TrainPlan, final: dict[str, float]) -> str:
    """The train run's one-sentence description: what was trained, how, and the last step's reward."""
    cfg = plan.train
    how = (f"GRPO on verl ({cfg.verl.nnodes} node(s) × {cfg.verl.n_gpus_per_node} GPUs)" if cfg.backend == "verl"
           else f"GRPO (local backend{', LoRA' if cfg.lora.enabled else ''})")
    sentence = (f"Trained the agent {plan.agent.model} with {how} for {cfg.steps} steps of {cfg.batch_size} "
                f"questions × {cfg.group_size} trajectories")
    reward = final.get("reward/mean", final.get("critic/score/mean"))
    if reward is not None and math.isfinite(reward):
        sentence += f"; mean reward at the last step {reward:.3f}"
    return sentence + "."


def _relog_curve(steps_csv: Path) -> None:
    """Log an existing steps.csv into the active run (training done earlier, run record lost)."""
    import mlflow
    import pandas as pd

    frame = pd.read_csv(steps_csv)
    for row in frame.to_dict("records"):
        step = int(row.pop("step"))
        mlflow.log_metrics({k: float(v) for k, v in row.items() if pd.notna(v)}, step=step)
    log.info("train: already complete; logged the recorded curve (%d steps) to MLflow", len(frame))
