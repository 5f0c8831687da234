"""Did a verl launch train the steps it should, and is it still training? Resume verification and the watchdog.

verl 0.9.1 (`verl/trainer/ppo/ray_trainer.py`) resumes with `trainer.resume_mode=auto` from the step named by
`<trainer.default_local_dir>/latest_checkpointed_iteration.txt`, then trains steps N+1 … total, printing one
console line per step (`step:N - key:value - …`, verl_health.py) after that step's checkpoint save and
validation. Two of its failure modes exit 0 as if nothing were wrong: a resume that silently restarts at step 0
(verl issue 7952: the checkpoint is not found, training starts afresh and overwrites the newer checkpoints) and a
resume at an epoch boundary whose dataloader state marks the epoch exhausted, so the epoch is skipped (verl issue
7401). A hang in weight sync or an NCCL collective (verl issue 6967) leaves the run waiting forever.

What this module checks, from the same output stream the health gate reads:

- **The schedule** (`VerlSchedule`, `verl_schedule`): the total verl computes, derived as verl derives it from
  the composed config (`pipeline.train.verl.config`, so `train.verl.extra_overrides` count):
  `trainer.total_training_steps` when set, else `trainer.total_epochs` × steps per epoch, where steps per
  epoch = training rows // `data.train_batch_size` (verl's train dataloader drops the last partial batch).
  When verl prints its own total (`Total training steps: N`, e.g. after `data.filter_overlong_prompts` dropped
  rows) that figure is the one a launch is held to.
- **The resume** (`ResumeCheck`): the checkpoint a launch must resume from is the newest `global_step_N`
  before the launch (verl's marker first, `checkpoint.latest_verl_step`). verl says where it resumes at the
  start of `fit`, before the checkpoint load and the validation before training (ray_trainer.py
  `_load_checkpoint`, `trainer.resume_mode=auto`): `Setting global step to N`, or `Training from scratch`
  (`fit_start`). A different step there, or else a first training step other than N+1, stops verl's process
  group at once (before a restart overwrites more checkpoints) with `TrainingIncomplete`, after setting aside
  what a restart saved and pointing verl's marker back at N. When verl exits 0, its last training step must be
  the total: a resume at an epoch boundary that logged at least a whole epoch fewer steps than it should is
  named a skipped epoch, any other shortfall a short run, unless verl's marker names the total
  (`latest_checkpointed_iteration.txt`, written after the last step's save, ray_trainer.py `_save_checkpoint`):
  the driver exits as soon as `fit` returns and Ray does not promise to forward a worker's last lines first.
  Every message names both figures: the step logged and the step expected, the last step and the total.
- **Progress** (`ProgressWatchdog`): until verl's fit-start line (or its first step line) the launch is
  bounded by `startup_s` alone: Ray, the workers, the rollout engines and the weights, a hang in any of which
  is stopped there. From then on the next step line must arrive within that step's bound (`StepBounds`),
  else verl's process group is stopped (SIGTERM, then SIGKILL after a grace) and the stage raises
  `TrainingStalled`. A step's bound is the environment's worst case for its rollout plus `train.verl.watchdog`'s
  allowances: `update_s` always; for the launch's first step, timed from the fit-start line, the checkpoint
  load (`checkpoint_s`, a resumed launch) and a validation pass with `val_before_train`; a validation pass at
  a step that validates (every `test_freq` steps and the last); `checkpoint_s` at a step that saves (every
  `save_freq` steps and the last). A validation-only line (the validation before training) is progress too.
  The environment's worst case for a rollout of C
  conversations of at most T turns, at most `environment.concurrency` calls in flight, each call at most
  `environment.timeout_s` × (1 + 1/`length_retry_factor`) (a request and its length retry, whose request is
  the one the timeout is sized for, pipeline/environment/budget.py), is list scheduling's bound:
  (⌈C·T / concurrency⌉ + T) × that call. A validation pass adds `validation_s` to the same bound for the
  validation rows. That worst case is loose for a large batch (the paper profile: 640 conversations, 64 in
  flight, 240 s timeout: 16,500 s); `watchdog.rollout_s` replaces it with a measured figure.

The flow retries a stalled train stage (it resumes from the last checkpoint); it does not retry a failed resume
check, which would meet the same checkpoint and the same verl (flows/policies.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.errors import DataError, TrainingIncomplete, TrainingStalled
from pipeline.runtime import stop_process_group
from pipeline.train.completion import TrainingProgress
from pipeline.train.verl.health_gate import TRAINING_KEY, parse_step_line

if TYPE_CHECKING:
    from pipeline.config import AgentConfig, EnvironmentConfig, WatchdogConfig
    from pipeline.train.plan import TrainPlan

log = logging.getLogger(__name__)

RESUME_CHECK_MARK = "training resume check"
"""Start of every resume-check message (the flow does not retry it: flows/policies.py)."""
STALL_MARK = "training stalled"
"""Start of the watchdog's message (the flow retries it)."""
_TOTAL_LINE = re.compile(r"Total training steps: (\d+)")
_STEP_FOLDER = re.compile(r"global_step_\d+")
_FROM_SCRATCH = re.compile(r"(?:^|\s)Training from scratch$")
_GLOBAL_STEP = re.compile(r"(?:^|\s)Setting global step to (\d+)$")
FIT_START_LINES = "'Training from scratch' or 'Setting global step to N'"
MARKER = "latest_checkpointed_iteration.txt"
"""verl's record of its newest checkpoint, written after each save (ray_trainer.py `_save_checkpoint`)."""
STOP_GRACE_S = 30.0
"""SIGTERM to SIGKILL: longer than the owner guard's own grace (pipeline/environment/guard.py)."""


