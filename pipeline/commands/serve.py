"""`promptr1 serve`: the registered champion behind MLflow's scoring server, answering POST /invocations.

Thin on purpose: it resolves `models:/<register.model_name>@<register.alias>` in the project's registry,
then runs MLflow's own server for it (`mlflow models serve --env-manager local`, which runs uvicorn over
`mlflow.pyfunc.scoring_server.app`) in this environment. Design decisions:

- **The timeout one question needs.** MLflow 3's scoring server wraps every request in
  `asyncio.wait_for(..., MLFLOW_SCORING_SERVER_REQUEST_TIMEOUT)` (60 s by default) and answers 504 after it;
  one question is a multi-turn rollout (~100-130 s on 2 CPU cores), so the served model timed out on every
  question. `register.serve.request_timeout_s` is passed as `mlflow models serve --timeout`, which MLflow
  hands to the server process as that variable (set here too, for readers of the environment).
- **The port is checked before anything loads**: out of range, in use or not an address here is one line
  naming it at once, not MLflow's traceback after the model has loaded for ~20 s.
- **The registry is read before the server starts**: no champion, or a store that cannot be read, is one
  clear line (UserError), not a server that starts and fails on its first request.
- **The environment is not started here.** The model carries the environment URL it was registered with
  (`environment.json`); `promptr1 env start` (or any endpoint serving the model) must answer there. If it does
  not at start-up, a warning says so; each request then fails fast with the URL and what to start
  (pipeline/environment/probes.py), instead of retrying for minutes.
- **llama.cpp generates, as in evaluation** (pipeline/agent/serving_policy.py): the served model config's
  `agent_engine`, `agent_parallel`, `agent_threads` and `cache_dir` are set from this project's `register.serve` and
  `paths.cache_dir` (MLflow's `SERVING_MODEL_CONFIG`), so the pyfunc exports the agent to GGUF once (cached
  beside evaluation's exports) and starts its own llama.cpp server at load, before /ping answers; that server
  stops with the scoring server. One question of the serving test: 11 s, 41-47 s with torch
  (docs/serving.md).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.errors import EnvironmentUnavailable, UserError
from pipeline.runtime import stop_process_group

if TYPE_CHECKING:
    from pipeline.config import Params

log = logging.getLogger(__name__)

TIMEOUT_VARIABLE = "MLFLOW_SCORING_SERVER_REQUEST_TIMEOUT"
"""What MLflow 3.x's scoring server reads (mlflow/pyfunc/scoring_server/__init__.py, `init`)."""
STOP_GRACE_S = 10.0
"""How long uvicorn gets to shut down (and stop the agent's llama.cpp server) before SIGKILL."""
MODEL_CONFIG_VARIABLE = "SERVING_MODEL_CONFIG"
"""JSON model-config overrides MLflow's scoring server loads the model with (`load_model_with_mlflow_config`)."""


def champion_uri(params: Params) -> str:
    return f"models:/{params.register.model_name}@{params.register.alias}"


def champion_version(params: Params) -> Any:
    """The model version the alias points at, or UserError naming the registry and how to make one."""
    import mlflow

    from pipeline.config.specs import tracking_spec
    from pipeline.tracking.lineage import current_champion
    from pipeline.tracking.runs import tracking_uri

    uri = tracking_uri(tracking_spec(params))
    client = mlflow.MlflowClient(tracking_uri=uri, registry_uri=uri)
    version = current_champion(client, params.register.model_name, params.register.alias)
    if version is None:
        raise UserError(
            f"{champion_uri(params)} does not exist in the registry at {uri}: register one first "
            "(`dvc repro`, or `promptr1 register` after evaluate)"
        )
    return version


