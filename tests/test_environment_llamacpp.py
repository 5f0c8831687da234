"""The environment for real: EnvironmentClient and the launcher against llama.cpp serving SmolLM2 (slow).

Uses the session `llama_server` fixture (tests/conftest.py); a few more servers are started here to prove
that what `environment_server` starts is gone after the block, also when the block raises. Replies are
kept to a few tokens so the whole module runs in seconds on 2 cores.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from urllib.parse import urlparse

import pytest
from demo_project import free_port, pid_alive

from pipeline.environment.client import EnvironmentClient
from pipeline.environment.manual import STATE_FILE, cli_start, cli_stop
from pipeline.environment.servers import (
    environment_server,
    is_healthy,
    served_models,
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
    client = EnvironmentClient.from_params(env_params)

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
    with environment_server(env_params) as url:
        assert url == llama_server and started_server(url) is session_server, "nothing new is started"
    assert is_healthy(llama_server) and pid_alive(session_server.pid), "a reused server must be left running"


def test_started_server_is_gone_after_the_block_also_when_it_raises(env_params):
    env_params.environment.port = free_port()
    with environment_server(env_params) as url:
        pid = started_server(url).pid
        assert served_models(url) == ["smollm2-135m-instruct"]
    assert not pid_alive(pid) and not is_healthy(url)

    with pytest.raises(KeyError), environment_server(env_params) as url:
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