# ------------------------------------------------------------------------------------------- schedule
@dataclass(frozen=True)
class VerlSchedule:
    """The steps verl 0.9.1 trains, and at which of them it validates and saves (ray_trainer.py `fit`)."""

    total_steps: int
    steps_per_epoch: int
    save_freq: int
    test_freq: int
    val_before_train: bool
    derivation: str
    """How `total_steps` follows from the config, for messages."""
    step_conversations: int = 0
    """Conversations one training step rolls out (`data.train_batch_size` × `rollout.n`)."""
    validation_conversations: int = 0
    """Conversations one validation pass rolls out (validation rows × `rollout.val_kwargs.n`)."""

    def saves_at(self, step: int) -> bool:
        return self.save_freq > 0 and (step % self.save_freq == 0 or step >= self.total_steps)

    def validates_at(self, step: int) -> bool:
        return self.test_freq > 0 and (step % self.test_freq == 0 or step >= self.total_steps)

    def epoch_boundary(self, step: int) -> bool:
        """Whether a resume at `step` starts a new epoch (verl 0.9.1 then skips restoring the dataloader)."""
        return step > 0 and self.steps_per_epoch > 0 and step % self.steps_per_epoch == 0


def schedule_from_config(value: Callable[[str], Any], train_rows: int, validation_rows: int = 0) -> VerlSchedule:
    """The schedule from a composed verl config (`value(key)`, `VerlRun.value`) and the training set's rows."""
    batch = int(value("data.gen_batch_size") or value("data.train_batch_size"))
    per_epoch = train_rows // batch  # StatefulDataLoader(drop_last=True)
    epochs = int(value("trainer.total_epochs"))
    explicit = value("trainer.total_training_steps")
    if explicit is not None:
        total, how = int(explicit), f"trainer.total_training_steps={int(explicit)}"
    else:
        total = per_epoch * epochs
        how = f"{epochs} epoch(s) x {per_epoch} steps ({train_rows} rows // data.train_batch_size {batch})"
    n = int(value("actor_rollout_ref.rollout.n") or 1)
    val_n = int(value("actor_rollout_ref.rollout.val_kwargs.n") or 1)
    return VerlSchedule(total_steps=total, steps_per_epoch=per_epoch, save_freq=int(value("trainer.save_freq")),
                        test_freq=int(value("trainer.test_freq")),
                        val_before_train=bool(value("trainer.val_before_train")), derivation=how,
                        step_conversations=int(value("data.train_batch_size")) * n,
                        validation_conversations=validation_rows * val_n)


