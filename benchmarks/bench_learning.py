"""The learning experiment (issue 12): does our GRPO teach the agent to use an environment that knows the answers?

    python benchmarks/bench_learning.py                     # profiles/learn.yaml, the knowledgeable environment
    python benchmarks/bench_learning.py --env llamacpp      # the same steps against llama.cpp (untimed)

What it runs, all through the pipeline's own code (the steps `dvc exp run -S profile=learn` runs):
1. the data stages (sample → validate → build) for the learn profile, into a work folder under `.cache/`;
2. the learn profile's format warm-up (`train_local` with `max_steps=0`), then GRPO in chunks of
   `--eval-every` steps (`train_local` resumes from its own checkpoint each time, as a restarted stage would);
3. after the warm-up and after every chunk, the checkpoint's agent answers the fixed held-out set (the
   authors' evaluation rows of the learn profile's ID datasets, never trained on) greedily with the
   environment (`pipeline.evaluation.systems.run_agent_with_environment`, what the evaluate stage runs); F1 and EM
   per question (`pipeline.metrics`), and the format rate (the `released` reward's gate).

Reported (`benchmarks/results/learning.json`, or `learning_llamacpp.json`): held-out F1/EM of the warm-up-only
agent vs the GRPO-trained agent, each with a bootstrap 95% CI and their difference with a *paired* bootstrap
95% CI (same questions, resampled jointly within each dataset); per GRPO step the mean reward with a 95%
t-interval over the step's trajectories, the reward parts, environment calls and the format rate; timings.
The per-step curve is also `learning_steps.csv` (a DVC plot) and `learning.png`, and everything goes to one
MLflow run (experiment of the profile): the training metrics per step plus `heldout/f1`, `heldout/em` and
`heldout/format_rate` at the evaluated steps.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "benchmarks" / "results"
TARGET_GAIN_POINTS = 10.0
NOTES = [
    ("First measurement (12 warm-up steps on demonstrations carrying the knowledgeable environment's live "
    "replies, 24 held-out questions): the warm-up-only agent already scored F1 98.6 / EM 95.8 with format "
    "rate 1.0 - the demonstrations ask the question and answer with the gold answer, which the live reply "
    "contains, so the supervised warm-up itself taught the skill whose learning by GRPO is measured here. "
    "Fix: the learn profile builds its demonstrations with withheld replies (train.warmup.replies: "
    "withheld): the warm-up teaches the protocol only; using the reply is left to GRPO."),
    ("GRPO learning rate 5e-5 (default 1e-5): 40 optimizer steps of 8 trajectories; Adam moves each weight "
    "by at most about lr per step, and the warm-up that changed the agent's behaviour moved them by 12 x 2e-4."),
]
log = logging.getLogger("bench_learning")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def learn_params(workdir: Path, env: str, steps: int | None, port: int):
    """The learn profile with every output under `workdir`; `env` llamacpp swaps in params.yaml's environment."""
    from pipeline.config import load_params

    paths = {name: str(workdir / sub) for name, sub in (
        ("sampled_dir", "data/sampled"), ("rl_dir", "data/rl"), ("reports_dir", "reports"),
        ("checkpoint_dir", "checkpoints/agent"), ("model_dir", "models/agent"), ("cache_dir", "cache"))}
    overrides: dict[str, Any] = {"profile": "learn", "paths": paths, "environment": {"port": port}}
    if steps is not None:
        overrides["train"] = {"steps": steps}
    params = load_params(ROOT / "params.yaml", overrides)
    params.environment.knowledge.sources = [str(workdir / "data/rl/train.parquet"), str(workdir / "data/rl/eval")]
    if env == "llamacpp":
        default = load_params(ROOT / "params.yaml").environment
        params.environment = default.model_copy(update={"port": port})
        params.mlflow.experiment = "prompt-r1-learn-llamacpp"
    return params


def build_data(params) -> None:
    from pipeline.data.build import run_build
    from pipeline.data.sample import run_sample
    from pipeline.data.validate import run_validate

    for dataset in params.data.train_datasets:
        run_sample(params, dataset)
    run_validate(params)
    run_build(params)


