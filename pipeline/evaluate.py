"""Stage `evaluate`: the merged agent with the environment on the ID and OOD sets, plus baselines.

The straight path (`run_evaluate`): load the evaluation rows → start (or reuse) the environment →
run every system on the same rows → score (ours and reference mode) → aggregate with bootstrap
CIs → write reports → log to MLflow.

Design decisions:
- **Rows.** The first `evaluate.rows_per_dataset` rows of each `data/rl/eval/<dataset>.parquet`. The
  authors' files are already random draws of 128, so "the first N" is a random sample that stays the
  same across seeds and profiles, and two runs with the same N score the same questions.
- **Systems, one harness.** All systems answer the same rows and are scored by the same code:
  - `prompt_r1`: the merged agent (`paths.model_dir`) with the environment, through the same
    `rollout()` training uses, greedy (temperature 0), up to `agent.max_turns` turns;
  - `env_only` ("w/o agent"): the environment answers the question directly: the question followed
    by `evaluate.env_only_instruction` (answer or complete the task; for short-answer questions reply
    with only the answer), one call, empty history, the method's system message;
  - `agent_only` ("w/o environment"): the merged agent answers alone in a single turn: the question
    followed by `evaluate.agent_only_instruction` (think, then `<answer>`), no interaction;
  - `base_agent` ("w/o RL"): the untrained `agent.model` with the environment, like `prompt_r1`.
  A prediction is the text inside the final `<answer>` tags for agents ('' when there is none, as the
  reward reads it) and the whole reply for the environment alone.
- **Environment.** Temperature `evaluate.env_temperature` (0) with the response cache
  (`evaluate.env_cache`), so a repeated evaluation costs no calls. With `evaluate.trace_environment`
  every request the client sends is an MLflow span (inputs, reply, token counts) inside the evaluate
  run; cache hits send nothing and are counted in the usage figures instead.
- **Metrics.** Both modes are always computed (`pipeline.metrics`); `evaluate.metrics_mode` picks the
  headline mode, the other is reported beside it under `reference`/`ours`. A dataset reports the
  metrics method.md assigns plus SM; ID/OOD averages use only the datasets a metric is assigned to (this
  reproduces the paper's averages), each with a stratified bootstrap CI; deltas vs each baseline use a
  paired bootstrap over the same rows. Scores are reported in points (×100).
- **Outputs.** `reports/eval/metrics.json` (DVC metrics), `plot_data.csv` (DVC bar plot: F1, the one
  metric every dataset reports, per dataset × system, with CI bounds), `plots/<dataset>.png` (bars with
  CIs for every reported metric), `predictions.parquet` (one row per question per system, with the
  trajectory as JSON), `summary.md`.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import pyarrow as pa
from tqdm.auto import tqdm

from pipeline import metrics as M
from pipeline.data.schema import write_json_atomic, write_parquet_atomic, write_text_atomic
from pipeline.errors import DataError, UserError
from pipeline.types import PromptItem, Trajectory, UsageStats

if TYPE_CHECKING:
    from pipeline.config import Params

log = logging.getLogger(__name__)

TRAINED = "prompt_r1"
SYSTEM_LABELS = {
    TRAINED: "Prompt-R1 (trained agent + environment)",
    "env_only": "environment alone (w/o agent)",
    "agent_only": "agent alone (w/o environment)",
    "base_agent": "untrained agent + environment (w/o RL)",
}
SPLITS = ("id", "ood")
PLOT_METRIC = "f1"


@dataclass
class EvalRow:
    """One evaluation question."""

    dataset: str
    split: str
    index: int
    uid: str
    question: str
    golds: list[str]
    messages: list[dict[str, str]]


@dataclass
class Answer:
    """One system's answer to one row, with what it cost."""

    prediction: str
    turns: int = 1
    stop_reason: str = ""
    trajectory: list[dict[str, Any]] = field(default_factory=list)
    usage: UsageStats = field(default_factory=UsageStats)
    seconds: float = 0.0


# --- data --------------------------------------------------------------------------------------------


def _question_from(row: pd.Series) -> str:
    extra = row.get("extra_info")
    if isinstance(extra, dict) and extra.get("question"):
        return str(extra["question"])
    content = str(list(row["prompt"])[-1]["content"])
    first = content.split("\n", 1)[0]
    return first.removeprefix("Question:").strip()


