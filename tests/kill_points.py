"""kill -9 inside `dvc repro`: a micro project, a stage-process finder, kill points and the checks after a kill.

Test scaffolding, not part of the package (like demo_project.py): tests/hardening/test_kill_repro.py uses it
for one kill per stage kind, benchmarks/bench_kill_campaign.py for the campaign of random kills.

- `make_micro_project(dest, …)`: a copy of this repository's code, params and dvc.yaml with the smallest
  settings (one training dataset, one ID and one OOD evaluation set, 16 sampled rows, a tiny agent, two
  GRPO steps, the `api` backend pointed at a local stand-in server, the environment-only baseline), in a
  fresh git repo. Every stage is the real `promptr1` command.
- `repro_killing(project, env, stage, reached)`: run `dvc repro`; once DVC starts `stage` and `reached(pid)`
  holds for its process, SIGKILL that process (never a sleep: kill points are observed states). Returns
  what happened (killed or not, DVC's exit code and output).
- Kill points (`KILL_POINTS`): sampling once the stage has the raw source open; evaluation once the
  stand-in server has answered part of the evaluation set; registering once a model version exists in
  the registry; training once it has checkpointed a given number of steps.
- Checks: `dvc_changed(project, env)` what DVC would still rerun; `half_written(project)` lists outputs that do not parse (JSON, Parquet, CSV); `orphan_versions`
  lists registered versions that no finished `register` accounts for (no `promotion.decision` tag);
  `repeated_steps` lists training steps recorded twice.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from demo_project import copy_project, project_env

API_KEY_ENV = "PROMPTR1_KILL_TEST_KEY"


def micro_params(raw: dict, mirror: Path, agent_dir: Path, url: str) -> dict:
    """The default profile shrunk to a micro run: a tiny agent, the api backend at the stand-in `url`."""
    raw["paths"]["mirror"] = str(mirror)
    raw["data"].update(train_datasets=["hotpotqa"], sample_datasets=["hotpotqa"], id_eval_datasets=["hotpotqa"],
                       ood_eval_datasets=["xsum"], sample_size=16)
    raw["agent"].update(model=str(agent_dir), max_turns=2, max_turn_tokens=24, max_response_tokens=200)
    raw["environment"].update(backend="api", base_url=url, served_name="fault-model", max_tokens=16,
                              api_key_env=API_KEY_ENV, max_retries=0)
    raw["train"].update(steps=2, batch_size=1, group_size=2, mini_batch_size=1, micro_batch_size=2, save_every=1)
    raw["train"]["warmup"].update(steps=0)
    raw["evaluate"].update(rows_per_dataset=4, agent_max_turn_tokens=8, bootstrap_samples=20, batch_size=1,
                           baselines=["env_only"])
    raw["gepa"].update(max_metric_calls=4, train_size=2, val_size=2, holdout_size=2, minibatch_size=1,
                       reflection_max_tokens=16)
    return raw


def make_micro_project(dest: Path, repo_root: Path, mirror: Path, agent_dir: Path, url: str) -> Path:
    """The micro project in `dest`, committed (DVC needs a git repo)."""
    copy_project(repo_root, dest)
    raw = yaml.safe_load((dest / "params.yaml").read_text())
    (dest / "params.yaml").write_text(yaml.safe_dump(micro_params(raw, mirror, agent_dir, url), sort_keys=False))
    env = micro_env()
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-qm", "micro project"]):
        subprocess.run(cmd, cwd=dest, env=env, check=True, timeout=60, capture_output=True)
    return dest


def micro_env() -> dict[str, str]:
    return project_env() | {API_KEY_ENV: "sk-local-test-key-0000"}


def stage_pids(project: Path, stage: str) -> list[int]:
    """Processes running `promptr1 <verb> [item]` for `stage` (e.g. `sample@hotpotqa`) in `project`."""
    verb, _, item = stage.partition("@")
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            cwd = os.readlink(entry / "cwd")
        except OSError:
            continue
        words = [a.decode(errors="replace") for a in argv if a]
        names = [Path(w).name for w in words]
        if cwd == str(project.resolve()) and "promptr1" in names:
            rest = words[names.index("promptr1") + 1:]
            if rest[:1] == [verb] and (not item or rest[1:2] == [item]):
                found.append(int(entry.name))
    return found


def open_paths(pid: int) -> list[str]:
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return []
    paths = []
    for fd in fds:
        try:
            paths.append(os.readlink(fd))
        except OSError:
            continue
    return paths


def registered_versions(project: Path) -> list[tuple[str, str, dict[str, str]]]:
    """(model, version, tags) of every registered model version in the project's MLflow SQLite store
    (deleted versions, which MLflow keeps as `Deleted_Internal` rows, left out, and so are the Prompt
    Registry's versions: MLflow keeps a prompt as a registered model tagged `mlflow.prompt.is_prompt`, and the
    gepa stage's instruction is one, which no `register` run decides on)."""
    db = project / "mlflow.db"
    if not db.is_file():
        return []
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10) as conn:
        try:
            rows = conn.execute("SELECT name, version FROM model_versions "
                                "WHERE current_stage IS NULL OR current_stage != 'Deleted_Internal'").fetchall()
            tags = conn.execute("SELECT name, version, key, value FROM model_version_tags").fetchall()
            prompts = {name for (name,) in conn.execute(
                "SELECT name FROM registered_model_tags WHERE key = 'mlflow.prompt.is_prompt' AND value = 'true'")}
        except sqlite3.OperationalError:  # the store is being created
            return []
    by_version: dict[tuple[str, str], dict[str, str]] = {(n, str(v)): {} for n, v in rows if n not in prompts}
    for name, version, key, value in tags:
        if (name, str(version)) in by_version:
            by_version[(name, str(version))][key] = value
    return [(n, v, t) for (n, v), t in sorted(by_version.items())]


