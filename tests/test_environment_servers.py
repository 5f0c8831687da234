"""Server launcher: commands built from params, reuse, api mode, start/stop semantics, CLI state file.

Fast tests use tests/fault_server.py as the served process (a real process answering /v1/models) so the
start → health → stop machinery is exercised in about a second; tests/test_environment_llamacpp.py does
the same with the real llama.cpp server (slow).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
from pathlib import Path

import pytest
from demo_project import free_port, pid_alive
from fault_server import FaultServer
from helpers import server_spec

from pipeline.commands.env import STATE_FILE, cli_start, cli_status, cli_stop
from pipeline.config import load_params
from pipeline.environment import servers
from pipeline.environment.probes import is_healthy
from pipeline.environment.servers import (
    serve_environment,
    server_command,
    started_server,
    vllm_command,
)
from pipeline.errors import EnvironmentUnavailable
from pipeline.hardware import usable_cores

FAULT_SERVER = Path(__file__).resolve().parent / "fault_server.py"


@pytest.fixture()
def local_params(params, tmp_path):
    params.paths.cache_dir = str(tmp_path / "cache")
    params.environment.port = free_port()
    params.environment.server.startup_timeout_s = 20
    return params


@pytest.fixture()
def stand_in(monkeypatch):
    """Serve with the fault server process instead of llama.cpp (same start/health/stop path)."""

    def command(params):
        return [sys.executable, str(FAULT_SERVER), "--port", str(params.environment.port),
                "--model", params.environment.served_name]

    monkeypatch.setattr(servers, "server_command", command)


@pytest.mark.parametrize(("engine", "module"), [("llama.cpp", "pipeline.environment.llama_server"),
                                              ("llama-cpp-python", "llama_cpp.server")])
def test_llamacpp_command_from_params(local_params, engine, module, monkeypatch):
    from pipeline import hardware

    monkeypatch.setattr(hardware, "_auto_threads", None)  # an idle machine, decided afresh
    monkeypatch.setattr(hardware, "busy_cores", lambda: 0.0)
    cfg = local_params.environment
    cfg.server.engine = engine
    cfg.server.extra_args = ["--verbose", "false"]
    cmd = server_command(server_spec(local_params))
    assert cmd[:3] == [sys.executable, "-m", module]
    args = dict(zip(cmd[3:-2:2], cmd[4:-2:2], strict=True))
    if engine == "llama.cpp":
        assert args.pop("--n_parallel") == "1"  # params.yaml: one call at a time (reproducible replies)
    assert args["--model"].endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and Path(args["--model"]).is_file()
    assert args["--model_alias"] == "smollm2-135m-instruct"
    assert (args["--host"], args["--port"]) == ("127.0.0.1", str(cfg.port))
    assert (args["--n_ctx"], args["--n_threads"]) == ("4096", str(usable_cores()))  # n_threads: auto
    assert cmd[-2:] == ["--verbose", "false"]


def test_vllm_command_from_paper_profile(repo_root):
    """The command on the weights' local path (tests/test_offline_weights.py: the snapshot folder it gets)."""
    params = load_params(repo_root / "params.yaml", {"profile": "paper",
                                                      "environment": {"server": {"extra_args": ["--enforce-eager"]}}})
    assert vllm_command(params.environment, "/hf/hub/models--openai--gpt-oss-20b/snapshots/abc") == [
        "vllm", "serve", "/hf/hub/models--openai--gpt-oss-20b/snapshots/abc",
        "--served-model-name", "gpt-oss-20b",
        "--tensor-parallel-size", "8",
        "--gpu-memory-utilization", "0.9",
        "--max-model-len", "32768",
        "--host", "127.0.0.1",
        "--port", "8000",
        "--enforce-eager",
    ]


def test_llamacpp_needs_a_gguf(local_params, tmp_path):
    local_params.environment.model = str(tmp_path)  # a directory, not a GGUF
    with pytest.raises(EnvironmentUnavailable, match="not a .gguf"):
        server_command(server_spec(local_params))


def test_api_backend_starts_nothing(local_params, monkeypatch):
    cfg = local_params.environment
    cfg.backend, cfg.base_url, cfg.api_key_env = "api", "https://api.example.invalid/v1", "PROMPTR1_TEST_KEY"
    monkeypatch.setenv("PROMPTR1_TEST_KEY", "sk-test")
    with serve_environment(server_spec(local_params)) as url:
        assert url == "https://api.example.invalid/v1" and started_server(url) is None
    monkeypatch.delenv("PROMPTR1_TEST_KEY")
    with pytest.raises(EnvironmentUnavailable, match=r"PROMPTR1_TEST_KEY"), serve_environment(
        server_spec(local_params)
    ):
        pytest.fail("must not enter the block")


