"""Progress of long work: a tqdm bar on a terminal, a periodic one-line log record otherwise.

    with progress(total=48, desc="evaluate prompt_r1", unit="q") as bar:
        ...
        bar.update(8)

Design decisions:
- **A bar only where it can redraw.** tqdm writes carriage returns; in a pipe (CI, `dvc repro > log`, a
  Prefect worker, a scheduled run) every redraw becomes a fragment of a line. So when stderr is not a
  terminal the same calls log one line through `logging` at most every `interval_s` seconds (and once at
  the end): `evaluate prompt_r1: 24/48 q (50%), 31 s`. The decision is made per bar, from `sys.stderr`.
- **Same interface as the tqdm subset we use** (`update`, `set_postfix`, `close`, iteration, context
  manager), so callers do not branch. Nested, short-lived bars (`quiet=True`, e.g. the rollout bar inside a
  training step) are drawn on a terminal and are silent otherwise: their parent reports progress.
- `PROMPTR1_PROGRESS=bar|log|off` forces a mode (tests, notebooks that are not a tty).
- **No quiet minute** (`heartbeat`): a stage runs inside a heartbeat that logs `<stage>: still running, N s`
  whenever no progress line was logged for `interval_s` (a model loading, a server starting, one long
  training step), so a pipe sees a line at least every minute without doubling the lines of phases that
  already report.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, Self

log = logging.getLogger("pipeline.progress")

DEFAULT_INTERVAL_S = 60.0
"""Seconds between two log lines of one bar in a pipe. 30 s put a default `dvc repro` at 147-151 console lines
against the budget of 150 on this 2-core machine, depending on its speed that hour (the count grows with the
run time); 60 s: 141 in a fresh-clone run of the same slow hour (benchmarks/results/pipeline_reply.json)."""


_last_line = time.monotonic()
"""When the last progress line (of any bar or heartbeat) was logged."""


def _noted() -> None:
    global _last_line
    _last_line = time.monotonic()


@contextmanager
def heartbeat(desc: str, interval_s: float = DEFAULT_INTERVAL_S, poll_s: float = 1.0) -> Iterator[None]:
    """Log `<desc>: still running, N s` whenever no progress line was logged for `interval_s` while the block
    runs (a daemon thread polling every `poll_s`); nothing when every phase reports on its own. Silent on a
    terminal (its bars redraw) and with `PROMPTR1_PROGRESS=off`."""
    if _mode() != "log":
        yield
        return
    start, done = time.monotonic(), threading.Event()
    _noted()

    def beat() -> None:
        while not done.wait(poll_s):
            if time.monotonic() - _last_line >= interval_s:
                _noted()
                log.info("%s: still running, %.0f s", desc, time.monotonic() - start)

    thread = threading.Thread(target=beat, name=f"heartbeat {desc}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(timeout=poll_s + 1)


def _mode() -> str:
    forced = os.environ.get("PROMPTR1_PROGRESS", "").strip().lower()
    if forced in {"bar", "log", "off"}:
        return forced
    stream = sys.stderr
    return "bar" if hasattr(stream, "isatty") and stream.isatty() else "log"


class LogProgress:
    """A tqdm stand-in that logs `desc: n/total unit (p%), elapsed` every `interval_s` seconds and at close."""

    def __init__(self, iterable: Iterable[Any] | None = None, *, total: int | None = None, desc: str = "",
                 unit: str = "it", interval_s: float = DEFAULT_INTERVAL_S, silent: bool = False) -> None:
        self.iterable = iterable
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)  # type: ignore[arg-type]
        self.total = total
        self.desc = desc
        self.unit = unit
        self.n = 0
        self.interval_s = interval_s
        self.silent = silent
        self.postfix = ""
        self._start = time.monotonic()
        self._last = self._start
        self._closed = False
        self._emitted_n: int | None = None

    def __iter__(self) -> Iterator[Any]:
        assert self.iterable is not None, "LogProgress was not given an iterable"
        try:
            for item in self.iterable:
                yield item
                self.update(1)
        finally:
            self.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def set_postfix(self, ordered_dict: dict[str, Any] | None = None, refresh: bool = True, **kwargs: Any) -> None:
        values = {**(ordered_dict or {}), **kwargs}
        self.postfix = ", ".join(f"{k}={v}" for k, v in values.items())

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if now - self._last >= self.interval_s:
            self._last = now
            self._emit()

    def _emit(self) -> None:
        if self.silent or self.n == self._emitted_n:  # nothing new since the last line (e.g. at close)
            return
        self._emitted_n = self.n
        _noted()
        done = f"{self.n}/{self.total}" if self.total else str(self.n)
        share = f" ({100 * self.n / self.total:.0f}%)" if self.total else ""
        extra = f", {self.postfix}" if self.postfix else ""
        log.info("%s: %s %s%s, %.0f s%s", self.desc, done, self.unit, share, time.monotonic() - self._start, extra)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._emit()


def progress(iterable: Iterable[Any] | None = None, *, total: int | None = None, desc: str = "", unit: str = "it",
             quiet: bool = False, interval_s: float = DEFAULT_INTERVAL_S, **tqdm_kwargs: Any) -> Any:
    """A progress bar (tqdm) on a terminal; a `LogProgress` otherwise (silent when `quiet`)."""
    mode = _mode()
    if mode == "bar":
        from tqdm.auto import tqdm

        return tqdm(iterable, total=total, desc=desc, unit=unit, leave=not quiet, **tqdm_kwargs)
    return LogProgress(iterable, total=total, desc=desc, unit=unit, interval_s=interval_s,
                       silent=quiet or mode == "off")
