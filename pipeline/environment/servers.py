"""Start, health-check and stop the environment's local OpenAI-compatible server, as a `ServerSpec` says.

Backends (`environment.backend`):
- `llamacpp`: a llama.cpp server on the model ref (the bundled SmolLM2-135M-Instruct GGUF by default),
  served under `served_name` on `host:port`: llama.cpp's own batching server (`server.engine: llama.cpp`,
  pipeline.environment.llama_server; 1.13x the requests/s at 8 in flight in benchmarks/bench_env_server.py) or
  `python -m llama_cpp.server` (`llama-cpp-python`). The CPU default; starts in about two seconds.
- `vllm`: `vllm serve <model>` with the tensor-parallel size, GPU memory fraction and max model length
  from `environment.server` (GPT-OSS-20B in the paper profile). Built here, runs on GPU nodes only.
- `knowledge`: `python -m pipeline.environment.simulated.knowledge_server` on `environment.knowledge.sources`, an environment
  that knows the questions' gold answers (the `learn` profile; see that module). Starts in about a second.
- `api`: a paid endpoint; nothing is started, but the key variable must be set (fails fast otherwise).

Launchers are a registry (`SERVER_LAUNCHERS`, `register_launcher`): one function per backend from its
`ServerSpec` (pipeline.environment.spec: config, project root, cache folder; resolved once) to its command line.

Design decisions:
- **Reuse before start.** If something already answers `GET <url>/models` with 200, it is used as is and
  never stopped by us (a server started by `promptr1 env start`, by a test session, or by an operator).
  The probes themselves (`served_models`, `is_healthy`, the served-model check) are
  pipeline/environment/probes.py's.
- **We stop only what we started**, by process group: the server runs in its own session
  (`start_new_session=True`) so SIGTERM → (grace) → SIGKILL reaches the server and any workers it forked
  (vLLM spawns several). `serve_environment` stops it on normal exit, on exceptions and on
  KeyboardInterrupt; an `atexit` hook is the last resort if the interpreter exits inside the block.
- **Startup failures are explained**: the server's output goes to a log file under `paths.cache_dir`; if it dies
  or is not healthy within `server.startup_timeout_s`, EnvironmentUnavailable carries the log's tail.
- Servers started by hand and left running (`promptr1 env start|stop|status`) are pipeline/commands/env.py's.
"""

from __future__ import annotations

import atexit
import logging
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.environment.client import resolve_api_key
from pipeline.environment.guard import guarded
from pipeline.environment.harmony import encodings_dir, harmony_server_env, needs_harmony, verify_encodings
from pipeline.environment.probes import check_serves_configured_model, is_healthy, served_models
from pipeline.environment.simulated.knowledge_server import knowledge_command
from pipeline.environment.spec import ServerSpec
from pipeline.errors import EnvironmentUnavailable
from pipeline.hardware import server_threads
from pipeline.local_weights import OFFLINE_ENV, model_status
from pipeline.modelref import ModelRefError, as_resolved
from pipeline.paths import display_path
from pipeline.placement import cuda_visible_devices, gpus_of_environment
from pipeline.runtime import stop_process_group

if TYPE_CHECKING:
    from pipeline.config import EnvironmentConfig

logger = logging.getLogger(__name__)

STOP_GRACE_S = 10.0
LOG_TAIL_CHARS = 3000


@dataclass
class ServerProcess:
    """A server process this module started."""

    pid: int
    pgid: int
    url: str
    command: list[str]
    log_path: str
    started_at: float


_STARTED: dict[str, ServerProcess] = {}
"""Servers started (and not yet stopped) by this interpreter, by URL: stopped at exit as a last resort."""


# -- commands -------------------------------------------------------------------------------------------


ServerLauncher = Callable[[ServerSpec], list[str]]
SERVER_LAUNCHERS: dict[str, ServerLauncher] = {}
"""Backends that run a local server: backend name → the command line serving the spec's environment."""


def register_launcher(backend: str) -> Callable[[ServerLauncher], ServerLauncher]:
    """Decorator: `fn(spec) -> command` starts the local server of `backend`."""

    def add(fn: ServerLauncher) -> ServerLauncher:
        SERVER_LAUNCHERS[backend] = fn
        return fn

    return add


def server_command(spec: ServerSpec) -> list[str]:
    """The command line that serves `spec.environment` locally (the backend's registered launcher)."""
    backend = spec.environment.backend
    if backend not in SERVER_LAUNCHERS:
        raise EnvironmentUnavailable(f"environment backend {backend!r} has no local server to start")
    return SERVER_LAUNCHERS[backend](spec)


@register_launcher("llamacpp")
def _llamacpp_launcher(spec: ServerSpec) -> list[str]:
    return llamacpp_command(spec.environment, _model_location(spec))


@register_launcher("vllm")
def _vllm_launcher(spec: ServerSpec) -> list[str]:
    return vllm_command(spec.environment, str(_verified_weights(spec)))


