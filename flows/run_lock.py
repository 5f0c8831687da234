"""One pipeline run at a time: a Prefect global concurrency limit plus a lock file in the workspace.

Design decisions:
- **Two layers, both cheap.** The Prefect global concurrency limit `promptr1-pipeline` (slots =
  `flow.concurrency_limit`, created by `promptr1 flow serve` or `prefect gcl create promptr1-pipeline
  --limit 1`) keeps a scheduled run and a manual run from overlapping on the nodes that share one Prefect
  server. The lock file `.dvc/tmp/promptr1-flow.lock` keeps two runs out of one *workspace* whatever the
  Prefect setup: two `dvc repro`s in one checkout would fight over params.yaml, dvc.lock and the outputs,
  so this one is always taken, also when a limit allows more than one slot (those slots are for more
  workspaces/nodes). When no Prefect API has the limit (the temporary local server of a plain `promptr1
  flow run`), the lock file alone does the job.
- **Wait, with a timeout, then say who holds it.** `timeout_s=0` fails at once; otherwise the run waits up
  to `timeout_s`. The holder writes its PID, host, flow run and start time beside the lock, so the message
  of the run that gives up names the run it waited for.
- The lock is an OS lock (`filelock`, flock on Linux): a crashed holder never leaves a stale lock behind.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from datetime import UTC, datetime
from pathlib import Path

from filelock import FileLock, Timeout

from pipeline.errors import UserError

log = logging.getLogger(__name__)

CONCURRENCY_LIMIT_NAME = "promptr1-pipeline"
LOCK_FILE = Path(".dvc") / "tmp" / "promptr1-flow.lock"


class RunLockBusy(UserError):
    """Another pipeline run holds the workspace lock or the concurrency slot(s)."""


def lock_path(root: Path) -> Path:
    return root / LOCK_FILE


def _holder_path(lock: Path) -> Path:
    return lock.with_suffix(".json")


def read_holder(root: Path) -> dict | None:
    """Who holds (or last held) the workspace lock: pid, host, flow_run, started_at."""
    try:
        return json.loads(_holder_path(lock_path(root)).read_text())
    except (OSError, ValueError):
        return None


def _describe(holder: dict | None) -> str:
    if not holder:
        return "another run"
    run = holder.get("flow_run") or "a run outside Prefect"
    return f"flow run {run!r} (pid {holder.get('pid')} on {holder.get('host')}, since {holder.get('started_at')})"


@contextmanager
def workspace_lock(root: Path, timeout_s: float, flow_run: str | None = None) -> Iterator[None]:
    """Hold the workspace lock file; raise RunLockBusy after `timeout_s` seconds of waiting."""
    path = lock_path(root)
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(path), timeout=max(timeout_s, 0))
    try:
        lock.acquire()
    except Timeout:
        waited = f"waited {timeout_s:g} s; " if timeout_s > 0 else ""
        raise RunLockBusy(
            f"another pipeline run is using {root}: {_describe(read_holder(root))}. {waited}"
            "wait for it to finish, or pass a lock timeout (flow.lock_timeout_s / --set flow.lock_timeout_s=3600)"
        ) from None
    try:
        _holder_path(path).write_text(json.dumps({
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "flow_run": flow_run,
            "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
        }))
        yield
    finally:
        lock.release()


def prefect_limit_exists(name: str = CONCURRENCY_LIMIT_NAME) -> bool:
    """True when the Prefect API in use has an active global concurrency limit `name`."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    try:
        with get_client(sync_client=True) as client:
            limit = client.read_global_concurrency_limit_by_name(name)
    except ObjectNotFound:
        return False
    except Exception as exc:  # noqa: BLE001 - no reachable API: the lock file still protects the workspace
        log.warning("could not read Prefect concurrency limit %r (%s); using the workspace lock only", name, exc)
        return False
    return bool(limit.active)


def ensure_prefect_limit(slots: int, name: str = CONCURRENCY_LIMIT_NAME) -> None:
    """Create or update the global concurrency limit on the configured Prefect API."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        client.upsert_global_concurrency_limit_by_name(name, slots)


@contextmanager
def run_lock(root: Path, timeout_s: float, flow_run: str | None = None,
             name: str = CONCURRENCY_LIMIT_NAME) -> Iterator[str]:
    """Hold a Prefect concurrency slot (when the limit exists) and the workspace lock.

    Yields a short description of what is held, for the run's log.
    """
    with ExitStack() as stack:
        held = "workspace lock"
        if prefect_limit_exists(name):
            from prefect.concurrency.sync import concurrency

            start = time.monotonic()
            try:
                stack.enter_context(concurrency(name, occupy=1, timeout_seconds=max(timeout_s, 1.0), strict=True))
            except TimeoutError:
                raise RunLockBusy(
                    f"all slots of the Prefect concurrency limit {name!r} are taken by other pipeline runs "
                    f"(waited {time.monotonic() - start:.0f} s); see `prefect gcl inspect {name}`"
                ) from None
            held = f"Prefect concurrency slot {name!r} + workspace lock"
        stack.enter_context(workspace_lock(root, timeout_s, flow_run))
        yield held