def load_eval_rows(params: Params) -> dict[str, list[EvalRow]]:
    """The first `rows_per_dataset` rows of every ID and OOD evaluation file, per dataset."""
    eval_dir = params.path(params.paths.rl_dir) / "eval"
    n = params.evaluate.rows_per_dataset
    out: dict[str, list[EvalRow]] = {}
    for split, names in (("id", params.data.id_eval_datasets), ("ood", params.data.ood_eval_datasets)):
        for name in names:
            path = eval_dir / f"{name}.parquet"
            if not path.is_file():
                raise DataError(f"evaluation file {path} is missing: run `promptr1 build` (dvc repro build)")
            frame = pd.read_parquet(path).head(n)
            rows = []
            for i, (_, r) in enumerate(frame.iterrows()):
                extra = r.get("extra_info") if isinstance(r.get("extra_info"), dict) else {}
                golds = [str(g) for g in list(r["reward_model"]["ground_truth"])]
                messages = [{"role": str(m["role"]), "content": str(m["content"])} for m in list(r["prompt"])]
                rows.append(EvalRow(dataset=name, split=split, index=i, uid=str(extra.get("id", f"{name}-{i}")),
                                    question=_question_from(r), golds=golds, messages=messages))
            if not rows:
                raise DataError(f"evaluation file {path} has no rows")
            out[name] = rows
    return out


def _input_frame(rows: Sequence[EvalRow]) -> pd.DataFrame:
    return pd.DataFrame({
        "uid": [r.uid for r in rows],
        "question": [r.question for r in rows],
        "gold_answers": [json.dumps(r.golds, ensure_ascii=False) for r in rows],
    })


# --- systems -----------------------------------------------------------------------------------------


def _trajectory_record(traj: Trajectory) -> list[dict[str, Any]]:
    """The turns of a trajectory as plain JSON-able dicts (texts, parts, flags, env reply; no token ids)."""
    out = []
    for turn in traj.turns:
        p = turn.parsed
        rec: dict[str, Any] = {
            "text": p.text, "think": p.think, "interaction_prompt": p.interaction_prompt, "answer": p.answer,
            "valid_intermediate": p.valid_intermediate, "complete_final": p.complete_final, "issues": p.issues,
            "agent_tokens": len(turn.agent_token_ids),
        }
        if turn.env_reply is not None:
            rec["environment"] = asdict(turn.env_reply)
        out.append(rec)
    return out


def _answers_from(trajs: Sequence[Trajectory]) -> list[Answer]:
    return [Answer(prediction=t.answer, turns=t.num_turns, stop_reason=t.stop_reason,
                   trajectory=_trajectory_record(t), usage=t.usage,
                   seconds=t.generation_s + t.environment_s) for t in trajs]


def _prompt_items(rows: Sequence[EvalRow]) -> list[PromptItem]:
    return [PromptItem(uid=r.uid, messages=r.messages, gold_answers=r.golds, data_source=r.dataset,
                       question=r.question) for r in rows]


def _chunks(rows: Sequence[EvalRow], size: int) -> list[Sequence[EvalRow]]:
    return [rows[i : i + size] for i in range(0, len(rows), size)]


def run_agent_with_environment(policy: Any, env: Any, rows_by_ds: dict[str, list[EvalRow]], params: Params,
                               system: str) -> dict[str, list[Answer]]:
    """`rollout()` (greedy) on every dataset, a progress bar per dataset."""
    from pipeline.agent.rollout import rollout

    async def one_dataset(rows: list[EvalRow], bar: tqdm) -> list[Answer]:
        answers: list[Answer] = []
        for chunk in _chunks(rows, params.evaluate.batch_size):
            trajs = await rollout(
                policy, env, _prompt_items(chunk), group_size=1, max_turns=params.agent.max_turns,
                max_turn_tokens=params.evaluate.agent_max_turn_tokens,
                max_response_tokens=params.agent.max_response_tokens,
                env_reply_max_chars=params.agent.env_reply_max_chars, temperature=0.0, top_p=1.0,
                return_logprobs=False, reward_fn=None, progress=False,
                max_prompt_tokens=params.agent.max_prompt_tokens,
            )
            answers.extend(_answers_from(trajs))
            bar.update(len(chunk))
        return answers

    out: dict[str, list[Answer]] = {}
    for name, rows in rows_by_ds.items():
        with tqdm(total=len(rows), desc=f"{system} · {name}", unit="q") as bar:
            out[name] = asyncio.run(one_dataset(rows, bar))
    return out


