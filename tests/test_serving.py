"""Serving the agent: the pyfunc fails fast without its environment (fast, a real closed port: HTTP 503 for MLflow),
is logged from code without a CloudPickle warning (a real SQLite registry), and `promptr1 serve` answers 503 while
the environment is down, a POST once it is up, and stops all it started on SIGTERM (slow)."""

from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path

import pytest
from demo_project import free_port

from pipeline.config.specs import tracking_spec
from pipeline.errors import EnvironmentUnavailable


def wait_for_ping(server, url: str, timeout_s: float, poll_s: float) -> None:
    """Wait until MLflow's scoring server at `url` answers /ping (or its process `server` ended); fail with
    its output when the process ended first."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and server.poll() is None:
        try:
            if httpx.get(f"{url}/ping", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(poll_s)
    assert server.poll() is None, server.stdout.read() if server.stdout else ""

def _agent_context(agent_dir: Path, tmp_path: Path, base_url: str):
    """The pyfunc's real load context: the bundled agent, environment JSON and model config, as MLflow passes them."""
    from mlflow.pyfunc import PythonModelContext

    from pipeline.config import load_params
    from pipeline.stages.register import _agent_model_config, environment_json

    params = load_params(Path(__file__).resolve().parents[1] / "params.yaml")
    env_file = tmp_path / "environment.json"
    env_file.write_text(json.dumps(environment_json(params)))
    config = _agent_model_config(params)
    config["environment"] = {"base_url": base_url}
    config["cache_dir"] = str(tmp_path / "cache")  # GGUF exports and agent-server logs: never the home folder
    return PythonModelContext(
        artifacts={"agent": str(agent_dir), "environment": str(env_file)}, model_config=config
    )


def test_predict_without_an_environment_fails_fast_naming_the_url(tiny_llama_dir, tmp_path, caplog):
    """Nothing listens on the port: predict raises within seconds, naming the URL and what to start (not retry
    every call for ~170 s and return an empty answer with no error)."""
    import pandas as pd

    from pipeline.serving.agent_model import PromptR1Agent

    url = f"http://127.0.0.1:{free_port()}/v1"  # bound, then closed: a real refused connection
    agent = PromptR1Agent()
    with caplog.at_level(logging.INFO, logger="pipeline.serving.agent_model"):
        agent.load_context(_agent_context(tiny_llama_dir, tmp_path, url))
    # where the pyfunc keeps its files (a GGUF export is hundreds of MB) and how much, said at load
    assert re.search(rf"Prompt-R1 agent cache: {re.escape(str((tmp_path / 'cache').resolve()))} holds \d+ MB",
                     caplog.text), caplog.text
    start = time.monotonic()
    with pytest.raises(
        EnvironmentUnavailable, match=r"does not answer at http://127\.0\.0\.1:\d+/v1.*promptr1 env start"
    ) as raised:
        agent.predict(None, pd.DataFrame({"question": ["Who directed The Carter?"]}))
    assert time.monotonic() - start < 10
    # MLflow's scoring server answers an MlflowException with its error code's HTTP status: a dependency outage
    # is 503 (TEMPORARILY_UNAVAILABLE), not the 400 "verify the input" any other exception becomes
    assert raised.value.get_http_status_code() == 503
    assert json.loads(raised.value.serialize_as_json())["error_code"] == "TEMPORARILY_UNAVAILABLE"


