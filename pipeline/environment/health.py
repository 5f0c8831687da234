"""Environment health: the outcome of the last N sent calls, judged against a maximum failure rate.

`EnvironmentClient` records every sent call (failed after all retries, or not) and raises
`EnvironmentUnhealthy` once the window is full and fails above `environment.max_failure_rate`, so training
and evaluation stop instead of learning from, or scoring, error notes. `check_environment_answers` is the
one-probe check before any call, for the callers that start no server themselves (the served agent).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from pipeline.errors import EnvironmentUnavailable

if TYPE_CHECKING:
    from pipeline.config import EnvironmentConfig


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


def check_environment_answers(cfg: EnvironmentConfig, timeout_s: float = 5.0) -> None:
    """Raise EnvironmentUnavailable, naming the URL and what to start, unless the endpoint answers
    `GET <url>/models` (and lists the configured model, when it lists any).

    For callers that start no server (the pyfunc agent, `promptr1 serve`): without this one check, a missing
    environment costs every call its full retry schedule (~170 s per question) and the agent then "answers"
    from error notes, an empty answer with no error. One probe of a few seconds says it at once.
    """
    from pipeline.environment.client import resolve_api_key
    from pipeline.environment.servers import check_serves_configured_model, served_models

    key = resolve_api_key(cfg) if cfg.backend == "api" else None
    models = served_models(cfg.url, key, timeout_s)
    if models is None:
        raise EnvironmentUnavailable(
            f"the agent's environment does not answer at {cfg.url} (GET {cfg.url.rstrip('/')}/models failed "
            f"within {timeout_s:g} s): start it first (`promptr1 env start`, or llama.cpp/vLLM serving "
            f"{cfg.served_name!r} there), or point the model at a running one with "
            "model_config={'environment': {'base_url': 'http://host:port/v1'}}"
        )
    check_serves_configured_model(cfg, models)