def run_agent_only(policy: Any, rows_by_ds: dict[str, list[EvalRow]], params: Params) -> dict[str, list[Answer]]:
    """The agent answers alone in one turn (no environment): greedy, stops at `</answer>`."""
    from pipeline.agent.protocol import ANSWER_CLOSE, THINK_OPENER, ConversationBuilder, parse_turn

    builder = ConversationBuilder(policy.tokenizer)
    instruction = params.evaluate.agent_only_instruction
    out: dict[str, list[Answer]] = {}
    for name, rows in rows_by_ds.items():
        answers: list[Answer] = []
        for chunk in tqdm(_chunks(rows, params.evaluate.batch_size), desc=f"agent_only · {name}", unit="batch"):
            prompts = [builder.start([{"role": "user", "content": f"Question: {r.question}\n{instruction}"}])
                       for r in chunk]
            start = time.perf_counter()
            gens = policy.generate(prompts, max_new_tokens=params.evaluate.agent_max_turn_tokens, temperature=0.0,
                                   top_p=1.0, stop=[ANSWER_CLOSE], return_logprobs=False)
            per_row = (time.perf_counter() - start) / max(1, len(chunk))
            for gen in gens:
                text = THINK_OPENER + gen.text  # the builder opened the turn, as the rollout parses it
                parsed = parse_turn(text)
                answers.append(Answer(
                    prediction=parsed.answer or "", turns=1,
                    stop_reason="answer" if parsed.answer is not None else "no_answer",
                    trajectory=[{"text": text, "think": parsed.think, "answer": parsed.answer,
                                 "complete_final": parsed.complete_final, "issues": parsed.issues,
                                 "agent_tokens": len(gen.token_ids)}],
                    seconds=per_row,
                ))
        out[name] = answers
    return out


def run_env_only(env: Any, rows_by_ds: dict[str, list[EvalRow]], params: Params) -> dict[str, list[Answer]]:
    """The environment answers each question directly (one call, no agent)."""
    instruction = params.evaluate.env_only_instruction

    async def one(row: EvalRow) -> Answer:
        prompt = f"{row.question}\n\n{instruction}"
        reply = await env.reply([], prompt)
        usage = UsageStats()
        usage.add(reply)
        prediction = "" if reply.error else reply.text.strip()
        return Answer(prediction=prediction, turns=1, stop_reason="error" if reply.error else "answer",
                      trajectory=[{"prompt": prompt, "environment": asdict(reply)}], usage=usage,
                      seconds=reply.latency_s)

    async def one_dataset(rows: list[EvalRow], bar: tqdm) -> list[Answer]:
        answers: list[Answer] = []
        for chunk in _chunks(rows, params.evaluate.batch_size):
            answers.extend(await asyncio.gather(*(one(r) for r in chunk)))
            bar.update(len(chunk))
        return answers

    out: dict[str, list[Answer]] = {}
    for name, rows in rows_by_ds.items():
        with tqdm(total=len(rows), desc=f"env_only · {name}", unit="q") as bar:
            out[name] = asyncio.run(one_dataset(rows, bar))
    return out


# --- scoring and aggregation -------------------------------------------------------------------------


Scores = dict[str, dict[str, dict[str, list[float]]]]
"""mode → dataset → metric → per-row scores (0..1), for one system."""


def score_system(answers: dict[str, list[Answer]], rows_by_ds: dict[str, list[EvalRow]],
                 ssim: M.SemanticSimilarity | None) -> Scores:
    """Every metric, both modes, for every row of every dataset."""
    out: Scores = {mode: {} for mode in M.MODES}
    for name, rows in rows_by_ds.items():
        preds = [a.prediction for a in answers[name]]
        golds = [r.golds for r in rows]
        for mode in M.MODES:
            out[mode][name] = M.score_rows(preds, golds, mode, ssim)
    return out


def _pts(x: float) -> float:
    return round(100.0 * x, 2)