def parquet_rows(path: Path) -> int:
    """Rows of a Parquet file (its footer only); DataError naming the file when it is not one."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path).metadata.num_rows
    except (OSError, pa.ArrowException) as exc:
        raise DataError(f"{path} is not a readable Parquet file ({exc}): run `dvc repro build` again") from None


def verl_schedule(plan: TrainPlan, val_files: list[Path] | None = None) -> VerlSchedule:
    """The schedule the plan's launch runs: our overrides composed with verl's config, the training set's rows."""
    from pipeline.train.verl.config import compose_plan
    from pipeline.train.verl.overrides import train_file

    path = train_file(plan)
    if not path.is_file():
        raise DataError(f"{path} not found: run `dvc repro build` (or `promptr1 build`) first")
    run = compose_plan(plan)
    val_rows = sum(parquet_rows(p) for p in (val_files or []) if p.is_file())
    schedule = schedule_from_config(run.value, parquet_rows(path), val_rows)
    if schedule.steps_per_epoch < 1 or schedule.total_steps < 1:
        raise DataError(f"{path} gives verl no training step ({parquet_rows(path)} rows, {schedule.derivation}): "
                        "build more rows or lower train.batch_size")
    return schedule


def fit_start(line: str) -> int | None:
    """The step verl says it resumes from at the start of `fit` (`Setting global step to N`; 0 for `Training
    from scratch`), or None for any other line."""
    text = line.rstrip()
    if _FROM_SCRATCH.search(text):
        return 0
    match = _GLOBAL_STEP.search(text)
    return int(match.group(1)) if match else None


def marker_step(checkpoint_dir: Path) -> int | None:
    """The step verl's marker names when that step's actor checkpoint exists, else None."""
    marker = checkpoint_dir / MARKER
    try:
        step = int(marker.read_text().strip())
    except (OSError, ValueError):
        return None
    return step if (checkpoint_dir / f"global_step_{step}" / "actor").is_dir() else None


def resumed_step(checkpoint_dir: Path) -> int:
    """The step of the checkpoint verl must resume from (`latest_verl_step`), 0 when there is none."""
    from pipeline.train.checkpoint import latest_verl_step

    actor = latest_verl_step(checkpoint_dir)
    return int(actor.parent.name.rsplit("_", 1)[1]) if actor is not None else 0


# ------------------------------------------------------------------------------------------- resume
def verl_step_folders(root: Path) -> set[str]:
    """The names of verl's `global_step_N` folders under `root`."""
    return {c.name for c in root.iterdir() if _STEP_FOLDER.fullmatch(c.name)} if root.is_dir() else set()


