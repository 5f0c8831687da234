"""kill -9 campaign: `dvc repro` of the micro project, SIGKILLed at a random point of a random stage, then rerun.

    python benchmarks/bench_kill_campaign.py [--runs 10] [--seed 0] [--out benchmarks/results/kill_campaign.json]

Each run builds a fresh micro project (tests/kill_points.py: one training set, a tiny random agent, the `api`
backend at a local stand-in server, real `promptr1` stages), starts `dvc repro`, and SIGKILLs the process of
one stage drawn at random (sampling, training, evaluation, registering) at a random point of it: an observed
state drawn per stage (the stage has started, the raw source is open, N training steps are checkpointed, N
evaluation calls were answered, a model version exists) plus a random delay of up to `--jitter` seconds. A
kill that lands after the stage exited counts as a run without a kill. Then `dvc repro` runs again, and the
run *survived* when that rerun exits 0 and: DVC has nothing left to rerun, no output is half-written, no
training step is recorded twice, the registry has no orphan version and the champion alias points at the
version `reports/promotion.json` names. Writes `{runs, kills, survived, runs_detail, ...}` to `--out`.

Outside CI (each run is a whole micro pipeline, ~2 min on 2 cores); tests/hardening/test_kill_repro.py runs
one kill per stage kind in CI.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # the micro project and the stand-in server are test scaffolding

import kill_points as kp
from demo_project import write_tiny_llama
from fault_server import FaultServer

KILL_STAGES = ["sample@hotpotqa", "train", "evaluate", "register"]


def kill_point(stage: str, rng: random.Random, project: Path, mirror: Path, server: FaultServer):
    """(description, arm) for a random observed point of `stage`; arm() returns the predicate on its pid."""
    if stage.startswith("sample"):
        if rng.random() < 0.5:
            return "started", lambda: (lambda pid: True)
        return "source open", lambda: kp.reached_sampling(project, mirror)
    if stage == "train":
        steps = rng.randint(0, 1)
        return f"{steps} steps checkpointed", lambda: kp.reached_training(project, steps)
    if stage == "evaluate":
        calls = rng.randint(1, 7)
        return f"{calls} evaluation calls answered", lambda: kp.reached_evaluation(server, calls)
    if rng.random() < 0.5:
        return "started", lambda: (lambda pid: True)
    return "version registered", lambda: kp.reached_registering(project)


def jittered(arm, delay_s: float):
    """The predicate of `arm`, holding only `delay_s` seconds after it first held."""
    def armed():
        predicate, since = arm(), []

        def check(pid: int) -> bool:
            if not since and predicate(pid):
                since.append(time.monotonic())
            return bool(since) and time.monotonic() - since[0] >= delay_s
        return check
    return armed


def survived_checks(project: Path, env: dict[str, str]) -> dict[str, object]:
    promotion_file = project / "reports" / "promotion.json"
    promotion = json.loads(promotion_file.read_text()) if promotion_file.is_file() else {}
    versions = kp.registered_versions(project)
    champion = [v for _, v, tags in versions if tags.get("promotion.decision") == "promoted"]
    return {
        "dvc_changed": kp.dvc_changed(project, env),
        "half_written": kp.half_written(project),
        "repeated_steps": kp.repeated_steps(project),
        "orphan_versions": kp.orphan_versions(project),
        "champion_matches_promotion": bool(promotion) and promotion.get("champion_after") in champion,
    }


def one_run(index: int, rng: random.Random, work: Path, agent_dir: Path, mirror: Path, jitter_s: float) -> dict:
    env = kp.micro_env()
    with FaultServer() as server:
        project = kp.make_micro_project(work / f"run{index}", REPO, mirror, agent_dir, server.url)
        stage = rng.choice(KILL_STAGES)
        point, arm = kill_point(stage, rng, project, mirror, server)
        delay = round(rng.uniform(0, jitter_s), 2)
        first = kp.repro_killing(project, env, stage, jittered(arm, delay))
        rerun = kp.repro_killing(project, env)
        checks = survived_checks(project, env) if rerun.returncode == 0 else {}
    ok = rerun.returncode == 0 and checks["champion_matches_promotion"] and not any(
        v for k, v in checks.items() if k != "champion_matches_promotion")
    return {
        "run": index, "stage": stage, "point": point, "delay_s": delay, "killed": first.killed,
        "first_exit": first.returncode, "first_seconds": first.seconds, "rerun_exit": rerun.returncode,
        "rerun_seconds": rerun.seconds, "checks": checks, "survived": bool(ok),
        "rerun_tail": [] if ok else rerun.output[-15:],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jitter", type=float, default=1.0, help="largest random delay after the kill point (s)")
    parser.add_argument("--mirror", type=Path, default=REPO.parent / "shared" / "datasets")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "kill_campaign.json")
    args = parser.parse_args()
    for key, value in {"MLFLOW_DISABLE_TELEMETRY": "true", "GX_ANALYTICS_ENABLED": "false", "DVC_NO_ANALYTICS": "1",
                       "HF_HUB_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0"}.items():
        os.environ.setdefault(key, value)
    rng = random.Random(args.seed)
    started = time.perf_counter()
    results = []
    with tempfile.TemporaryDirectory(prefix="kill-campaign-") as tmp:
        work = Path(tmp)
        agent_dir = write_tiny_llama(work / "tiny_agent")
        for index in range(args.runs):
            result = one_run(index, rng, work, agent_dir, args.mirror.resolve(), args.jitter)
            results.append(result)
            print(json.dumps({k: result[k] for k in ("run", "stage", "point", "delay_s", "killed", "survived")}),
                  flush=True)
    summary = {
        "what": "kill -9 at a random point of a random stage of `dvc repro` (micro project), then `dvc repro` again",
        "command": f"python benchmarks/bench_kill_campaign.py --runs {args.runs} --seed {args.seed} "
                   f"--jitter {args.jitter:g}",
        "runs": len(results),
        "kills": sum(r["killed"] for r in results),
        "survived": sum(r["survived"] for r in results),
        "kills_by_stage": {s: sum(r["killed"] for r in results if r["stage"] == s) for s in KILL_STAGES},
        "seconds": round(time.perf_counter() - started, 1),
        "runs_detail": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"{summary['survived']}/{summary['runs']} runs survived, {summary['kills']} kills; wrote {args.out}")
    if summary["survived"] != summary["runs"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
