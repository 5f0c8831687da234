"""Stage `train` (`promptr1 train`): GRPO on the agent with the backend params name, tracked in MLflow.

- backend `local` → `pipeline.train.local.train_local` (transformers on CPU / one GPU);
- backend `verl`  → `pipeline.train.verl_backend.train_verl` (Ray cluster of GPU nodes).

Both run inside `tracking.stage_run(params, "train", new_parent=True)`: a trained model starts a new
pipeline execution (parent run), recorded in `reports/mlflow_run.json` for the later stages.

The stage ends by describing itself (`tracking.describe_stage`): model, backend, steps, last reward; and
by logging its params, its input dataset and the last step's reward on the parent (`pipeline.train.record`).
The trajectory log reaches MLflow as a sanitised copy (`pipeline.environment.sanitize`): it holds the
environment's replies, untrusted text.

Rerunning is safe: the local backend resumes from its last checkpoint. When training is already complete
(checkpoint at `train.steps`, `reports/train/steps.csv` and `reports/mlflow_run.json` present) the stage
does nothing, so a forced `dvc repro` does not open an empty MLflow run; if the run file is missing it
opens one and logs the recorded curve into it, so the stage's outputs are always valid.
"""

from __future__ import annotations

import logging
import math
import tempfile
from pathlib import Path

from pipeline import tracking
from pipeline.config import Params
from pipeline.environment.sanitize import sanitized_json_copy
from pipeline.train.record import log_training_record

log = logging.getLogger(__name__)


def run_train(params: Params) -> None:
    """Train the agent (see module docstring)."""
    if params.train.backend == "local":
        from pipeline.train.resume import training_complete

        if training_complete(params) and (params.path(params.paths.reports_dir) / tracking.RUN_FILE).is_file():
            log.info("train: already complete at %d steps (checkpoints in %s); nothing to do",
                     params.train.steps, params.paths.checkpoint_dir)
            return
    if params.train.backend == "verl":  # GPUs here and in Ray, disk, verl's validation: before anything starts
        from pipeline.train.resources import assert_resources

        assert_resources(params)
    with tracking.stage_run(params, "train", new_parent=True) as run:
        import mlflow

        mlflow.set_tag("train.backend", params.train.backend)
        if params.train.backend == "verl":
            from pipeline.train.verl_backend import train_verl

            if params.train.warmup.steps > 0:
                log.warning("train.warmup is a local-backend feature: ignored with backend verl")

            train_verl(params, run)
            log_training_record(params)
            tracking.describe_stage("train", describe_training(params, {}))
            # verl keeps its rollouts in its own logs; the DVC output exists, empty, for every backend.
            from pipeline.train.step_metrics import steps_csv_path
            from pipeline.train.trajectory_log import TRAJECTORIES_FILE

            empty_log = steps_csv_path(params).with_name(TRAJECTORIES_FILE)
            empty_log.parent.mkdir(parents=True, exist_ok=True)
            empty_log.touch()
            return
        from pipeline.train.local import train_local
        from pipeline.train.resume import training_complete
        from pipeline.train.step_metrics import steps_csv_path
        from pipeline.train.trajectory_log import TRAJECTORIES_FILE

        if training_complete(params):
            _relog_curve(params)
            log_training_record(params)
            return
        final = train_local(params, run)
        log_training_record(params)
        tracking.describe_stage("train", describe_training(params, final))
        csv = steps_csv_path(params)
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


def describe_training(params: Params, final: dict[str, float]) -> str:
    """The train run's one-sentence description: what was trained, how, and the last step's reward."""
    cfg = params.train
    how = (f"GRPO on verl ({cfg.verl.nnodes} node(s) × {cfg.verl.n_gpus_per_node} GPUs)" if cfg.backend == "verl"
           else f"GRPO (local backend{', LoRA' if cfg.lora.enabled else ''})")
    sentence = (f"Trained the agent {params.agent.model} with {how} for {cfg.steps} steps of {cfg.batch_size} "
                f"questions × {cfg.group_size} trajectories")
    reward = final.get("reward/mean", final.get("critic/score/mean"))
    if reward is not None and math.isfinite(reward):
        sentence += f"; mean reward at the last step {reward:.3f}"
    return sentence + "."


def _relog_curve(params: Params) -> None:
    """Log an existing steps.csv into the active run (training done earlier, run record lost)."""
    import mlflow
    import pandas as pd

    from pipeline.train.step_metrics import steps_csv_path

    frame = pd.read_csv(steps_csv_path(params))
    for row in frame.to_dict("records"):
        step = int(row.pop("step"))
        mlflow.log_metrics({k: float(v) for k, v in row.items() if pd.notna(v)}, step=step)
    log.info("train: already complete; logged the recorded curve (%d steps) to MLflow", len(frame))