def _ci_dict(mean: float, low: float, high: float) -> dict[str, float]:
    return {"mean": _pts(mean), "low": _pts(low), "high": _pts(high)}


def _split_groups(scores: dict[str, dict[str, list[float]]], datasets: Sequence[str],
                  metric: str) -> list[list[float]]:
    return [scores[d][metric] for d in datasets if metric in M.reported_metrics(d) and metric in scores[d]]


def aggregate(all_scores: dict[str, Scores], rows_by_ds: dict[str, list[EvalRow]],
              params: Params) -> dict[str, Any]:
    """metrics.json content: per dataset × system × metric, ID/OOD averages with CIs, deltas, both modes."""
    ev = params.evaluate
    boot = {"samples": ev.bootstrap_samples, "confidence": ev.confidence, "seed": params.seed}
    split_ds = {s: [d for d in rows_by_ds if rows_by_ds[d][0].split == s] for s in SPLITS}
    systems = list(all_scores)
    headline, other = ev.metrics_mode, ("reference" if ev.metrics_mode == "ours" else "ours")

    def tables(mode: str) -> dict[str, Any]:
        per_dataset: dict[str, Any] = {}
        for d in rows_by_ds:
            per_dataset[d] = {}
            for system in systems:
                entry: dict[str, Any] = {}
                for metric in M.reported_metrics(d):
                    vals = all_scores[system][mode][d][metric]
                    entry[metric] = _ci_dict(*M.bootstrap_ci(vals, **boot))
                per_dataset[d][system] = entry
        averages: dict[str, Any] = {}
        for system in systems:
            averages[system] = {}
            for split in SPLITS:
                averages[system][split] = {}
                for metric in (*M.HEADLINE_METRICS, "sm"):
                    groups = _split_groups(all_scores[system][mode], split_ds[split], metric)
                    if groups:
                        averages[system][split][metric] = _ci_dict(*M.bootstrap_ci_average(groups, **boot))
        deltas: dict[str, Any] = {}
        if TRAINED in systems:
            for base in systems:
                if base == TRAINED:
                    continue
                deltas[f"vs_{base}"] = {}
                for split in SPLITS:
                    deltas[f"vs_{base}"][split] = {}
                    for metric in (*M.HEADLINE_METRICS, "sm"):
                        a = _split_groups(all_scores[TRAINED][mode], split_ds[split], metric)
                        b = _split_groups(all_scores[base][mode], split_ds[split], metric)
                        if a:
                            d, lo, hi = M.paired_bootstrap_delta(a, b, **boot)
                            deltas[f"vs_{base}"][split][metric] = {"delta": _pts(d), "low": _pts(lo),
                                                                   "high": _pts(hi)}
        return {"per_dataset": per_dataset, "averages": averages, "deltas": deltas}

    result = {
        "mode": headline,
        "rows_per_dataset": ev.rows_per_dataset,
        "systems": systems,
        "datasets": {s: split_ds[s] for s in SPLITS},
        "confidence": ev.confidence,
        **tables(headline),
        other: tables(other),
    }
    return result


# --- outputs -----------------------------------------------------------------------------------------


def predictions_frame(all_answers: dict[str, dict[str, list[Answer]]], all_scores: dict[str, Scores],
                      rows_by_ds: dict[str, list[EvalRow]]) -> pd.DataFrame:
    """One row per (system, question): inputs, prediction, per-metric scores (both modes), trajectory, usage."""
    records = []
    for system, answers in all_answers.items():
        for name, rows in rows_by_ds.items():
            for i, (row, ans) in enumerate(zip(rows, answers[name], strict=True)):
                rec: dict[str, Any] = {
                    "system": system, "dataset": name, "split": row.split, "row": row.index, "uid": row.uid,
                    "question": row.question, "gold": list(row.golds), "prediction": ans.prediction,
                }
                for metric in M.ALL_METRICS:
                    rec[metric] = all_scores[system]["ours"][name].get(metric, [np.nan] * len(rows))[i]
                    rec[f"ref_{metric}"] = all_scores[system]["reference"][name].get(metric, [np.nan] * len(rows))[i]
                rec.update({
                    "turns": ans.turns, "stop_reason": ans.stop_reason,
                    "trajectory": json.dumps(ans.trajectory, ensure_ascii=False, default=str),
                    "env_calls": ans.usage.calls, "env_cache_hits": ans.usage.cache_hits,
                    "env_prompt_tokens": ans.usage.prompt_tokens,
                    "env_completion_tokens": ans.usage.completion_tokens,
                    "env_errors": ans.usage.errors, "env_cost_usd": ans.usage.cost_usd, "seconds": ans.seconds,
                })
                records.append(rec)
    return pd.DataFrame.from_records(records)


