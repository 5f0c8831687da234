"""Overhead of the Prefect retraining flow over a plain `dvc repro`, when nothing has to rerun.

    python benchmarks/bench_flow_overhead.py [--repeats 5] [--real]

Measured on tests/demo_project.py's tiny DVC project (five stages, trivial commands), after one full run:
- `dvc repro` (a subprocess, as a user types it);
- the flow in-process with a warm Prefect API (`run_pipeline_flow`, what a served deployment pays per run
  once its process is up);
- the flow as a command (`python -m flows.retrain`, a fresh interpreter that also starts Prefect's temporary
  local server: what `promptr1 flow run` costs without a configured Prefect server).
With `--real`, also `dvc repro` vs the in-process flow on this repository (needs its stages up to date).
Writes benchmarks/results/flow_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # the demo project is test scaffolding (tests/demo_project.py)


def _timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def _summary(values: list[float]) -> dict[str, float | list[float]]:
    return {"median_s": round(statistics.median(values), 3), "min_s": round(min(values), 3),
            "runs_s": [round(v, 3) for v in values]}


def _dvc_repro(root: Path) -> None:
    from flows.dvc_steps import subprocess_env

    subprocess.run([sys.executable, "-m", "dvc", "repro"], cwd=root, check=True, capture_output=True,
                   env=subprocess_env())


def measure(root: Path, repeats: int, launcher=None, cold: bool = True) -> dict:
    from flows.retrain import run_pipeline_flow

    def flow_once() -> None:
        summary = run_pipeline_flow(root, launcher=launcher)
        assert {s["result"] for s in summary["stages"]} == {"up to date"}, summary["stages"]

    flow_once()  # starts the temporary Prefect server once; not counted in the warm figures
    result = {"dvc_repro": _summary(_timed(lambda: _dvc_repro(root), repeats)),
              "flow_in_process_warm": _summary(_timed(flow_once, repeats))}
    if cold:
        def cli_once() -> None:
            with tempfile.TemporaryDirectory() as home:
                env = {**os.environ, "PREFECT_HOME": home, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
                subprocess.run([sys.executable, "-m", "flows.retrain", "--project-dir", str(root)], cwd=REPO,
                               env=env, check=True, capture_output=True)

        result["flow_cli_cold"] = _summary(_timed(cli_once, max(2, repeats // 2)))
    dvc = result["dvc_repro"]["median_s"]
    result["overhead_warm_s"] = round(result["flow_in_process_warm"]["median_s"] - dvc, 3)
    if cold:
        result["overhead_cold_cli_s"] = round(result["flow_cli_cold"]["median_s"] - dvc, 3)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--real", action="store_true", help="also measure on this repository")
    args = parser.parse_args()
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DVC_NO_ANALYTICS", "1")

    from demo_project import StaticEnvironment, make_demo_project

    from flows.retrain import run_pipeline_flow

    results: dict = {
        "what": "seconds for a run with nothing to rerun: plain `dvc repro` vs the Prefect flow",
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform()},
        "command": "python benchmarks/bench_flow_overhead.py" + (" --real" if args.real else ""),
    }
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["PREFECT_HOME"] = str(Path(tmp) / "prefect-home")
        root = make_demo_project(Path(tmp) / "demo")
        env = StaticEnvironment(root)
        start = time.perf_counter()
        run_pipeline_flow(root, launcher=env)
        results["demo_first_full_run_s"] = round(time.perf_counter() - start, 3)
        results["demo_project"] = measure(root, args.repeats, launcher=env)
        if args.real:
            results["real_project"] = measure(REPO, args.repeats, cold=False)
    out = REPO / "benchmarks" / "results" / "flow_overhead.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
