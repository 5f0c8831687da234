"""Owner guard: a server the pipeline starts never outlives the process that started it.

`serve_environment` stops its server on every exit path Python sees (normal exit, exception, Ctrl-C,
SIGTERM turned into KeyboardInterrupt by `pipeline.runtime`), but nothing runs when the owner is killed
with SIGKILL or the OOM killer: llama.cpp or vLLM would keep the port and the GPUs. So the server is not
started directly but under this guard:

    python -m pipeline.environment.guard -- <server command …>

Decisions:
- The guard is the owner's direct child and polls `os.getppid()` every `POLL_S`: when the owner dies the
  guard is re-parented, the parent id changes, and it stops the server. No PID is compared against a
  recorded number, so a recycled PID cannot fool it.
- The guard runs the server as its own child in the session and process group the owner created for it
  (`start_new_session=True`), so `stop_server`'s `killpg` reaches guard, server and the server's workers
  alike; the guard then escalates SIGTERM → (grace) → SIGKILL over the whole group **and the whole
  session**: every process whose session id is the guard's, whichever process group it moved to. One
  mechanism for llama.cpp, vLLM and verl. It matters for verl with `train.verl.ray_address: ""`: verl's
  `ray.init()` starts a private Ray (gcs_server, raylet, dashboard and runtime-env agents, log monitor,
  autoscaler monitor) as children of the verl process, in its group, with `PR_SET_PDEATHSIG` (Ray's
  kernel fate sharing), but the raylet starts each worker process (`ray::<Actor>`) in a process group of
  its own, where a `killpg` does not reach it; those workers still stay in the session. A test SIGKILLs
  the pipeline process of such a run (`tests/hardening/test_ray_orphans.py`): no process of the Ray
  session remains (Ray's own shutdown, the raylet stopping its workers, achieves that with a
  group-only guard too; the session sweep does not depend on it, and a second test shows a child in a group
  of its own is stopped). Only a process that calls `setsid` itself leaves the session; Ray's do not.
  A guard not started as a session leader (a bare `guarded(...)` run) stops only its group, never the
  caller's session.
- With `ray_address: auto` (a cluster started by `ray start`) the job's workers belong to that cluster's
  raylets, outside the guard: Ray cleans them up when the job's driver (verl) dies.
- It exits with the server's exit code when the server ends by itself, so start-up failures look the same
  to the owner as without the guard.
- Servers meant to outlive their starter (`promptr1 env start`) are started without it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from pipeline.runtime import stop_process_group

POLL_S = 0.5
GRACE_S = 10.0


def guarded(command: list[str]) -> list[str]:
    """`command` wrapped so that it is stopped when the calling process dies."""
    return [sys.executable, "-m", "pipeline.environment.guard", "--", *command]


def _stop_all(child: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM the group and the session (server, its workers, their own groups), then SIGKILL what is left
    after `grace_s` (the guard goes down with it). Only a guard started as a session leader
    (start_new_session=True) owns its session and sweeps it; otherwise it stops only its group."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the group signal reaches the guard too
    stop_process_group(child, grace_s, whole_session=True)


def main(argv: list[str]) -> int:
    if not argv or argv[0] != "--" or len(argv) < 2:
        print("usage: python -m pipeline.environment.guard -- COMMAND [ARGS…]", file=sys.stderr)
        return 2
    owner = os.getppid()
    child = subprocess.Popen(argv[1:])
    stopping = False

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    while child.poll() is None:
        if stopping or os.getppid() != owner:
            _stop_all(child, GRACE_S)
            break
        time.sleep(POLL_S)
    code = child.wait()
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
