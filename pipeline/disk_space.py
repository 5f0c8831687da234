"""A full disk, said in one line: the path, the free space there, and what was needed.

A stage meets a full disk in one of two ways:
- **It checks first.** The local trainer checks before each checkpoint (`writing`: the free space of the
  checkpoint folder against what the checkpoint takes), as the verl stage checks the checkpoints verl retains
  before it starts (pipeline/train/verl/resources.py; both read `free_bytes` here), and refuses with `DiskFull`
  before it writes anything.
- **A write fails.** Python says OSError ENOSPC, SQLite "database or disk is full" (MLflow's tracking store:
  raised through SQLAlchemy while the failed stage's MLflow run was being closed, it hid the first error under
  ~100 lines of traceback), torch and safetensors their own wording of ENOSPC. `disk_full` finds any of them
  in an exception's chain (`__cause__`, `__context__`) and words it as one `DiskFull`; the CLI ends every
  stage with that line (pipeline/cli.py), and MLflow's own ERROR record of the same SQLAlchemy error (its
  whole traceback) is dropped (`FullStoreFilter`). Such a failure names what it was writing when the error
  says so (the file, or the SQLite file of the tracking store), else the project folder; what it needed is
  known only where a stage checked first.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from pipeline.errors import DiskFull
from pipeline.paths import display_path

FULL_WORDS = ("no space left on device", "database or disk is full", "storagefull", "disk quota exceeded")
"""How ENOSPC reads in the messages of the libraries that do not raise OSError (SQLite, safetensors)."""
NEARLY_FULL_BYTES = 1024 * 1024
"""Free space under which a write that failed is taken to have failed on the full disk."""
MLFLOW_DB_LOGGER = "mlflow.store.db.utils"
"""The MLflow logger that logs a SQLAlchemy error with its whole traceback before raising it (MLflow 3.x)."""


def format_size(size: float) -> str:
    """Bytes for a person: `0 B`, `512 KiB`, `38.2 MiB`, `1.6 GiB`."""
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    index = 0
    while abs(size) >= 1024 and index < len(units) - 1:
        size /= 1024
        index += 1
    return f"{size:.0f} {units[index]}" if index < 2 else f"{size:.1f} {units[index]}"


def space_problem(shown: str, free: int, needed: int, what: str) -> str | None:
    """Why `what` (needing `needed` bytes) does not fit in the `free` bytes of `shown`, or None when it fits."""
    if needed <= free:
        return None
    return f"{shown}: not enough disk space for {what}: it needs ~{format_size(needed)}, {format_size(free)} free there"


@contextmanager
def writing(folder: Path, root: Path, needed: int, what: str, advice: str,
            cleanup: Callable[[], None] | None = None) -> Iterator[None]:
    """Check that `needed` bytes fit in `folder` before the block, and turn a block failing on a full disk into
    DiskFull; `cleanup` removes what the failed block left half-written (before the free space is measured).
    `advice` says what the person can do; `root` is the project, for the path shown."""
    shown = display_path(folder, root)
    problem = space_problem(shown, free_bytes(folder), needed, what)
    if problem is not None:
        raise DiskFull(f"{problem}; {advice}")
    try:
        yield
    except DiskFull:
        raise
    except Exception as exc:
        # torch.save words ENOSPC as "file write failed": a disk left (nearly) full by the failed write says it.
        if free_bytes(folder) >= NEARLY_FULL_BYTES and not any(_full_error(link) for link in _chain(exc)):
            raise
        if cleanup is not None:
            cleanup()
        free = format_size(free_bytes(folder))
        raise DiskFull(f"{shown}: the disk filled while writing {what} (~{format_size(needed)} needed, {free} "
                       f"free now that the partial write is removed); {advice}") from exc


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _full_error(exc: BaseException) -> bool:
    """Whether `exc` itself says the disk is full (ENOSPC, EDQUOT, or a library's words for them)."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return any(word in str(exc).lower() for word in FULL_WORDS)


def _tracking_uri() -> str:
    """The MLflow tracking URI this process uses (MLflow imported only if the stage imported it)."""
    mlflow = sys.modules.get("mlflow")
    return os.environ.get("MLFLOW_TRACKING_URI") or (mlflow.get_tracking_uri() if mlflow is not None else "")


def _written_path(exc: BaseException, root: Path) -> Path:
    """What the failed write was writing: the file an OSError names, the SQLite file of the tracking store,
    else the project folder."""
    if isinstance(exc, OSError) and exc.filename:
        return Path(os.fsdecode(exc.filename))
    uri = _tracking_uri()
    if "database or disk is full" in str(exc).lower() and uri.startswith("sqlite:///"):
        return Path(uri.removeprefix("sqlite:///").split("?", 1)[0])
    return root


def _said(exc: BaseException) -> str:
    """The line of `exc`'s message that says the disk is full (SQLAlchemy's first line is about autoflush)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return next((line for line in lines if any(w in line.lower() for w in FULL_WORDS)), lines[0] if lines
                else type(exc).__name__)


def disk_full(exc: BaseException, root: Path) -> DiskFull | None:
    """The one-line DiskFull for an exception whose chain holds a full disk (the DiskFull a stage raised
    itself, first), or None when no link of the chain is about a full disk."""
    links = list(_chain(exc))
    raised = next((link for link in links if isinstance(link, DiskFull)), None)
    if raised is not None:
        return raised
    full = next((link for link in links if _full_error(link)), None)
    if full is None:
        return None
    path = _written_path(full, root)
    return DiskFull(f"{display_path(path, root)}: the disk is full ({format_size(free_bytes(path))} free there; "
                    f"{_said(full)}): free space there and rerun")


class FullStoreFilter(logging.Filter):
    """Drops MLflow's own ERROR record of a SQLAlchemy error on a full disk (its whole traceback, logged before
    it raises): the stage's one DiskFull line says it. Other database errors are logged as MLflow logs them."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        said = [str(link) for link in _chain(error)] if error is not None else [record.getMessage()]
        return not any(w in text.lower() for text in said for w in FULL_WORDS)


def quiet_full_store_tracebacks() -> None:
    """Install `FullStoreFilter` on the MLflow logger that prints a SQLAlchemy error's traceback."""
    logging.getLogger(MLFLOW_DB_LOGGER).addFilter(FullStoreFilter())


def free_bytes(folder: Path) -> int:
    """Free bytes of the file system that holds `folder` (its nearest existing parent)."""
    folder = folder.resolve()
    while not folder.exists():
        folder = folder.parent
    return shutil.disk_usage(folder).free
