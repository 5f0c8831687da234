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
"""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
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