@register_launcher("knowledge")
def _knowledge_launcher(spec: ServerSpec) -> list[str]:
    return knowledge_command(spec.environment, spec.root)


def llamacpp_command(cfg: EnvironmentConfig, model_path: str) -> list[str]:
    """An OpenAI-compatible llama.cpp server on a GGUF file: llama.cpp's own batching server
    (`server.engine: llama.cpp`, pipeline.environment.llama_server) or llama-cpp-python's."""
    llama_cpp = cfg.server.engine == "llama.cpp"
    module = "pipeline.environment.llama_server" if llama_cpp else "llama_cpp.server"
    return [
        sys.executable, "-m", module,
        "--model", model_path,
        "--model_alias", cfg.served_name,
        "--host", cfg.host,
        "--port", str(cfg.port),
        "--n_ctx", str(cfg.server.n_ctx),
        "--n_threads", str(server_threads(cfg.server.n_threads)),
        *(["--n_parallel", str(cfg.server.parallel)] if llama_cpp else []),
        *cfg.server.extra_args,
    ]


def vllm_command(cfg: EnvironmentConfig, model: str) -> list[str]:
    """`vllm serve` for GPU nodes (the paper's GPT-OSS-20B environment); `model` is the weights' local path
    (`_verified_weights`), served under `environment.served_name`."""
    return [
        "vllm", "serve", model,
        "--served-model-name", cfg.served_name,
        "--tensor-parallel-size", str(cfg.server.tensor_parallel_size),
        "--gpu-memory-utilization", str(cfg.server.gpu_memory_utilization),
        "--max-model-len", str(cfg.server.max_model_len),
        "--host", cfg.host,
        "--port", str(cfg.port),
        *cfg.server.extra_args,
    ]


def _model_location(spec: ServerSpec) -> str:
    cfg = spec.environment
    try:
        resolved = as_resolved(cfg.model, spec.root)
    except ModelRefError as exc:
        raise EnvironmentUnavailable(f"environment.model: {exc}") from exc
    if cfg.backend == "llamacpp" and not resolved.gguf_file:
        raise EnvironmentUnavailable(
            f"environment.model {cfg.model!r} resolves to {resolved.location}, not a .gguf file: "
            "the llamacpp backend serves GGUF models"
        )
    return resolved.location


# -- start / stop ---------------------------------------------------------------------------------------


def cache_dir(spec: ServerSpec) -> Path:
    """The spec's cache folder (`paths.cache_dir`), created: server logs and manual servers' state go there."""
    spec.cache_dir.mkdir(parents=True, exist_ok=True)
    return spec.cache_dir


def _log_tail(path: str | Path, chars: int = LOG_TAIL_CHARS) -> str:
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return "(no log)"
    return text[-chars:].strip() or "(empty log)"


def _check_startable(cfg: EnvironmentConfig) -> None:
    local_url = f"http://{cfg.host}:{cfg.port}/v1"
    if cfg.base_url and cfg.url != local_url:
        raise EnvironmentUnavailable(
            f"nothing healthy answers at environment.base_url={cfg.url}, and a {cfg.backend} server would be "
            f"started at {local_url}: leave base_url empty to start one, or start the server at base_url"
        )


def _verified_weights(spec: ServerSpec) -> Path:
    """The local path of the vLLM model's verified weights (a Hub id's snapshot folder in the Hugging Face
    cache); EnvironmentUnavailable naming `promptr1 weights` when they are not on this machine."""
    cfg = spec.environment
    status = model_status("environment.model", cfg.model, spec.root, fetch=False)
    if status.location is None:
        raise EnvironmentUnavailable(f"environment.model={cfg.model!r} is {status.state} on this "
                                     f"machine ({status.detail}): run `promptr1 weights` before starting vLLM")
    return status.location


def server_env(spec: ServerSpec) -> dict[str, str]:
    """The server's environment: its GPUs only (`environment.server.gpus`), and offline Hub access for vLLM.

    vLLM is given only the devices the layout assigns it, so it cannot land on verl's GPUs. Its weights
    must already be in the Hugging Face cache (`promptr1 weights`); it is started on their local path with
    `HF_HUB_OFFLINE=1` and `TRANSFORMERS_OFFLINE=1` (`pipeline.local_weights.OFFLINE_ENV`) instead of downloading
    ~13 GB inside its startup timeout while the GPUs wait. A GPT-OSS model also needs harmony's encoding file,
    which those variables do not cover: `TIKTOKEN_ENCODINGS_BASE` points harmony at the copy `promptr1 weights`
    fetched (pipeline/environment/harmony.py), so it never downloads; and `harmony_server_env` keeps our
    instruction in harmony's developer message.
    """
    env = dict(os.environ)
    cfg = spec.environment
    gpus = gpus_of_environment(cfg)
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices(gpus)
    if cfg.backend == "vllm":
        _verified_weights(spec)
        env.update(OFFLINE_ENV)
        if needs_harmony(cfg):
            problem = verify_encodings(encodings_dir())
            if problem:
                raise EnvironmentUnavailable(f"environment.model={cfg.model!r} is GPT-OSS, whose "
                                             f"harmony encoding vLLM loads at start: {problem}. Run `promptr1 "
                                             "weights` before starting vLLM")
            env.update(harmony_server_env())
    return env


