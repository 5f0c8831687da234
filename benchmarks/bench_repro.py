"""Does `dvc repro` reproduce its own numbers? The default profile run several times from fresh clones of HEAD,
idle and with one core kept busy; each stage's time, the figures that differ between runs, the calls that
timed out.

    python benchmarks/bench_repro.py                       # idle, idle, loaded, loaded (~80 min on our 2 cores)
    python benchmarks/bench_repro.py --loads idle idle     # one pair
    python benchmarks/bench_repro.py --keep DIR            # keep the clones (DIR/run1, ...) and consoles (DIR/run1.log)
    python benchmarks/bench_repro.py --compare A B         # two kept runs (e.g. before and after a refactor)

Each run: `git clone` of the committed HEAD (so an empty `.cache/`, no outputs, and the datasets mirror
`../shared/datasets` passed as an absolute path), then `dvc repro -f` with its output piped and every line
timestamped (stage times from DVC's `Running stage` lines, as benchmarks/bench_pipeline.py does). A
`loaded` run keeps one core busy the whole time with a spinning process of its own (2 cores: the pipeline
gets one). Run it on an otherwise idle machine: the idle figures are the ones the README quotes.

Compared between every run and the first: each reward column of `reports/train/steps.csv` (every column
but times and speeds) and every number in `reports/eval/metrics.json` except the timing and throughput
fields (`seconds`, `_s`, `per_s`, `tokens_per_s`, ...), which measure the machine, not the result. A figure
that differs is listed by name in `differing`; the console lines where an environment call timed out are
listed in `timeouts`. Writes benchmarks/results/repro.json:
`{"runs": [{"load", "total_s", "stages": {stage: s}}], "differing": [...], "timeouts": [...], ...}`.

`--compare A B` runs nothing: it compares two kept runs (folders with a project and its console log beside it,
`run1/` and `run1.log`), for example of the commits before and after a change meant to keep behaviour: the
same figures, and the console lines once times, durations, speeds, process ids and MLflow run ids are masked
(progress lines and timed-out calls, whose number follows the machine's speed, are counted apart; the lines
whose only difference is a logger name are listed apart: a module that moved logs under its new name). Writes `--out` (default benchmarks/results/repro_compare.json).
"""

from __future__ import annotations

import argparse
import csv
import difflib
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_pipeline import RESULTS, clone_head, machine, repro_env, stage_seconds, timed_repro

TIMING = re.compile(r"(^|[._/])(seconds|wall|latency|elapsed|duration|timing|throughput|hours)|(_s|_per_s|_time)$")
"""Figures that measure the machine (a name part or suffix), left out of the comparison."""
TIMEOUT_LINE = re.compile(r"environment call timed out|timeout after")
SPIN = "import time\nwhile True:\n    time.time()\n"


def run_repro(project: Path, load: str) -> tuple[float, list[tuple[float, str]]]:
    """`dvc repro -f` in `project` (a spinning process beside it when `load` is "loaded")."""
    spinner = subprocess.Popen([sys.executable, "-c", SPIN]) if load == "loaded" else None
    try:
        return timed_repro(project, repro_env(project), ("dvc", "repro", "-f"))
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()


def figures(project: Path) -> dict[str, object]:
    """The figures a run is judged by: steps.csv's reward columns per step, metrics.json's numbers."""
    out: dict[str, object] = {}
    with (project / "reports/train/steps.csv").open() as fh:
        for row in csv.DictReader(fh):
            for key, value in row.items():
                if key != "step" and not TIMING.search(key):
                    out[f"train/steps.csv:step{row.get('step')}:{key}"] = value

    def walk(prefix: str, node: object) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if not TIMING.search(str(key)):
                    walk(f"{prefix}.{key}" if prefix else str(key), value)
        elif isinstance(node, list):
            for i, value in enumerate(node):
                walk(f"{prefix}[{i}]", value)
        elif isinstance(node, int | float | str | bool) or node is None:
            out[f"eval/metrics.json:{prefix}"] = node

    walk("", json.loads((project / "reports/eval/metrics.json").read_text()))
    return out


