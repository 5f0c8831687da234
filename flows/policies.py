"""How the retraining flow (flows/retrain.py) treats each stage: retries, their delays, whether it needs the
environment server, and the retry condition that never retries a run the training health gate stopped.

In its own module so the flow stays readable; `flows.retrain` re-exports these names.
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
"""Start of the line a stage prints when the training health gate stopped it (pipeline/train/health.py)."""


def retry_unless_unhealthy(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect's retry condition: retry a failed stage unless the training health gate stopped it (a resumed
    run would train from the same last healthy checkpoint into the same breach, hours of GPU later)."""
    try:
        state.result()
    except Exception as exc:  # noqa: BLE001 - the stage's failure, whatever it is, is what we judge
        return HEALTH_GATE_MARK not in str(exc)
    return True
