"""`promptr1 env start|stop|status`: an environment server started by hand and left running.

`env start` starts (or reuses) the configured server detached, outside any stage, and records its PID,
process group, URL and command in `<cache_dir>/environment_server.json`; the stages then find it healthy
and reuse it. `env stop` reads that file and stops only that process, after checking the PID still runs the
recorded command, so a recycled PID is never killed. `env status` health-checks whatever the params point at.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from pathlib import Path

import typer

from pipeline.config import Params
from pipeline.environment.client import resolve_api_key
from pipeline.environment.probes import check_serves_configured_model, is_healthy, served_models
from pipeline.environment.servers import (
    ServerProcess,
    cache_dir,
    process_alive,
    start_server,
    stop_server,
)
from pipeline.environment.spec import ServerSpec
from pipeline.errors import EnvironmentUnavailable

STATE_FILE = "environment_server.json"
logger = logging.getLogger(__name__)


def _server_spec(params: Params) -> ServerSpec:
    """The environment server the params describe: its section, the project root, `paths.cache_dir`."""
    cache_dir = params.path(params.paths.cache_dir)
    return ServerSpec(environment=params.environment, root=params.root, cache_dir=cache_dir)


def _state_path(spec: ServerSpec) -> Path:
    return cache_dir(spec) / STATE_FILE


def _read_state(spec: ServerSpec) -> ServerProcess | None:
    path = _state_path(spec)
    try:
        return ServerProcess(**json.loads(path.read_text(encoding="utf-8")))
    except FileNotFoundError:
        return None
    except (ValueError, TypeError) as exc:
        logger.warning("ignoring unreadable %s: %s", path, exc)
        return None


def _runs_command(server: ServerProcess) -> bool:
    """The recorded PID is alive and (where /proc exists) still runs the recorded command."""
    if not process_alive(server.pid):
        return False
    cmdline = Path(f"/proc/{server.pid}/cmdline")
    if not cmdline.exists():
        return True
    try:
        args = [a.decode(errors="replace") for a in cmdline.read_bytes().split(b"\0")]
    except OSError:
        return False
    # The recorded arguments after the executable appear in order (`vllm` runs as `python …/vllm serve …`).
    tail = server.command[1:]
    return any(args[i : i + len(tail)] == tail for i in range(len(args) - len(tail) + 1))


def cli_start(params: Params) -> None:
    """`promptr1 env start`: start (or reuse) the server and leave it running; record its PID."""
    spec = _server_spec(params)
    cfg = spec.environment
    if cfg.backend == "api":
        resolve_api_key(cfg)
        typer.echo(f"backend api: nothing to start; requests go to {cfg.url} (key from ${cfg.api_key_env})")
        return
    models = served_models(cfg.url)
    if models is not None:
        check_serves_configured_model(cfg, models)
        typer.echo(f"an environment server already answers at {cfg.url} (models: {', '.join(models)}); reusing it")
        return
    server = start_server(spec, detached=True)
    _state_path(spec).write_text(json.dumps(asdict(server), indent=2), encoding="utf-8")
    typer.echo(f"environment server started at {server.url} (pid {server.pid}, log {server.log_path}); "
               "stop it with `promptr1 env stop`")


def cli_stop(params: Params) -> None:
    """`promptr1 env stop`: stop the server `env start` recorded; never touches servers it did not start."""
    spec = _server_spec(params)
    state = _read_state(spec)
    path = _state_path(spec)
    if state is None:
        note = " (a server does answer there, but env start did not start it)" if is_healthy(
            spec.environment.url) else ""
        typer.echo(f"no environment server recorded in {path}{note}; nothing to stop")
        return
    if _runs_command(state):
        stop_server(state)
        typer.echo(f"environment server at {state.url} (pid {state.pid}) stopped")
    else:
        typer.echo(f"environment server pid {state.pid} is no longer running")
    path.unlink(missing_ok=True)


def cli_status(params: Params) -> None:
    """`promptr1 env status`: health-check the configured endpoint; exit 1 when nothing healthy answers."""
    spec = _server_spec(params)
    cfg = spec.environment
    api_key = resolve_api_key(cfg) if cfg.backend == "api" else None
    models = served_models(cfg.url, api_key=api_key, timeout_s=5.0)
    state = _read_state(spec)
    owner = f" (started by env start: pid {state.pid}, log {state.log_path})" if state and _runs_command(state) else ""
    if models is None:
        raise EnvironmentUnavailable(f"environment backend {cfg.backend}: nothing healthy answers at {cfg.url}"
                                     f"/models; start it with `promptr1 env start`")
    typer.echo(f"environment backend {cfg.backend}: healthy at {cfg.url}{owner}; models: {', '.join(models)}")