def usage_by_system(all_answers: dict[str, dict[str, list[Answer]]]) -> dict[str, dict[str, float]]:
    out = {}
    for system, answers in all_answers.items():
        total = UsageStats()
        for rows in answers.values():
            for a in rows:
                total.merge(a.usage)
        out[system] = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in total.as_dict().items()}
    return out


def plot_rows(summary: dict[str, Any]) -> pd.DataFrame:
    """plot_data.csv: F1 (the one metric every dataset reports) per dataset × system, with CI bounds."""
    rows = []
    for d, per_system in summary["per_dataset"].items():
        for system, entry in per_system.items():
            ci = entry[PLOT_METRIC]
            rows.append({"dataset_system": f"{d} | {system}", "dataset": d, "system": system,
                         "metric": PLOT_METRIC, "score": ci["mean"], "low": ci["low"], "high": ci["high"]})
    return pd.DataFrame(rows)


def write_plots(summary: dict[str, Any], out_dir: Path) -> list[Path]:
    """One PNG per dataset: grouped bars (metric × system) with CI error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    systems = summary["systems"]
    width = 0.8 / max(1, len(systems))
    for d, per_system in summary["per_dataset"].items():
        metrics_ = M.reported_metrics(d)
        fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(metrics_), 3.2))
        x = np.arange(len(metrics_))
        for k, system in enumerate(systems):
            cis = [per_system[system][m] for m in metrics_]
            means = np.array([c["mean"] for c in cis])
            err = np.array([[c["mean"] - c["low"] for c in cis], [c["high"] - c["mean"] for c in cis]])
            ax.bar(x + (k - (len(systems) - 1) / 2) * width, means, width, yerr=err, capsize=3, label=system)
        ax.set_xticks(x, [m.upper() for m in metrics_])
        ax.set_ylim(0, 105)
        ax.set_ylabel("score (points)")
        ax.set_title(f"{d} ({summary['mode']} mode, {int(summary['confidence'] * 100)}% bootstrap CI)", fontsize=9)
        ax.legend(fontsize=7, loc="upper right")
        fig.tight_layout()
        path = out_dir / f"{d}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


def _fmt(ci: dict[str, float] | None) -> str:
    return "–" if ci is None else f"{ci['mean']:.2f} [{ci['low']:.2f}, {ci['high']:.2f}]"


def summary_markdown(summary: dict[str, Any], params: Params) -> str:
    """A short human-readable report of metrics.json."""
    mode = summary["mode"]
    other = "reference" if mode == "ours" else "ours"
    systems = summary["systems"]
    lines = [
        "# Evaluation summary",
        "",
        (f"{summary['rows_per_dataset']} rows per dataset; scores in points; metrics mode `{mode}` "
        f"(the `{other}` numbers are in metrics.json); {int(summary['confidence'] * 100)}% bootstrap CIs "
        f"in brackets."),
        "",
        "Systems: " + "; ".join(f"`{s}` = {SYSTEM_LABELS.get(s, s)}" for s in systems) + ".",
        f"env_only prompt: the question, a blank line, then: \"{params.evaluate.env_only_instruction}\"",
        "",
        "## Averages",
        "",
        "| system | split | EM | F1 | SSim | SM |",
        "|---|---|---|---|---|---|",
    ]
    for s in systems:
        for split in SPLITS:
            av = summary["averages"][s][split]
            lines.append(f"| {s} | {split} | " + " | ".join(_fmt(av.get(m)) for m in ("em", "f1", "ssim", "sm"))
                         + " |")
    if summary["deltas"]:
        lines += ["", "## Deltas of prompt_r1 (paired bootstrap)", "", "| vs | split | EM | F1 | SSim | SM |",
                  "|---|---|---|---|---|---|"]
        for vs, per_split in summary["deltas"].items():
            for split in SPLITS:
                cells = []
                for m in ("em", "f1", "ssim", "sm"):
                    c = per_split[split].get(m)
                    cells.append("–" if c is None else f"{c['delta']:+.2f} [{c['low']:+.2f}, {c['high']:+.2f}]")
                lines.append(f"| {vs.removeprefix('vs_')} | {split} | " + " | ".join(cells) + " |")
    lines += ["", "## Per dataset (mean)", "", "| dataset | metric | " + " | ".join(systems) + " |",
              "|---|---|" + "---|" * len(systems)]
    for d, per_system in summary["per_dataset"].items():
        for m in M.reported_metrics(d):
            lines.append(f"| {d} | {m.upper()} | " + " | ".join(f"{per_system[s][m]['mean']:.2f}" for s in systems)
                         + " |")
    lines += ["", "## Environment usage", "", ("| system | calls | cache hits | prompt tok | completion tok | errors |"
              " cost USD |"), "|---|---|---|---|---|---|---|"]
    for s, u in summary["env_usage"].items():
        lines.append(f"| {s} | {u['calls']} | {u['cache_hits']} | {u['prompt_tokens']} | {u['completion_tokens']} |"
                     f" {u['errors']} | {u['cost_usd']:.4f} |")
    return "\n".join(lines) + "\n"


def flat_metrics(summary: dict[str, Any]) -> dict[str, float]:
    """MLflow metric keys: `<system>/<dataset>/<metric>`, `<system>/<split>/<metric>[_low|_high]`, deltas."""
    out: dict[str, float] = {}
    for d, per_system in summary["per_dataset"].items():
        for s, entry in per_system.items():
            for m, ci in entry.items():
                out[f"{s}/{d}/{m}"] = ci["mean"]
    for s, per_split in summary["averages"].items():
        for split, entry in per_split.items():
            for m, ci in entry.items():
                out[f"{s}/{split}/{m}"] = ci["mean"]
                out[f"{s}/{split}/{m}_low"] = ci["low"]
                out[f"{s}/{split}/{m}_high"] = ci["high"]
    for vs, per_split in summary["deltas"].items():
        for split, entry in per_split.items():
            for m, c in entry.items():
                out[f"delta_{vs}/{split}/{m}"] = c["delta"]
    other = "reference" if summary["mode"] == "ours" else "ours"
    for s, per_split in summary[other]["averages"].items():
        for split, entry in per_split.items():
            for m, ci in entry.items():
                out[f"{other}/{s}/{split}/{m}"] = ci["mean"]
    for s, u in summary["env_usage"].items():
        for k, v in u.items():
            out[f"env/{s}/{k}"] = float(v)
    return out


def _log_mlflow(summary: dict[str, Any], predictions: pd.DataFrame, rows_by_ds: dict[str, list[EvalRow]],
                params: Params, out_dir: Path, plots: list[Path]) -> None:
    import mlflow

    from pipeline.tracking import log_dataset_inputs

    mlflow.log_params({"evaluate.rows_per_dataset": params.evaluate.rows_per_dataset,
                       "evaluate.systems": ",".join(summary["systems"]),
                       "evaluate.metrics_mode": params.evaluate.metrics_mode})
    mlflow.log_metrics(flat_metrics(summary))
    eval_dir = params.path(params.paths.rl_dir) / "eval"
    log_dataset_inputs({f"eval/{d}": (_input_frame(rows), eval_dir / f"{d}.parquet")
                        for d, rows in rows_by_ds.items()}, context="evaluation")
    mlflow.log_table(predictions.assign(gold=predictions["gold"].map(lambda g: json.dumps(list(g)))),
                     artifact_file="eval/predictions.json")
    for name in ("metrics.json", "summary.md", "plot_data.csv"):
        mlflow.log_artifact(str(out_dir / name), artifact_path="eval")
    for path in plots:
        mlflow.log_artifact(str(path), artifact_path="eval/plots")
    mlflow.set_tags({"eval.mode": summary["mode"], "eval.systems": ",".join(summary["systems"])})


# --- the stage ---------------------------------------------------------------------------------------


def _eval_params(params: Params) -> Params:
    """A copy of params with the evaluation's environment sampling (greedy, cached)."""
    p = params.model_copy(deep=True)
    p.root = params.root
    p.environment.temperature = params.evaluate.env_temperature
    p.environment.cache = params.evaluate.env_cache
    return p