def heldout_rows(params):
    from pipeline.evaluate import load_eval_rows
    from pipeline.evaluation.plan import EvaluatePlan

    held = params.model_copy(deep=True)
    held.root = params.root
    held.data.ood_eval_datasets = []
    return load_eval_rows(EvaluatePlan.for_evaluate(held))


def evaluate_agent(model_dir: Path, tokenizer, env, rows_by_ds, params, label: str) -> dict[str, Any]:
    """Greedy held-out answers of the model in `model_dir`: per-dataset F1/EM/format lists and the means."""
    import torch
    from transformers import AutoModelForCausalLM

    from pipeline.agent.policy import TransformersPolicy
    from pipeline.agent.protocol import parse_turn
    from pipeline.evaluation.systems import run_agent_with_environment
    from pipeline.metrics import exact_match, token_f1
    from pipeline.reward import compute_reward

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    policy = TransformersPolicy(model, tokenizer, seed=params.seed)
    start = time.perf_counter()
    answers = run_agent_with_environment(policy, env, rows_by_ds, params.agent, params.evaluate, label)
    seconds = time.perf_counter() - start
    out: dict[str, Any] = {"f1": {}, "em": {}, "format": {}, "env_calls": 0, "seconds": seconds,
                           "examples": []}
    for name, rows in rows_by_ds.items():
        f1s, ems, fmts = [], [], []
        for row, answer in zip(rows, answers[name], strict=True):
            f1s.append(token_f1(answer.prediction, row.answers))
            ems.append(exact_match(answer.prediction, row.answers))
            turns = [parse_turn(t["text"]) for t in answer.trajectory]
            fmts.append(float(compute_reward(turns, row.answers, params.reward).gated))
            out["env_calls"] += answer.usage.calls
            if len(out["examples"]) < 3:
                out["examples"].append({"question": row.question, "golds": row.answers,
                                        "turns": [t["text"] for t in answer.trajectory],
                                        "replies": [t["environment"]["text"] for t in answer.trajectory
                                                    if t.get("environment")],
                                        "prediction": answer.prediction})
        out["f1"][name], out["em"][name], out["format"][name] = f1s, ems, fmts
    for key in ("f1", "em", "format"):
        values = [v for vs in out[key].values() for v in vs]
        out[f"{key}_mean"] = sum(values) / len(values)
    return out


def step_rows(steps_csv: Path) -> list[dict[str, Any]]:
    """Per-step curve from the training's steps.csv: mean reward with a 95% t-interval, parts, calls."""
    import pandas as pd
    from scipy import stats

    frame = pd.read_csv(steps_csv)
    rows = []
    for rec in frame.to_dict("records"):
        n = int(rec.get("critic/score/count", 0) or 0)
        mean, std = float(rec["critic/score/mean"]), float(rec.get("critic/score/std", float("nan")))
        half = float(stats.t.ppf(0.975, n - 1) * std / math.sqrt(n)) if n > 1 and math.isfinite(std) else float("nan")
        rows.append({
            "step": int(rec["step"]),
            "reward_mean": mean,
            "reward_ci95": [mean - half, mean + half],
            "reward_parts": {k.split("/")[1]: float(rec[k]) for k in rec if k.startswith("reward/")},
            "format_rate": float(rec["reward/gated/mean"]),
            "env_calls": float(rec["env/calls"]),
            "trajectories": n,
            "step_s": float(rec["timing_s/step"]),
        })
    return rows


def gain(after: dict[str, list[float]], before: dict[str, list[float]], params) -> dict[str, Any]:
    """Means, bootstrap CIs and the paired bootstrap CI of the difference, in points."""
    from pipeline.metrics import bootstrap_ci_average, paired_bootstrap_delta

    names = list(before)
    samples, conf = params.evaluate.bootstrap_samples, params.evaluate.confidence
    b = bootstrap_ci_average([before[n] for n in names], samples, conf, seed=params.seed)
    a = bootstrap_ci_average([after[n] for n in names], samples, conf, seed=params.seed)
    d = paired_bootstrap_delta([after[n] for n in names], [before[n] for n in names], samples, conf,
                               seed=params.seed)
    pts = [round(100 * x, 2) for x in (*b, *a, *d)]
    return {"before": pts[0], "before_ci": pts[1:3], "after": pts[3], "after_ci": pts[4:6],
            "gain": pts[6], "gain_ci": pts[7:9]}