class ResumeCheck:
    """Fed verl's lines; holds a launch to resuming at `resumed_from` + 1 and ending at the total."""

    def __init__(self, schedule: VerlSchedule, resumed_from: int, checkpoint_dir: Path) -> None:
        self.schedule = schedule
        self.resumed_from = resumed_from
        self.checkpoint_dir = checkpoint_dir
        self.folders_before = verl_step_folders(checkpoint_dir)
        """verl's checkpoint folders before the launch: what a stopped restart wrote is the rest."""
        self.first: int | None = None
        self.last: int | None = None
        self.logged = 0
        self.verl_total: int | None = None
        """verl's own `Total training steps: N`, when printed."""
        self.started_at: int | None = None
        """The step verl's fit-start line named (`fit_start`), when printed."""
        self.seen: list[int] = []
        """The training steps whose lines this launch's output carried, in order."""

    @property
    def total(self) -> int:
        return self.verl_total if self.verl_total is not None else self.schedule.total_steps

    @property
    def total_from(self) -> str:
        if self.verl_total is not None and self.verl_total != self.schedule.total_steps:
            return f"verl's log: Total training steps: {self.verl_total}"
        return self.schedule.derivation

    def _checkpoint(self) -> str:
        return f"checkpoint global_step_{self.resumed_from} in {self.checkpoint_dir}"

    def observe(self, line: str) -> None:
        """Raises TrainingIncomplete when verl's fit-start line, or else its first training step, does not
        follow the checkpoint."""
        total = _TOTAL_LINE.search(line)
        if total:
            self.verl_total = int(total.group(1))
            if self.verl_total != self.schedule.total_steps:
                log.warning("verl computes %d training steps, the stage derived %d (%s): holding the run to verl's",
                            self.verl_total, self.schedule.total_steps, self.schedule.derivation)
            return
        started = fit_start(line)
        if started is not None and self.started_at is None:
            self.started_at = started
            if started != self.resumed_from:
                raise TrainingIncomplete(self._fit_start_message(started))
            return
        parsed = parse_step_line(line)
        if parsed is None or TRAINING_KEY not in parsed[1]:
            return
        step = parsed[0]
        if self.first is None:
            self.first = step
            if step != self.resumed_from + 1:
                raise TrainingIncomplete(self._restart_message(step))
        self.last = step if self.last is None else max(self.last, step)
        self.logged += 1
        self.seen.append(step)

    def _restart_message(self, step: int) -> str:
        expected = self.resumed_from + 1
        if self.resumed_from > 0 and step == 1:
            what = (f"verl restarted at step 0: its first training step was 1, but the {self._checkpoint()} existed "
                    f"before the launch (verl's marker latest_checkpointed_iteration.txt), so it should have been "
                    f"step {expected}")
        else:
            start = self._checkpoint() if self.resumed_from else "no checkpoint (a fresh start)"
            what = f"verl's first training step was {step}, but the launch resumed from {start}: expected step {expected}"
        return (f"{RESUME_CHECK_MARK}: {what}; verl was stopped so it cannot overwrite the checkpoints "
                "(see verl issue 7952)")

    def _fit_start_message(self, started: int) -> str:
        said = "Training from scratch" if started == 0 else f"Setting global step to {started}"
        if self.resumed_from > 0 and started == 0:
            what = (f"verl restarted at step 0: it printed '{said}' at the start of training, but the "
                    f"{self._checkpoint()} existed before the launch (verl's marker {MARKER}), so it should have "
                    f"resumed from step {self.resumed_from}")
        else:
            start = self._checkpoint() if self.resumed_from else "no checkpoint (a fresh start)"
            what = (f"verl printed '{said}' at the start of training, but the launch resumed from {start}: "
                    f"expected step {self.resumed_from}")
        return (f"{RESUME_CHECK_MARK}: {what}; verl was stopped before its checkpoint load and first step, so "
                "it cannot overwrite the checkpoints (see verl issue 7952)")

    def undo_restart(self) -> str:
        """After a restart was stopped: set the checkpoints it wrote aside (`restarted-global_step_K`, kept for
        inspection, invisible to verl and merge) and point verl's marker back at the checkpoint it should have
        resumed from. verl saves a step before printing its line, so with `save_freq` 1 the restart's step 1 is on
        disk and would otherwise be what the next launch resumes from. Returns what was done, for the message."""
        root = self.checkpoint_dir
        moved = sorted(verl_step_folders(root) - self.folders_before)
        for name in moved:
            target = root / f"restarted-{name}"
            if target.exists():
                shutil.rmtree(target)
            os.replace(root / name, target)
        done = [f"set aside {', '.join(moved)} as restarted-*"] if moved else []
        if self.resumed_from and (root / f"global_step_{self.resumed_from}" / "actor").is_dir():
            tmp = root / ".latest_checkpointed_iteration.tmp"
            tmp.write_text(str(self.resumed_from))
            os.replace(tmp, root / "latest_checkpointed_iteration.txt")
            done.append(f"verl's marker points at global_step_{self.resumed_from} again")
        return "; ".join(done) or "no checkpoint was written"

    def verify(self) -> TrainingProgress:
        """After verl exited 0: the launch's progress; raises TrainingIncomplete when it ended short of the total."""
        total = self.total
        last = self.last if self.last is not None else self.resumed_from
        progress = TrainingProgress(backend="verl", resumed_from=self.resumed_from, last_step=last,
                                    total_steps=total, total_from=self.total_from)
        if progress.complete:
            return progress
        saved = marker_step(self.checkpoint_dir)
        if saved is not None and saved == total > self.resumed_from:
            log.warning("verl's last step line(s) did not reach this process (last seen: %s), but its marker %s "
                        "names global_step_%d, saved after the last step: the run is complete", self.last,
                        MARKER, saved)
            return TrainingProgress(backend="verl", resumed_from=self.resumed_from, last_step=saved,
                                    total_steps=total, total_from=self.total_from)
        logged = (f"logged {self.logged} training step(s) ({self.first}..{self.last})" if self.logged
                  else "logged no training step")
        start = self._checkpoint() if self.resumed_from else "no checkpoint (a fresh start)"
        figures = (f"verl exited 0 having {logged} after resuming from {start}; its last step {last} is short of "
                   f"the {total} it computes ({self.total_from})")
        missing = total - self.resumed_from - self.logged
        if self.schedule.epoch_boundary(self.resumed_from) and missing >= self.schedule.steps_per_epoch:
            epoch = self.resumed_from // self.schedule.steps_per_epoch
            raise TrainingIncomplete(
                f"{RESUME_CHECK_MARK}: skipped epoch: {figures}; the resume was at an epoch boundary "
                f"(step {self.resumed_from} = {epoch} epoch(s) x {self.schedule.steps_per_epoch} steps), where "
                "verl can skip the next epoch (verl issue 7401)")
        raise TrainingIncomplete(f"{RESUME_CHECK_MARK}: short run: {figures}")


