"""Did a verl launch train the steps it should? The resume check, and everything the stage checks of one launch.

verl 0.9.1 (`verl/trainer/ppo/ray_trainer.py`) resumes with `trainer.resume_mode=auto` from the step named by
`<trainer.default_local_dir>/latest_checkpointed_iteration.txt`, then trains steps N+1 … total, printing one
console line per step (`step:N - key:value - …`, verl_health.py) after that step's checkpoint save and
validation. Two of its failure modes exit 0 as if nothing were wrong: a resume that silently restarts at step 0
(verl issue 7952: the checkpoint is not found, training starts afresh and overwrites the newer checkpoints) and a
resume at an epoch boundary whose dataloader state marks the epoch exhausted, so the epoch is skipped (verl issue
7401). A hang in weight sync or an NCCL collective (verl issue 6967) leaves the run waiting forever.

What this module checks, from the same output stream the health gate reads, against the schedule verl computes
(`pipeline.train.verl.schedule`); `VerlProgress` also feeds every line to the progress watchdog
(`pipeline.train.verl.watchdog`):

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

The flow retries a stalled train stage (it resumes from the last checkpoint); it does not retry a failed resume
check, which would meet the same checkpoint and the same verl (flows/policies.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.errors import TrainingIncomplete, TrainingStalled
from pipeline.train.completion import TrainingProgress
from pipeline.train.verl.health_gate import TRAINING_KEY, parse_step_line
from pipeline.train.verl.schedule import VerlSchedule, announced_total, fit_start, verl_schedule
from pipeline.train.verl.watchdog import STALL_MARK, ProgressWatchdog, StepBounds

if TYPE_CHECKING:
    from pipeline.train.plan import TrainPlan

log = logging.getLogger(__name__)

RESUME_CHECK_MARK = "training resume check"
"""Start of every resume-check message (the flow does not retry it: flows/policies.py)."""
_STEP_FOLDER = re.compile(r"global_step_\d+")
MARKER = "latest_checkpointed_iteration.txt"
"""verl's record of its newest checkpoint, written after each save (ray_trainer.py `_save_checkpoint`)."""


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
        total = announced_total(line)
        if total is not None:
            self.verl_total = total
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