def _load_policy(ref: str, params: Params) -> Any:
    from pipeline.agent.policy import TransformersPolicy

    return TransformersPolicy.from_ref(ref, params.root, params.agent.dtype)


def _release_memory() -> None:
    """Collect garbage and return cached CUDA blocks. Callers drop their own model references first
    (`policy = None`): a function cannot free an object its caller still names."""
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:  # pragma: no cover - torch is a dependency
        pass


def evaluate_systems(params: Params, rows_by_ds: dict[str, list[EvalRow]]) -> dict[str, dict[str, list[Answer]]]:
    """Run the trained agent and each configured baseline on the same rows (environment started here)."""
    from pipeline.environment.client import EnvironmentClient
    from pipeline.environment.servers import environment_server

    ep = _eval_params(params)
    model_dir = params.path(params.paths.model_dir)
    if not model_dir.exists():
        raise UserError(f"no merged agent at {model_dir}: run `promptr1 merge` (dvc repro merge) first")
    baselines = list(dict.fromkeys(params.evaluate.baselines))
    answers: dict[str, dict[str, list[Answer]]] = {}
    with environment_server(ep):
        env = EnvironmentClient.from_params(ep, trace=params.evaluate.trace_environment)
        try:
            policy = _load_policy(str(model_dir), params)
            answers[TRAINED] = run_agent_with_environment(policy, env, rows_by_ds, ep, TRAINED)
            if "agent_only" in baselines:
                answers["agent_only"] = run_agent_only(policy, rows_by_ds, ep)
            policy = None  # the trained model must be gone before the base model loads
            _release_memory()
            if "env_only" in baselines:
                answers["env_only"] = run_env_only(env, rows_by_ds, ep)
            if "base_agent" in baselines:
                base = _load_policy(params.agent.model, params)
                answers["base_agent"] = run_agent_with_environment(base, env, rows_by_ds, ep, "base_agent")
                base = None
                _release_memory()
        finally:
            asyncio.run(env.aclose())
    order = [TRAINED, *[b for b in ("env_only", "agent_only", "base_agent") if b in answers]]
    return {s: answers[s] for s in order}


