"""The local GRPO backend's run (`train_local`): resume, warm up once, then step, log and checkpoint.

`train_local` reads top to bottom:
1. refuse warm-up + LoRA; drop checkpoints trained with other params and find the one to resume
   (`pipeline.train.local.resume`); stop at once when it already reached `train.steps`;
2. load the training set (`pipeline.train.local.questions`) and the policy (`pipeline.train.local.models`), restore the
   optimizer, RNG state and data position from the checkpoint;
3. with the environment server up: the format warm-up if asked and not yet done (`pipeline.train.local.warmup`);
4. GRPO steps (`pipeline.train.local.trainer.LocalTrainer.step`), each logged to `reports/train/steps.csv` and
   MLflow (`pipeline.train.local.step_metrics`), its trajectories to `reports/train/trajectories.jsonl` and a
   sample of them as MLflow traces (`pipeline.train.local.trajectory_log`), checkpointed every `save_every`
   (`pipeline.train.checkpoint`) once its size fits in the folder's free space (`pipeline.disk_space`: else one
   line naming the folder, the free space and the size, and the last checkpoint stays); each step is first
   judged by the health gate (`pipeline.train.health_gate`):
   a breach logs the step, tags the run and raises `TrainingUnhealthy` before the step is checkpointed.

Design decisions:
- **Reference policy** (`pipeline.train.local.models`): a frozen base copy for a full fine-tune, overwritten with
  the weights right after the format warm-up when `train.warmup.steps > 0` (kept in
  `<checkpoint_dir>/warmup/model` for resumes); LoRA → adapters disabled (warm-up + LoRA is refused for that
  reason).
- **Format warm-up** (`pipeline.train.local.warmup`, off when `train.warmup.steps` is 0): supervised steps on
  Prompt-R1 demonstrations before GRPO step 1, with its own optimizer; a `step_0` checkpoint with
  `warmup_done` follows it, so a resumed run does not repeat it. Its metrics go to MLflow (`warmup/*`) and
  `reports/train/warmup.csv`; steps.csv's `step` stays the GRPO step.
- **The environment server is started once** for the whole run (`serve_environment(plan.server)`), reused
  if one already answers.
- **A budget stop keeps every finished step**: on `BudgetExceeded` the last finished step is checkpointed
  (if not already) and the data position rewound to it, so a later call resumes without a gap or a repeat.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import torch

from pipeline import disk_space
from pipeline.errors import BudgetExceeded, EnvironmentUnhealthy, UserError
from pipeline.paths import display_path
from pipeline.stage_files import TRAJECTORIES_FILE
from pipeline.train import checkpoint as ckpt
from pipeline.train import health_gate
from pipeline.train.local import warmup
from pipeline.train.local.models import (
    PolicyModels,
    load_full_weights,
    load_policy_models,
    pick_device,
    write_weights,
)
from pipeline.train.local.questions import QuestionSampler, load_training_set, prompt_item_from_row
from pipeline.train.local.resume import discard_stale_checkpoints, reached_steps, training_config
from pipeline.train.local.step_metrics import (
    WARMUP_CSV,
    StepsLog,
    log_mlflow_metrics,
    set_run_tag,
    write_warmup_csv,
)
from pipeline.train.local.trainer import LocalTrainer
from pipeline.train.local.trajectory_log import TrajectoryLog, log_step_traces
from pipeline.train.plan import TrainPlan

if TYPE_CHECKING:
    from pipeline.config import TrainConfig

log = logging.getLogger(__name__)

WARMUP_DIR = "warmup"
"""Folder under the checkpoint dir holding the weights right after the format warm-up (the KL reference)."""


def train_local(plan: TrainPlan, run: Any = None, *, max_steps: int | None = None) -> dict[str, float]:
    """Run (or resume) local GRPO training up to `train.steps`; returns the last step's metrics.

    `max_steps` stops after that many new steps in this call (benchmarks, tests); checkpoints and logs
    stay consistent, so a later call continues.
    """
    from pipeline.environment.client import EnvironmentClient
    from pipeline.environment.servers import serve_environment

    cfg = plan.train
    _refuse_warmup_with_lora(cfg)
    discard_stale_checkpoints(plan)
    folder = ckpt.latest_checkpoint(plan.checkpoint_dir)
    state = ckpt.TrainerState.read(folder) if folder else None
    start = state.step if state else 0
    # A run resumed from a GRPO step never warms up (it either did, or ran without warm-up).
    need_warmup = cfg.warmup.steps > 0 and state is None
    steps_log = StepsLog(plan.steps_csv, keep_upto=start)
    trajectory_log = TrajectoryLog(plan.steps_csv.with_name(TRAJECTORIES_FILE), keep_upto=start)
    if reached_steps(start, cfg):
        log.info("training already complete: checkpoint at step %d >= train.steps %d", start, cfg.steps)
        return dict(state.metrics) if state else {}

    training = _TrainingRun(plan, _load_trainer(plan, folder, state), steps_log, trajectory_log,
                            warmed=bool(state and state.warmup_done))
    last: dict[str, float] = dict(state.metrics) if state else {}
    gate = health_gate.HealthGate(cfg.health, health_gate.LOCAL_METRICS, cfg.steps,
                             [(int(r["step"]), r) for r in steps_log.rows])  # a resume judges the same windows
    end = cfg.steps if max_steps is None else min(cfg.steps, start + max_steps)
    with serve_environment(plan.server):
        if need_warmup:
            trainer = training.trainer
            warm_metrics = _run_warmup(plan, trainer.models, trainer.frame, trainer.device, plan.checkpoint_dir)
            training.warmed = True
            training.save(0, warm_metrics)
            if cfg.steps == 0:
                return warm_metrics
        env = EnvironmentClient.in_cache_dir(plan.environment, plan.cache_dir)
        if end > start:
            log.info("GRPO rollouts sampled by %s", "llama.cpp's server (the policy exported to GGUF each step)"
                     if training.trainer.engine == "llama.cpp" else "the policy in this process (transformers)")
            set_run_tag("train.rollout_engine_used", training.trainer.engine)
        try:
            return _grpo_steps(training, env, gate, start, end, last)
        finally:
            _close_env(env)


@dataclass
class _TrainingRun:
    """One call of `train_local`: the plan, the trainer, and the logs its steps are written to."""

    plan: TrainPlan
    trainer: LocalTrainer
    steps_log: StepsLog
    trajectory_log: TrajectoryLog
    warmed: bool
    """The format warm-up is done: the checkpoints saved from now on say so (`warmup_done`)."""

    def save(self, step: int, metrics: dict[str, float]) -> None:
        plan, cfg, sampler = self.plan, self.plan.train, self.trainer.sampler
        st = ckpt.TrainerState(step=step, epoch=sampler.epoch, position=sampler.position, seed=plan.seed,
                               base_model=plan.agent.model, lora=cfg.lora.enabled, steps_target=cfg.steps,
                               metrics=metrics, config=training_config(plan), warmup_done=self.warmed)
        _save_if_it_fits(plan, self.trainer.models, self.trainer.optimizer, st)

    def log_step(self, step: int, metrics: dict[str, float]) -> None:
        """The step to steps.csv and its trajectories to trajectories.jsonl."""
        self.steps_log.append(step, metrics)
        self.trajectory_log.append(step, self.trainer.last_trajectories)


def _load_trainer(plan: TrainPlan, folder: Path | None, state: ckpt.TrainerState | None) -> LocalTrainer:
    """The trainer over the training set: the policy, its optimizer, the RNG state and the data position restored
    from the checkpoint `folder` (`state`: its trainer state), or fresh when there is none."""
    cfg = plan.train
    torch.manual_seed(plan.seed)
    np.random.seed(plan.seed)
    device = pick_device()
    frame = load_training_set(plan.train_file)
    log.info("loading the policy %s (%s)%s", plan.agent.model, "LoRA" if cfg.lora.enabled else "full",
             f", resuming from {display_path(folder, plan.root)}" if folder else "")
    models = load_policy_models(plan.require_agent_model(), plan.agent, cfg, folder, device)
    sampler = QuestionSampler(len(frame), plan.seed, state.epoch if state else 0, state.position if state else 0)
    trainer = LocalTrainer(plan, models, frame, device, sampler)
    # A fresh run's reference is a copy of the policy (the base, or the warmed weights after the warm-up):
    # its first update takes the reference log-probs from the policy's own forward (LocalTrainer.update).
    trainer.reference_is_policy = folder is None
    log.info("warm-up and updates in %s (train.autocast: %s)", trainer.autocast_dtype or "float32",
             cfg.autocast)
    set_run_tag("train.autocast_used", trainer.autocast_dtype or "float32")
    if state is not None and state.warmup_done and models.reference is not None:
        _load_warmed_reference(models, plan.checkpoint_dir, plan.agent.model, plan.root)
    if folder is not None and state is not None:
        ckpt.restore_optimizer_and_rng(trainer.optimizer, folder)
        log.info("resumed at step %d (epoch %d, position %d)", state.step, sampler.epoch, sampler.position)
    return trainer


def _grpo_steps(training: _TrainingRun, env: Any, gate: health_gate.HealthGate, start: int, end: int,
                last: dict[str, float]) -> dict[str, float]:
    """GRPO steps `start`+1 … `end`, each judged by the health gate, then checkpointed and logged; returns the
    last finished step's metrics (`last` when none finishes)."""
    from pipeline.progress import progress

    plan, trainer, sampler = training.plan, training.trainer, training.trainer.sampler
    cfg = plan.train
    bar = progress(range(start + 1, end + 1), desc="GRPO", unit="step", total=end - start)
    try:
        for step in bar:
            position = (sampler.epoch, sampler.position)
            try:
                metrics = trainer.step(env, step)
            except (BudgetExceeded, EnvironmentUnhealthy):
                # Keep every finished step: checkpoint the last one (its questions drawn, not this one's);
                # the failing step itself is never saved, so a resume redoes it against a healthy server.
                sampler.restore(*position)
                if step - 1 > start and (step - 1) % cfg.save_every != 0:
                    training.save(step - 1, last)
                raise
            breach = gate.observe(step, metrics)
            if breach is not None:
                # Judged before the save: the breaching step's weights never become a checkpoint.
                training.log_step(step, metrics)
                log_mlflow_metrics(metrics, step)
                raise health_gate.stop_training(breach, _kept(plan.checkpoint_dir))
            t0 = time.perf_counter()
            if step % cfg.save_every == 0 or step == cfg.steps or step == end:
                training.save(step, metrics)
            metrics["timing_s/save"] = time.perf_counter() - t0
            training.log_step(step, metrics)
            log_step_traces(step, trainer.last_trajectories[: plan.trace_train_samples])
            log_mlflow_metrics(metrics, step)
            bar.set_postfix(reward=f"{metrics['critic/score/mean']:.3f}",
                            step_s=f"{metrics['timing_s/step']:.1f}")
            last = metrics
    finally:
        bar.close()
    return last