def start_server(spec: ServerSpec, *, detached: bool = False, role: str = "environment",
                 quiet: bool = False) -> ServerProcess:
    """Start the local server for `spec.environment` and wait until it is healthy.

    Raises EnvironmentUnavailable with the log's tail if it exits or does not become healthy within
    `server.startup_timeout_s`. The process is stopped if waiting is interrupted (KeyboardInterrupt too).
    `detached` servers are not stopped when this interpreter exits. `role` names the server in log lines
    and its log file ("environment"; "agent" when evaluation serves the agent the same way); `quiet` logs
    its start at DEBUG (a server started once per training step).
    """
    cfg = spec.environment
    _check_startable(cfg)
    command = server_command(spec)
    if shutil.which(command[0]) is None:
        raise EnvironmentUnavailable(f"cannot start the environment server: {command[0]!r} is not on PATH "
                                     f"(environment.backend={cfg.backend})")
    if not detached:  # stopped even if this process is SIGKILLed (pipeline.environment.guard)
        command = guarded(command)
    log_path = cache_dir(spec) / f"{role}_server_{cfg.backend}_{cfg.port}.log"
    level = logging.DEBUG if quiet else logging.INFO
    logger.log(level, "starting the %s %s server %s on %s (log: %s)", cfg.backend, role, cfg.served_name,
               cfg.url, display_path(log_path, spec.root))
    logger.debug("environment server command: %s", shlex.join(command))
    with open(log_path, "wb") as log:
        try:
            process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, cwd=spec.root, env=server_env(spec),
            )
        except FileNotFoundError as exc:
            raise EnvironmentUnavailable(f"cannot start the environment server: {exc}") from exc
    server = ServerProcess(pid=process.pid, pgid=process.pid, url=cfg.url, command=command,
                           log_path=str(log_path), started_at=time.time())
    if not detached:
        _STARTED[server.url] = server
    try:
        _wait_healthy(server, process, cfg.server.startup_timeout_s)
    except BaseException:
        stop_server(server)
        raise
    logger.log(level, "%s server healthy at %s (pid %d)", role, server.url, server.pid)
    return server


def _wait_healthy(server: ServerProcess, process: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    delay = 0.1
    while True:
        code = process.poll()
        if code is not None:
            raise EnvironmentUnavailable(
                f"the environment server exited with code {code} before answering at {server.url}; "
                f"command: {shlex.join(server.command)}; log {server.log_path} ends with:\n"
                f"{_log_tail(server.log_path)}"
            )
        if is_healthy(server.url, timeout_s=1.0):
            return
        if time.monotonic() > deadline:
            raise EnvironmentUnavailable(
                f"the environment server did not answer at {server.url} within {timeout_s:g}s "
                f"(environment.server.startup_timeout_s); log {server.log_path} ends with:\n"
                f"{_log_tail(server.log_path)}"
            )
        time.sleep(delay)
        delay = min(1.0, delay * 1.5)


def process_alive(pid: int) -> bool:
    """True while `pid` runs (a reaped zombie child of ours counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie child of ours counts as gone once reaped
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == 0
    except ChildProcessError:
        return True


def stop_server(server: ServerProcess, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM the server's process group, then SIGKILL after `grace_s`; idempotent."""
    _STARTED.pop(server.url, None)
    stop_process_group(server.pgid, grace_s)
    logger.debug("server pid %d stopped", server.pid)


@atexit.register
def _stop_leftovers() -> None:
    for server in list(_STARTED.values()):
        stop_server(server, grace_s=3.0)


def started_server(url: str) -> ServerProcess | None:
    """The server this interpreter started at `url` and has not stopped yet (None if reused or none)."""
    return _STARTED.get(url.rstrip("/"))


@contextmanager
def serve_environment(spec: ServerSpec, role: str = "environment", quiet: bool = False) -> Iterator[str]:
    """Make the spec's environment reachable for the block; yields its base URL (ending in /v1).

    Reuses a healthy server at the URL (and leaves it running); backend api starts nothing but needs its
    key variable; otherwise starts llama.cpp or vLLM and stops it when the block exits, however it exits.
    """
    cfg = spec.environment
    if cfg.backend == "api":
        resolve_api_key(cfg)  # fails fast, naming the variable
        yield cfg.url
        return
    models = served_models(cfg.url)
    if models is not None:
        check_serves_configured_model(cfg, models)
        logger.info("reusing the %s server already answering at %s", role, cfg.url)
        yield cfg.url
        return
    server = start_server(spec, role=role, quiet=quiet)
    try:
        yield server.url
    finally:
        stop_server(server)
