"""Benchmark the local GRPO backend on CPU with the default profile (params.yaml as is).

Measures:
1. the machine's fp32 matmul rate: best `torch.mm` FLOP/s over square sizes and the model's own shapes
   (tokens × hidden @ hidden × intermediate), with torch's default threads;
2. the default profile's training (`run_train`, params.yaml's train/agent/environment sections unchanged,
   the real SmolLM2-135M-Instruct agent against the real llama.cpp environment): per step the time split
   into generation / environment / update, mean/min/max reward (does it rise?), peak RSS of this process
   (the trainer) and of the llama.cpp server (a child, via RUSAGE_CHILDREN after it stops);
   The format warm-up (train.warmup, before GRPO step 1) is reported apart: demonstration build time
   (environment calls), supervised step time, loss curve (`warmup` in the JSON); `grpo_steps_s` sums
   the GRPO steps alone, `train_wall_s` is the whole stage (model load, warm-up, GRPO, saves);
3. the GRPO update's model-FLOPs utilisation: 6 · params · tokens / policy update time ÷ measured matmul
   rate (tokens = non-padding tokens through forward+backward), and the stricter whole-update figure that
   also charges the reference forward (2 · params · tokens) against all of `timing_s/update`;
4. agreement of the local loss (micro-batched, as the trainer computes it) with verl's functions applied
   directly to the whole batch, and with an independent re-implementation of method.md's formula, on
   random inputs: max absolute difference of the loss and of its gradient.

Only the outputs are redirected (checkpoints, reports, MLflow store go to a scratch folder, removed at
the end unless --keep) and the environment port is a free one, so the benchmark does not disturb the
project's outputs or another server on the default port.

Run:
    flock /tmp/promptr1-heavy.lock python benchmarks/bench_train.py [--steps N] [--set train.steps=2 ...]
Writes benchmarks/results/train.json and benchmarks/results/train_steps.csv.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import resource
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"

for _k, _v in {"MLFLOW_DISABLE_TELEMETRY": "true", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
               "RAY_USAGE_STATS_ENABLED": "0"}.items():
    os.environ.setdefault(_k, _v)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def matmul_flops(shapes: list[tuple[int, int, int]], seconds: float = 2.0) -> dict[str, float]:
    """Best fp32 torch.mm FLOP/s for each (m, k, n)."""
    import torch

    out = {}
    for m, k, n in shapes:
        a, b = torch.randn(m, k), torch.randn(k, n)
        for _ in range(2):
            torch.mm(a, b)
        best, t_end = 0.0, time.perf_counter() + seconds
        while time.perf_counter() < t_end:
            t0 = time.perf_counter()
            torch.mm(a, b)
            best = max(best, 2 * m * k * n / (time.perf_counter() - t0))
        out[f"{m}x{k}x{n}"] = best
    return out


def loss_agreement(trials: int = 50) -> dict[str, float]:
    import numpy as np
    import torch
    from verl.trainer.ppo.core_algos import agg_loss, compute_policy_loss_vanilla, kl_penalty

    from pipeline.train.local.grpo import GRPOObjective, PolicyLossConfig, grpo_advantages, grpo_loss

    max_loss, max_grad, max_formula = 0.0, 0.0, 0.0
    rng = np.random.default_rng(0)
    for trial in range(trials):
        g = torch.Generator().manual_seed(trial)
        b, r = int(rng.integers(2, 9)) * 2, int(rng.integers(4, 64))
        lp = -torch.rand(b, r, generator=g) * 4
        old = lp + 0.2 * torch.randn(b, r, generator=g)
        ref = lp + 0.2 * torch.randn(b, r, generator=g)
        mask = (torch.rand(b, r, generator=g) > 0.4).float()
        mask[:, 0] = 1
        groups = [f"g{i // 2}" for i in range(b)]
        adv = grpo_advantages(torch.randn(b, generator=g), mask, groups)
        obj = GRPOObjective(clip_ratio_low=0.2, clip_ratio_high=0.28, kl_loss_coef=0.01)
        # verl, whole batch
        x = lp.clone().requires_grad_(True)
        cfg = PolicyLossConfig(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28)
        pg, _ = compute_policy_loss_vanilla(old, x, adv, mask, "token-mean", cfg)
        verl_loss = pg + 0.01 * agg_loss(kl_penalty(x, ref, "low_var_kl"), mask, "token-mean")
        verl_loss.backward()
        # ours, micro-batched with mini-batch normalisation, as LocalTrainer does
        y = lp.clone().requires_grad_(True)
        total = torch.zeros(())
        perm = torch.randperm(b, generator=g)
        for chunk in perm.split(3):
            idx = chunk.tolist()
            part, _ = grpo_loss(y[idx], old[idx], adv[idx], mask[idx], obj, ref_log_prob=ref[idx],
                                batch_num_tokens=int(mask.sum()), global_batch_size=b)
            part.backward()
            total = total + part.detach()
        max_loss = max(max_loss, float((total - verl_loss.detach()).abs()))
        max_grad = max(max_grad, float((x.grad - y.grad).abs().max()))
        # method.md written out independently
        ratio = torch.exp(lp - old)
        pgm = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.28))
        pgm = torch.where(adv < 0, torch.minimum(pgm, -adv * 3.0), pgm)
        d = ref - lp
        kl = (torch.exp(d) - d - 1).clamp(-10, 10)
        formula = ((pgm * mask).sum() + 0.01 * (kl * mask).sum()) / mask.sum()
        max_formula = max(max_formula, float((formula - total).abs()))
    return {"trials": trials, "max_abs_diff_loss_vs_verl": max_loss, "max_abs_diff_grad_vs_verl": max_grad,
            "max_abs_diff_loss_vs_formula": max_formula}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--set", dest="sets", action="append", default=[], help="extra override key=value")
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder (checkpoints, reports)")
    parser.add_argument("--tag", default="", help="suffix for the result files")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "urllib3", "filelock", "alembic", "openai._base_client"):
        logging.getLogger(noisy).setLevel(logging.WARNING)

    import pandas as pd
    import torch

    from pipeline.config import deep_merge, load_params, parse_override
    from pipeline.hardware import cpu_capability, native_bf16, resolve_autocast
    from pipeline.stages.train import run_train

    scratch = Path(tempfile.mkdtemp(prefix="bench_train_"))
    overrides = {
        "paths": {"checkpoint_dir": str(scratch / "checkpoints/agent"), "reports_dir": str(scratch / "reports"),
                  "cache_dir": str(scratch / ".cache")},
        "environment": {"port": free_port()},
        "mlflow": {"tracking_uri": f"sqlite:///{scratch / 'mlflow.db'}", "artifact_root": str(scratch / "mla")},
    }
    for item in args.sets:
        overrides = deep_merge(overrides, parse_override(item))
    params = load_params(ROOT / "params.yaml", overrides)

    print("measuring fp32 matmul rate ...", flush=True)
    mm = matmul_flops([(1024, 1024, 1024), (2048, 2048, 2048), (2048, 576, 1536), (2048, 1536, 576)])
    peak = max(mm.values())
    print("loss agreement with verl ...", flush=True)
    agreement = loss_agreement()

    print(f"training: {params.train.steps} steps of the default profile ...", flush=True)
    t0 = time.perf_counter()
    run_train(params)
    wall = time.perf_counter() - t0
    trainer_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2  # KiB -> GiB
    server_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024**2

    steps = pd.read_csv(scratch / "reports/train/steps.csv")
    RESULTS.mkdir(parents=True, exist_ok=True)
    steps.to_csv(RESULTS / f"train_steps{args.tag}.csv", index=False)
    n_params = float(steps["perf/num_params"].iloc[0])
    per_step = []
    for row in steps.to_dict("records"):
        tokens, policy_s = row["perf/update_tokens"], row["perf/update_policy_s"]
        mfu_policy = 6 * n_params * tokens / policy_s / peak if policy_s else 0.0
        mfu_update = 8 * n_params * tokens / row["timing_s/update"] / peak if row["timing_s/update"] else 0.0
        per_step.append({
            "step": int(row["step"]),
            "reward_mean": row["critic/score/mean"], "reward_min": row["critic/score/min"],
            "reward_max": row["critic/score/max"], "format_mean": row["reward/format/mean"],
            "answer_mean": row["reward/answer/mean"], "pg_loss": row["actor/pg_loss"],
            "kl_loss": row["actor/kl_loss"], "grad_norm": row["actor/grad_norm"],
            "gen_s": row["timing_s/gen"], "env_s": row["timing_s/env"], "update_s": row["timing_s/update"],
            "ref_s": row["timing_s/ref"], "step_s": row["timing_s/step"], "save_s": row.get("timing_s/save", 0.0),
            "env_calls": row["env/calls"], "env_errors": row["env/errors"], "num_turns": row["num_turns/mean"],
            "response_length": row["response_length/mean"], "update_tokens": tokens,
            "mfu_policy_fwd_bwd": mfu_policy, "mfu_whole_update": mfu_update,
            "rollout_logprob_diff_max": row.get("training/rollout_logprob_diff_max"),
            "gated_frac": row.get("reward/gated/mean"), "complete_final": row.get("reward/complete_final/mean"),
            "valid_intermediate_turns": row.get("reward/valid_intermediate_turns/mean"),
            "adv_max": row["critic/advantages/max"], "adv_min": row["critic/advantages/min"],
        })
    rewards = [s["reward_mean"] for s in per_step]
    warm_csv = scratch / "reports/train/warmup.csv"
    warmup: dict = {"enabled": params.train.warmup.steps > 0}
    if warm_csv.is_file():
        w = pd.read_csv(warm_csv)
        build_s = float(w["warmup/build_s"].iloc[0]) if "warmup/build_s" in w else 0.0
        warmup.update({
            "steps": len(w), "loss_curve": w["warmup/loss"].round(4).tolist(), "build_s": build_s,
            "steps_s": float(w["warmup/step_s"].sum()), "total_s": build_s + float(w["warmup/step_s"].sum()),
            "env_calls": float(w["warmup/env_calls"].iloc[0]) if "warmup/env_calls" in w else 0.0,
        })
    result = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "torch": torch.__version__, "cpu_capability": cpu_capability(),
                    "native_bf16": native_bf16("cpu")},
        "autocast_used": resolve_autocast(params.train.autocast, "cpu", "train.autocast") or "float32",
        "rollout_engine": params.train.rollout_engine,
        "params": {"train": params.train.model_dump(mode="json", exclude={"verl"}),
                   "agent": params.agent.model_dump(mode="json"),
                   "environment": {"backend": params.environment.backend, "model": params.environment.model,
                                   "max_tokens": params.environment.max_tokens}},
        "matmul_flops": mm, "matmul_peak_flops": peak,
        "train_wall_s": wall, "warmup": warmup,
        "grpo_steps_s": float(steps["timing_s/step"].sum()), "peak_rss_trainer_gib": trainer_rss, "peak_rss_env_server_gib": server_rss,
        "num_params": n_params, "steps": per_step,
        "reward_curve": rewards,
        "reward_rises": bool(len(rewards) > 1 and rewards[-1] > rewards[0]),
        "mean_step_s": float(steps["timing_s/step"].mean()),
        "mfu_policy_fwd_bwd_mean": float(sum(s["mfu_policy_fwd_bwd"] for s in per_step) / len(per_step)),
        "mfu_whole_update_mean": float(sum(s["mfu_whole_update"] for s in per_step) / len(per_step)),
        "loss_agreement": agreement,
    }
    out = RESULTS / f"train{args.tag}.json"
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k not in ("steps", "params")}, indent=2))
    if warmup.get("steps"):
        print(f"warm-up: {warmup['steps']} steps, build {warmup['build_s']:.1f}s, steps {warmup['steps_s']:.1f}s, "
              f"loss {warmup['loss_curve'][0]} -> {warmup['loss_curve'][-1]}")
    for s in per_step:
        print(f"step {s['step']}: reward {s['reward_mean']:.3f} [{s['reward_min']:.2f}, {s['reward_max']:.2f}] "
              f"gen {s['gen_s']:.1f}s env {s['env_s']:.1f}s update {s['update_s']:.1f}s "
              f"step {s['step_s']:.1f}s  MFU {s['mfu_policy_fwd_bwd']:.0%}")
    if args.keep:
        print(f"scratch kept at {scratch}")
    else:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
