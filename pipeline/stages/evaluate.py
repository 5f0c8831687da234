"""Stage `evaluate`: the merged agent with the environment on the ID and OOD sets, plus baselines.

The straight path (`run_evaluate`), each step a named function:
load the evaluation rows (`load_eval_rows`) → start (or reuse) the environment and run every system on
the same rows (`evaluate_systems`, the runners in `pipeline.evaluation.systems`) → score in both metrics
modes and aggregate with bootstrap CIs (`pipeline.evaluation.scores`) → write the report and log it to
MLflow (`pipeline.evaluation.report`).

Design decisions:
- **This module is the stage; `pipeline.evaluation` holds its parts**, one module per job (systems,
  scores, report; see that package's docstring). Here: which rows, which models and environment, in
  which order, and the evaluate MLflow run around it all.
- **Rows.** The first `evaluate.rows_per_dataset` rows of each `data/rl/eval/<dataset>.parquet`. The
  authors' files are already random draws of 128, so "the first N" is a random sample that stays the
  same across seeds and profiles, and two runs with the same N score the same questions.
- **Environment.** Temperature `evaluate.env_temperature` (0) with the response cache
  (`evaluate.env_cache`), so a repeated evaluation costs no calls; cache hits send nothing and are counted
  in the usage figures instead.
- **What MLflow shows** (`pipeline.evaluation.traces`): with `mlflow.trace_evaluation` every evaluated
  trajectory, of every system, is one trace of the evaluate run (a span per turn: the agent's prompt to the
  environment, the reply, tokens, latency, cost; the answer and its scores on the root), and the
  predictions table names each row's trace. Traces are made once the answers are scored, then written in
  the background while the report is drawn.
- **Who runs the agents** (`evaluate.agent_engine`, pipeline.agent.evaluation_policy): llama.cpp's server
  on a GGUF export of the merged agent (default; each conversation keeps its KV cache between turns) or the
  model in this process (transformers). One agent at a time: the trained agent answers with the
  environment and alone, then its server (or model) is released before the untrained `agent.model` comes.
- **Cost and the paper.** metrics.json also holds every system's cost (`evaluation.costs`: per question
  and one-off, GEPA's from `data/gepa/prompt.json`, GRPO's from `reports/train/steps.csv`) and the paper's
  published numbers beside ours (`evaluation.paper`).
- **Plug-and-play** (`evaluate.environments`, pipeline/evaluation/matrix.py): after the main run, the
  trained agent and the baselines that use an environment run again with each listed environment, one
  environment at a time, on the same rows; metrics.json, summary.md and MLflow get the matrix
  (trained-with × evaluated-with), `matrix.csv` its DVC plot.
- **One plan** (`pipeline.evaluation.plan.EvaluatePlan`): the entry resolves the paths, the engine, the
  environments and the sections once; every step below gets the plan, and metrics.json records the engine
  the plan decided (what ran), not a decision made again afterwards.
- **Order.** Systems run in the order that keeps one model loaded, and are reported `prompt_r1` first,
  then the configured baselines in `BASELINES` order, whatever order `evaluate.baselines` lists them in.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

import pandas as pd

from pipeline import metrics as M
from pipeline.agent.evaluation_policy import evaluation_policy, release_memory
from pipeline.errors import DataError, UserError
from pipeline.evaluation.costs import inference_costs, one_off_costs, read_gepa_prompt
from pipeline.evaluation.matrix import (
    build_matrix,
    log_matrix_predictions,
    matrix_baselines,
    matrix_row,
    write_matrix,
)
from pipeline.evaluation.paper import paper_comparison
from pipeline.evaluation.plan import EvaluatePlan
from pipeline.evaluation.report import (
    describe_evaluation,
    log_mlflow,
    predictions_frame,
    write_reports,
)
from pipeline.evaluation.scores import aggregate, answer_outcomes, score_system, usage_by_system
from pipeline.evaluation.summary import format_ci
from pipeline.evaluation.systems import (
    BASELINES,
    Answer,
    run_agent_only,
    run_agent_with_environment,
    run_env_only,
)
from pipeline.evaluation.traces import log_traces
from pipeline.tracking.traces import flush_traces
from pipeline.types import TRAINED, EvalRow

if TYPE_CHECKING:
    from pipeline.config import Params
    from pipeline.environment.spec import ServerSpec

log = logging.getLogger(__name__)


def _question_from(row: pd.Series) -> str:
    extra = row.get("extra_info")
    if isinstance(extra, dict) and extra.get("question"):
        return str(extra["question"])
    content = str(list(row["prompt"])[-1]["content"])
    first = content.split("\n", 1)[0]
    return first.removeprefix("Question:").strip()


def load_eval_rows(plan: EvaluatePlan) -> dict[str, list[EvalRow]]:
    """The first `rows_per_dataset` rows of every ID and OOD evaluation file, per dataset."""
    n = plan.evaluate.rows_per_dataset
    out: dict[str, list[EvalRow]] = {}
    for split, names in (("id", plan.id_datasets), ("ood", plan.ood_datasets)):
        for name in names:
            path = plan.rows_dir / f"{name}.parquet"
            if not path.is_file():
                raise DataError(f"evaluation file {path} is missing: run `promptr1 build` (dvc repro build)")
            frame = pd.read_parquet(path).head(n)
            rows = []
            for i, (_, r) in enumerate(frame.iterrows()):
                extra = r.get("extra_info") if isinstance(r.get("extra_info"), dict) else {}
                answers = [str(g) for g in list(r["reward_model"]["ground_truth"])]
                messages = [{"role": str(m["role"]), "content": str(m["content"])} for m in list(r["prompt"])]
                row_id = str(extra.get("id", f"{name}-{i}"))
                rows.append(EvalRow(dataset=name, split=split, index=i, id=row_id, question=_question_from(r),
                                    answers=answers, messages=messages))
            if not rows:
                raise DataError(f"evaluation file {path} has no rows")
            out[name] = rows
    return out


def evaluate_systems(
    plan: EvaluatePlan, rows_by_ds: dict[str, list[EvalRow]], server: ServerSpec | None = None,
    baselines: list[str] | None = None,
) -> dict[str, dict[str, list[Answer]]]:
    """Run the trained agent and each baseline on the same rows (environment started here).

    `server`: the environment the systems use (default: the training environment's, `plan.server`);
    `baselines`: default `evaluate.baselines` (the matrix passes those that use one).
    """
    from pipeline.environment.client import EnvironmentClient
    from pipeline.environment.servers import serve_environment

    server = plan.server if server is None else server
    ev = plan.evaluate
    if not plan.model_dir.exists():
        raise UserError(f"no merged agent at {plan.model_dir}: run `promptr1 merge` (dvc repro merge) first")
    baselines = list(dict.fromkeys(ev.baselines if baselines is None else baselines))
    gepa_instruction = read_gepa_prompt(plan.gepa_prompt)["optimised"]["instruction"] if "gepa" in baselines else None
    answers: dict[str, dict[str, list[Answer]]] = {}
    batch = plan.rollout_batch
    agent, concurrency = plan.agent, server.environment.concurrency
    with serve_environment(server):
        env = EnvironmentClient.in_cache_dir(server.environment, server.cache_dir)
        try:
            # The trained agent's server/model is gone when this block ends, before the base model comes.
            with evaluation_policy(str(plan.model_dir), plan.agent_serving, ev, engine=plan.engine) as policy:
                answers[TRAINED] = run_agent_with_environment(policy, env, rows_by_ds, agent, ev, TRAINED, batch)
                if "agent_only" in baselines:
                    answers["agent_only"] = run_agent_only(policy, rows_by_ds, ev, batch)
                tokenizer = policy.tokenizer  # merge wrote the base model's tokenizer: base_agent's too
            del policy
            release_memory()
            if "env_only" in baselines:
                answers["env_only"] = run_env_only(env, rows_by_ds, ev, concurrency)
            if gepa_instruction is not None:
                answers["gepa"] = run_env_only(env, rows_by_ds, ev, concurrency, instruction=gepa_instruction,
                                               system="gepa")
            if "base_agent" in baselines:
                base_policy = evaluation_policy(agent.model, plan.agent_serving, ev, tokenizer, engine=plan.engine)
                with base_policy as base:
                    answers["base_agent"] = run_agent_with_environment(base, env, rows_by_ds, agent, ev,
                                                                       "base_agent", batch)
                del base
                release_memory()
        finally:
            asyncio.run(env.aclose())
    order = [TRAINED, *[b for b in BASELINES if b in answers]]
    return {s: answers[s] for s in order}


def evaluate_matrix(plan: EvaluatePlan, rows_by_ds: dict[str, list[EvalRow]], summary: dict[str, Any],
                    ssim: M.SemanticSimilarity) -> dict[str, Any]:
    """The plug-and-play matrix (`evaluate.environments`, pipeline/evaluation/matrix.py): the trained agent and
    the baselines that use an environment, with each extra environment in turn, scored like the main run.
    Each environment's answers go to the evaluate run as the table `eval/matrix/<name>/predictions.json`."""
    rows = []
    for run in plan.variants:
        name, environment = run.name, run.server.environment
        log.info("plug-and-play: evaluating with environment %r (%s, %s)", name, environment.backend,
                 environment.served_name)
        answers = evaluate_systems(plan, rows_by_ds, run.server, matrix_baselines(plan.evaluate.baselines))
        scores = {s: score_system(a, rows_by_ds, ssim) for s, a in answers.items()}
        aggregated = aggregate(scores, rows_by_ds, plan.evaluate, plan.seed)
        aggregated["env_usage"] = usage_by_system(answers)
        row = matrix_row(name, environment, aggregated)
        row["cost"] = inference_costs(answers, environment)  # at this environment's prices
        rows.append(row)
        log_matrix_predictions(name, predictions_frame(answers, scores, rows_by_ds))
    return build_matrix(plan.environment, summary, rows)


def run_evaluate(params: Params) -> dict[str, Any]:
    """Stage 6: evaluate, write reports/eval/*, log the evaluate child run. Returns metrics.json's content."""
    from pipeline.config.specs import tracking_spec
    from pipeline.tracking.runs import describe_stage, stage_run

    plan = EvaluatePlan.for_evaluate(params)
    out_dir = plan.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    rows_by_ds = load_eval_rows(plan)
    log.info("evaluating on %d datasets × %d rows", len(rows_by_ds), plan.evaluate.rows_per_dataset)
    with stage_run(tracking_spec(params), "evaluate"):
        started = time.perf_counter()
        all_answers = evaluate_systems(plan, rows_by_ds)
        ssim = M.SemanticSimilarity(plan.evaluate.ssim_model, plan.root)
        all_scores = {s: score_system(a, rows_by_ds, ssim) for s, a in all_answers.items()}
        summary = aggregate(all_scores, rows_by_ds, plan.evaluate, plan.seed)
        summary["env_usage"] = usage_by_system(all_answers)
        summary["wall_s"] = round(time.perf_counter() - started, 1)
        summary["agent_engine"] = plan.engine  # what ran the agents (decided once, in the plan)
        summary["cost"] = {
            "prices": {"usd_per_million_prompt": plan.environment.price_per_million_prompt,
                       "usd_per_million_completion": plan.environment.price_per_million_completion},
            "inference": inference_costs(all_answers, plan.environment),
            "one_off": one_off_costs(summary["systems"], plan.gepa_prompt, plan.steps_csv),
        }
        summary["outcomes"] = answer_outcomes(all_answers)
        summary["paper"] = paper_comparison(summary, plan.agent.model, plan.environment)
        if plan.variants:
            summary["matrix"] = evaluate_matrix(plan, rows_by_ds, summary, ssim)

        trace_ids = (log_traces(all_answers, all_scores, rows_by_ds, plan.evaluate.metrics_mode)
                     if plan.trace_evaluation else {})
        predictions = predictions_frame(all_answers, all_scores, rows_by_ds)
        plots = write_reports(summary, predictions, plan)
        write_matrix(summary, plan.environment, out_dir)
        log_mlflow(summary, predictions, rows_by_ds, plan, plots, trace_ids)
        flush_traces()
        describe_stage("evaluate", describe_evaluation(summary))
    for s in summary["systems"]:
        av = summary["averages"][s]
        log.info("%s: ID F1 %s, OOD F1 %s", s, format_ci(av["id"].get("f1")), format_ci(av["ood"].get("f1")))
    return summary
