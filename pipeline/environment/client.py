"""`EnvironmentClient`: the one async client the pipeline uses to talk to the environment (the large LLM).

It speaks the OpenAI chat-completions API, so the same code drives llama.cpp's server on a laptop, a vLLM
server for GPT-OSS-20B on GPU nodes, and a paid API (GPT-4o-mini). Design decisions:

- **Our retry policy, not the SDK's.** `AsyncOpenAI(max_retries=0)`; `reply()` retries 429 (honouring
  `Retry-After`), 408/409/5xx, connection errors, timeouts and unparseable bodies with exponential backoff
  (equal jitter, capped), so retries are counted in `UsageStats` and tested against a fault-injecting server.
- **Never raise on model/HTTP failure.** After the last retry, or on a non-retryable 4xx, or on an empty
  reply, `reply()` returns an `EnvironmentReply` with `error` set and a short note as `text`: a trajectory
  always finishes and the failure is counted. Only problems no retry can fix are raised: `BudgetExceeded`
  (the price table says the budget is spent) and `EnvironmentUnavailable` (API key variable unset for the
  paid backend; the endpoint rejects the key with 401/403).
- **The request goes through the SDK's public low-level `post("/chat/completions", cast_to=bytes)`**
  rather than `chat.completions.create`: same auth, base URL, error classes (status → APIStatusError
  subclasses, connection, timeout) and timeout handling, minus the SDK's recursive TypedDict transform of
  the parameters (an identity for plain-text messages) and its pydantic response model; the body is parsed
  and checked field by field here (`_parse_completion`), which we need anyway for malformed replies. On 2
  cores with 32 concurrent trajectories, `create` costs ~0.5 ms more CPU per call and moved the
  latency-hiding ratio (benchmarks/bench_latency_hiding.py) from ~1.14 to ~1.22.
- **Per-call timeout** is enforced twice: the SDK's httpx timeout and an overall `asyncio.timeout`, so a
  server that trickles bytes cannot stall a rollout.
- **Concurrency** is bounded by a semaphore (`environment.concurrency`); a rollout can fire every active
  trajectory's request at once and the client keeps the endpoint's load bounded.
- **Persistent response cache** (SQLite, WAL, one table) keyed by sha256 of (model ref, served name,
  messages including the system message, sampling parameters). Used only when `temperature == 0` and
  `environment.cache` is on: a repeated evaluation costs 0 calls. Identical requests that are in flight at
  the same moment are coalesced (one request, the others wait for it), which is common in GRPO groups.
  Error replies are never cached.
- **Event loops.** The sync wrappers of the rollout call `asyncio.run` once per step, so the same client
  meets several event loops. The SDK client (its httpx pool), the semaphore and the in-flight table are
  bound to a loop, so they are rebuilt when the running loop changes; usage and the cache persist. Use
  one client from one event loop at a time (one per thread if threads each run a loop).
- **Empty after `finish_reason: length`.** A reasoning model (GPT-OSS) can spend `max_tokens` thinking and
  return empty content. That is counted (`UsageStats.empty_after_length`) and asked once more at once with
  `max_tokens × environment.length_retry_factor`; if still empty it is a failed call. GPT-OSS's
  `reasoning_effort` comes from params (sent only when set, and part of the cache key).
- **Failures stop the run.** Every sent call's outcome (failed after all retries, or not) enters a sliding
  window of the last `environment.failure_window` calls; once the window is full and its failure rate
  exceeds `environment.max_failure_rate`, `reply()` raises `EnvironmentUnhealthy` (naming the rate, the
  keys and the last error). Training and evaluation therefore stop instead of learning from, or scoring,
  error notes; checkpoints already written stay.
- **Budget.** Cost is computed from the price table in params (USD per million prompt/completion tokens).
  Each call reserves its worst case (`worst_case_usd`) in a `CostLedger` before it is sent and settles its
  real cost after; a call that could take the total over `budget_usd` raises `BudgetExceeded` before
  sending anything. `in_cache_dir` shares the ledger file under `paths.cache_dir` with every process of
  the project (pipeline/environment/ledger.py), so concurrent processes never spend more than the budget.
- **No tracing here.** A single call knows nothing of the trajectory, question or system it serves, so the
  evaluate and train stages trace whole trajectories instead (`pipeline.tracking.traces`), from what `reply()`
  returns (text, tokens, latency, cost).
- The API key is read from the variable *named* by `environment.api_key_env`; its value is never logged or
  put into an error message. It is sent only to the paid backend (`api`), only over https or to a loopback
  address over http; servers the pipeline starts itself (llama.cpp, vLLM) always get a placeholder, so a key
  in the environment never leaves for a host it was not meant for.
- **Replies are bounded**: a body over `MAX_BODY_BYTES` is a malformed reply (retried, then counted), so a
  misbehaving server cannot fill memory, logs or MLflow.
- **A failing cache write never strands waiters**: the coalesced in-flight future is resolved first, then
  the reply is cached (a write error is logged and the reply still returned).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import sqlite3
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import openai
from openai import AsyncOpenAI

from pipeline.environment.cache import CachedResponse, ResponseCache
from pipeline.environment.failure_window import FailureWindow
from pipeline.environment.ledger import LEDGER_FILE, CostLedger
from pipeline.environment.sanitize import redact_secrets, register_secret
from pipeline.environment.wire import MalformedReply, parse_completion, retry_after_seconds, shorten
from pipeline.errors import EnvironmentUnavailable, EnvironmentUnhealthy
from pipeline.placement import is_loopback
from pipeline.types import EnvironmentReply, UsageStats

if TYPE_CHECKING:
    from pipeline.config import EnvironmentConfig

logger = logging.getLogger(__name__)

CACHE_FILE = "environment_cache.sqlite"
LOCAL_PLACEHOLDER_KEY = "sk-local-no-key"
"""Sent to local servers (llama.cpp, vLLM) when no key variable is set: they do not check it."""
MAX_BACKOFF_S = 30.0
MAX_RETRY_AFTER_S = 120.0
RETRYABLE_STATUS = frozenset({408, 409, 425, 429})
"""Besides every 5xx: request timeout, conflict, too early, rate limit."""
TEMPLATE_TOKENS = (256, 16)
"""Worst-case chat-template tokens per request and per message (GPT-OSS's harmony preamble fits)."""


def resolve_api_key(cfg: EnvironmentConfig) -> str:
    """The API key from the variable named in params; a placeholder for local servers.

    Raises EnvironmentUnavailable for the paid backend when the variable is unset or empty, or when the
    endpoint would carry the key in clear text to another machine (http to a non-loopback host); the
    message names the variable and the key, never a value. Local backends always get the placeholder.
    """
    if cfg.backend != "api":
        return LOCAL_PLACEHOLDER_KEY
    url = urlsplit(cfg.url)
    if url.scheme != "https" and not (url.scheme == "http" and url.hostname and is_loopback(url.hostname)):
        raise EnvironmentUnavailable(
            f"environment.base_url={cfg.url!r}: the API key from ${cfg.api_key_env} is sent only over https "
            "(or http to a loopback address)"
        )
    key = os.environ.get(cfg.api_key_env, "")
    if not key:
        raise EnvironmentUnavailable(
            f"environment backend 'api' ({cfg.url}) needs an API key in the environment variable "
            f"{cfg.api_key_env}, which is unset or empty: export {cfg.api_key_env}=... and retry"
        )
    register_secret(key)
    return key


@dataclass
class _LoopState:
    """Everything bound to one asyncio event loop."""

    loop: asyncio.AbstractEventLoop
    sdk: AsyncOpenAI
    semaphore: asyncio.Semaphore
    in_flight: dict[str, asyncio.Future[EnvironmentReply]]


class EnvironmentClient:
    """Async OpenAI-compatible chat client for the environment, with retries, cache, usage and budget."""

    def __init__(self, cfg: EnvironmentConfig, cache_path: Path | None = None, *,
                 ledger_path: Path | None = None) -> None:
        self.cfg = cfg
        self.model = cfg.served_name
        self._api_key = resolve_api_key(cfg)
        self.usage = UsageStats()
        self.spent_usd = 0.0  # cost of every call this client made; never reset (the budget reads it)
        self.cache = ResponseCache(cache_path) if (cache_path is not None and cfg.cache) else None
        self._state: _LoopState | None = None
        self._stale_sdks: list[AsyncOpenAI] = []
        self.health = FailureWindow(cfg.failure_window, cfg.max_failure_rate)
        self.ledger = None if cfg.budget_usd is None else CostLedger(
            cfg.budget_usd, ledger_path, where=f" at {cfg.url}" + (f" (ledger {ledger_path})" if ledger_path else ""))

    @classmethod
    def in_cache_dir(cls, cfg: EnvironmentConfig, cache_dir: Path) -> EnvironmentClient:
        """A client for `cfg` caching to `<cache_dir>/environment_cache.sqlite` (when `cfg.cache`) and
        sharing the budget through `<cache_dir>/environment_ledger.json`."""
        return cls(cfg, cache_dir / CACHE_FILE if cfg.cache else None, ledger_path=cache_dir / LEDGER_FILE)

    # -- public API -------------------------------------------------------------------------------------

    @property
    def sampling(self) -> dict[str, Any]:
        """The sampling parameters sent with every request (and part of the cache key)."""
        sampling: dict[str, Any] = {"temperature": self.cfg.temperature, "max_tokens": self.cfg.max_tokens}
        if self.cfg.reasoning_effort:
            sampling["reasoning_effort"] = self.cfg.reasoning_effort
        return sampling

    @property
    def caching(self) -> bool:
        return self.cache is not None and self.cfg.temperature == 0

    def messages(self, history: list[dict[str, str]], prompt: str) -> list[dict[str, str]]:
        """The request: the method's system message, the environment's own history, then the new prompt.

        The same for every backend: vLLM renders a GPT-OSS model's leading `system` message as harmony's
        developer instructions (pipeline/environment/harmony.py says why the role stays `system`).
        """
        return [
            {"role": "system", "content": self.cfg.system_prompt},
            *({"role": m["role"], "content": m["content"]} for m in history),
            {"role": "user", "content": prompt},
        ]

    async def reply(self, history: list[dict[str, str]], prompt: str) -> EnvironmentReply:
        """Ask the environment; `history` is its earlier user/assistant messages (no system message).

        Never raises on model or HTTP failure (see the module docstring); raises BudgetExceeded once the
        budget could be exceeded and EnvironmentUnavailable when the endpoint rejects the key.
        """
        state = self._loop_state()
        messages = self.messages(history, prompt)
        key = None
        if self.caching:
            key = ResponseCache.key(f"{self.cfg.model}|{self.model}", messages, self.sampling)
            cached = await self._from_cache_or_in_flight(state, key)
            if cached is not None:
                self.usage.add(cached)
                return cached
        future: asyncio.Future[EnvironmentReply] | None = None
        if key is not None:
            future = state.loop.create_future()
            state.in_flight[key] = future
        try:
            async with state.semaphore:
                with self.ledger.hold(self.worst_case_usd(messages)) if self.ledger else nullcontext() as hold:
                    result = await self._request_with_retries(state.sdk, messages)
                    if hold is not None:
                        hold.settle(result.cost_usd)
        except BaseException:
            if future is not None:
                # Waiters see an error reply and send their own request (or hit the same exception).
                _forget(state.in_flight, key, future)
                future.set_result(EnvironmentReply(text="", error="coalesced request did not complete"))
            raise
        if key is not None and future is not None:
            _forget(state.in_flight, key, future)
            future.set_result(result)
            if result.error is None:
                try:
                    # Stored with secrets redacted: the cache file sits in the project (SECURITY.md).
                    self.cache.put(key, self.model, CachedResponse(redact_secrets(result.text),
                                                                   result.prompt_tokens, result.completion_tokens))
                except sqlite3.Error as exc:
                    logger.warning("environment response cache %s: write failed (%s); reply not cached",
                                   self.cache.path, exc)
        self.usage.add(result)
        self.spent_usd += result.cost_usd
        self._judge_health(result)
        return result

    def take_usage(self) -> UsageStats:
        """Return the usage so far and start a fresh tally (per training step, per evaluation set).

        The budget keeps counting across tallies (`spent_usd`).
        """
        usage, self.usage = self.usage, UsageStats()
        return usage

    async def answer_directly(self, question: str) -> EnvironmentReply:
        """The environment alone answers a question (the env-only baseline): empty history."""
        return await self.reply([], question)

    async def aclose(self) -> None:
        """Close the HTTP pool(s) and the cache file (both reopen if the client is used again)."""
        sdks = [*self._stale_sdks, *([self._state.sdk] if self._state else [])]
        self._state, self._stale_sdks = None, []
        for sdk in sdks:
            try:
                await sdk.close()
            except RuntimeError:  # its event loop is already closed
                pass
        if self.cache is not None:
            self.cache.close()

    # -- internals --------------------------------------------------------------------------------------

    def _judge_health(self, result: EnvironmentReply) -> None:
        self.health.record(result.error is not None, result.error)
        if self.health.unhealthy():
            raise EnvironmentUnhealthy(
                f"environment at {self.cfg.url} failed {self.health.rate:.0%} of the last {self.health.size} calls "
                f"(environment.max_failure_rate={self.cfg.max_failure_rate:g}, "
                f"environment.failure_window={self.cfg.failure_window}); last error: {self.health.last_error}. "
                "Stopped so that nothing learns from or is scored on error notes"
            )

    def worst_case_usd(self, messages: list[dict[str, str]]) -> float:
        """An upper bound of one call's recorded cost: ≤ 1 token per UTF-8 byte plus template tokens, the
        prompt sent twice and `max_tokens × (1 + length_retry_factor)` completion tokens (the length retry)."""
        per_request, per_message = TEMPLATE_TOKENS
        prompt = per_request + sum(len(m["content"].encode()) + per_message for m in messages)
        return self._cost(2 * prompt, self.cfg.max_tokens + int(self.cfg.max_tokens * self.cfg.length_retry_factor))

    def _loop_state(self) -> _LoopState:
        loop = asyncio.get_running_loop()
        if self._state is None or self._state.loop is not loop:
            if self._state is not None:
                self._stale_sdks.append(self._state.sdk)
            sdk = AsyncOpenAI(base_url=self.cfg.url, api_key=self._api_key, max_retries=0,
                              timeout=self.cfg.timeout_s)
            self._state = _LoopState(loop, sdk, asyncio.Semaphore(self.cfg.concurrency), {})
        return self._state

    async def _from_cache_or_in_flight(self, state: _LoopState, key: str) -> EnvironmentReply | None:
        hit = self.cache.get(key) if self.cache is not None else None
        if hit is None and key in state.in_flight:
            leader = await asyncio.shield(state.in_flight[key])
            if leader.error is None:
                hit = CachedResponse(leader.text, leader.prompt_tokens, leader.completion_tokens)
        if hit is None:
            return None
        return EnvironmentReply(text=hit.text, prompt_tokens=hit.prompt_tokens,
                                completion_tokens=hit.completion_tokens, cached=True)

    def _cost(self, prompt_tokens: int, completion_tokens: int) -> float:
        return (prompt_tokens * self.cfg.price_per_million_prompt
                + completion_tokens * self.cfg.price_per_million_completion) / 1e6

    def _backoff(self, attempt: int) -> float:
        full = min(MAX_BACKOFF_S, self.cfg.backoff_base_s * (2**attempt))
        return full * random.uniform(0.5, 1.0)

    async def _request_with_retries(self, sdk: AsyncOpenAI, messages: list[dict[str, str]]) -> EnvironmentReply:
        start = time.perf_counter()
        retries = 0
        error = "no attempt made"
        for attempt in range(self.cfg.max_retries + 1):
            delay: float | None = None
            try:
                text, prompt_tokens, completion_tokens, finish = await self._request_once(sdk, messages)
                empty_after_length = not text.strip() and finish == "length"
                if empty_after_length:
                    budget = int(self.cfg.max_tokens * self.cfg.length_retry_factor)
                    logger.debug("empty reply after finish_reason=length; asking again with max_tokens=%d", budget)
                    text, more_prompt, more_completion, finish = await self._request_once(
                        sdk, messages, max_tokens=budget)
                    prompt_tokens, completion_tokens = prompt_tokens + more_prompt, completion_tokens + more_completion
            except openai.APIStatusError as exc:
                status = exc.status_code
                error = f"HTTP {status}: {shorten(exc.message)}"
                if status in (401, 403):
                    raise EnvironmentUnavailable(
                        f"environment endpoint {self.cfg.url} rejected the API key from ${self.cfg.api_key_env} "
                        f"(HTTP {status})"
                    ) from None
                if status not in RETRYABLE_STATUS and status < 500:
                    return self._failed(error, start, retries)
                delay = retry_after_seconds(exc.response)
            except (openai.APITimeoutError, TimeoutError):
                error = f"timeout after {self.cfg.timeout_s:g}s"
                # Said at WARNING even when a retry then succeeds: on a llama.cpp server the abandoned request
                # changed what its slot holds, so the run's later replies may differ from an unloaded run's.
                logger.warning("environment call timed out after %gs (attempt %d of %d): %s", self.cfg.timeout_s,
                               attempt + 1, self.cfg.max_retries + 1, shorten(messages[-1]["content"], 80))
            except openai.APIConnectionError as exc:
                error = f"connection error: {shorten(str(exc.__cause__ or exc))}"
            except (MalformedReply, openai.APIResponseValidationError) as exc:
                error = f"malformed response: {shorten(str(exc))}"
            else:
                if not text.strip():
                    reason = "empty reply after finish_reason=length twice" if empty_after_length else "empty reply"
                    failed = self._failed(reason, start, retries, prompt_tokens, completion_tokens)
                    failed.empty_after_length = empty_after_length
                    return failed
                return EnvironmentReply(
                    text=text, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                    latency_s=time.perf_counter() - start, retries=retries,
                    cost_usd=self._cost(prompt_tokens, completion_tokens),
                    truncated=finish == "length", empty_after_length=empty_after_length,
                )
            if attempt == self.cfg.max_retries:
                break
            retries += 1
            wait = min(delay, MAX_RETRY_AFTER_S) if delay is not None else self._backoff(attempt)
            logger.debug("environment call failed (%s); retry %d in %.2fs", error, retries, wait)
            await asyncio.sleep(wait)
        logger.warning("environment call failed after %d retries: %s", retries, error)
        return self._failed(error, start, retries)

    async def _request_once(self, sdk: AsyncOpenAI, messages: list[dict[str, str]],
                            max_tokens: int | None = None) -> tuple[str, int, int, str | None]:
        """One request: (text, prompt tokens, completion tokens, finish_reason)."""
        sampling = {**self.sampling, **({"max_tokens": max_tokens} if max_tokens else {})}
        async with asyncio.timeout(self.cfg.timeout_s):
            body = await sdk.post(
                "/chat/completions", cast_to=bytes,
                body={"model": self.model, "messages": messages, **sampling},
                options={"timeout": self.cfg.timeout_s},
            )
        return parse_completion(body)

    def _failed(self, error: str, start: float, retries: int, prompt_tokens: int = 0,
                completion_tokens: int = 0) -> EnvironmentReply:
        return EnvironmentReply(
            text=f"[environment error: {error}]", prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens, latency_s=time.perf_counter() - start, retries=retries,
            error=error, cost_usd=self._cost(prompt_tokens, completion_tokens),
        )


def _forget(in_flight: dict[str, asyncio.Future[EnvironmentReply]], key: str,
            future: asyncio.Future[EnvironmentReply]) -> None:
    if in_flight.get(key) is future:
        del in_flight[key]


__all__ = ["CACHE_FILE", "EnvironmentClient", "resolve_api_key"]
