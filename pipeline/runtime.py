"""Process settings every entry point applies first: telemetry off, logging to stderr, SIGTERM as Ctrl-C.

The entry points (`promptr1` in pipeline/cli.py, `python -m flows.retrain`, the flow's DVC subprocesses)
all need the same process-wide setup; it lives here, below every stage module, so that no entry point
imports another for it. Design decisions:

- **Telemetry is off unless the user said otherwise.** `TELEMETRY_OFF` is set with `setdefault`: a value
  already in the environment (a user opting in, a test harness) wins. The same table is handed to every
  subprocess the flow starts (flows/dvc_steps.py), so a stage run by DVC is as quiet as one run by hand.
- **Logs go to stderr**, stdout stays for results a user or a script reads; the HTTP and lock libraries'
  per-request INFO lines are raised to WARNING, since every stage talks HTTP to its environment server.
- **SIGTERM unwinds like Ctrl-C** (`terminate_as_interrupt`): a process manager, `timeout` or `kill` then
  runs the `finally` blocks that stop servers and child process groups instead of orphaning them. Only the
  main thread can own signal handlers; elsewhere the context manager does nothing.
- **One way to stop a child process group** (`stop_process_group`): every process the pipeline starts that
  starts processes of its own (DVC, verl, llama.cpp, vLLM, the MLflow scoring server) runs in a group of its
  own (`start_new_session=True`); stopping it is SIGTERM to the group, a grace period in which every
  member may finish (an exited leader whose workers still run is not "stopped"), then SIGKILL to what is
  left. "Running" is read from /proc and excludes zombies, which a container's PID 1 may never reap.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

TELEMETRY_OFF: dict[str, str] = {
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DO_NOT_TRACK": "1",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "GX_ANALYTICS_ENABLED": "false",
    "DVC_NO_ANALYTICS": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
"""Environment variables that switch off the usage reporting of the libraries the pipeline runs."""

NOISY_LOGGERS = ("httpx", "httpx2", "httpcore", "urllib3", "filelock", "alembic", "openai._base_client",
                 "great_expectations", "mlflow.store.db.utils", "mlflow.tracking.fluent", "prefect.events",
                 "sentence_transformers", "huggingface_hub", "mlflow.tracing.export", "gguf")
"""Third-party loggers whose INFO lines are per-request or set-up chatter: WARNING unless `-v`."""
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
BENIGN_WARNINGS = (
    # MLflow registers the local-artifact dataset source twice and says so for every dataset input we log.
    "The specified dataset source can be interpreted in multiple ways",
    # register logs the pyfunc agent without an input example on purpose: inferring one would run the
    # agent and the environment.
    "An input example was not provided when logging the model",
    # The pipeline is offline by design; the merged agent's card is models/agent/README.md.
    "The model card could not be retrieved from the hub",
    "Unable to find license information for this model",
)
"""Third-party warnings that are expected here and not actionable (each says why): hidden unless `-v`."""


def quiet_telemetry() -> None:
    """Set every `TELEMETRY_OFF` variable this process has not set already."""
    for key, value in TELEMETRY_OFF.items():
        os.environ.setdefault(key, value)


def configure_logging(verbose: bool = False) -> None:
    """Root logging to stderr: INFO, third-party chatter at WARNING; `verbose`: DEBUG and everything back.

    When stderr is not a terminal, third-party tqdm bars (transformers' weight loading, sentence-transformers,
    the Hub) are switched off (`TQDM_DISABLE`, unless set): in a pipe each redraw is a fragment of a line.
    The pipeline's own long loops report through `pipeline.progress` instead.
    """
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format=LOG_FORMAT, stream=sys.stderr)
    if not verbose:
        for text in BENIGN_WARNINGS:
            warnings.filterwarnings("ignore", message=f".*{re.escape(text)}")
        for handler in logging.getLogger().handlers:
            handler.addFilter(_hide_benign)
        logging.getLogger("mlflow.transformers").addFilter(_hide_benign)  # MLflow's loggers do not propagate
    if not (hasattr(sys.stderr, "isatty") and sys.stderr.isatty()):
        os.environ.setdefault("TQDM_DISABLE", "1")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    for noisy in NOISY_LOGGERS:
        logging.getLogger(noisy).setLevel(logging.DEBUG if verbose else logging.WARNING)


def _hide_benign(record: logging.LogRecord) -> bool:
    """Logging filter: False for a `BENIGN_WARNINGS` record."""
    message = record.getMessage()
    return not any(text in message for text in BENIGN_WARNINGS)


@contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM raises KeyboardInterrupt (main thread only); the old handler comes back after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _members(pgid: int, sid: int | None) -> list[int]:
    """Live (not zombie) processes of group `pgid`, and of session `sid` when given, this process excluded."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            fields = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if fields[0] != "Z" and (int(fields[2]) == pgid or (sid is not None and int(fields[3]) == sid)):
            found.append(int(entry.name))
    return found


def _signal(pgid: int, sid: int | None, signum: int) -> None:
    for pid in _members(pgid, sid) if sid is not None else []:  # session members that moved to groups of their own
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            continue
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:
        pass


def stop_process_group(proc: subprocess.Popen | int, grace_s: float, *, whole_session: bool = False,
                       kill_wait_s: float = 5.0) -> bool:
    """Stop the process group of `proc` (a child we started, or a pid): SIGTERM, up to `grace_s` for every
    member to exit, then SIGKILL to what is left and up to `kill_wait_s` more. True when none is left.

    `whole_session` also signals every process of `proc`'s session, whichever group it moved to (Ray's
    workers each take a group of their own): only when that session is not this process's own, or this
    process leads it (the owner guard). A `Popen` is polled meanwhile, so an exited child is reaped.
    """
    pid = proc if isinstance(proc, int) else proc.pid
    try:
        pgid = os.getpgid(pid)
    except ProcessLookupError:
        pgid = pid  # the leader is gone; its group, if any member is left, still has its id
    sid = None
    if whole_session:
        try:
            sid = os.getsid(pid)
        except ProcessLookupError:
            sid = pid
        if sid == os.getsid(0) and sid != os.getpid():
            sid = None  # never sweep the caller's own session

    def gone(deadline: float) -> bool:
        while True:
            if not isinstance(proc, int):
                proc.poll()
            else:
                _reap(pid)
            if not _members(pgid, sid):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)

    for signum, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, kill_wait_s)):
        _signal(pgid, sid, signum)
        if gone(time.monotonic() + wait_s):
            return True
        logging.getLogger(__name__).warning("process group %d ignored %s", pgid, signal.Signals(signum).name)
    return False


def _reap(pid: int) -> None:
    """Collect `pid`'s exit status when it is an exited child of ours (else its zombie would count as gone
    only through /proc's state)."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
