"""Cost beside quality: what each system costs per question, and what it cost once to make.

Design decisions:
- **Inference cost is counted from the replies each answer used**, cached or not: a cache hit was paid
  for once and a fresh run pays it again, so the figure is the same on a rerun served from the cache
  (`env_usage` beside it says what this run actually sent). Per system: environment requests, prompt and
  completion tokens, and USD at the configured prices (`environment.price_per_million_*`), in total and
  per question. The agent's own compute at inference is not priced (it is the same small model for every
  agent system, and zero for the environment-only systems).
- **One-off costs** are read from the stages that paid them: `gepa` from `data/gepa/prompt.json` (metric
  calls, task and reflection tokens and USD, optimisation wall time) and `prompt_r1` from
  `reports/train/steps.csv` (the environment columns `env/*` summed over steps, and the agent's hours as
  the sum of `timing_s/step`). A system without one (`env_only`) has none; a missing file is said, not
  guessed.
- **One point per system and split** (`quality_cost_rows`): F1 against environment tokens per question,
  the quality-against-cost chart of DVC and summary.md.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from pipeline.errors import UserError
from pipeline.evaluation.systems import Answer
from pipeline.types import TRAINED

if TYPE_CHECKING:
    from pipeline.config import EnvironmentConfig

ENV_STEP_COLUMNS = ("env/calls", "env/cache_hits", "env/prompt_tokens", "env/completion_tokens", "env/cost_usd")


def read_gepa_prompt(path: Path) -> dict[str, Any]:
    """The gepa stage's output (see `pipeline.stages.gepa`) at `path` (`<paths.gepa_dir>/prompt.json`, pipeline.stage_files.GEPA_PROMPT_FILE)."""
    if not path.is_file():
        raise UserError(f"no optimised prompt at {path}: run `promptr1 gepa` (dvc repro gepa) or drop `gepa` "
                        "from evaluate.baselines")
    return json.loads(path.read_text(encoding="utf-8"))


def _usd(prompt_tokens: float, completion_tokens: float, env: EnvironmentConfig) -> float:
    return (prompt_tokens * env.price_per_million_prompt + completion_tokens * env.price_per_million_completion) / 1e6


def inference_costs(all_answers: dict[str, dict[str, list[Answer]]],
                    env: EnvironmentConfig) -> dict[str, dict[str, float]]:
    """Per system: questions, environment requests and tokens of every reply used, USD, per-question figures,
    at `env`'s prices."""
    out = {}
    for system, answers in all_answers.items():
        questions = requests = prompt_tokens = completion_tokens = 0
        for rows in answers.values():
            for answer in rows:
                questions += 1
                for step in answer.trajectory:
                    reply = step.get("environment")
                    if reply:
                        requests += 1
                        prompt_tokens += int(reply.get("prompt_tokens", 0))
                        completion_tokens += int(reply.get("completion_tokens", 0))
        usd = _usd(prompt_tokens, completion_tokens, env)
        out[system] = {
            "questions": questions, "env_requests": requests, "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens, "usd": round(usd, 6),
            "env_requests_per_question": round(requests / max(1, questions), 3),
            "env_tokens_per_question": round((prompt_tokens + completion_tokens) / max(1, questions), 1),
            "usd_per_question": round(usd / max(1, questions), 8),
        }
    return out


def gepa_one_off(content: dict[str, Any]) -> dict[str, Any]:
    """GEPA's optimisation cost from prompt.json's `cost` (task rollouts + reflection calls)."""
    cost = content["cost"]
    parts = (cost["task"], cost["reflection"])
    kept_seed = content.get("optimised", {}).get("candidate") == 0
    outcome = (f"none beat the seed on the val slice ({cost['accepted']} accepted into the search)" if kept_seed
               else f"{cost['accepted']} accepted")
    return {
        "what": f"GEPA: {cost['metric_calls']} metric calls, {cost['proposals']} proposals ({outcome})",
        "env_requests": sum(p["calls"] + p["cache_hits"] for p in parts),
        "prompt_tokens": sum(p["prompt_tokens"] for p in parts),
        "completion_tokens": sum(p["completion_tokens"] for p in parts),
        "usd": round(sum(p["cost_usd"] for p in parts), 6),
        "hours": round(cost["optimise_s"] / 3600, 4),
    }


def grpo_one_off(steps_csv: Path) -> dict[str, Any] | None:
    """GRPO's training cost from steps.csv: environment usage summed over steps, agent hours; None if absent."""
    if not steps_csv.is_file() or steps_csv.stat().st_size == 0:
        return None
    frame = pd.read_csv(steps_csv)
    if frame.empty:
        return None

    def total(column: str) -> float:
        return float(frame[column].fillna(0).sum()) if column in frame.columns else 0.0

    missing = [c for c in (*ENV_STEP_COLUMNS, "timing_s/step") if c not in frame.columns]
    out: dict[str, Any] = {
        "what": f"GRPO: {len(frame)} steps" + (f" (steps.csv lacks {', '.join(missing)})" if missing else ""),
        "env_requests": int(total("env/calls") + total("env/cache_hits")),
        "prompt_tokens": int(total("env/prompt_tokens")),
        "completion_tokens": int(total("env/completion_tokens")),
        "usd": round(total("env/cost_usd"), 6),
        "hours": round(total("timing_s/step") / 3600, 4),
    }
    return out


def one_off_costs(systems: list[str], gepa_prompt: Path, steps_csv: Path) -> dict[str, dict[str, Any] | None]:
    """Each system's one-off cost (None where it has none or its record is missing): GEPA's from its
    `prompt.json`, GRPO's from the train stage's `steps.csv`."""
    out: dict[str, dict[str, Any] | None] = {}
    for system in systems:
        if system == "gepa":
            out[system] = gepa_one_off(read_gepa_prompt(gepa_prompt))
        elif system == TRAINED:
            out[system] = grpo_one_off(steps_csv)
        else:
            out[system] = None
    return out


def quality_cost_rows(summary: dict[str, Any], metric: str = "f1") -> pd.DataFrame:
    """One point per (system, split): the average `metric` against the environment cost per question."""
    rows = []
    for system in summary["systems"]:
        inf = summary["cost"]["inference"][system]
        once = summary["cost"]["one_off"].get(system) or {}
        for split, entry in summary["averages"][system].items():
            if metric not in entry:
                continue
            rows.append({"point": f"{system} ({split.upper()})", "system": system, "split": split,
                         metric: entry[metric]["mean"], "env_tokens_per_question": inf["env_tokens_per_question"],
                         "usd_per_question": inf["usd_per_question"], "one_off_usd": once.get("usd", 0.0),
                         "one_off_hours": once.get("hours", 0.0)})
    return pd.DataFrame(rows)
