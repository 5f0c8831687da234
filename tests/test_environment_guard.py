"""A server the pipeline starts dies with its owner, even when the owner is killed with SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from demo_project import free_port

from pipeline.environment.guard import guarded
from pipeline.environment.probes import is_healthy

ROOT = Path(__file__).resolve().parents[1]
FAULT_SERVER = Path(__file__).resolve().parent / "fault_server.py"

OWNER = textwrap.dedent("""
    import sys, time
    from pipeline.config import load_params
    from pipeline.environment import servers
    from pipeline.environment.spec import ServerSpec

    port = int(sys.argv[1])
    servers.server_command = lambda spec: [sys.executable, sys.argv[2], "--port", str(port),
                                           "--model", spec.environment.served_name]
    params = load_params(sys.argv[3], {"environment": {"port": port, "base_url": ""},
                                       "paths": {"cache_dir": sys.argv[4]}})
    cache_dir = params.path(params.paths.cache_dir)
    spec = ServerSpec(environment=params.environment, root=params.root, cache_dir=cache_dir)
    with servers.serve_environment(spec) as url:
        print(url, flush=True)
        time.sleep(300)
""")


def _group_members(pgid: int) -> list[int]:
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getpgid(int(entry.name)) == pgid:
                    members.append(int(entry.name))
            except ProcessLookupError:
                continue
    return members


def test_server_stops_when_its_owner_is_killed_with_sigkill(tmp_path):
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(port), str(FAULT_SERVER), str(ROOT / "params.yaml"),
                              str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        url = owner.stdout.readline().strip()
        assert url.endswith(f":{port}/v1") and is_healthy(url)
        guard_pgids = {os.getpgid(p) for p in _group_members_of_children(owner.pid)}
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait(timeout=10)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and (is_healthy(url, timeout_s=0.5)
                                               or any(_group_members(g) for g in guard_pgids)):
            time.sleep(0.2)
        assert not is_healthy(url, timeout_s=0.5), "the server outlived its SIGKILLed owner"
        assert not any(_group_members(g) for g in guard_pgids), "processes of the server's group remain"
    finally:
        if owner.poll() is None:
            owner.kill()


def _group_members_of_children(pid: int) -> list[int]:
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(c) for c in children]


def test_guard_passes_the_exit_code_through():
    done = subprocess.run(guarded([sys.executable, "-c", "raise SystemExit(7)"]), check=False, env={**os.environ,
                          "PYTHONPATH": str(ROOT)}, timeout=30)
    assert done.returncode == 7
