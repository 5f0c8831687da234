"""A stand-in for `python -m verl.trainer.main_ppo` that replays a recorded verl log (stdlib only, but `--mlflow`).

Test scaffolding (tests/test_verl_progress.py, tests/test_verl_first_hour.py): verl itself needs GPUs, so the
launcher's stream, resume check and watchdog are driven by a real child process that prints verl's lines with the
timing a test asks for:

    python tests/verl_replay.py LOG [--gap STEP=SECONDS ...] [--hang-after STEP] [--hang-before TEXT]
                                    [--hang-s SECONDS] [--pace SECONDS] [--spawn-child] [--mlflow]

Before a step line `step:N - ...` it sleeps the gap given for N (else `--pace`); after the step line of
`--hang-after`, or before the first line containing `--hang-before`, it goes silent for `--hang-s` seconds
(600) without exiting, as a run stuck in a collective or in its start-up does. With `--mlflow` each step line's
numeric metrics are logged, before the line is printed as verl's `Tracking.log` does, to the MLflow run
`MLFLOW_RUN_ID` at `MLFLOW_TRACKING_URI`, as verl's MLflow logger does.
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
    parser.add_argument("--hang-before", default=None, help="go silent before the first line containing this")
    parser.add_argument("--hang-s", type=float, default=600.0)
    parser.add_argument("--mlflow", action="store_true", help="log each step line's metrics to MLFLOW_RUN_ID")
    args = parser.parse_args(argv)
    log_step = _mlflow_logger() if args.mlflow else None
    if args.spawn_child:  # as verl's private Ray daemons: children in verl's process group
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print(f"replay child pid {child.pid}", flush=True)
    gaps = {int(k): float(v) for k, v in (g.split("=") for g in args.gap)}
    with open(args.log, encoding="utf-8") as f:
        for line in f:
            match = _STEP.search(line)
            if args.hang_before is not None and args.hang_before in line:
                args.hang_before = None
                time.sleep(args.hang_s)
            if match:
                time.sleep(gaps.get(int(match.group(1)), args.pace))
                if log_step is not None:
                    log_step(int(match.group(1)), line[match.end():])
            sys.stdout.write(line)
            sys.stdout.flush()
            if match and int(match.group(1)) == args.hang_after and "critic/score/mean" in line:
                time.sleep(args.hang_s)
    return 0


def _mlflow_logger():
    """A function (step, the line's `key:value - …` text) that logs the numbers to the run, as verl's logger."""
    import os

    from mlflow import MlflowClient
    from mlflow.entities import Metric

    client, run_id = MlflowClient(), os.environ["MLFLOW_RUN_ID"]

    def log_step(step: int, text: str) -> None:
        metrics = []
        for item in text.strip().split(" - "):
            key, _, raw = item.rpartition(":")
            try:
                metrics.append(Metric(key, float(raw), int(time.time() * 1000), step))
            except ValueError:
                continue
        client.log_batch(run_id, metrics=metrics)

    return log_step


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