# ------------------------------------------------------------------------------------------- watchdog
def environment_worst_s(env: EnvironmentConfig, max_turns: int, conversations: int) -> float:
    """The longest the environment can keep a rollout of `conversations` conversations waiting without a failed
    call (module docstring): list scheduling's bound over every call, each bounded by its timeout."""
    if conversations <= 0:
        return 0.0
    call_s = env.timeout_s * (1 + 1 / env.length_retry_factor)
    return (math.ceil(conversations * max_turns / env.concurrency) + max_turns) * call_s


@dataclass(frozen=True)
class StepBounds:
    """How long verl's start-up and each step's line may take to appear (module docstring)."""

    schedule: VerlSchedule
    cfg: WatchdogConfig
    rollout_s: float
    """The environment's worst case for one training step's rollout."""
    validation_rollout_s: float
    """The environment's worst case for one validation pass."""
    resumed: bool = False
    """The launch resumes a checkpoint: its first step also waits for the load."""

    @classmethod
    def of(cls, schedule: VerlSchedule, cfg: WatchdogConfig, env: EnvironmentConfig, agent: AgentConfig,
           resumed_from: int = 0) -> StepBounds:
        """The bounds for a profile: `cfg.rollout_s` when measured, else the environment's worst case."""
        if cfg.rollout_s is not None:
            share = schedule.validation_conversations / max(schedule.step_conversations, 1)
            return cls(schedule=schedule, cfg=cfg, rollout_s=cfg.rollout_s, validation_rollout_s=cfg.rollout_s * share,
                       resumed=resumed_from > 0)
        return cls(schedule=schedule, cfg=cfg,
                   rollout_s=environment_worst_s(env, agent.max_turns, schedule.step_conversations),
                   validation_rollout_s=environment_worst_s(env, agent.max_turns, schedule.validation_conversations),
                   resumed=resumed_from > 0)

    def startup_parts(self) -> dict[str, float]:
        """The start-up's allowance, from the launch to verl's fit-start line."""
        return {"start-up until verl's fit-start line": self.cfg.startup_s}

    def parts(self, step: int, first: bool) -> dict[str, float]:
        """The allowances that make up step `step`'s bound, by name, timed from the line before it; `first`:
        the launch's first step, timed from verl's fit-start line, with the checkpoint load (a resumed
        launch) and the validation before training still ahead of it."""
        validation = self.validation_rollout_s + self.cfg.validation_s
        parts = {"rollout": self.rollout_s, "update": self.cfg.update_s}
        if first and self.resumed:
            parts["checkpoint load"] = self.cfg.checkpoint_s
        if first and self.schedule.val_before_train:
            parts["validation before training"] = validation
        if self.schedule.validates_at(step):
            parts["validation"] = validation
        if self.schedule.saves_at(step):
            parts["checkpoint"] = self.cfg.checkpoint_s
        return parts

    def seconds(self, step: int, first: bool) -> float:
        return sum(self.parts(step, first).values())

    def explain(self, step: int, first: bool) -> str:
        return _explain(self.parts(step, first))


