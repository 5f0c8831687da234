"""The environment for real: EnvironmentClient and the launcher against llama.cpp serving SmolLM2 (slow).

Uses the session `llama_server` fixture (tests/conftest.py); a few more servers are started here to prove
that what `serve_environment` starts is gone after the block, also when the block raises. Replies are
kept to a few tokens so the whole module runs in seconds on 2 cores.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from urllib.parse import urlparse

import pytest
from demo_project import free_port, pid_alive
from helpers import environment_client, server_spec

from pipeline.commands.env import STATE_FILE, cli_start, cli_stop
from pipeline.environment.probes import is_healthy, served_models
from pipeline.environment.servers import (
    serve_environment,
    started_server,
)

pytestmark = pytest.mark.slow


@pytest.fixture()
def env_params(params, tmp_path):
    params.paths.cache_dir = str(tmp_path / "cache")
    params.environment.max_tokens = 12
    return params


def test_client_gets_a_real_reply_with_token_counts(llama_server, env_params):
    env_params.environment.base_url = llama_server
    client = environment_client(env_params)

    async def go():
        try:
            first = await client.answer_directly("What is the capital of France?")
            history = [{"role": "user", "content": "What is the capital of France?"},
                       {"role": "assistant", "content": first.text}]
            follow_up = await client.reply(history, "And of Italy?")
            again = await client.answer_directly("What is the capital of France?")
            return first, follow_up, again
        finally:
            await client.aclose()

    first, follow_up, again = asyncio.run(go())
    assert first.error is None and first.text.strip(), first
    assert first.prompt_tokens > 10 and 0 < first.completion_tokens <= 12
    assert follow_up.error is None and follow_up.prompt_tokens > first.prompt_tokens
    assert again.cached and again.text == first.text  # temperature 0: the repeat costs no call
    assert client.usage.calls == 2 and client.usage.cache_hits == 1 and client.usage.errors == 0
    assert served_models(llama_server) == ["smollm2-135m-instruct"]


def test_second_environment_server_reuses_the_running_one(llama_server, env_params):
    env_params.environment.port = urlparse(llama_server).port
    session_server = started_server(llama_server)  # the session fixture's process
    with serve_environment(server_spec(env_params)) as url:
        assert url == llama_server and started_server(url) is session_server, "nothing new is started"
    assert is_healthy(llama_server) and pid_alive(session_server.pid), "a reused server must be left running"


def test_started_server_is_gone_after_the_block_also_when_it_raises(env_params):
    env_params.environment.port = free_port()
    with serve_environment(server_spec(env_params)) as url:
        pid = started_server(url).pid
        assert served_models(url) == ["smollm2-135m-instruct"]
    assert not pid_alive(pid) and not is_healthy(url)

    with pytest.raises(KeyError), serve_environment(server_spec(env_params)) as url:
        pid = started_server(url).pid
        raise KeyError("the body failed")
    assert not pid_alive(pid) and not is_healthy(url)


def test_cli_start_and_stop_real_server(env_params, capsys):
    env_params.environment.port = free_port()
    cli_start(env_params)
    state = json.loads((Path(env_params.paths.cache_dir) / STATE_FILE).read_text())
    try:
        assert is_healthy(state["url"])
        log = Path(state["log_path"]).read_text()
        assert log, "the server log is written under cache_dir"
    finally:
        cli_stop(env_params)
    assert not pid_alive(state["pid"]) and not is_healthy(state["url"])
    assert "stopped" in capsys.readouterr().out


def test_llama_cpp_engine_decodes_concurrent_requests_together(env_params):
    """`server.engine: llama.cpp` (llama.cpp's own server from the xllamacpp wheel): the served name is the
    alias, concurrent calls all get real replies, and its log shows slots busy at the same time (one batch)."""
    env_params.environment.port = free_port()
    env_params.environment.server.engine = "llama.cpp"
    env_params.environment.server.parallel = 4
    env_params.environment.cache = False
    env_params.environment.concurrency = 8
    questions = [f"What is {a} plus {b}?" for a, b in zip(range(2, 10), range(7, 15), strict=True)]
    with serve_environment(server_spec(env_params)) as url:
        server = started_server(url)
        assert server is not None and "pipeline.environment.llama_server" in server.command
        assert served_models(url) == ["smollm2-135m-instruct"]
        client = environment_client(env_params)

        async def go():
            try:
                return await asyncio.gather(*(client.answer_directly(q) for q in questions))
            finally:
                await client.aclose()

        replies = asyncio.run(go())
        log_text = Path(server.log_path).read_text(errors="replace")
        pid = server.pid
    assert all(r.error is None and r.text.strip() and r.completion_tokens > 0 for r in replies), replies
    busy: set[str] = set()
    most_busy = 0
    for line in log_text.splitlines():
        slot = re.search(r"\bid\s+(\d+)\s+\|\s+task", line)
        if slot and "launch_slot_" in line:
            busy.add(slot.group(1))
            most_busy = max(most_busy, len(busy))
        elif slot and " release: " in line:
            busy.discard(slot.group(1))
    assert most_busy >= 2, f"no two slots were ever busy together:\n{log_text[-2000:]}"
    assert not pid_alive(pid) and not is_healthy(url)