def test_healthy_server_is_reused_not_stopped(local_params):
    with FaultServer(model="smollm2-135m-instruct") as running:
        local_params.environment.port = running.port
        with serve_environment(server_spec(local_params)) as url:
            assert url == running.url and started_server(url) is None
        assert is_healthy(running.url)


def test_server_serving_another_model_is_not_reused(local_params):
    """Reuse means "serves the configured model": a stranger at the port stops the stage, naming the key."""
    with FaultServer(model="some-other-model") as running:
        local_params.environment.port = running.port
        expected = r"serves \['some-other-model'\], not environment\.served_name"
        with pytest.raises(EnvironmentUnavailable, match=expected), serve_environment(
            server_spec(local_params)
        ):
            pytest.fail("must not enter the block")
        assert is_healthy(running.url)  # left alone


def test_start_and_stop_own_server_also_when_body_raises(local_params, stand_in):
    with serve_environment(server_spec(local_params)) as url:
        pid = started_server(url).pid
        assert is_healthy(url) and pid_alive(pid)
    assert not pid_alive(pid) and not is_healthy(url)

    with pytest.raises(RuntimeError, match="boom"), serve_environment(server_spec(local_params)) as url:
        pid = started_server(url).pid
        raise RuntimeError("boom")
    assert not pid_alive(pid) and not is_healthy(url) and started_server(url) is None


def test_startup_failure_reports_log_tail(local_params):
    local_params.environment.server.extra_args = ["--no-such-flag-xyz"]
    with (pytest.raises(EnvironmentUnavailable, match="exited with code") as info,
          serve_environment(server_spec(local_params))):
        pytest.fail("must not enter the block")
    assert "no-such-flag-xyz" in str(info.value)  # argparse's complaint, from the log
    log = Path(local_params.paths.cache_dir) / f"environment_server_llamacpp_{local_params.environment.port}.log"
    assert log.is_file()


def test_startup_timeout_kills_the_process(local_params, monkeypatch, tmp_path):
    pid_file = tmp_path / "sleeper.pid"
    sleeper = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    monkeypatch.setattr(servers, "server_command", lambda params: [sys.executable, "-c", sleeper])
    local_params.environment.server.startup_timeout_s = 1.0
    with pytest.raises(EnvironmentUnavailable, match="did not answer"), serve_environment(
        server_spec(local_params)
    ):
        pytest.fail("must not enter the block")
    assert not pid_alive(int(pid_file.read_text())), "a server that never became healthy must be killed"
    assert started_server(local_params.environment.url) is None


def test_missing_server_binary(local_params, tiny_llama_dir):
    local_params.environment.backend = "vllm"
    local_params.environment.model = str(tiny_llama_dir)  # weights present: the missing binary is the problem
    if shutil.which("vllm"):
        pytest.skip("vllm is installed here (GPU node)")
    with pytest.raises(EnvironmentUnavailable, match="cannot start"), serve_environment(
        server_spec(local_params)
    ):
        pass


def test_base_url_elsewhere_is_not_started(local_params):
    local_params.environment.base_url = f"http://127.0.0.1:{free_port()}/v1"
    with pytest.raises(EnvironmentUnavailable, match="base_url"), serve_environment(
        server_spec(local_params)
    ):
        pass


def test_cli_start_status_stop(local_params, stand_in, capsys):
    cli_start(local_params)
    state_file = Path(local_params.paths.cache_dir) / STATE_FILE
    state = json.loads(state_file.read_text())
    assert state["url"] == local_params.environment.url and pid_alive(state["pid"])
    assert started_server(state["url"]) is None  # detached: not stopped when this interpreter exits
    try:
        cli_start(local_params)  # second start reuses
        assert "reusing" in capsys.readouterr().out
        cli_status(local_params)
        out = capsys.readouterr().out
        assert "healthy" in out and f"pid {state['pid']}" in out
    finally:
        cli_stop(local_params)
    assert not pid_alive(state["pid"]) and not state_file.exists()
    assert "stopped" in capsys.readouterr().out
    with pytest.raises(EnvironmentUnavailable, match="nothing healthy"):
        cli_status(local_params)
    cli_stop(local_params)
    assert "nothing to stop" in capsys.readouterr().out


