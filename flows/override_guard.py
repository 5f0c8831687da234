"""No stage runs on a dead flow run's overrides: the guard every `promptr1` stage command passes first.

A flow run writes its `-S` overrides into params.yaml (and profiles) for DVC and journals the originals
(`flows/dvc_steps.py`, `.dvc/tmp/promptr1-overrides.json`). A run killed with SIGKILL leaves both behind;
the next *flow* run restores them, but a plain `dvc repro` or `promptr1 train` would silently run with the
dead run's overrides and record them in dvc.lock as if they were the project's params.

Design decisions:
- **Refuse, not restore.** `pipeline/cli.py` calls `refuse_dead_run_overrides` before any stage loads its
  params; it raises with the dead run's overrides, the files they are in and the command that restores them
  (`promptr1 flow restore`). Restoring silently inside a stage was the alternative, but a stage runs inside
  `dvc repro`, which has already read params.yaml to decide what to run: rewriting it under DVC would make
  dvc.lock record params no stage ran with. And the overrides may be what the person wants now (they can
  keep them by deleting the journal); a one-line refusal lets them choose, costs nothing to follow, and
  happens before the stage has done any work.
- **Dead, not live.** A live flow run holds the workspace lock (flows/run_lock.py) while its overrides are
  applied and its stages run. So a journal with the lock free belongs to a dead run; with the lock held, it
  is the live run's and the stage is one of that run's (DVC spawned it): it runs. The lock is an OS lock,
  released by the kernel when its holder dies, so a killed run never looks alive.
- `promptr1 flow restore` takes the workspace lock (not waiting: a live run must finish first) and calls
  the same `recover_overrides` the next flow run would: byte for byte, refusing a file edited since.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from flows.dvc_steps import OVERRIDE_JOURNAL, recover_overrides
from flows.run_lock import lock_path, workspace_lock
from pipeline.errors import UserError

RESTORE_COMMAND = "promptr1 flow restore"


def _lock_is_free(root: Path) -> bool:
    """True when no live process holds the workspace lock (probed without waiting, released at once)."""
    path = lock_path(root)
    if not path.parent.is_dir():
        return True
    lock = FileLock(str(path), timeout=0)
    try:
        lock.acquire()
    except Timeout:
        return False
    lock.release()
    return True


def dead_run_journal(root: Path) -> dict[str, Any] | None:
    """The override journal of a flow run that died with its overrides applied; None when there is none.

    None also when the journal belongs to a live run (it holds the workspace lock: module docstring).
    """
    journal = root / OVERRIDE_JOURNAL
    if not journal.is_file() or not _lock_is_free(root):
        return None
    try:
        entry = json.loads(journal.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        entry = {}
    return entry if isinstance(entry, dict) else {}


def refuse_dead_run_overrides(root: Path) -> None:
    """Raise UserError when a dead flow run's overrides are still written into the params files."""
    entry = dead_run_journal(root)
    if entry is None:
        return
    overrides = " ".join(str(o) for o in entry.get("overrides") or []) or "(unreadable journal)"
    files = ", ".join(sorted(entry.get("files") or {})) or "the params files"
    pid = f" (pid {entry['pid']})" if entry.get("pid") else ""
    raise UserError(
        f"a flow run{pid} was killed with its overrides `{overrides}` still written into {files} "
        f"(journal {OVERRIDE_JOURNAL.as_posix()}); this stage would run with them. Run `{RESTORE_COMMAND}` "
        "to put the params back, or delete the journal to keep them, then rerun"
    )


def restore_dead_run_overrides(root: Path) -> list[Path]:
    """`promptr1 flow restore`: restore what a dead flow run left overridden; returns the files restored.

    Fails (RunLockBusy) while a flow run is live: its overrides are its own until it ends.
    """
    with workspace_lock(root, 0, flow_run=RESTORE_COMMAND):
        return recover_overrides(root)
