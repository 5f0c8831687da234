"""`CostLedger`: the environment budget (`environment.budget_usd`), held across every process of a project.

One ledger file, `<paths.cache_dir>/environment_ledger.json`, records what every process of the project
has spent on the environment and what calls in flight may still cost. Design decisions:

- **Reserve before sending, settle after.** A call is admitted only if what is spent, plus what calls in
  flight (in any process) may still cost, plus this call's worst case stays within the budget; the
  reservation is replaced by the call's real cost when it returns. So the budget is a hard cap: concurrent
  processes (and concurrent calls in one process) never spend more than it in total, and the run stops a
  call early rather than a call late. The worst case of a call is an upper bound computed by the client
  (`EnvironmentClient.worst_case_usd`): at most one token per UTF-8 byte of the messages, plus template
  tokens, sent twice when the empty-after-length retry fires, and `max_tokens` completions for both.
- **One exclusive `fcntl.flock` per update**, on a sidecar lock file (`<ledger>.lock`) that is never
  replaced, so every process, thread and coroutine sees one serial history. The state is rewritten whole
  to a temporary file, fsynced and `os.replace`d onto the ledger: a process killed mid-write leaves the
  previous complete state, never a half-written record. An unreadable ledger stops the run (fail closed)
  naming the file, rather than being read as "nothing spent".
- **A reservation whose process died counts as spent at its worst case**: the call may have been billed.
  Processes are named by pid and start time (Linux `/proc`), so a reused pid is not mistaken for the owner.
- **The ledger is the project's, not the run's**: it accumulates across runs until the budget is raised or
  the file is deleted, so a rerun, a second stage or a second process never starts again from zero.
- verl's agent-loop workers spend from the same file (`pipeline.train.verl.worker_client`); on several
  nodes it must sit on a shared filesystem with working `flock`. A client built without a ledger path
  (tests) keeps the same state in memory: the budget then holds within that process only.
"""

from __future__ import annotations

import fcntl
import json
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.errors import BudgetExceeded

LEDGER_FILE = "environment_ledger.json"
_counter = iter(range(1 << 62))
_counter_lock = threading.Lock()


def _start_time(pid: int) -> str:
    """The process's start time in clock ticks since boot ('' where /proc is absent or the pid is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[1].split()[19]


def _alive(owner: str) -> bool:
    pid, _, start = owner.partition(":")
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return start == "" or _start_time(int(pid)) in ("", start)


@dataclass
class _State:
    spent_usd: float = 0.0
    reservations: dict[str, float] = field(default_factory=dict)
    """`<pid>:<start time>:<n>` → worst-case USD of a call in flight."""

    @property
    def committed(self) -> float:
        return self.spent_usd + sum(self.reservations.values())


class CostLedger:
    """Spend and in-flight reservations against `budget_usd`, in a file shared by processes (or in memory)."""

    def __init__(self, budget_usd: float, path: Path | None = None, *, where: str = "") -> None:
        self.budget_usd = budget_usd
        self.path = path
        self.where = where
        self._memory = _State()
        self._thread_lock = threading.Lock()
        pid = os.getpid()
        self._owner = f"{pid}:{_start_time(pid)}"

    @property
    def spent_usd(self) -> float:
        """Spent so far by every process sharing the ledger (reservations of dead processes included)."""
        with self._locked() as state:
            return state.spent_usd

    @contextmanager
    def hold(self, worst_case_usd: float) -> Iterator[_Hold]:
        """Reserve `worst_case_usd` for one call, or raise BudgetExceeded without sending anything.

        Settle the real cost with `hold.settle(usd)`; a call that ends without settling (an exception, a
        cancellation) stays counted at its worst case.
        """
        with _counter_lock:
            key = f"{self._owner}:{next(_counter)}"
        with self._locked() as state:
            if state.committed + worst_case_usd > self.budget_usd:
                raise BudgetExceeded(
                    f"environment budget spent: ${state.spent_usd:.4f} spent and ${state.committed - state.spent_usd:.4f} "
                    f"in flight of environment.budget_usd=${self.budget_usd:.4f}{self.where}; the next call may "
                    f"cost up to ${worst_case_usd:.4f}, so the run stopped cleanly (raise the budget to continue)"
                )
            state.reservations[key] = worst_case_usd
        hold = _Hold()
        try:
            yield hold
        finally:
            with self._locked() as state:
                reserved = state.reservations.pop(key, worst_case_usd)
                state.spent_usd += hold.cost_usd if hold.cost_usd is not None else reserved

    @contextmanager
    def _locked(self) -> Iterator[_State]:
        """The current state, saved back when the block ends without an exception."""
        with self._thread_lock:
            if self.path is None:
                yield self._memory
                return
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path.with_name(self.path.name + ".lock"), "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                state = self._read()
                yield state
                self._write(state)

    def _read(self) -> _State:
        try:
            raw = json.loads(self.path.read_text())
            state = _State(float(raw["spent_usd"]), {str(k): float(v) for k, v in raw["reservations"].items()})
        except FileNotFoundError:
            return _State()
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise BudgetExceeded(
                f"environment cost ledger {self.path} is unreadable ({exc}); the spend is unknown, so no call is "
                "sent. Restore or delete the file once you know what was spent"
            ) from None
        for key in [k for k in state.reservations if not _alive(k.rsplit(":", 1)[0])]:
            state.spent_usd += state.reservations.pop(key)
        return state

    def _write(self, state: _State) -> None:
        tmp = self.path.with_name(f"{self.path.name}.tmp-{os.getpid()}")
        with open(tmp, "w") as f:
            json.dump({"spent_usd": state.spent_usd, "reservations": state.reservations}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)


@dataclass
class _Hold:
    """One admitted call; `settle` records what it really cost."""

    cost_usd: float | None = None

    def settle(self, cost_usd: float) -> None:
        self.cost_usd = cost_usd


__all__ = ["LEDGER_FILE", "CostLedger"]