def reached_sampling(project: Path, mirror: Path) -> Callable[[int], bool]:
    """The sample process has a raw source file (or its output) open: it is reading or writing.

    /proc reports resolved paths, so the roots are resolved too (the mirror is often reached through a link,
    such as a `../shared` beside the clone).
    """
    roots = (str(mirror.resolve()), str((project / "data" / "sampled").resolve()))
    return lambda pid: any(p.startswith(roots) for p in open_paths(pid))


def reached_training(project: Path, steps: int = 1) -> Callable[[int], bool]:
    """Training has finished and checkpointed `steps` steps (complete `step_N/` folders), 0 = has started."""
    return lambda pid: len(list((project / "checkpoints" / "agent").glob("step_*/trainer_state.json"))) >= steps


def reached_evaluation(server, calls: int) -> Callable[[int], bool]:
    """The stand-in environment has received `calls` of the evaluation's calls since it was armed (fewer than
    the set needs, so the stage is mid-set)."""
    start = len(server.chat_requests)
    return lambda pid: len(server.chat_requests) - start >= calls


def reached_registering(project: Path) -> Callable[[int], bool]:
    """A new model version exists in the registry (the stage has not finished accounting for it)."""
    before = len(registered_versions(project))
    return lambda pid: len(registered_versions(project)) > before


@dataclass
class ReproRun:
    """One `dvc repro` with a kill armed for one stage."""

    stage: str | None
    killed: bool = False
    killed_pid: int | None = None
    returncode: int | None = None
    output: list[str] = field(default_factory=list)
    seconds: float = 0.0
    stage_started_s: dict[str, float] = field(default_factory=dict)
    """Seconds after the start of `dvc repro` at which DVC announced each stage it ran."""


def repro_killing(project: Path, env: dict[str, str], stage: str | None = None,
                  arm: Callable[[], Callable[[int], bool]] | None = None, timeout_s: float = 900) -> ReproRun:
    """Run `dvc repro`; if `stage` is given, SIGKILL its process once the predicate `arm()` returns holds.

    `arm` is called when DVC announces the stage (so a predicate can note the state at that moment).
    """
    run = ReproRun(stage)
    started = time.monotonic()
    proc = subprocess.Popen(["dvc", "repro"], cwd=project, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    announced = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            run.output.append(line.rstrip("\n"))
            if line.startswith("Running stage '"):
                run.stage_started_s[line.split("'")[1]] = round(time.monotonic() - started, 1)
            if stage is not None and f"Running stage '{stage}'" in line:
                announced.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        if stage is not None:
            predicate = None
            while proc.poll() is None and time.monotonic() - started < timeout_s:
                if announced.is_set() and predicate is None:
                    predicate = arm() if arm else (lambda pid: True)
                if predicate is not None:
                    for pid in stage_pids(project, stage):
                        if predicate(pid):
                            os.kill(pid, signal.SIGKILL)
                            run.killed, run.killed_pid = True, pid
                            break
                if run.killed:
                    break
                time.sleep(0.002)
        run.returncode = proc.wait(timeout=max(1.0, timeout_s - (time.monotonic() - started)))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(timeout=10)
    run.seconds = round(time.monotonic() - started, 1)
    return run


def half_written(project: Path) -> list[str]:
    """Outputs that exist but do not parse: a stage killed mid-write must never leave one."""
    import pandas as pd

    bad = []
    for folder in ("data", "reports", "models", "checkpoints"):
        for path in (project / folder).rglob("*") if (project / folder).is_dir() else []:
            if not path.is_file():
                continue
            try:
                if path.suffix == ".json":
                    json.loads(path.read_text())
                elif path.suffix == ".parquet":
                    pd.read_parquet(path)
                elif path.suffix == ".jsonl":
                    [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
                elif path.suffix == ".csv" and path.stat().st_size:
                    pd.read_csv(path)
            except (ValueError, OSError) as exc:  # Arrow, pandas and JSON parse errors are ValueErrors
                bad.append(f"{path.relative_to(project)}: {type(exc).__name__}")
    return bad


def orphan_versions(project: Path) -> list[str]:
    """Registered versions that no finished `register` accounts for (no `promotion.decision` tag)."""
    return [f"{n} v{v}" for n, v, tags in registered_versions(project) if "promotion.decision" not in tags]


def repeated_steps(project: Path) -> list[int]:
    """Training steps recorded more than once in reports/train/steps.csv."""
    import pandas as pd

    csv = project / "reports" / "train" / "steps.csv"
    if not csv.is_file():
        return []
    steps = pd.read_csv(csv)["step"].tolist()
    return sorted({s for s in steps if steps.count(s) > 1})


def dvc_changed(project: Path, env: dict[str, str]) -> dict:
    """What `dvc status` reports changed, the `sources` stage (always changed by design) left out."""
    proc = subprocess.run(["dvc", "status", "--json"], cwd=project, env=env, capture_output=True, text=True,
                          timeout=300, check=True)
    return {k: v for k, v in json.loads(proc.stdout or "{}").items() if v != ["always changed"]}