def _save_if_it_fits(plan: TrainPlan, models: PolicyModels, optimizer: torch.optim.Optimizer,
                     state: ckpt.TrainerState) -> None:
    """`save_checkpoint` once the checkpoint's size fits in its folder's free space, else DiskFull naming the
    folder, the free space and the size; a save the disk cut short is removed and said the same way."""
    root = plan.checkpoint_dir
    with disk_space.writing(root, plan.root, _checkpoint_bytes(models, optimizer, root),
                            f"step {state.step}'s checkpoint", _disk_advice(root),
                            cleanup=partial(ckpt.remove_partial_saves, root)):
        ckpt.save_checkpoint(root, state, partial(write_weights, models), optimizer,
                             keep=plan.train.keep_checkpoints)


def _checkpoint_bytes(models: PolicyModels, optimizer: torch.optim.Optimizer, root: Path) -> int:
    """Bytes the next checkpoint takes, the larger of: the newest one on disk, and what `write_weights` saves (the
    adapter with LoRA, else the whole model) plus the optimizer's state as it is now (AdamW holds none before its
    first step), the tokenizer's few MB aside."""
    params = list(models.model.parameters())
    saved = sum(p.numel() * p.element_size() for p in params if p.requires_grad or not models.lora)
    state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    estimate = saved + sum(t.numel() * t.element_size() for t in state)
    last = ckpt.latest_checkpoint(root)
    return max(estimate, ckpt.folder_bytes(last)) if last is not None else estimate