def run_evaluate(params: Params) -> dict[str, Any]:
    """Stage 6: evaluate, write reports/eval/*, log the evaluate child run. Returns metrics.json's content."""
    from pipeline.tracking import stage_run

    out_dir = params.path(params.paths.reports_dir) / "eval"
    out_dir.mkdir(parents=True, exist_ok=True)
    rows_by_ds = load_eval_rows(params)
    log.info("evaluating on %d datasets × %d rows", len(rows_by_ds), params.evaluate.rows_per_dataset)
    with stage_run(params, "evaluate"):
        started = time.perf_counter()
        all_answers = evaluate_systems(params, rows_by_ds)
        ssim = M.SemanticSimilarity(params.evaluate.ssim_model, params.root)
        all_scores = {s: score_system(a, rows_by_ds, ssim) for s, a in all_answers.items()}
        summary = aggregate(all_scores, rows_by_ds, params)
        summary["env_usage"] = usage_by_system(all_answers)
        summary["wall_s"] = round(time.perf_counter() - started, 1)

        predictions = predictions_frame(all_answers, all_scores, rows_by_ds)
        # atomic writes (temporary file + rename): a killed stage never leaves a half-written output
        write_parquet_atomic(pa.Table.from_pandas(predictions, preserve_index=False),
                             out_dir / "predictions.parquet")
        write_json_atomic(summary, out_dir / "metrics.json")
        write_text_atomic(plot_rows(summary).to_csv(index=False), out_dir / "plot_data.csv")
        plots = write_plots(summary, out_dir / "plots")
        write_text_atomic(summary_markdown(summary, params), out_dir / "summary.md")
        _log_mlflow(summary, predictions, rows_by_ds, params, out_dir, plots)
    for s in summary["systems"]:
        av = summary["averages"][s]
        log.info("%s: ID F1 %s, OOD F1 %s", s, _fmt(av["id"].get("f1")), _fmt(av["ood"].get("f1")))
    return summary