def _explain(parts: dict[str, float]) -> str:
    return " + ".join(f"{name} {s:.0f} s" for name, s in parts.items())


def suggested_rollout_s(measured_s: float, measured_conversations: int, conversations: int,
                        env: EnvironmentConfig, max_turns: int, margin: float = 2.0) -> float:
    """A `train.verl.watchdog.rollout_s` for steps of `conversations` conversations from one measured
    rollout (`measured_s` for `measured_conversations`, e.g. verl's `timing_s/gen` of the doctor's step):
    scaled as the environment's worst case scales between the two sizes (list scheduling over
    `environment.concurrency` calls in flight), times `margin`, rounded up to a minute."""
    scale = environment_worst_s(env, max_turns, conversations) / environment_worst_s(
        env, max_turns, max(measured_conversations, 1))
    return float(math.ceil(measured_s * scale * margin / 60.0) * 60)


class ProgressWatchdog:
    """Fed verl's lines (`observe`); while `watching` a process, stops its group when verl's start-up or its
    next step is overdue."""

    def __init__(self, bounds: StepBounds, resumed_from: int, *, grace_s: float = STOP_GRACE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.bounds = bounds
        self.grace_s = grace_s
        self._clock = clock
        self._lock = threading.Lock()
        self.next_step = resumed_from + 1
        self.started = False
        """verl's fit-start line (or a step line) seen: start-up is over."""
        self.first = True
        """No line since the fit-start line: the next step's bound holds the load and the validation before it."""
        self.since = clock()
        self.stall: str | None = None
        """What the watchdog saw when it stopped the run (None: it did not)."""

    def observe(self, line: str) -> None:
        total = _TOTAL_LINE.search(line)
        if total:
            with self._lock:  # verl's own count decides which step is the last (it validates and saves)
                schedule = dataclasses.replace(self.bounds.schedule, total_steps=int(total.group(1)))
                self.bounds = dataclasses.replace(self.bounds, schedule=schedule)
            return
        if fit_start(line) is not None:
            with self._lock:
                if not self.started:
                    self.started, self.since = True, self._clock()
            return
        parsed = parse_step_line(line)
        if parsed is None:
            return
        step, metrics = parsed
        with self._lock:
            if TRAINING_KEY in metrics:
                self.next_step = step + 1
            self.started, self.first = True, False
            self.since = self._clock()  # a validation-only line (before training) is progress too

    def bound(self) -> tuple[float, str, int | None]:
        """(seconds, what they are made of, the step awaited: None for the fit-start line) now."""
        with self._lock:
            if not self.started:
                return self.bounds.cfg.startup_s, _explain(self.bounds.startup_parts()), None
            step, first = self.next_step, self.first
        return self.bounds.seconds(step, first), self.bounds.explain(step, first), step

    def overdue(self) -> tuple[float, float] | None:
        """(seconds waited, the bound) when the awaited line is overdue, else None."""
        bound = self.bound()[0]
        with self._lock:
            waited = self._clock() - self.since
        return (waited, bound) if waited > bound else None

    @contextlib.contextmanager
    def watching(self, process: subprocess.Popen) -> Iterator[None]:
        """Watch `process` (the leader of verl's process group) while the caller reads its output."""
        with self._lock:
            self.since = self._clock()
        done = threading.Event()
        thread = threading.Thread(target=self._watch, args=(process, done), name="verl-watchdog", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join(timeout=self.grace_s + 5)

    def _watch(self, process: subprocess.Popen, done: threading.Event) -> None:
        poll_s = min(5.0, max(0.05, min(self.bounds.cfg.startup_s, self.bounds.seconds(self.next_step, False)) / 20))
        while not done.wait(poll_s):
            if process.poll() is not None:
                return
            late = self.overdue()
            if late is None:
                continue
            waited, _ = late
            bound, parts, step = self.bound()
            if step is None:
                self.stall = (f"no fit-start line from verl ({FIT_START_LINES}) for {waited:.0f} s, beyond the "
                              f"start-up bound of {bound:.0f} s ({parts}; train.verl.watchdog.startup_s)")
            else:
                self.stall = (f"no verl step line for {waited:.0f} s, beyond step {step}'s bound of {bound:.0f} s "
                              f"({parts}; train.verl.watchdog)")
            log.error("%s: %s; stopping verl's process group", STALL_MARK, self.stall)
            stop_process_group(process, self.grace_s)
            return


# ------------------------------------------------------------------------------------------- one launch
class VerlProgress:
    """Everything the stage checks of one verl launch's progress: fed every output line, watching the clock."""

    def __init__(self, check: ResumeCheck, watchdog: ProgressWatchdog | None) -> None:
        self.check = check
        self.watchdog = watchdog

    @classmethod
    def for_launch(cls, plan: TrainPlan, val_files: list[Path]) -> VerlProgress:
        """Before the launch: the schedule, the checkpoint verl must resume from, the step bounds."""
        schedule = verl_schedule(plan, val_files)
        resumed_from = resumed_step(plan.checkpoint_dir)
        cfg = plan.train.verl.watchdog
        bounds = StepBounds.of(schedule, cfg, plan.environment, plan.agent, resumed_from=resumed_from)
        watchdog = ProgressWatchdog(bounds, resumed_from) if cfg.enabled else None
        log.info("verl resumes from step %d and must end at step %d (%s)", resumed_from, schedule.total_steps,
                 schedule.derivation)
        return cls(ResumeCheck(schedule, resumed_from, plan.checkpoint_dir), watchdog)

    def __call__(self, line: str) -> None:
        if self.watchdog is not None:
            self.watchdog.observe(line)
        self.check.observe(line)

    def watching(self, process: subprocess.Popen) -> contextlib.AbstractContextManager[None]:
        return self.watchdog.watching(process) if self.watchdog is not None else contextlib.nullcontext()

    def stalled(self) -> TrainingStalled | None:
        """The error to raise when the watchdog stopped verl (it names the checkpoint a retry resumes from)."""
        if self.watchdog is None or self.watchdog.stall is None:
            return None
        kept = resumed_step(self.check.checkpoint_dir)
        where = (f"global_step_{kept} in {self.check.checkpoint_dir} is kept and a retry resumes from it" if kept
                 else "no checkpoint was saved yet, so a retry starts afresh")
        return TrainingStalled(f"{STALL_MARK}: {self.watchdog.stall}; verl's process group was stopped; {where}")

    def verify(self) -> TrainingProgress:
        return self.check.verify()