def _disk_advice(root: Path) -> str:
    folder = ckpt.latest_checkpoint(root)
    kept = f"{folder.name} is kept and a rerun resumes from it" if folder else "no checkpoint was written"
    return ("free space there, lower train.keep_checkpoints, or point paths.checkpoint_dir at a larger disk "
            f"({kept})")


def _kept(root: Path) -> str:
    folder = ckpt.latest_checkpoint(root)
    if folder is None:
        return "no checkpoint kept (none was saved before the breach)"
    return f"kept checkpoint {folder.name} (the last saved at or before the last healthy step)"


def _refuse_warmup_with_lora(train: TrainConfig) -> None:
    if train.warmup.steps > 0 and train.lora.enabled:
        raise UserError("train.warmup with LoRA is not supported (the LoRA KL reference is the base with "
                        "adapters disabled, which would undo the warm-up): set train.warmup.steps: 0 or "
                        "train.lora.enabled: false")


def _load_warmed_reference(models: PolicyModels, root: Path, base_ref: str, project: Path) -> None:
    """A resumed run after the warm-up: the frozen KL reference is the warmed weights kept on disk."""
    shown = display_path(root / WARMUP_DIR, project)
    if (root / WARMUP_DIR / "model").is_dir():
        load_full_weights(models.reference, root / WARMUP_DIR / "model", base_ref)  # type: ignore[arg-type]
        log.info("KL reference: the warmed-up weights in %s", shown)
    else:
        log.warning("%s missing: the KL reference falls back to the base weights", shown)


