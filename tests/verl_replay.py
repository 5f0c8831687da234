"""A stand-in for `python -m verl.trainer.main_ppo` that replays a recorded verl log (stdlib only).

Test scaffolding (tests/test_verl_progress.py): verl itself needs GPUs, so the launcher's stream, resume check and
watchdog are driven by a real child process that prints verl's lines with the timing a test asks for:

    python tests/verl_replay.py LOG [--gap STEP=SECONDS ...] [--hang-after STEP] [--pace SECONDS] [--spawn-child]

Before a step line `step:N - ...` it sleeps the gap given for N (else `--pace`); after the step line of
`--hang-after` it goes silent without exiting, as a run stuck in a collective does.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time

_STEP = re.compile(r"(?:^|\s)step:(\d+) - ")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("log")
    parser.add_argument("--gap", action="append", default=[], help="STEP=SECONDS: sleep before step STEP's line")
    parser.add_argument("--hang-after", type=int, default=None)
    parser.add_argument("--pace", type=float, default=0.0)
    parser.add_argument("--spawn-child", action="store_true", help="start a sleeping child in the same group")
    args = parser.parse_args(argv)
    if args.spawn_child:  # as verl's private Ray daemons: children in verl's process group
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print(f"replay child pid {child.pid}", flush=True)
    gaps = {int(k): float(v) for k, v in (g.split("=") for g in args.gap)}
    with open(args.log, encoding="utf-8") as f:
        for line in f:
            match = _STEP.search(line)
            if match:
                time.sleep(gaps.get(int(match.group(1)), args.pace))
            sys.stdout.write(line)
            sys.stdout.flush()
            if match and int(match.group(1)) == args.hang_after and "critic/score/mean" in line:
                time.sleep(600)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
