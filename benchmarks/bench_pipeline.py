"""Wall time of `dvc repro` on the default profile from a clean clone, each stage's share, the console it
prints, and a second `dvc repro` with nothing changed (targets: ≤ 15 min plus ≤ 4 min for the gepa stage,
≤ 150 console lines, ≤ 10 s).

    python benchmarks/bench_pipeline.py [--label after] [--keep DIR]

Clones the committed HEAD into a temporary folder (with the datasets mirror `../shared/datasets` of this
repo, passed as an absolute path), runs ONE plain `dvc repro` with its output going to a pipe (not a
terminal, as in CI or a scheduled run), timestamps every line it prints, and splits the wall time by the
`Running stage '<name>'` lines DVC prints. Then a plain `dvc repro` that must find nothing to do.
Writes benchmarks/results/pipeline[_<label>].json and the console it saw (pipeline[_<label>]_console.txt),
and copies the run's evaluation summary and training curve next to them, so the figures in the closing
notes can be traced to a file.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
STAGE_LINE = re.compile(r"Running stage '([^']+)'")


def clone_head(project: Path) -> str:
    """A fresh clone of this repo's committed HEAD at `project`, its params pointing at the datasets mirror
    (`../shared/datasets` of this repo) by absolute path; returns the short commit."""
    subprocess.run(["git", "clone", "-q", str(REPO), str(project)], check=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=project, capture_output=True,
                            text=True, check=True).stdout.strip()
    params_file = project / "params.yaml"
    raw = yaml.safe_load(params_file.read_text())
    raw["paths"]["mirror"] = str((REPO.parent / "shared" / "datasets").resolve())
    params_file.write_text(yaml.safe_dump(raw, sort_keys=False))
    return commit


def repro_env(project: Path) -> dict[str, str]:
    """The environment `dvc repro` runs under in a clone: this interpreter's tools first, no tracking URI or
    forced colour from the caller, and the clone's own code (not the editable install's checkout, which may
    hold uncommitted work)."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.pop("MLFLOW_TRACKING_URI", None)
    env.pop("FORCE_COLOR", None)
    env["PYTHONPATH"] = str(project)
    return env


def timed_repro(project: Path, env: dict[str, str], command: tuple[str, ...] = ("dvc", "repro"),
                ) -> tuple[float, list[tuple[float, str]]]:
    """One `dvc repro` (or `command`), output piped; returns its wall time and every line with its time since start."""
    started = time.perf_counter()
    proc = subprocess.Popen(list(command), cwd=project, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1)
    lines: list[tuple[float, str]] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append((time.perf_counter() - started, line.rstrip("\n")))
        print(line, end="", flush=True)
    code = proc.wait()
    elapsed = time.perf_counter() - started
    if code != 0:
        sys.exit(f"{' '.join(command)} failed with exit code {code} in {project}")
    return elapsed, lines


def stage_seconds(lines: list[tuple[float, str]], total: float) -> dict[str, float]:
    """Seconds from each `Running stage` line to the next (the last stage runs to the end)."""
    starts = [(t, m.group(1)) for t, text in lines if (m := STAGE_LINE.search(text))]
    out: dict[str, float] = {}
    for i, (t, name) in enumerate(starts):
        end = starts[i + 1][0] if i + 1 < len(starts) else total
        out[name] = round(end - t, 1)
    return out


def machine() -> dict[str, object]:
    """What the stage times depend on: cores, and whether bf16 is native (train.autocast: auto follows it)."""
    from pipeline.hardware import cpu_capability, native_bf16

    return {"platform": platform.platform(), "cpu_model": cpu_model(), "cpus": os.cpu_count(),
            "cpu_capability": cpu_capability(), "native_bf16_cpu": native_bf16("cpu")}


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo): hosts of one cloud differ, and so do their times."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", default="", help="suffix of the result files (e.g. before, after)")
    parser.add_argument("--keep", type=Path, help="clone into this folder and keep it (default: a temp dir)")
    args = parser.parse_args()

    workdir = args.keep or Path(tempfile.mkdtemp(prefix="promptr1-bench-"))
    project = workdir / "project"
    commit = clone_head(project)
    env = repro_env(project)

    total, lines = timed_repro(project, env)
    timings = stage_seconds(lines, total)
    started = time.perf_counter()
    subprocess.run(["dvc", "repro"], cwd=project, env=env, check=True, capture_output=True)
    second = round(time.perf_counter() - started, 2)

    gepa = sum(s for name, s in timings.items() if name == "gepa")
    result = {
        "what": "dvc repro, default profile, clean clone, 2-core CPU, output piped (not a terminal)",
        "command": "python benchmarks/bench_pipeline.py" + (f" --label {args.label}" if args.label else ""),
        "commit": commit,
        "machine": machine(),
        "total_seconds": round(total, 1),
        "total_without_gepa_seconds": round(total - gepa, 1),
        "stage_seconds": timings,
        "stage_share": {name: round(s / total, 3) for name, s in timings.items()},
        "console_lines": len(lines),
        "second_repro_no_change_seconds": second,
        "targets": {"total_without_gepa_seconds": 900, "gepa_seconds": 240, "console_lines": 150,
                    "second_repro_seconds": 10},
    }
    suffix = f"_{args.label}" if args.label else ""
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"pipeline{suffix}.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / f"pipeline{suffix}_console.txt").write_text(
        "".join(f"[{t:7.1f}s] {text}\n" for t, text in lines))
    for src, dst in [("reports/eval/summary.md", "eval_summary.md"),
                     ("reports/eval/metrics.json", "eval_metrics.json"),
                     ("reports/train/steps.csv", "train_steps.csv"),
                     ("reports/promotion.json", "promotion.json")]:
        if (project / src).is_file():
            shutil.copy(project / src, RESULTS / f"pipeline{suffix}_{dst}")
    print(json.dumps(result, indent=2))
    if not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