def _run_warmup(plan: TrainPlan, models: PolicyModels, frame: pd.DataFrame, device: torch.device,
                root: Path) -> dict[str, float]:
    """The format warm-up, then the warmed weights become the frozen KL reference (and are kept on disk)."""
    import os
    import shutil

    from pipeline.environment.client import CACHE_FILE, EnvironmentClient
    from pipeline.environment.spec import environment_with

    # Demonstrations see the environment at temperature 0 (deterministic, cached) whatever training uses.
    env_cfg = environment_with(plan.environment, temperature=0.0)
    cache = plan.cache_dir / CACHE_FILE if env_cfg.cache else None
    env = EnvironmentClient(env_cfg, cache)
    w = plan.train.warmup
    log.info("format warm-up: %d steps x %d demonstrations, lr %g", w.steps, w.batch_size, w.lr)
    try:
        rows = warmup.run_warmup(plan, models.model, models.tokenizer, frame, env, device, prompt_item_from_row,
                                 log_metrics=log_mlflow_metrics)
    finally:
        _close_env(env)
    write_warmup_csv(plan.reports_dir / WARMUP_CSV, rows)
    if models.reference is not None:
        models.reference.load_state_dict(models.model.state_dict())
    tmp = root / f".tmp-{WARMUP_DIR}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    models.model.save_pretrained(str(tmp / "model"), safe_serialization=True)
    shutil.rmtree(root / WARMUP_DIR, ignore_errors=True)
    os.replace(tmp, root / WARMUP_DIR)
    last = dict(rows[-1]) if rows else {}
    last["warmup/total_s"] = sum(r["warmup/step_s"] for r in rows) + rows[0].get("warmup/build_s", 0.0) if rows else 0.0
    return last


def _close_env(env) -> None:
    import asyncio

    try:
        asyncio.run(env.aclose())
    except Exception as exc:  # noqa: BLE001 - closing must not hide the real outcome of training
        log.debug("closing the environment client: %s", exc)