def write_outputs(result: dict[str, Any], stem: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    held = {p["step"]: p for p in result["heldout_curve"]}
    columns = ["step", "reward_mean", "reward_low", "reward_high", "format_rate", "env_calls", "answer_f1",
               "heldout_f1"]
    csv = pd.DataFrame(columns=columns, data=[{
        "step": s["step"], "reward_mean": s["reward_mean"], "reward_low": s["reward_ci95"][0],
        "reward_high": s["reward_ci95"][1], "format_rate": s["format_rate"], "env_calls": s["env_calls"],
        "answer_f1": s["reward_parts"].get("answer", float("nan")),
        "heldout_f1": held[s["step"]]["f1"] if s["step"] in held else float("nan"),
    } for s in result["steps"]] or None)
    csv.to_csv(RESULTS / f"{stem}_steps.csv", index=False)

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    top.plot(csv["step"], csv["reward_mean"], marker=".", label="mean reward")
    top.fill_between(csv["step"], csv["reward_low"], csv["reward_high"], alpha=0.25, label="95% CI")
    top.plot(csv["step"], csv["format_rate"], linestyle="--", label="format rate (gated)")
    top.set_ylabel("training reward (released)")
    top.legend(loc="lower right")
    steps = [p["step"] for p in result["heldout_curve"]]
    bottom.plot(steps, [p["f1"] for p in result["heldout_curve"]], marker="o", label="held-out F1")
    bottom.plot(steps, [p["em"] for p in result["heldout_curve"]], marker="s", label="held-out EM")
    bottom.set_xlabel("GRPO step (0 = warm-up only)")
    bottom.set_ylabel("points")
    bottom.legend(loc="lower right")
    gain_text = ("no held-out evaluation after GRPO" if result["heldout_f1_gain"] is None else
                 f"held-out F1 gain {result['heldout_f1_gain']:+.1f} [{result['heldout_f1_gain_ci'][0]:+.1f}, "
                 f"{result['heldout_f1_gain_ci'][1]:+.1f}] after {result['grpo_steps_evaluated']} steps")
    fig.suptitle(f"GRPO learning, {result['environment']} environment: {gain_text}")
    fig.tight_layout()
    fig.savefig(RESULTS / f"{stem}.png", dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import asyncio

    import mlflow

    from pipeline import tracking
    from pipeline.environment.client import EnvironmentClient
    from pipeline.environment.servers import environment_server
    from pipeline.train import checkpoint as ckpt
    from pipeline.train.local import WARMUP_DIR, train_local
    from pipeline.train.models import load_tokenizer
    from pipeline.train.step_metrics import steps_csv_path

    t_all = time.perf_counter()
    workdir = ROOT / ".cache" / f"bench_learning_{args.env}"
    if workdir.exists() and not args.keep:
        shutil.rmtree(workdir)
    params = learn_params(workdir, args.env, args.steps, free_port())
    t0 = time.perf_counter()
    build_data(params)
    data_s = time.perf_counter() - t0
    rows_by_ds = heldout_rows(params)
    tokenizer = load_tokenizer(params.agent.model, params.root)
    ckpt_root = params.path(params.paths.checkpoint_dir)
    eval_params = params.model_copy(deep=True)
    eval_params.root = params.root
    eval_params.environment.temperature = params.evaluate.env_temperature
    curve: list[dict[str, Any]] = []
    evals: dict[int, dict[str, Any]] = {}
    timings = {"data_s": data_s, "warmup_s": 0.0, "grpo_s": 0.0, "eval_s": 0.0}

    with environment_server(params), tracking.stage_run(params, "learning", new_parent=True):
        mlflow.set_tags({"benchmark": "bench_learning", "environment": args.env})
        env = EnvironmentClient(eval_params.environment)

        def evaluate_at(step: int, model_dir: Path) -> None:
            saved = workdir / f"heldout_step{step}.json"
            if args.keep and saved.is_file():  # a resumed run: this checkpoint was evaluated already
                result = json.loads(saved.read_text(encoding="utf-8"))
            else:
                t = time.perf_counter()
                result = evaluate_agent(model_dir, tokenizer, env, rows_by_ds, eval_params, f"step {step}")
                timings["eval_s"] += time.perf_counter() - t
                saved.write_text(json.dumps(result), encoding="utf-8")
            evals[step] = result
            point = {"step": step, "f1": 100 * result["f1_mean"], "em": 100 * result["em_mean"],
                     "format_rate": result["format_mean"], "env_calls": result["env_calls"]}
            curve.append(point)
            mlflow.log_metrics({"heldout/f1": point["f1"], "heldout/em": point["em"],
                                "heldout/format_rate": point["format_rate"]}, step=step)
            log.info("held-out at step %d: F1 %.1f EM %.1f format %.2f", step, point["f1"], point["em"],
                     point["format_rate"])

        try:
            t = time.perf_counter()
            train_local(params, max_steps=0)  # the format warm-up only (skipped when resuming)
            timings["warmup_s"] = time.perf_counter() - t
            evaluate_at(0, ckpt_root / WARMUP_DIR / "model")
            done = ckpt.TrainerState.read(ckpt.latest_checkpoint(ckpt_root)).step
            for saved in sorted(workdir.glob("heldout_step*.json"), key=lambda f: int(f.stem[12:])):
                if 0 < int(saved.stem[12:]) <= done:
                    evaluate_at(int(saved.stem[12:]), ckpt_root)  # reloads what a resumed run measured
            while done < params.train.steps:
                chunk = min(args.eval_every, params.train.steps - done)
                t = time.perf_counter()
                train_local(params, max_steps=chunk)
                timings["grpo_s"] += time.perf_counter() - t
                done += chunk
                folder = ckpt.latest_checkpoint(ckpt_root)
                evaluate_at(done, folder / "model")
            if done not in evals:  # resumed with --steps at or below the checkpoint's step
                evaluate_at(done, ckpt.latest_checkpoint(ckpt_root) / "model")
        finally:
            asyncio.run(env.aclose())

        result = summarise(params, args, evals, curve, steps_csv_path(params), rows_by_ds, timings,
                           time.perf_counter() - t_all)
        if result["heldout_f1_gain_ci"] is not None:
            mlflow.log_metrics({"heldout/f1_gain": result["heldout_f1_gain"],
                                "heldout/f1_gain_low": result["heldout_f1_gain_ci"][0],
                                "heldout/f1_gain_high": result["heldout_f1_gain_ci"][1]})
    return result


def summarise(params, args, evals: dict[int, dict[str, Any]], curve: list[dict[str, Any]], steps_csv: Path,
              rows_by_ds, timings: dict[str, float], total_s: float) -> dict[str, Any]:
    """learning.json's content. The GRPO side is the last evaluated step; with no evaluation after the
    warm-up (an interrupted run) the GRPO figures are null and `complete` is false."""
    from pipeline.config import load_params

    profile_steps = load_params(ROOT / "params.yaml", {"profile": "learn"}).train.steps
    steps = step_rows(steps_csv) if steps_csv.is_file() else []
    last = max(evals)
    f1 = gain(evals[last]["f1"], evals[0]["f1"], params) if last > 0 else None
    em = gain(evals[last]["em"], evals[0]["em"], params) if last > 0 else None
    warm = gain(evals[0]["f1"], evals[0]["f1"], params)
    warm_em = gain(evals[0]["em"], evals[0]["em"], params)
    return {
        "what": "learning experiment (issue 12): warm-up-only vs GRPO-trained agent on a fixed held-out set",
        "command": "python benchmarks/bench_learning.py" + (" --env llamacpp" if args.env != "knowledge" else ""),
        "environment": args.env,
        "complete": last >= profile_steps,
        "profile_steps": profile_steps,
        "grpo_steps_evaluated": last,
        "heldout_f1_warmup": warm["before"], "heldout_f1_grpo": f1["after"] if f1 else None,
        "heldout_f1_gain": f1["gain"] if f1 else None, "heldout_f1_gain_ci": f1["gain_ci"] if f1 else None,
        "heldout_f1_warmup_ci": warm["before_ci"], "heldout_f1_grpo_ci": f1["after_ci"] if f1 else None,
        "heldout_em_warmup": warm_em["before"], "heldout_em_grpo": em["after"] if em else None,
        "heldout_em_gain": em["gain"] if em else None, "heldout_em_gain_ci": em["gain_ci"] if em else None,
        "heldout_format_rate_warmup": evals[0]["format_mean"], "heldout_format_rate_grpo": evals[last]["format_mean"],
        "target": f"gain >= {TARGET_GAIN_POINTS} F1 points with the paired 95% CI's lower bound > 0",
        "target_met": bool(f1 and f1["gain"] >= TARGET_GAIN_POINTS and f1["gain_ci"][0] > 0),
        "heldout": {"datasets": list(rows_by_ds), "questions": sum(len(r) for r in rows_by_ds.values()),
                    "source": "the authors' evaluation rows (data/rl/eval), first evaluate.rows_per_dataset"},
        "notes": [*NOTES, *(getattr(args, "note", None) or [])],
        "heldout_curve": sorted(curve, key=lambda p: p["step"]),
        "steps": steps,
        "examples": {"warmup": evals[0]["examples"], "grpo": evals[last]["examples"] if last > 0 else []},
        "timing_s": {**{k: round(v, 1) for k, v in timings.items()},
                     "mean_grpo_step_s": round(sum(s["step_s"] for s in steps) / max(1, len(steps)), 1),
                     "total_s": round(total_s, 1)},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "params": {"agent": params.agent.model_dump(mode="json"), "reward": params.reward.model_dump(),
                   "train": params.train.model_dump(mode="json", exclude={"verl"}),
                   "environment": {"backend": params.environment.backend,
                                   "knowledge": {**params.environment.knowledge.model_dump(), "sources": [
                                       _project_relative(x) for x in params.environment.knowledge.sources]}},
                   "evaluate.rows_per_dataset": params.evaluate.rows_per_dataset},
    }


def _project_relative(path: str) -> str:
    """`path` relative to the project when it lies inside it (no machine paths in the recorded results)."""
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return path


def report_only(args: argparse.Namespace) -> dict[str, Any]:
    """learning.json from what the work folder holds (held-out results, steps.csv), without running anything."""
    workdir = ROOT / ".cache" / f"bench_learning_{args.env}"
    params = learn_params(workdir, args.env, args.steps, free_port())
    evals = {int(f.stem[12:]): json.loads(f.read_text(encoding="utf-8")) for f in workdir.glob("heldout_step*.json")}
    curve = [{"step": k, "f1": 100 * v["f1_mean"], "em": 100 * v["em_mean"], "format_rate": v["format_mean"],
              "env_calls": v["env_calls"]} for k, v in evals.items()]
    rows_by_ds = heldout_rows(params)
    steps_csv = workdir / "reports" / "train" / "steps.csv"
    return summarise(params, args, evals, curve, steps_csv, rows_by_ds, {}, 0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env", choices=["knowledge", "llamacpp"], default="knowledge")
    parser.add_argument("--steps", type=int, default=None, help="GRPO steps (default: the learn profile's)")
    parser.add_argument("--eval-every", type=int, default=20, help="held-out evaluation every N GRPO steps")
    parser.add_argument("--keep", action="store_true",
                        help="resume in the existing work folder (checkpoints and held-out results are reused)")
    parser.add_argument("--report-only", action="store_true",
                        help="write the results from the work folder as it is (e.g. after an interrupted run)")
    parser.add_argument("--note", action="append", help="a line added to the results' notes (repeatable)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    result = report_only(args) if args.report_only else run(args)
    write_outputs(result, "learning" if args.env == "knowledge" else f"learning_{args.env}")
    log.info("held-out F1: warm-up %s → GRPO %s after %d steps, gain %s %s (target met: %s)",
             result["heldout_f1_warmup"], result["heldout_f1_grpo"], result["grpo_steps_evaluated"],
             result["heldout_f1_gain"], result["heldout_f1_gain_ci"], result["target_met"])


if __name__ == "__main__":
    main()
