"""Is a verl launch still training? The progress watchdog (`ProgressWatchdog`) and the bounds it holds verl's
start-up and each step to (`StepBounds`).

A hang in weight sync or an NCCL collective (verl issue 6967) leaves a run waiting forever. The watchdog reads
the same output stream the health gate reads (`pipeline.train.verl.progress.VerlProgress` feeds it every line).
Until verl's fit-start line (or its first step line) the launch is bounded by `startup_s` alone: Ray, the
workers, the rollout engines and the weights, a hang in any of which is stopped there. From then on the next
step line must arrive within that step's bound (`StepBounds`), else verl's process group is stopped (SIGTERM,
then SIGKILL after a grace) and the stage raises `TrainingStalled`. A step's bound is the environment's worst
case for its rollout plus `train.verl.watchdog`'s allowances: `update_s` always; for the launch's first step,
timed from the fit-start line, the checkpoint load (`checkpoint_s`, a resumed launch) and a validation pass
with `val_before_train`; a validation pass at a step that validates (every `test_freq` steps and the last);
`checkpoint_s` at a step that saves (every `save_freq` steps and the last). A validation-only line (the
validation before training) is progress too.

The environment's worst case for a rollout of C conversations of at most T turns, at most
`environment.concurrency` calls in flight, each call at most `environment.timeout_s` × (1 +
1/`length_retry_factor`) (a request and its length retry, whose request is the one the timeout is sized for,
pipeline/environment/budget.py), is list scheduling's bound: (⌈C·T / concurrency⌉ + T) × that call. A
validation pass adds `validation_s` to the same bound for the validation rows. That worst case is loose for a
large batch (the paper profile: 640 conversations, 64 in flight, 240 s timeout: 16,500 s);
`watchdog.rollout_s` replaces it with a measured figure.

The flow retries a stalled train stage: it resumes from the last checkpoint (flows/policies.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipeline.runtime import stop_process_group
from pipeline.train.verl.health_gate import TRAINING_KEY, parse_step_line
from pipeline.train.verl.schedule import FIT_START_LINES, announced_total, fit_start

if TYPE_CHECKING:
    from pipeline.config import AgentConfig, EnvironmentConfig, WatchdogConfig
    from pipeline.train.verl.schedule import VerlSchedule

log = logging.getLogger(__name__)

STALL_MARK = "training stalled"
"""Start of the watchdog's message (the flow retries it)."""
STOP_GRACE_S = 30.0
"""SIGTERM to SIGKILL: longer than the owner guard's own grace (pipeline/environment/guard.py)."""


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
        total = announced_total(line)
        if total is not None:
            with self._lock:  # verl's own count decides which step is the last (it validates and saves)
                schedule = dataclasses.replace(self.bounds.schedule, total_steps=total)
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
