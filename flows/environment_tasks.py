"""The environment server's lifecycle as Prefect tasks of the retraining flow: start, health-check, stop.

Design decisions:
- **Started only when needed.** The flow (flows/retrain.py) runs `start-environment` and
  `check-environment` right before `train` and `evaluate`, and only if DVC says that stage will run (or
  `force`). Starting enters `pipeline.environment.servers.serve_environment(spec)`, which reuses a
  healthy server already answering at the URL and never stops one it did not start; the stage commands
  then find the server healthy and reuse it too.
- **Health is `GET <url>/models` answering 200**, the OpenAI-compatible route every backend (llama.cpp,
  vLLM, a paid API) serves; the API key, when the backend needs one, is read from the variable the params
  name, never stored.
- **Always stopped.** `EnvironmentSession` owns what one flow run entered; the flow calls `stop-environment`
  in a `finally`, so a failing stage, a failed health check or an interrupt still stops what the flow
  started. For runs Prefect kills, `stop_live_environments` is the flow's `on_crashed`/`on_cancellation`
  hook: it stops every session still open in this process.
- **Retries only where they are safe:** starting and health-checking are idempotent, so both retry with
  growing delays; stopping does not retry (it must not wait on a server that is gone).
- **Weights before GPU time.** `fetch-weights` runs once, before the first stage that needs the environment:
  every model the params need is fetched into the Hugging Face cache and verified
  (`pipeline.weights`), so a vLLM server or verl never downloads while GPUs wait. It retries like start.
- The launcher (Params → context manager yielding the base URL) is a parameter, so tests and benchmarks can
  run the flow against a stand-in server; deployments always use `default_launcher`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from typing import Any, ClassVar

import httpx
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from pipeline.config import Params
from pipeline.errors import EnvironmentUnavailable

Launcher = Callable[[Params], AbstractContextManager[str]]

ENVIRONMENT_RETRIES = 2
ENVIRONMENT_RETRY_DELAYS_S = [20.0, 60.0]


def default_launcher(params: Params) -> AbstractContextManager[str]:
    """The configured environment server (`pipeline.environment.servers.serve_environment`)."""
    from pipeline.environment.servers import serve_environment
    from pipeline.environment.spec import ServerSpec

    cache_dir = params.path(params.paths.cache_dir)
    spec = ServerSpec(environment=params.environment, root=params.root, cache_dir=cache_dir)
    return serve_environment(spec)


class EnvironmentSession:
    """The environment server this flow run entered; closing it stops only what was started."""

    live: ClassVar[set[EnvironmentSession]] = set()

    def __init__(self, params: Params, launcher: Launcher) -> None:
        self.params = params
        self.launcher = launcher
        self.url: str | None = None
        self._stack = ExitStack()

    def start(self) -> str:
        if self.url is None:
            self.url = self._stack.enter_context(self.launcher(self.params))
            EnvironmentSession.live.add(self)
        return self.url

    def stop(self) -> None:
        try:
            self._stack.close()
        finally:
            self.url = None
            EnvironmentSession.live.discard(self)

    @classmethod
    def stop_all(cls) -> None:
        for session in list(cls.live):
            session.stop()


def stop_live_environments(flow_: Any, flow_run: Any, state: Any) -> None:
    """on_crashed / on_cancellation: stop servers a killed run left behind."""
    EnvironmentSession.stop_all()


@task(name="start-environment", cache_policy=NO_CACHE, retries=ENVIRONMENT_RETRIES,
      retry_delay_seconds=ENVIRONMENT_RETRY_DELAYS_S)
def start_environment(session: EnvironmentSession) -> str:
    """Start (or reuse) the configured environment server; return its base URL."""
    cfg = session.params.environment
    url = session.start()
    get_run_logger().info("environment (%s, %s) at %s", cfg.backend, cfg.served_name, url)
    return url


@task(name="check-environment", cache_policy=NO_CACHE, retries=3, retry_delay_seconds=[2.0, 5.0, 10.0])
def check_environment(url: str, api_key_env: str | None = None, timeout_s: float = 10.0) -> list[str]:
    """`GET <url>/models` must answer 200; return the served model ids."""
    headers = {}
    if api_key_env and os.environ.get(api_key_env):
        headers["Authorization"] = f"Bearer {os.environ[api_key_env]}"
    try:
        response = httpx.get(f"{url.rstrip('/')}/models", headers=headers, timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise EnvironmentUnavailable(f"environment at {url} does not answer: {exc}") from exc
    if response.status_code != 200:
        raise EnvironmentUnavailable(f"environment at {url}: GET /models answered {response.status_code}")
    try:
        models = [m.get("id", "?") for m in response.json().get("data", [])]
    except (ValueError, AttributeError):
        models = []
    get_run_logger().info("environment healthy at %s (models: %s)", url, ", ".join(models) or "n/a")
    return models


@task(name="stop-environment", cache_policy=NO_CACHE)
def stop_environment(session: EnvironmentSession) -> None:
    """Stop the server the flow started (a reused one is left running)."""
    session.stop()
    get_run_logger().info("environment released")


@task(name="fetch-weights", retries=ENVIRONMENT_RETRIES, retry_delay_seconds=ENVIRONMENT_RETRY_DELAYS_S,
      cache_policy=NO_CACHE)
def fetch_weights(params: Params) -> list[str]:
    """Fetch and verify every model the params need (`promptr1 weights`); one line per model."""
    from pipeline.commands.weights import run_weights

    lines = [f"{s.key}: {s.state} ({s.ref})" for s in run_weights(params)]
    for line in lines:
        get_run_logger().info("weights %s", line)
    return lines
