"""Owner guard: a server the pipeline starts never outlives the process that started it.

`environment_server` stops its server on every exit path Python sees (normal exit, exception, Ctrl-C,
SIGTERM turned into KeyboardInterrupt by `pipeline.runtime`), but nothing runs when the owner is killed
with SIGKILL or the OOM killer: llama.cpp or vLLM would keep the port and the GPUs. So the server is not
started directly but under this guard:

    python -m pipeline.environment.guard -- <server command …>

Decisions:
- The guard is the owner's direct child and polls `os.getppid()` every `POLL_S`: when the owner dies the
  guard is re-parented, the parent id changes, and it stops the server. No PID is compared against a
  recorded number, so a recycled PID cannot fool it.
- The guard runs the server as its own child in the process group the owner created for it
  (`start_new_session=True`), so `stop_server`'s `killpg` reaches guard, server and the server's workers
  alike; the guard then escalates SIGTERM → (grace) → SIGKILL over the whole group.
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

POLL_S = 0.5
GRACE_S = 10.0


def guarded(command: list[str]) -> list[str]:
    """`command` wrapped so that it is stopped when the calling process dies."""
    return [sys.executable, "-m", "pipeline.environment.guard", "--", *command]


def _stop_group(child: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM the whole group (server and its workers), then SIGKILL it (the guard goes down with it)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the group signal reaches the guard too
    group = os.getpgid(0)
    try:
        os.killpg(group, signal.SIGTERM)
        child.wait(timeout=grace_s)
    except ProcessLookupError:
        return
    except subprocess.TimeoutExpired:
        os.killpg(group, signal.SIGKILL)


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
            _stop_group(child, GRACE_S)
            break
        time.sleep(POLL_S)
    code = child.wait()
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
