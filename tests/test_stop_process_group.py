"""`pipeline.runtime.stop_process_group`, the one way the pipeline stops a child process group, on real processes.

What the callers rely on: a worker that ignores SIGTERM is still stopped (SIGKILL after the grace), a group
whose leader already exited is not "stopped" while a worker of it runs, and `whole_session` reaches a
member that moved to a group of its own (as Ray's workers do) while a plain stop leaves it alone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from pipeline.runtime import stop_process_group

# A leader that starts a SIGTERM-ignoring worker in its group, writes the worker's pid, then waits.
STUBBORN = """
import os, signal, subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"],
    stdout=subprocess.PIPE, text=True)
worker.stdout.readline()
print(worker.pid, flush=True)
time.sleep(60)
"""
# A leader whose worker leaves for a process group of its own (same session), then the leader exits.
MOVED = """
import os, subprocess, sys
worker = subprocess.Popen([sys.executable, "-c",
    "import os, time; os.setpgid(0, 0); print('ready', flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
worker.stdout.readline()
print(worker.pid, flush=True)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _start(code: str) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    return proc, int(proc.stdout.readline())


def test_a_worker_ignoring_sigterm_is_killed_after_the_grace():
    proc, worker = _start(STUBBORN)
    started = time.monotonic()
    assert stop_process_group(proc, 1.0) is True
    assert not _alive(worker) and proc.poll() is not None
    assert 1.0 <= time.monotonic() - started < 8.0  # the grace was given, then SIGKILL


def test_a_group_whose_leader_exited_is_stopped_by_pid():
    proc, worker = _start(STUBBORN)
    os.kill(proc.pid, signal.SIGKILL)  # the leader goes; its SIGTERM-ignoring worker stays in the group
    proc.wait()
    assert _alive(worker)
    assert stop_process_group(proc.pid, 0.5) is True
    assert not _alive(worker)


def test_whole_session_reaches_a_member_in_a_group_of_its_own():
    proc, worker = _start(MOVED)
    proc.wait()
    try:
        assert os.getsid(worker) == proc.pid and os.getpgid(worker) == worker
        assert stop_process_group(proc.pid, 0.5) is True  # the leader's group is empty: nothing to stop there
        assert _alive(worker)
        assert stop_process_group(proc.pid, 2.0, whole_session=True) is True
        assert not _alive(worker)
    finally:
        if _alive(worker):
            os.kill(worker, signal.SIGKILL)
