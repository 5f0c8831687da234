"""Environment health: the outcome of the last N sent calls, judged against a maximum failure rate.

`EnvironmentClient` records every sent call (failed after all retries, or not) and raises
`EnvironmentUnhealthy` once the window is full and fails above `environment.max_failure_rate`, so training
and evaluation stop instead of learning from, or scoring, error notes. The one-probe check before any call,
for the callers that start no server themselves, is `probes.check_environment_answers`, beside the other
probes of a server.
"""

from __future__ import annotations

from collections import deque


class FailureWindow:
    """The outcomes of the last `size` sent calls; `unhealthy()` once it is full and fails above `max_rate`."""

    def __init__(self, size: int, max_rate: float) -> None:
        self.size, self.max_rate = size, max_rate
        self._outcomes: deque[bool] = deque(maxlen=size)
        self.last_error: str | None = None

    def record(self, failed: bool, error: str | None = None) -> None:
        self._outcomes.append(failed)
        if failed:
            self.last_error = error

    @property
    def rate(self) -> float:
        return sum(self._outcomes) / len(self._outcomes) if self._outcomes else 0.0

    def unhealthy(self) -> bool:
        return len(self._outcomes) == self.size and self.rate > self.max_rate
