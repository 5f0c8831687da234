"""Probes of an OpenAI-compatible server: does something healthy answer `GET <url>/models`, and does it serve
the model the params name.

`pipeline.environment.servers` probes before it starts a server (reuse before start) and while it waits for
one; `promptr1 env` and the doctor probe servers left running; the callers that start no server (the pyfunc
agent, `promptr1 serve`) call `check_environment_answers` once, before the first request.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import httpx

from pipeline.environment.client import resolve_api_key
from pipeline.errors import EnvironmentUnavailable

if TYPE_CHECKING:
    from pipeline.config import EnvironmentConfig


def served_models(url: str, api_key: str | None = None, timeout_s: float = 2.0) -> list[str] | None:
    """Model ids listed by `GET <url>/models`, or None when nothing healthy answers there."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(f"{url.rstrip('/')}/models", headers=headers, timeout=timeout_s)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    try:
        return [str(m.get("id")) for m in response.json().get("data", [])]
    except (ValueError, AttributeError):
        return []


def is_healthy(url: str, api_key: str | None = None, timeout_s: float = 2.0) -> bool:
    return served_models(url, api_key, timeout_s) is not None


def check_serves_configured_model(cfg: EnvironmentConfig, models: list[str]) -> None:
    """Refuse to reuse a server that answers at the URL but serves another model than params name.

    Training against the wrong environment would run for hours on the wrong signal; the check is what
    "reuse" means. A server that lists no models at all (some proxies) is accepted.
    """
    if models and cfg.served_name not in models:
        raise EnvironmentUnavailable(
            f"the server answering at {cfg.url} serves {models}, not environment.served_name={cfg.served_name!r}: "
            "stop it, point environment.port/base_url elsewhere, or set environment.served_name to what it serves"
        )


def check_environment_answers(cfg: EnvironmentConfig, timeout_s: float = 5.0) -> None:
    """Raise EnvironmentUnavailable, naming the URL and what to start, unless the endpoint answers
    `GET <url>/models` (and lists the configured model, when it lists any).

    For callers that start no server (the pyfunc agent, `promptr1 serve`): without this one check, a missing
    environment costs every call its full retry schedule (~170 s per question) and the agent then "answers"
    from error notes, an empty answer with no error. One probe of a few seconds says it at once.
    """
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
