"""Wall time of `dvc repro` on the default profile from a clean clone, per stage and in total, and of a
second `dvc repro` with nothing changed (targets: ≤ 20 min and ≤ 10 s on the 2-core machine).

    python benchmarks/bench_pipeline.py [--keep DIR]

Clones the committed HEAD into a temporary folder (with the datasets mirror `../shared/datasets` of this
repo, passed as an absolute path), then runs each stage in pipeline order with
`dvc repro --single-item <stage>` and times it, then a plain `dvc repro` that must find nothing to do.
Writes benchmarks/results/pipeline.json and copies the run's evaluation summary and training curve next
to it, so the figures in the closing notes can be traced to a file.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"


def run(cmd: list[str], cwd: Path, env: dict[str, str]) -> float:
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=env, check=False)
    elapsed = time.perf_counter() - started
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed with exit code {proc.returncode}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", type=Path, help="clone into this folder and keep it (default: a temp dir)")
    args = parser.parse_args()

    workdir = args.keep or Path(tempfile.mkdtemp(prefix="promptr1-bench-"))
    project = workdir / "project"
    subprocess.run(["git", "clone", "-q", str(REPO), str(project)], check=True)
    mirror = (REPO.parent / "shared" / "datasets").resolve()
    params_file = project / "params.yaml"
    raw = yaml.safe_load(params_file.read_text())
    raw["paths"]["mirror"] = str(mirror)
    params_file.write_text(yaml.safe_dump(raw, sort_keys=False))

    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.pop("MLFLOW_TRACKING_URI", None)

    stages = [f"sample@{d}" for d in raw["data"]["train_datasets"]]
    stages += ["validate", "build", "train", "merge", "evaluate", "register"]
    timings: dict[str, float] = {}
    for stage in stages:
        timings[stage] = round(run(["dvc", "repro", "--single-item", stage], project, env), 1)
        print(f"{stage}: {timings[stage]} s", flush=True)
    total = round(sum(timings.values()), 1)
    second = round(run(["dvc", "repro"], project, env), 2)

    result = {
        "what": "dvc repro, default profile, clean clone, 2-core CPU",
        "command": "python benchmarks/bench_pipeline.py",
        "stage_seconds": timings,
        "total_seconds": total,
        "second_repro_no_change_seconds": second,
        "targets": {"total_seconds": 1200, "second_repro_seconds": 10},
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "pipeline.json").write_text(json.dumps(result, indent=2))
    for src, dst in [("reports/eval/summary.md", "pipeline_eval_summary.md"),
                     ("reports/eval/metrics.json", "pipeline_eval_metrics.json"),
                     ("reports/train/steps.csv", "pipeline_train_steps.csv"),
                     ("reports/promotion.json", "pipeline_promotion.json")]:
        if (project / src).is_file():
            shutil.copy(project / src, RESULTS / dst)
    print(json.dumps(result, indent=2))
    if not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
