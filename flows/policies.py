"""How the retraining flow (flows/retrain.py) treats each stage: retries, their delays, whether it needs the
environment server, and the retry condition that never retries a run the training health gate or the resume
check stopped (a stalled run is retried: it resumes from its last checkpoint).

In its own module so the flow stays readable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StagePolicy:
    """How the flow treats one stage."""

    retries: int = 0
    retry_delays_s: tuple[float, ...] = ()
    """Delay before retry 1, 2, … (the last one repeats)."""
    needs_environment: bool = False
    """Start and health-check the environment server before this stage (when it will run)."""


STAGE_POLICIES: dict[str, StagePolicy] = {
    "sources": StagePolicy(),
    "sample": StagePolicy(),
    "validate": StagePolicy(),
    "build": StagePolicy(),
    # Idempotent: the same seed, slices and cached environment replies give the same prompt.
    "gepa": StagePolicy(retries=1, retry_delays_s=(30.0,), needs_environment=True),
    # Safe to retry only because it resumes from the last checkpoint (persist: true output); see docstring.
    "train": StagePolicy(retries=1, retry_delays_s=(60.0,), needs_environment=True),
    "merge": StagePolicy(),
    "evaluate": StagePolicy(retries=2, retry_delays_s=(30.0, 120.0), needs_environment=True),
    "register": StagePolicy(retries=3, retry_delays_s=(10.0, 30.0, 90.0)),
}
DEFAULT_POLICY = StagePolicy()

HEALTH_GATE_MARK = "training health gate"
"""Start of the line a stage prints when the training health gate stopped it (pipeline/train/health_gate.py)."""
RESUME_CHECK_MARK = "training resume check"
"""Start of the line when verl did not train the steps it should have (pipeline/train/verl/progress.py)."""
STEPS_RECORD_MARK = "training steps record"
"""Start of the line when steps.csv lacks steps the training went through (pipeline/train/verl/steps.py)."""
STALL_MARK = "training stalled"
"""Start of the line when the progress watchdog stopped verl (pipeline/train/verl/watchdog.py): retried."""

NOT_RETRIED = {
    HEALTH_GATE_MARK: "a resumed run would train from the same last healthy checkpoint into the same breach",
    RESUME_CHECK_MARK: "a rerun resumes from the same checkpoint with the same verl: the same restart or skip",
    STEPS_RECORD_MARK: "the training is complete, so a rerun finds nothing to do and would pass with the same "
                       "incomplete steps.csv",
}
"""Failures a retry cannot fix, by the mark their line starts with, and why. Anything else is retried,
including a stall (`STALL_MARK`): a hang in weight sync or a collective is transient, and the retry resumes
from the last checkpoint."""


def retry_unless_unhealthy(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect's retry condition: retry a failed stage unless its failure is one a retry cannot fix
    (`NOT_RETRIED`: the training health gate, the resume check, the steps record), hours of GPU later."""
    try:
        state.result()
    except Exception as exc:  # noqa: BLE001 - the stage's failure, whatever it is, is what we judge
        text = str(exc)
        return not any(mark in text for mark in NOT_RETRIED)
    return True