def test_cli_stop_never_kills_a_recycled_pid(local_params, capsys):
    sleeper = servers.subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                                       start_new_session=True)
    try:
        state = {"pid": sleeper.pid, "pgid": sleeper.pid, "url": local_params.environment.url,
                 "command": [sys.executable, "-m", "llama_cpp.server", "--port", "1"], "log_path": "x",
                 "started_at": 0.0}
        state_file = Path(local_params.paths.cache_dir) / STATE_FILE
        state_file.parent.mkdir(parents=True, exist_ok=True)
        state_file.write_text(json.dumps(state))
        cli_stop(local_params)
        assert sleeper.poll() is None, "a process not running the recorded command must survive"
        assert "no longer running" in capsys.readouterr().out
    finally:
        os.killpg(sleeper.pid, signal.SIGKILL)
        sleeper.wait()


def test_vllm_server_gets_only_its_gpus_and_starts_offline(local_params, tiny_llama_dir):
    """Placement: vLLM sees only environment.server.gpus; its weights are verified, then it runs offline."""
    from pipeline.environment.servers import server_env

    env_cfg = local_params.environment
    env_cfg.backend, env_cfg.model = "vllm", str(tiny_llama_dir)
    env_cfg.server.gpus, env_cfg.server.tensor_parallel_size = [6, 7], 2
    env = server_env(server_spec(local_params))
    assert env["CUDA_VISIBLE_DEVICES"] == "6,7" and env["HF_HUB_OFFLINE"] == "1"

    env_cfg.model = "some-org/not-downloaded-model"
    with pytest.raises(EnvironmentUnavailable, match=r"run `promptr1 weights` before starting vLLM"):
        server_env(server_spec(local_params))


def test_gpt_oss_vllm_starts_offline_with_harmony_reading_the_fetched_encoding(repo_root, tmp_path, monkeypatch):
    """vLLM's GPT-OSS path loads harmony's o200k_base.tiktoken at start, outside the Hub cache: the server
    gets TIKTOKEN_ENCODINGS_BASE (what harmony reads) pointing at the verified copy, and refuses to start
    without it, naming `promptr1 weights`."""
    import hashlib

    from pipeline.environment import harmony
    from pipeline.environment.servers import server_env

    model = tmp_path / "gpt-oss-20b"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"x")
    folder = tmp_path / "encodings"
    monkeypatch.setenv("TIKTOKEN_ENCODINGS_BASE", str(folder))
    vocab = b"IQ== 0\n"
    monkeypatch.setattr(harmony, "ENCODING_FILES", {"o200k_base.tiktoken": hashlib.sha256(vocab).hexdigest()})
    params = load_params(repo_root / "params.yaml", {"profile": "paper", "environment": {"model": str(model)}})

    with pytest.raises(EnvironmentUnavailable, match=r"GPT-OSS, whose harmony encoding .*o200k_base\.tiktoken is "
                                                     r"missing\. Run `promptr1 weights`"):
        server_env(server_spec(params))
    folder.mkdir()
    (folder / "o200k_base.tiktoken").write_bytes(vocab + b"tampered")
    with pytest.raises(EnvironmentUnavailable, match="sha256"):
        server_env(server_spec(params))
    (folder / "o200k_base.tiktoken").write_bytes(vocab)
    env = server_env(server_spec(params))
    assert env["TIKTOKEN_ENCODINGS_BASE"] == str(folder.resolve())
    assert env["HF_HUB_OFFLINE"] == "1" and env["CUDA_VISIBLE_DEVICES"] == "8,9,10,11,12,13,14,15"
    assert server_command(server_spec(params))[:3] == ["vllm", "serve", str(model)]

    # Not GPT-OSS: no harmony file needed, none pointed at
    monkeypatch.delenv("TIKTOKEN_ENCODINGS_BASE")
    params.environment.served_name = "qwen"
    params.environment.model = str(model.rename(tmp_path / "qwen"))
    assert "TIKTOKEN_ENCODINGS_BASE" not in server_env(server_spec(params))


def test_llama_server_extra_args_set_llama_cpp_fields_by_name_and_type():
    """`environment.server.extra_args` for the llama.cpp engine: `--name value` onto llama.cpp's params,
    converted to the field's type; unknown names and bad values stop with one line naming them."""
    import xllamacpp

    from pipeline.environment.llama_server import set_extra

    params = xllamacpp.CommonParams()
    set_extra(params, ["--n_batch", "1024", "--cache_prompt", "false", "--n-ubatch", "256"])
    assert (params.n_batch, params.cache_prompt, params.n_ubatch) == (1024, False, 256)
    for bad, message in [(["--no_such_knob", "1"], "unknown llama.cpp server parameter '--no_such_knob'"),
                         (["--n_batch", "many"], "--n_batch takes a int, got 'many'"),
                         (["--cache_prompt", "maybe"], "--cache_prompt takes true or false"),
                         (["--n_batch"], "must be --name value pairs")]:
        with pytest.raises(SystemExit, match=message):
            set_extra(params, bad)
