"""Environment faults at 25%: every call finishes, every injected fault is counted, nothing hangs.

A real local server answers 200 concurrent calls; one in four answers is a fault drawn from the kinds a paid API
or a proxy produces (timeouts, 429 with Retry-After, 5xx, malformed JSON, non-JSON bodies, dropped connections,
oversized and empty replies). The client retries what is retryable; what remains becomes a counted error reply.
Accounting must close: every injected fault is either one retry or one final error.
"""

from __future__ import annotations

import asyncio
import random

import pytest
from fault_server import Behaviour, FaultServer

from pipeline.config import EnvironmentConfig
from pipeline.environment.client import EnvironmentClient

FAULTS = [
    Behaviour("status", status=429, retry_after="0"),
    Behaviour("status", status=503),
    Behaviour("status", status=500),
    Behaviour("malformed"),
    Behaviour("not_json"),
    Behaviour("drop"),
    Behaviour("ok", text="x" * (5 * 1024 * 1024)),   # oversized: refused as malformed, retried
    Behaviour("ok", delay_s=1.5),                      # slower than the 0.5 s timeout
    Behaviour("empty"),                                # not retried: a counted error reply
]


@pytest.mark.timeout(180)
def test_faults_at_25_percent_are_all_counted_and_nothing_hangs():
    rng = random.Random(7)
    calls = 200
    script = [rng.choice(FAULTS) if rng.random() < 0.25 else Behaviour("ok") for _ in range(calls * 3)]
    injected = sum(b.kind != "ok" or b.delay_s > 0 or (b.text or "").startswith("xxxx") for b in script)
    with FaultServer() as server:
        server.script(*script)
        cfg = EnvironmentConfig(backend="llamacpp", model="m", served_name="fault-model", base_url=server.url,
                                system_prompt="s", timeout_s=0.5, max_retries=5, backoff_base_s=0.01,
                                concurrency=16, cache=False, failure_window=calls, max_failure_rate=0.5)
        client = EnvironmentClient(cfg)

        async def go():
            replies = await asyncio.wait_for(
                asyncio.gather(*(client.reply([], f"question {i}") for i in range(calls))), timeout=150)
            await client.aclose()
            return replies

        replies = asyncio.run(go())
        sent = len(server.chat_requests)
    assert len(replies) == calls
    usage = client.usage
    faults_seen = sum(1 for b in script[:sent] if b.kind != "ok" or b.delay_s > 0 or (b.text or "").startswith("xxxx"))
    assert usage.retries + usage.errors == faults_seen, (usage, faults_seen)
    assert usage.calls == calls and sent == calls + usage.retries
    assert sum(r.error is not None for r in replies) == usage.errors
    assert injected >= faults_seen > 0.15 * calls
