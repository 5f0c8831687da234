"""Do the agent's final answers come from what the environment told it? Read from a finished run.

The format warm-up's demonstrations end with an answer (`train.warmup.answer`). With `gold`, a weak environment
(the default profile's SmolLM2-135M) rarely states the gold answer, so the demos teach the agent to write an
answer unrelated to the replies, and Prompt-R1 then scores below the environment alone. This reads a finished
project's `reports/train/trajectories.jsonl` (GRPO samples) and `reports/eval/predictions.parquet` and reports,
per system that talks to the environment:

- answered: trajectories with a non-empty final answer;
- grounded: answers whose normalised text appears in the environment's replies of that trajectory (on word
  boundaries), i.e. the agent passed on what it was told;
- F1 (evaluation, `ours` mode) and, for GRPO samples, the mean reward.

    python benchmarks/bench_warmup_answers.py PROJECT_DIR --label gold     # writes results/warmup_answers_gold.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd

from pipeline.train.local.demonstrations import stated_in

RESULTS = Path(__file__).resolve().parent / "results"


def _replies(turns: list[dict]) -> list[str]:
    return [str((t.get("environment") or {}).get("text") or "") for t in turns if t.get("environment")]


def _final_answer(turns: list[dict]) -> str | None:
    answers = [t.get("answer") for t in turns if t.get("answer") is not None]
    return answers[-1] if answers else None


def summarise(records: list[tuple[str | None, list[str]]]) -> dict[str, float]:
    n = len(records)
    answered = [a for a, _ in records if a and a.strip()]
    ground = sum(stated_in(a, r) for a, r in records if a and a.strip())
    return {"trajectories": n, "answered": len(answered), "grounded": ground,
            "grounded_share_of_answers": round(ground / len(answered), 3) if answered else 0.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("project", type=Path, help="a project where `dvc repro` (train and evaluate) has run")
    parser.add_argument("--label", required=True, help="suffix of the result file, e.g. gold or reply")
    args = parser.parse_args()
    project = args.project.resolve()
    result: dict[str, object] = {"command": f"python benchmarks/bench_warmup_answers.py PROJECT --label {args.label}"}

    steps = [json.loads(line) for line in (project / "reports/train/trajectories.jsonl").read_text().splitlines()
             if line.strip()]
    train = summarise([(_final_answer(r["turns"]), _replies(r["turns"])) for r in steps])
    train["mean_reward"] = round(sum(float(r["reward"]["total"]) for r in steps) / max(len(steps), 1), 4)
    result["grpo_samples"] = train

    warm = project / "reports/train/warmup.csv"
    if warm.is_file():
        frame = pd.read_csv(warm)
        result["warmup_loss_first_last"] = [round(float(frame["warmup/loss"].iloc[0]), 4),
                                            round(float(frame["warmup/loss"].iloc[-1]), 4)]

    preds = pd.read_parquet(project / "reports/eval/predictions.parquet")
    systems: dict[str, dict[str, float]] = {}
    for system, group in preds.groupby("system", sort=False):
        records = [(str(p), _replies(json.loads(t))) for p, t in zip(group["prediction"], group["trajectory"],
                                                                    strict=True)]
        entry = summarise(records) if system in ("prompt_r1", "base_agent") else {"trajectories": len(group)}
        entry["f1_mean"] = round(float(group["f1"].mean()), 2)
        entry["mean_turns"] = round(float(group["turns"].mean()), 2)
        entry["stop_reasons"] = {str(k): int(v) for k, v in group["stop_reason"].value_counts().items()}
        systems[str(system)] = entry
    result["evaluation"] = systems

    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"warmup_answers_{args.label}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