MASKS = [
    (re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ "), ""),  # the log line's timestamp
    (re.compile(r"\b[0-9a-f]{32}\b"), "<run id>"),
    (re.compile(r"\b(pid|port) \d+"), r"\1 <n>"),
    (re.compile(r"\d+(\.\d+)?(e-?\d+)?( ?)(s|ms|min|h|tok/s|it/s|/s|s/it)\b"), r"<t>\3\4"),
    (re.compile(r"\d+:\d\d(:\d\d)?"), "<clock>"),
    (re.compile(r"^\tgit add (.*)$"), lambda m: "\tgit add " + " ".join(sorted(m.group(1).split()))),  # DVC's order
]
LOGGER = re.compile(r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL) [\w.]+: ")
TIME_DRIVEN = re.compile(r"^INFO pipeline\.progress: |environment call timed out|other work keeps ~")
"""Lines whose number depends on the machine's speed: progress lines (one every so many seconds) and the
environment calls that timed out and the warning that other work holds a core (a busy machine's); counted apart, left out of the in-order comparison."""


def masked(line: str) -> str:
    """A console line with what measures the machine or names a run masked."""
    for pattern, repl in MASKS:
        line = pattern.sub(repl, line)
    return line.rstrip()


def compare_console(a: list[str], b: list[str]) -> dict[str, object]:
    """Console lines of two runs, masked, time-driven lines apart, matched as a diff (difflib) on the lines
    without their logger: lines only one run has are `differing`; matched lines whose logger differs are
    `logger_only` (a module that moved logs under its new name)."""
    a, b = [masked(x) for x in a], [masked(x) for x in b]
    time_driven = [sum(bool(TIME_DRIVEN.search(x)) for x in lines) for lines in (a, b)]
    a, b = [x for x in a if not TIME_DRIVEN.search(x)], [x for x in b if not TIME_DRIVEN.search(x)]
    bare_a, bare_b = [LOGGER.sub(r"\1 ", x) for x in a], [LOGGER.sub(r"\1 ", x) for x in b]
    logger_only, differing = set(), []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, bare_a, bare_b, autojunk=False).get_opcodes():
        if tag == "equal":
            logger_only.update(f"{a[i].split(': ')[0]} -> {b[j].split(': ')[0]}"
                               for i, j in zip(range(i1, i2), range(j1, j2), strict=True) if a[i] != b[j])
        else:
            differing.append({"a": a[i1:i2], "b": b[j1:j2]})
    return {"lines": [len(a), len(b)], "time_driven_lines": time_driven, "logger_only": sorted(logger_only),
            "differing": differing}


def compare(a: Path, b: Path, out: Path) -> None:
    """`--compare`: the figures and consoles of two kept runs."""
    fa, fb = figures(a), figures(b)
    differing = sorted(k for k in fa.keys() | fb.keys() if fa.get(k) != fb.get(k))
    logs = [p.with_name(p.name + ".log") for p in (a, b)]
    console = (compare_console(*(p.read_text().splitlines() for p in logs)) if all(p.is_file() for p in logs)
               else None)
    result = {"what": "two kept dvc repro runs compared: figures, and console lines with times and ids masked",
              "command": f"python benchmarks/bench_repro.py --compare {a.name} {b.name}",
              "commits": [subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=p, capture_output=True, check=True,
                                         text=True).stdout.strip() for p in (a, b)],
              "figures_compared": len(fa), "differing": differing, "console": console}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{len(differing)} of {len(fa)} figures differ" + (f": {differing[:20]}" if differing else ""))
    if console:
        print(f"console: {console['lines'][0]} and {console['lines'][1]} lines compared (time-driven: "
              f"{console['time_driven_lines']}); {len(console['differing'])} differ "
              f"once masked; {len(console['logger_only'])} logger renames: {console['logger_only'][:10]}")
    if differing or (console and console["differing"]):
        sys.exit(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loads", nargs="+", choices=["idle", "loaded"], default=["idle", "idle", "loaded", "loaded"])
    parser.add_argument("--keep", type=Path, help="clone into this folder and keep the clones")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("A", "B"), help="compare two kept runs")
    args = parser.parse_args()
    if args.compare:
        compare(*args.compare, args.out or RESULTS / "repro_compare.json")
        return
    args.out = args.out or RESULTS / "repro.json"

    workdir = args.keep or Path(tempfile.mkdtemp(prefix="promptr1-repro-"))
    workdir.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, object]] = []
    seen: list[dict[str, object]] = []
    timeouts: list[str] = []
    commit = ""
    for i, load in enumerate(args.loads, start=1):
        project = workdir / f"run{i}"
        commit = clone_head(project)
        print(f"== run {i} of {len(args.loads)} ({load}) in {project}", flush=True)
        total, lines = run_repro(project, load)
        if args.keep:
            project.with_name(project.name + ".log").write_text("".join(text + "\n" for _, text in lines))
        runs.append({"load": load, "total_s": round(total, 1), "stages": stage_seconds(lines, total)})
        timeouts += [f"run {i} ({load}) at {t:.0f}s: {text.strip()}" for t, text in lines if TIMEOUT_LINE.search(text)]
        seen.append(figures(project))
        if not args.keep:
            shutil.rmtree(project, ignore_errors=True)
    first = seen[0]
    differing = sorted({key for other in seen[1:] for key in first.keys() | other.keys()
                        if first.get(key) != other.get(key)})
    result = {
        "what": "dvc repro -f, default profile, fresh clones of one commit; figures compared with the first run",
        "command": "python benchmarks/bench_repro.py --loads " + " ".join(args.loads),
        "commit": commit,
        "machine": machine(),
        "runs": runs,
        "figures_compared": len(first),
        "differing": differing,
        "timeouts": timeouts,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for i, run in enumerate(runs, start=1):
        stages = ", ".join(f"{name} {s:.0f}s" for name, s in run["stages"].items())
        print(f"run {i} ({run['load']}): {run['total_s']:.0f}s: {stages}")
    print(f"{len(differing)} of {len(first)} figures differ" + (f": {differing[:20]}" if differing else ""))
    print(f"{len(timeouts)} environment calls timed out" + "".join(f"\n  {t}" for t in timeouts))
    if not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)
    if differing:
        sys.exit(1)


if __name__ == "__main__":
    main()
