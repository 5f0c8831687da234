"""What `promptr1 doctor`'s steps share: the state they read and write (`Doctor`), a step's outcome
(`StepResult`) and the three verdicts a step returns. In a module of its own so that the steps of
`doctor_environment` and `doctor_train` and the runner in `doctor` all import it and none imports another.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pipeline.config import Params

Status = Literal["pass", "fail", "skipped"]
DEFAULT_ROWS = 64
BUILD_FIRST = "run dvc repro build first"
ROWS_DEADLINE_S = 180.0
"""Rows still unanswered this long after the first was sent count as failed (their calls are cancelled), so
the doctor ends in bounded time (within five minutes on a CPU) even against a server that hangs or a machine
busy with other work."""


@dataclass
class StepResult:
    """One step's outcome: what the line says, the figures behind it, and how long it took."""

    name: str
    status: Status
    detail: str
    figures: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def line(self) -> str:
        return f"{self.status}: {self.name}: {self.detail}"


def passed(detail: str, **figures: Any) -> tuple[Status, str, dict[str, Any]]:
    return "pass", detail, figures


def failed(detail: str, **figures: Any) -> tuple[Status, str, dict[str, Any]]:
    return "fail", detail, figures


def skipped(detail: str, **figures: Any) -> tuple[Status, str, dict[str, Any]]:
    return "skipped", detail, figures


@dataclass
class Doctor:
    """The state the steps share: params, the host's GPUs, the environment's URL and the results so far."""

    params: Params
    rows: int = DEFAULT_ROWS
    rows_deadline_s: float = ROWS_DEADLINE_S
    gpus: list[dict[str, str]] = field(default_factory=list)
    """nvidia-smi's GPUs (index, name, driver, memory); empty on a machine without one."""
    environment_url: str | None = None
    checkpoint_dir: Path | None = None
    """The one-step verl run's temporary checkpoint folder (pipeline.checks.doctor_train.checkpoint_folder)."""
    reports_dir: Path = Path("reports")
    """`paths.reports_dir`, resolved once by `run_doctor` (the report and the one-step run's outputs go under it)."""
    results: dict[str, StepResult] = field(default_factory=dict)
    stack: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    def status(self, name: str) -> Status | None:
        result = self.results.get(name)
        return result.status if result else None


Step = Callable[[Doctor], tuple[Status, str, dict[str, Any]]]
