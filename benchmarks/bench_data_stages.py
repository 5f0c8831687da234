"""Wall time of the data stages (sample ×8 + validate + build), cold and with nothing changed.

Measures, on the default profile (full 5,120-row sampling, all 20 validations, all 12 eval files):
1. `direct`: the three stage commands called one after another (`promptr1 sample <ds>` for the 8 training
   sets, `promptr1 validate`, `promptr1 build`), from a clean state (no outputs);
2. `dvc_cold`: `dvc repro --force --no-run-cache build` from a clean state (no outputs, no lock);
3. `dvc_nochange`: a second `dvc repro build` with nothing changed (every stage skipped).
Targets: cold ≤ 60 s, no-change ≤ 10 s.

By default it runs in a throw-away copy of the project (`--copy`, the default) so the workspace's outputs,
dvc.lock and git state are never touched: the copy gets the package sources, params and profiles, a
dvc.yaml holding only the three data stages (so a problem in a later stage cannot stop the measurement),
`dvc init --no-scm`, and a symlink that makes `paths.mirror` resolve as it does in the project.
`--in-place` measures the project itself instead (it deletes the data-stage outputs first).

    python benchmarks/bench_data_stages.py [--in-place] [--keep]

Prints the figures and the per-dataset rows kept / dropped / leaked, and writes
benchmarks/results/data_stages.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.config import load_params

RESULTS = ROOT / "benchmarks" / "results" / "data_stages.json"
DATA_STAGES = ("sample", "validate", "build")
COPIED = ("pipeline", "profiles", "params.yaml", "pyproject.toml")
ENV = {
    "DVC_NO_ANALYTICS": "1",
    "GX_ANALYTICS_ENABLED": "false",
    "HF_HUB_OFFLINE": "1",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "PYTHONPATH": "",
}


def _run(cmd: list[str], cwd: Path, env: dict[str, str]) -> float:
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, check=False)
    elapsed = time.perf_counter() - started
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"command failed ({proc.returncode}): {' '.join(cmd)}")
    return elapsed


def _clean(project: Path) -> None:
    params = load_params(project / "params.yaml")
    for folder in (
        params.path(params.paths.sampled_dir),
        params.path(params.paths.rl_dir),
        *(params.path(params.paths.reports_dir) / s for s in DATA_STAGES),
    ):
        shutil.rmtree(folder, ignore_errors=True)


def _make_copy(workdir: Path) -> Path:
    project = workdir / "project"
    project.mkdir()
    for name in COPIED:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, project / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, project / name)
    pipeline = yaml.safe_load((ROOT / "dvc.yaml").read_text())
    pipeline["stages"] = {k: v for k, v in pipeline["stages"].items() if k in DATA_STAGES}
    (project / "dvc.yaml").write_text(yaml.safe_dump(pipeline, sort_keys=False))
    mirror = load_params(ROOT / "params.yaml").paths.mirror
    if mirror and not Path(mirror).is_absolute():  # make the relative mirror path resolve in the copy
        link = Path(os.path.normpath(project / mirror))
        if not link.exists():
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to((ROOT / mirror).resolve(), target_is_directory=True)
    subprocess.run(["dvc", "init", "--no-scm", "-q"], cwd=project, check=True)
    return project


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--in-place", action="store_true", help="measure the project itself (deletes outputs)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the temporary copy")
    args = parser.parse_args()

    env = {**os.environ, **ENV}
    venv_bin = Path(sys.executable).parent
    env["PATH"] = f"{venv_bin}{os.pathsep}{env.get('PATH', '')}"
    workdir = Path(tempfile.mkdtemp(prefix="bench_data_"))
    project = ROOT if args.in_place else _make_copy(workdir)
    params = load_params(project / "params.yaml")
    try:
        _clean(project)
        direct = {}
        for ds in params.data.train_datasets:
            direct[f"sample {ds}"] = _run(["promptr1", "sample", ds], project, env)
        direct["validate"] = _run(["promptr1", "validate"], project, env)
        direct["build"] = _run(["promptr1", "build"], project, env)

        _clean(project)
        (project / "dvc.lock").unlink(missing_ok=True)
        dvc_cold = _run(["dvc", "repro", "--force", "--no-run-cache", "build"], project, env)
        dvc_nochange = _run(["dvc", "repro", "build"], project, env)

        per_dataset = {}
        for ds in params.data.train_datasets:
            report = json.loads((params.path(params.paths.reports_dir) / "sample" / f"{ds}.json").read_text())
            per_dataset[ds] = {
                "rows_source": report["rows_source"],
                "dropped_by_reason": {k: v for k, v in report["dropped_by_reason"].items() if v},
                "leaked_removed": report["leaked_removed"],
                "rows_written": report["rows_written"],
                "shortfall": report["shortfall"],
            }
    finally:
        if not args.keep and not args.in_place:
            shutil.rmtree(workdir, ignore_errors=True)

    result = {
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
        },
        "mode": "in-place" if args.in_place else "copy",
        "direct_seconds": {k: round(v, 2) for k, v in direct.items()},
        "direct_total_seconds": round(sum(direct.values()), 2),
        "dvc_cold_seconds": round(dvc_cold, 2),
        "dvc_nochange_seconds": round(dvc_nochange, 2),
        "targets": {"cold_seconds": 60, "nochange_seconds": 10},
        "per_dataset": per_dataset,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
