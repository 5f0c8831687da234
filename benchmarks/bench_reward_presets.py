"""Score trajectories under both reward presets and report how many get the full format reward under each.

"Full format reward" means R_fmt reached the cap eps (the gate is open, so the answer's F1 counts): 1.5
for `paper` (method.md), 1.0 for `released` (the authors' code). The two presets parse turns differently
(table in `pipeline/reward.py`), so on the same trajectories their shares differ; this measures by how much.

Input, one of:
- `--input FILE.jsonl`: one trajectory per line, with the agent turns' texts (each as the rollout records
  it, starting with the `<think>\\n` opener) under `turns` (strings, or objects with a `text` key, as
  `pipeline.stages.evaluate` writes them), `prompt_r1_turns` (verl's extra field) or `trajectory` (a JSON string
  of such objects); gold answers under `gold_answers` / `golds` (a list or a JSON string) or
  `reward_model.ground_truth`.
- nothing: `--demos N` warm-up demonstrations (`pipeline.train.local.demonstrations.demo_texts`, seeded), of which a
  share `--defect-rate` get one seeded format defect in one turn (a leading space, trailing text, an empty
  answer or interaction prompt, a repeated `<think>`, text before `<answer>`), the kinds where the presets
  disagree.

Run: `python benchmarks/bench_reward_presets.py [--input FILE.jsonl | --demos 200 --defect-rate 0.5]
[--out reports/reward_presets.json]`. Prints the summary as JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.agent.protocol import THINK_OPENER, parse_turn
from pipeline.config import RewardConfig
from pipeline.reward import REWARD_PRESETS, compute_reward

QUESTIONS = [
    ("What is the capital of France?", "Paris"),
    ("Who wrote Hamlet?", "William Shakespeare"),
    ("Which planet is known as the Red Planet?", "Mars"),
    ("In which year did the Berlin Wall fall?", "1989"),
    ("What is the largest ocean on Earth?", "Pacific Ocean"),
]

DEFECTS = {
    "leading space": lambda t: " " + t,
    "trailing text": lambda t: t + " Done.",
    "empty answer": lambda t: re.sub(r"<answer>.*?</answer>", "<answer></answer>", t, flags=re.DOTALL),
    "empty prompt": lambda t: re.sub(r"<interaction_prompt>.*?</interaction_prompt>",
                                     "<interaction_prompt></interaction_prompt>", t, flags=re.DOTALL),
    "repeated think": lambda t: t.replace("</think>", "</think><think>Again.</think>", 1),
    "text before answer": lambda t: t.replace("<answer>", "The answer is <answer>", 1),
}


def texts_of(record: dict[str, Any]) -> list[str]:
    """The agent turns' texts of one JSONL record (see the module docstring)."""
    turns = record.get("turns", record.get("prompt_r1_turns"))
    if turns is None and "trajectory" in record:
        turns = record["trajectory"]
        turns = json.loads(turns) if isinstance(turns, str) else turns
    return [t["text"] if isinstance(t, dict) else str(t) for t in turns or []]


def golds_of(record: dict[str, Any]) -> list[str]:
    golds = record.get("gold_answers", record.get("golds"))
    if golds is None:
        golds = (record.get("reward_model") or {}).get("ground_truth")
    if isinstance(golds, str):
        try:
            golds = json.loads(golds)
        except json.JSONDecodeError:
            pass
    if isinstance(golds, str):
        return [golds]
    return [str(g) for g in golds or []]


def from_jsonl(path: Path) -> list[tuple[list[str], list[str]]]:
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [(texts_of(r), golds_of(r)) for r in rows]


def from_demos(count: int, defect_rate: float, seed: int, interaction_turns: int) -> list[tuple[list[str], list[str]]]:
    from pipeline.train.local.demonstrations import demo_texts

    rng = random.Random(seed)
    out = []
    for i in range(count):
        question, answer = QUESTIONS[i % len(QUESTIONS)]
        demo = demo_texts(question, answer, interaction_turns, rng)
        texts = [THINK_OPENER + t for t in [*demo.interaction_turns, demo.final_turn]]
        if rng.random() < defect_rate:
            j = rng.randrange(len(texts))
            texts[j] = DEFECTS[rng.choice(sorted(DEFECTS))](texts[j])
        out.append((texts, [answer]))
    return out


def summarize(trajectories: list[tuple[list[str], list[str]]]) -> dict[str, Any]:
    presets = sorted(REWARD_PRESETS)
    full = {p: 0 for p in presets}
    score = {p: 0.0 for p in presets}
    disagree = 0
    for texts, golds in trajectories:
        turns = [parse_turn(t) for t in texts]
        gated = set()
        for p in presets:
            r = compute_reward(turns, golds, RewardConfig(preset=p))
            score[p] += r.total
            if r.gated:
                full[p] += 1
                gated.add(p)
        disagree += 0 < len(gated) < len(presets)
    n = max(1, len(trajectories))
    return {
        "trajectories": len(trajectories),
        "full_format_share": {p: full[p] / n for p in presets},
        "mean_reward": {p: score[p] / n for p in presets},
        "presets_disagree_share": disagree / n,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--input", type=Path, help="JSONL of trajectories (default: warm-up demonstrations)")
    ap.add_argument("--demos", type=int, default=200)
    ap.add_argument("--defect-rate", type=float, default=0.5)
    ap.add_argument("--interaction-turns", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.input:
        trajectories = from_jsonl(args.input)
        source = str(args.input)
    else:
        trajectories = from_demos(args.demos, args.defect_rate, args.seed, args.interaction_turns)
        source = f"warm-up demonstrations (seed {args.seed}, defect rate {args.defect_rate})"
    summary = {"source": source, **summarize(trajectories)}
    text = json.dumps(summary, indent=2)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n", encoding="utf-8")
    print(text)
    return summary


if __name__ == "__main__":
    main()