def test_register_logs_the_agent_from_code_without_a_cloudpickle_warning(
    tmp_path, repo_root, tiny_llama_dir, monkeypatch, capfd, caplog
):
    """The register stage's model logging says nothing about CloudPickle (not in logs, warnings or the
    console), logs one copy of the model, and the champion loads from its code without pickle."""
    import logging
    import shutil
    import warnings

    import mlflow
    from helpers import write_eval_metrics

    from pipeline.config import load_params
    from pipeline.stages.register import run_register

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_PICKLE_DESERIALIZATION", raising=False)
    monkeypatch.setenv("PROMPTR1_CACHE_DIR", str(tmp_path / "cache"))
    shutil.copy(repo_root / "params.yaml", tmp_path / "params.yaml")
    params = load_params(tmp_path / "params.yaml", {"paths": {"model_dir": str(tiny_llama_dir)}})
    write_eval_metrics(tmp_path, 30.0, 40.0)

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    loggers = [logging.getLogger(), logging.getLogger("mlflow")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:  # INFO and up, whatever earlier tests left the levels at
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert run_register(params)["promoted"]
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.removeHandler(handler)
            logger.setLevel(level)
    said = "\n".join([*records, *(str(w.message) for w in caught), *capfd.readouterr()])
    assert records, "no log record captured: the capture itself is broken"
    assert "cloudpickle" not in said.lower(), said

    local = Path(mlflow.artifacts.download_artifacts(f"models:/{params.register.model_name}@champion"))
    assert "model_code_path" in (local / "MLmodel").read_text()
    assert not list(local.rglob("python_model.pkl"))
    assert len(list(local.rglob("config.json"))) == 1  # one copy of the model per version
    model = mlflow.pyfunc.load_model(str(local))  # pickle deserialization stays disallowed
    assert type(model.unwrap_python_model()).__name__ == "PromptR1Agent"

    # `promptr1 serve` reads the champion's environment.json alone and warns that nothing answers there
    from pipeline.commands.serve import _warn_if_environment_down, champion_version
    from pipeline.tracking.runs import tracking_uri

    with caplog.at_level(logging.WARNING, logger="pipeline.commands.serve"):
        _warn_if_environment_down(champion_version(params), tracking_uri(tracking_spec(params)))
    assert f"does not answer at {params.environment.url}" in caplog.text, caplog.text


def _descendants(pid: int) -> set[int]:
    """Every live process below `pid` (children, grandchildren …), read from /proc; zombies excluded."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _alive(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                alive.add(pid)
        except OSError:
            pass
    return alive


@pytest.mark.slow
def test_promptr1_serve_answers_503_while_the_environment_is_down_and_sigterm_stops_all_it_started(
    tmp_path, repo_root, monkeypatch
):
    """Register the real SmolLM2 agent as champion in a temp SQLite registry and run `promptr1 serve` on a free
    port while nothing answers at the environment's URL: it warns, starts and answers /ping; a POST gets HTTP 503
    whose JSON message names the URL and `promptr1 env start` (not MLflow's 400 blaming the input). Then the
    environment comes up (the fault server, an OpenAI-compatible endpoint, on that port): the same POST is
    answered with the answer and its trajectory. Last, SIGTERM to the `promptr1 serve` process alone stops
    everything it started: the MLflow CLI, uvicorn and the agent's llama.cpp server (and its guard)."""
    import os
    import signal
    import subprocess
    import sys

    import httpx
    from fault_server import FaultServer
    from helpers import register_params, save_smollm2_agent, write_eval_metrics

    from pipeline.serving.agent_model import OUTPUT_COLUMNS
    from pipeline.stages.register import run_register

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    agent_dir = save_smollm2_agent(tmp_path / "agent")

    project = tmp_path / "proj"
    project.mkdir()
    fact = "The Carter was directed by Adam Bhala Lough."
    env_port = free_port()  # nothing listens there until the fault server starts
    params = register_params(
        project,
        repo_root,
        agent_dir,
        base_url=f"http://127.0.0.1:{env_port}/v1",
        served_name="smollm2-135m-instruct",
    )
    params.agent.max_turns = 2
    params.evaluate.agent_max_turn_tokens = 64
    write_eval_metrics(project, 30.0, 40.0)
    assert run_register(params)["promoted"]

    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli", "serve", "--params", str(project / "params.yaml"), "--port", str(port)],
        cwd=project,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    started: set[int] = set()
    commands: dict[int, bytes] = {}
    question = {"dataframe_records": [{"question": "Who directed The Carter?"}]}
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for_ping(server, url, 120, 1.0)
        down = httpx.post(f"{url}/invocations", timeout=60, json=question)
        with FaultServer(responder=lambda messages: fact, model="smollm2-135m-instruct", port=env_port):
            start = time.monotonic()
            response = httpx.post(f"{url}/invocations", timeout=600, json=question)
            per_question = time.monotonic() - start
        started = _descendants(server.pid)
        commands = {pid: Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:120] for pid in started}
        os.kill(server.pid, signal.SIGTERM)  # the serve process only, as a supervisor or `kill <pid>` does
        server.wait(timeout=60)
        deadline = time.monotonic() + 30
        while _alive(started) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = _alive(started)
    finally:
        for pid in _alive(started) | ({server.pid} if server.poll() is None else set()):
            os.kill(pid, signal.SIGKILL)
    output = server.stdout.read() if server.stdout else ""
    assert f"does not answer at http://127.0.0.1:{env_port}/v1" in output and "requests fail until it answers" in output, (
        output
    )
    assert "serving models:/prompt-r1-agent@champion (v1)" in output and "could not check" not in output, output

    assert down.status_code == 503, down.text
    message = down.json()["message"]
    assert f"does not answer at http://127.0.0.1:{env_port}/v1" in message and "promptr1 env start" in message, message
    assert down.json()["error_code"] == "TEMPORARILY_UNAVAILABLE"

    assert response.status_code == 200, response.text
    (row,) = response.json()["predictions"]
    assert list(row) == OUTPUT_COLUMNS
    # Generated by llama.cpp's server on the agent's GGUF export (evaluation's engine), not torch in-process;
    # the export is cached in the serving project's cache folder.
    assert row["agent_engine"] == "llama.cpp", row
    assert "Prompt-R1 agent loaded: engine llama.cpp (agent-" in output, output
    assert list((project / ".cache" / "agent_gguf").glob("agent-*-f16.gguf")), output
    trajectory = json.loads(row["trajectory"])
    assert 1 <= row["turns"] == len(trajectory) <= 2
    assert set(trajectory[0]) >= {
        "text",
        "think",
        "interaction_prompt",
        "answer",
        "agent_tokens",
        "generation_s",
    }
    replies = [t["environment"] for t in trajectory if "environment" in t]
    assert row["env_calls"] == len(replies) and all(r["error"] is None and r["text"] == fact for r in replies)
    assert isinstance(row["answer"], str) and row["stop_reason"]

    # what serve started: the MLflow CLI, uvicorn, the agent server's guard and llama.cpp server
    assert len(started) >= 3, commands
    assert left == set(), {pid: commands.get(pid) for pid in left}
    assert server.returncode == 0, output
    print(
        f"\nserved answer: {row['answer']!r} ({row['turns']} turns, {row['stop_reason']}) "
        f"in {per_question:.1f} s per question; stopped {len(started)} processes on SIGTERM"
    )


def test_serve_passes_the_request_timeout_mlflow_reads(tmp_path, repo_root, monkeypatch):
    """MLflow answers 504 after MLFLOW_SCORING_SERVER_REQUEST_TIMEOUT (60 s by default, less than one question
    takes): `promptr1 serve` sets it, and `mlflow models serve --timeout`, from register.serve.request_timeout_s."""
    from mlflow.environment_variables import MLFLOW_SCORING_SERVER_REQUEST_TIMEOUT

    from pipeline.commands.serve import TIMEOUT_VARIABLE, serve_command
    from pipeline.config import load_params

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert MLFLOW_SCORING_SERVER_REQUEST_TIMEOUT.name == TIMEOUT_VARIABLE
    params = load_params(repo_root / "params.yaml", {"register": {"serve": {"request_timeout_s": 1234}}})
    cmd, env = serve_command(params, port=8123)
    assert env[TIMEOUT_VARIABLE] == "1234" and cmd[cmd.index("--timeout") + 1] == "1234"
    assert cmd[cmd.index("-m", cmd.index("serve")) + 1] == "models:/prompt-r1-agent@champion"
    assert cmd[cmd.index("--port") + 1] == "8123" and env["MLFLOW_TRACKING_URI"].startswith("sqlite:////")


def test_serve_without_a_champion_names_the_registry(tmp_path, repo_root, monkeypatch):
    from pipeline.commands.serve import champion_version
    from pipeline.config import load_params
    from pipeline.errors import UserError

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    params = load_params(
        repo_root / "params.yaml", {"mlflow": {"tracking_uri": f"sqlite:///{tmp_path / 'm.db'}"}}
    )
    with pytest.raises(
        UserError, match=r"models:/prompt-r1-agent@champion does not exist .*m\.db.*dvc repro"
    ):
        champion_version(params)


def test_serve_refuses_a_busy_or_impossible_port_at_once_naming_it(tmp_path, repo_root):
    """`promptr1 serve --port <busy>` or `--port 70000` loaded the model for ~20 s, then printed MLflow's
    traceback: now the port is checked before the registry or the model is touched (the registry here is empty,
    so anything later would fail differently), one line naming it, in seconds. A real listening socket is busy."""
    import socket
    import subprocess
    import sys

    store = f"mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}"
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        for port, said in ((taken, f"port {taken} on 127.0.0.1 is in use by another process"),
                           (70000, "port 70000 is not a TCP port (1-65535)")):
            start = time.monotonic()
            done = subprocess.run([sys.executable, "-m", "pipeline.cli", "serve", "--params",
                                   str(repo_root / "params.yaml"), "-S", store, "--port", str(port)],
                                  cwd=tmp_path, check=False, capture_output=True, text=True, timeout=120)
            seconds = time.monotonic() - start
            output = done.stdout + done.stderr
            assert done.returncode == 1, output
            line = f"error: promptr1 serve: {said}: choose another with --port (default: register.serve.port)"
            assert output.strip().splitlines() == [line], output
            assert seconds < 30, seconds  # the CLI's start-up only: no model, no registry
    assert not (tmp_path / "mlflow.db").exists()  # the registry was never opened


@pytest.mark.slow
def test_the_served_model_answers_400_to_an_empty_or_non_text_question_without_calling_the_environment(
    tiny_llama_dir, tmp_path
):
    """MLflow's scoring server (`mlflow models serve`, what `promptr1 serve` runs) on the pyfunc saved as the
    register stage logs it (models from code, the tiny agent, transformers engine): an empty question got 200
    and an invented answer after ~12 s, `{"question": 42}` a 200 too. Now each is HTTP 400 whose message names
    the row and why, and the environment (a real stand-in server on 127.0.0.1, recording every request) is never
    called, not even probed."""
    import os
    import signal
    import subprocess
    import sys

    import httpx
    import mlflow.pyfunc
    from fault_server import FaultServer

    import pipeline
    from pipeline.serving.agent_model import AGENT_ARTIFACT, ENVIRONMENT_ARTIFACT, MODEL_CODE, signature

    with FaultServer() as env:
        context = _agent_context(tiny_llama_dir, tmp_path, env.url)
        config = {**context.model_config, "agent_engine": "transformers",
                  "environment": {"base_url": env.url, "served_name": env.model}}
        model = tmp_path / "model"
        mlflow.pyfunc.save_model(
            str(model), python_model=str(MODEL_CODE), model_config=config, signature=signature(),
            artifacts={AGENT_ARTIFACT: context.artifacts["agent"],
                       ENVIRONMENT_ARTIFACT: context.artifacts["environment"]},
            code_paths=[str(Path(pipeline.__file__).parent)],
        )
        port = free_port()
        server = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "models", "serve", "-m", str(model), "--env-manager", "local",
             "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        answers = {}
        try:
            url = f"http://127.0.0.1:{port}"
            wait_for_ping(server, url, 180, 0.5)
            for name, question in (("empty", ""), ("blank", "  "), ("number", 42), ("null", None)):
                answers[name] = httpx.post(f"{url}/invocations", timeout=120,
                                           json={"dataframe_records": [{"question": question}]})
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait(timeout=10)
        requests = list(env.requests)
    expected = {"empty": "row 0: the question is empty ('')", "blank": "row 0: the question is empty ('  ')",
                "number": "row 0: a question must be text, got int 42",
                "null": "row 0: a question must be text, got NoneType None"}
    for name, response in answers.items():
        assert response.status_code == 400, (name, response.text)
        assert response.json()["error_code"] == "INVALID_PARAMETER_VALUE", (name, response.text)
        assert expected[name] in response.json()["message"], (name, response.text)
    assert requests == []
