"""A private Ray started under the guard dies with the pipeline process, even when that one is SIGKILLed.

With `train.verl.ray_address: ""` verl's `ray.init()` starts a whole Ray instance (gcs_server, raylet,
worker processes, …) inside the guarded verl process. This test launches, through the very functions
`verl_backend._launch` uses (`guarded` + `_stream`, which sets `start_new_session=True`), a small program
that starts a private Ray and one actor, then SIGKILLs the pipeline process that launched it. Every process
of that Ray session — found both as a descendant of the pipeline process before the kill and by the
session name on any command line after it — must be gone within 30 s. The positive control: before the
kill the tree really holds a gcs_server, a raylet and the actor's worker, the worker in a process group
of its own (Ray's per-worker groups), out of reach of a `killpg`.

A second, fast test isolates the mechanism that covers such processes: a guarded program whose child moves
to a process group of its own (as Ray's workers do) is stopped with it when the owner is SIGKILLed, because
the guard stops its whole session, not only its group.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]

RAY_PROGRAM = textwrap.dedent("""
    import os, sys, time
    import ray

    ray.init(num_cpus=1, include_dashboard=False, object_store_memory=80 * 1024 * 1024,
             _temp_dir=sys.argv[1])

    @ray.remote
    class Sleeper:
        def pid(self):
            return os.getpid()

    actor = Sleeper.remote()
    node = ray._private.worker.global_worker.node
    print(f"READY {node.session_name} {ray.get(actor.pid.remote())}", flush=True)
    time.sleep(600)
""")

# The pipeline process: it runs the program exactly as `_launch` runs verl.
OWNER = textwrap.dedent("""
    import logging, os, sys
    from pathlib import Path
    from pipeline.environment.guard import guarded
    from pipeline.train.verl.backend import _stream

    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")  # _stream mirrors here
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    _stream(guarded([sys.executable, "-c", sys.argv[1], sys.argv[2]]), env=env, cwd=Path.cwd(),
            log_file=Path(sys.argv[3]))
""")


def _session_processes(session: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and any(session in a for a in proc.info["cmdline"] or []):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    alive = []
    for proc in procs:
        try:  # is_running compares the start time too: a recycled pid is not counted
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
        except psutil.NoSuchProcess:
            continue
    return alive


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_private_ray_does_not_outlive_a_sigkilled_owner(tmp_path):
    temp_dir = Path(tempfile.mkdtemp(prefix="ray"))  # short: Ray's socket paths must fit in 107 bytes
    log_file = tmp_path / "owner.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    with open(log_file, "w") as sink:
        owner = subprocess.Popen([sys.executable, "-c", OWNER, RAY_PROGRAM, str(temp_dir),
                                  str(tmp_path / "verl.log")], cwd=tmp_path, env=env, stdout=sink,
                                 stderr=subprocess.STDOUT)
    tree: list[psutil.Process] = []
    session = ""
    try:
        deadline = time.monotonic() + 200
        while not session:
            assert owner.poll() is None, log_file.read_text()[-3000:]
            assert time.monotonic() < deadline, "Ray never started: " + log_file.read_text()[-3000:]
            time.sleep(0.5)
            ready = [ln for ln in log_file.read_text().splitlines() if ln.startswith("READY ")]
            if ready:
                _, session, actor_pid = ready[0].split()
        tree = psutil.Process(owner.pid).children(recursive=True)
        names = " ".join(" ".join(p.cmdline()) for p in _alive(tree))
        # Positive control: the tree holds Ray's daemons and the actor's worker.
        assert "gcs_server" in names and "raylet" in names, names
        assert int(actor_pid) in {p.pid for p in tree}
        assert os.getpgid(int(actor_pid)) != os.getpgid(tree[0].pid)  # Ray's worker left the guard's group
        assert _session_processes(session), "no process names the Ray session: the check below could not fail"

        os.kill(owner.pid, signal.SIGKILL)
        owner.wait(timeout=10)
        deadline = time.monotonic() + 30
        left = _alive(tree) + _session_processes(session)
        while left and time.monotonic() < deadline:
            time.sleep(0.5)
            left = _alive(tree) + _session_processes(session)
        assert not left, [" ".join(p.cmdline())[:200] for p in _alive(left)]
    finally:
        for proc in [owner, *tree]:  # never leave Ray behind, whatever failed
            try:
                proc.kill()
            except (psutil.NoSuchProcess, ProcessLookupError):
                pass
        owner.wait(timeout=10)
        shutil.rmtree(temp_dir, ignore_errors=True)


REGROUPING = textwrap.dedent("""
    import os, subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], process_group=0)
    print(f"READY {child.pid}", flush=True)
    time.sleep(600)
""")


@pytest.mark.timeout(60)
def test_guard_stops_a_child_that_left_its_process_group(tmp_path):
    log_file = tmp_path / "owner.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    with open(log_file, "w") as sink:
        owner = subprocess.Popen([sys.executable, "-c", OWNER, REGROUPING, "unused", str(tmp_path / "x.log")],
                                 cwd=tmp_path, env=env, stdout=sink, stderr=subprocess.STDOUT)
    regrouped = None
    try:
        deadline = time.monotonic() + 40
        while regrouped is None:
            assert owner.poll() is None and time.monotonic() < deadline, log_file.read_text()[-2000:]
            time.sleep(0.2)
            ready = [ln for ln in log_file.read_text().splitlines() if ln.startswith("READY ")]
            if ready:
                regrouped = psutil.Process(int(ready[0].split()[1]))
        guard = psutil.Process(owner.pid).children()[0]
        assert os.getpgid(regrouped.pid) != os.getpgid(guard.pid)  # a killpg of the guard's group misses it
        assert os.getsid(regrouped.pid) == os.getsid(guard.pid) == guard.pid
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait(timeout=10)
        deadline = time.monotonic() + 20
        while _alive([regrouped, guard]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive([regrouped, guard])
    finally:
        if regrouped is not None and _alive([regrouped]):
            regrouped.kill()
        if owner.poll() is None:
            owner.kill()
            owner.wait(timeout=10)