def serve_command(
    params: Params, host: str | None = None, port: int | None = None
) -> tuple[list[str], dict[str, str]]:
    """The `mlflow models serve` command line and its environment for the champion."""
    from pipeline.config.specs import tracking_spec
    from pipeline.tracking.runs import tracking_uri

    cfg = params.register.serve
    timeout = str(cfg.request_timeout_s)
    cmd = [
        sys.executable,
        "-m",
        "mlflow",
        "models",
        "serve",
        "-m",
        champion_uri(params),
        "--env-manager",
        "local",
        "--host",
        host or cfg.host,
        "--port",
        str(port or cfg.port),
        "--timeout",
        timeout,
        "--workers",
        "1",
    ]
    uri = tracking_uri(tracking_spec(params))
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "MLFLOW_REGISTRY_URI": uri, TIMEOUT_VARIABLE: timeout}
    env[MODEL_CONFIG_VARIABLE] = json.dumps(serving_model_config(params))
    return cmd, env


def serving_model_config(params: Params) -> dict[str, Any]:
    """The pyfunc model-config keys this project's params decide at serve time (pipeline/agent/serving_policy.py),
    under any the caller already put in `SERVING_MODEL_CONFIG`."""
    cfg = params.register.serve
    ours = {
        "agent_engine": cfg.agent_engine,
        "agent_parallel": cfg.agent_parallel,
        "agent_threads": cfg.agent_threads,
        "cache_dir": str(params.path(params.paths.cache_dir).resolve()),
    }
    return {**ours, **json.loads(os.environ.get(MODEL_CONFIG_VARIABLE) or "{}")}


def _warn_if_environment_down(version: Any, uri: str) -> None:
    """Log a warning when the environment the champion was registered with does not answer now."""
    import mlflow

    from pipeline.config import EnvironmentConfig
    from pipeline.environment.probes import check_environment_answers

    try:
        from pipeline.tracking.lineage import logged_model_id

        model = mlflow.MlflowClient(tracking_uri=uri, registry_uri=uri).get_logged_model(
            logged_model_id(version)
        )
        where = f"{model.artifact_location}/artifacts/environment.json"  # this file only, not the weights
        local = Path(mlflow.artifacts.download_artifacts(artifact_uri=where))
        check_environment_answers(EnvironmentConfig.model_validate(json.loads(local.read_text())))
    except EnvironmentUnavailable as exc:
        log.warning("serve: %s; requests fail until it answers", exc)
    except Exception as exc:  # noqa: BLE001 - a pre-check only: the server still starts
        log.warning("serve: could not check the champion's environment: %s", exc)


def port_problem(host: str, port: int) -> str | None:
    """Why the scoring server could not listen on `host:port` (not a TCP port, in use, not an address of this
    machine), or None. Bound the way uvicorn binds (SO_REUSEADDR: a port left in TIME_WAIT is free to it)."""
    if not 1 <= port <= 65535:
        return f"port {port} is not a TCP port (1-65535)"
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        return f"host {host!r} cannot be resolved ({exc.strerror})"
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return f"port {port} on {host} is in use by another process"
            return f"cannot listen on {host}:{port} ({exc.strerror})"
    return None


def run_serve(params: Params, host: str | None = None, port: int | None = None) -> int:
    """Serve the champion until interrupted (SIGINT or SIGTERM: the server and all it started are stopped);
    returns the server's exit code. The port is checked first, before the registry or the model is loaded."""
    from pipeline.runtime import terminate_as_interrupt

    where_host, where_port = host or params.register.serve.host, port or params.register.serve.port
    problem = port_problem(where_host, where_port)
    if problem is not None:
        raise UserError(f"promptr1 serve: {problem}: choose another with --port (default: register.serve.port)")
    version = champion_version(params)
    cmd, env = serve_command(params, host, port)
    _warn_if_environment_down(version, env["MLFLOW_TRACKING_URI"])
    where = f"http://{where_host}:{where_port}/invocations"
    log.info(
        "serving %s (v%s) on %s; %s s per request",
        champion_uri(params),
        version.version,
        where,
        params.register.serve.request_timeout_s,
    )
    server = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        with terminate_as_interrupt():
            return server.wait()
    except KeyboardInterrupt:
        log.info("serve: stopping the scoring server (process group %d) and the agent server it started", server.pid)
        stop_process_group(server, STOP_GRACE_S)
        return 0
