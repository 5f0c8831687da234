"""Stage `gepa`: GEPA (reflective prompt evolution) optimises the environment's instruction — the rival to
training an agent, in the same harness.

The straight path (`run_gepa`): draw three disjoint slices of `data/rl/train.parquet` (`load_slices`) →
make the environment reachable and build the task and reflection clients → `gepa.optimize` with our adapter
(`EnvironmentInstructionAdapter`) from the seed instruction `evaluate.env_only_instruction` → score the seed
and the optimised instruction on the held-out slice → write `data/gepa/prompt.json`,
`reports/gepa/{metrics.json,history.csv}` and the MLflow `gepa` run.

Design decisions:
- **The `gepa` package, not DSPy.** `gepa` 0.1.4 installs with no dependencies at all (litellm, mlflow,
  wandb are optional extras we do not need), and its `GEPAAdapter` protocol (`evaluate` +
  `make_reflective_dataset`) hands us the rollout: every request is built by our `EnvironmentClient`, so the
  chat messages are exactly those of the `env_only` baseline (`systems.env_only_prompt`: the environment's
  system message, then the question, a blank line and the instruction), with our retries, cache, budget,
  token counts and prices. DSPy would wrap the prompt in its own signature format and route every call
  through litellm (a large dependency tree), so the optimised text could not be dropped unchanged into
  the `env_only` harness. GEPA's reflection prompt is kept; its call goes through a second client (`ReflectionProposer`).
- **The metric is the answer reward's token F1** (`pipeline.metrics.token_f1`, max over gold answers):
  GEPA optimises the number the reward and the evaluation use. The reflection feedback names the score and
  the gold answers, which is what GEPA's reflection needs to propose a better instruction.
- **Three disjoint slices**, drawn with `gepa.seed`: `train_size` rows GEPA reflects on (minibatches of
  `minibatch_size`), `val_size` rows it scores candidates on (its Pareto set), and `holdout_size` rows it
  never sees, on which the seed and the optimised instruction are both scored for the report.
- **Budget** is `gepa.max_metric_calls` task rollouts, never exceeded. GEPA's own `max_metric_calls` is
  checked only between iterations, and one iteration scores the parent and the proposal on a minibatch
  and, when the proposal wins there, the whole val slice (2 × `minibatch_size` + `val_size` calls), so a
  budget of 40 ran to 48. `WholeIterationBudget` stops before an iteration that could overrun it; the seed's
  val scoring (`val_size` calls, before any iteration) must fit too. The one-off cost (metric calls, task
  and reflection tokens and USD, wall time) is written beside the result, and the evaluation reports it
  with the other systems' costs.
- **Same sampling as the evaluation**: temperature `evaluate.env_temperature` and cache `evaluate.env_cache`,
  so the optimised instruction is selected under the conditions it is evaluated in, and a rerun with
  unchanged inputs costs no calls.
- **GEPA's log lines go to `logging`** (no prints); its progress is recorded by `HistoryRecorder`
  (the adapter, proposer, recorder and logger GEPA calls are in pipeline/evaluation/gepa_adapter.py) (one row
  per proposal and per candidate scored on the val slice), which becomes the score history.
"""

from __future__ import annotations

import asyncio
import json
import logging
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from pipeline.errors import DataError, UserError
from pipeline.evaluation.gepa_adapter import (
    COMPONENT,
    EnvironmentInstructionAdapter,
    HistoryRecorder,
    LoggingLogger,
    ReflectionProposer,
    TaskExample,
)
from pipeline.evaluation.systems import evaluation_environment
from pipeline.progress import progress
from pipeline.stage_files import GEPA_PROMPT_FILE, GEPA_REPORTS_DIR, METRICS_FILE, TRAIN_FILE
from pipeline.stages.figures import gepa_outcome
from pipeline.types import UsageStats

if TYPE_CHECKING:
    from pipeline.config import EnvironmentConfig, GepaConfig, Params
    from pipeline.environment.client import EnvironmentClient
    from pipeline.environment.spec import ServerSpec

log = logging.getLogger(__name__)

@dataclass
class Slices:
    """Three disjoint slices of the training set."""

    train: list[TaskExample]
    """GEPA reflects on minibatches of these."""
    val: list[TaskExample]
    """GEPA scores every accepted candidate on these (its Pareto set) and picks the best by them."""
    holdout: list[TaskExample]
    """Never shown to GEPA: the seed and the optimised instruction are compared on these."""


@dataclass(frozen=True)
class GepaPlan:
    """What the stage resolves from the params, once, at its entry (`run_gepa`), and hands down."""

    gepa: GepaConfig
    train_file: Path
    """`<paths.rl_dir>/train.parquet`: the slices' source."""
    prompt_file: Path
    """`<paths.gepa_dir>/prompt.json`: the optimised instruction, for evaluate."""
    out_dir: Path
    seed_instruction: str
    """`evaluate.env_only_instruction`: GEPA's seed candidate."""
    task: ServerSpec
    """The environment with the evaluation's sampling (`evaluation_environment`), its project root and
    `paths.cache_dir`: what the environment's server and the task client take."""
    reflection: EnvironmentConfig
    """The reflection model's endpoint, name and sampling (`reflection_config`)."""
    cache: Path
    """The environment's response cache file (`paths.cache_dir`); the ledger lies beside it."""

    @classmethod
    def for_gepa(cls, params: Params) -> GepaPlan:
        from pipeline.environment.client import CACHE_FILE
        from pipeline.environment.spec import ServerSpec

        cache_dir = params.path(params.paths.cache_dir)
        task = evaluation_environment(params.environment, params.evaluate)
        return cls(gepa=params.gepa, train_file=params.path(params.paths.rl_dir) / TRAIN_FILE,
                   prompt_file=params.path(params.paths.gepa_dir) / GEPA_PROMPT_FILE,
                   out_dir=params.path(params.paths.reports_dir) / GEPA_REPORTS_DIR,
                   seed_instruction=params.evaluate.env_only_instruction,
                   task=ServerSpec(environment=task, root=params.root, cache_dir=cache_dir),
                   reflection=reflection_config(task, params.gepa), cache=cache_dir / CACHE_FILE)


def load_slices(path: Path, cfg: GepaConfig) -> Slices:
    """Three disjoint random slices of the RL training set at `path` (seeded by `gepa.seed`)."""
    if not path.is_file():
        raise DataError(f"training set {path} is missing: run `promptr1 build` (dvc repro build)")
    frame = pd.read_parquet(path, columns=["data_source", "reward_model", "extra_info"])
    need = cfg.train_size + cfg.val_size + cfg.holdout_size
    if len(frame) < need:
        raise DataError(f"{path} has {len(frame)} rows; gepa needs {need} (train_size + val_size + holdout_size)")
    drawn = frame.sample(n=need, random_state=cfg.seed)
    examples = [
        TaskExample(uid=str(r.extra_info.get("id", i)), dataset=str(r.data_source),
                    question=str(r.extra_info["question"]),
                    answers=tuple(str(g) for g in r.reward_model["ground_truth"]))
        for i, r in enumerate(drawn.itertuples(index=False))
    ]
    a, b = cfg.train_size, cfg.train_size + cfg.val_size
    return Slices(train=examples[:a], val=examples[a:b], holdout=examples[b:])


def reflection_config(environment: EnvironmentConfig, cfg: GepaConfig) -> EnvironmentConfig:
    """The environment section with the reflection model's endpoint, name and sampling (`gepa.reflection_*`)."""
    from pipeline.environment.spec import environment_with

    return environment_with(
        environment,
        served_name=cfg.reflection_served_name or environment.served_name,
        base_url=cfg.reflection_base_url or environment.base_url,
        max_tokens=cfg.reflection_max_tokens,
        temperature=cfg.reflection_temperature,
    )



class WholeIterationBudget:
    """GEPA stop condition: stop before an iteration that could take the metric calls past `max_metric_calls`
    (its worst case, `per_iteration`, is a minibatch for the parent and one for the proposal, then the val
    slice). `max_metric_calls` is the attribute GEPA reads to report the remaining budget."""

    def __init__(self, max_metric_calls: int, per_iteration: int) -> None:
        self.max_metric_calls = max_metric_calls
        self.per_iteration = per_iteration

    def __call__(self, gepa_state: Any) -> bool:
        return gepa_state.total_num_evals + self.per_iteration > self.max_metric_calls


def _mean(xs: list[float]) -> float:
    return round(sum(xs) / len(xs), 4) if xs else 0.0


def _usage(u: UsageStats) -> dict[str, Any]:
    return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in asdict(u).items()}


def optimise(plan: GepaPlan, slices: Slices, task: EnvironmentClient,
             reflection: EnvironmentClient) -> dict[str, Any]:
    """GEPA from the seed instruction, then both instructions on the held-out slice: prompt.json's content."""
    from gepa import optimize

    cfg = plan.gepa
    seed_instruction = plan.seed_instruction
    if cfg.max_metric_calls < cfg.val_size:
        raise UserError(f"gepa.max_metric_calls={cfg.max_metric_calls} is below gepa.val_size={cfg.val_size}: "
                        "scoring the seed instruction on the val slice alone would exceed the budget")
    adapter = EnvironmentInstructionAdapter(task)
    recorder = HistoryRecorder()
    started = time.perf_counter()
    with progress(total=cfg.max_metric_calls, desc="GEPA", unit="metric calls") as recorder.bar:
        result = optimize(
            seed_candidate={COMPONENT: seed_instruction}, trainset=slices.train, valset=slices.val,
            adapter=adapter, custom_candidate_proposer=ReflectionProposer(reflection, cfg.max_instruction_chars),
            candidate_selection_strategy="pareto",
            reflection_minibatch_size=cfg.minibatch_size,
            stop_callbacks=WholeIterationBudget(cfg.max_metric_calls, 2 * cfg.minibatch_size + cfg.val_size),
            logger=LoggingLogger(), callbacks=[recorder], seed=cfg.seed, raise_on_exception=True,
            display_progress_bar=False,
        )
    optimise_s = time.perf_counter() - started
    task_usage, reflection_usage = task.take_usage(), reflection.take_usage()
    best = result.candidates[result.best_idx][COMPONENT]
    seed_holdout = adapter.evaluate(slices.holdout, {COMPONENT: seed_instruction}).scores
    best_holdout = adapter.evaluate(slices.holdout, {COMPONENT: best}).scores
    holdout_usage = task.take_usage()
    accepted = sum(p["accepted"] for p in recorder.proposals)
    if not recorder.proposals:
        # GEPA logs a failing proposal step and goes on; a run that proposed nothing must not look like one
        # whose proposals were all worse.
        log.warning("GEPA made no proposal in %d metric calls: see the GEPA log lines above",
                    result.total_metric_calls or 0)
    return {
        "component": COMPONENT,
        "seed": {"instruction": seed_instruction, "val_score": round(result.val_aggregate_scores[0], 4),
                 "holdout_f1": _mean(seed_holdout)},
        "optimised": {"instruction": best, "candidate": result.best_idx,
                      "val_score": round(result.val_aggregate_scores[result.best_idx], 4),
                      "holdout_f1": _mean(best_holdout)},
        "holdout": {"rows": len(slices.holdout), "uids": [e.uid for e in slices.holdout],
                    "seed_scores": [round(s, 4) for s in seed_holdout],
                    "optimised_scores": [round(s, 4) for s in best_holdout]},
        "slices": {"train": [e.uid for e in slices.train], "val": [e.uid for e in slices.val]},
        "candidates": [{"instruction": c[COMPONENT], "parents": [p for p in result.parents[i] if p is not None],
                        "val_score": round(result.val_aggregate_scores[i], 4)}
                       for i, c in enumerate(result.candidates)],
        "proposals": recorder.proposals,
        "val_history": recorder.val_scores,
        "cost": {
            "metric_calls": int(result.total_metric_calls or recorder.metric_calls),
            "proposals": len(recorder.proposals), "accepted": accepted,
            "task": _usage(task_usage), "reflection": _usage(reflection_usage),
            "holdout": _usage(holdout_usage), "optimise_s": round(optimise_s, 1),
        },
        "models": {"task": plan.task.environment.served_name, "reflection": reflection.cfg.served_name},
        "budget": cfg.model_dump(),
    }


def report_metrics(content: dict[str, Any]) -> dict[str, float]:
    """reports/gepa/metrics.json: the headline numbers (F1 in points)."""
    cost = content["cost"]
    tokens = {f"{part}_{k}": cost[part][k] for part in ("task", "reflection")
              for k in ("calls", "prompt_tokens", "completion_tokens", "cost_usd")}
    return {
        "holdout_f1_seed": round(100 * content["seed"]["holdout_f1"], 2),
        "holdout_f1_optimised": round(100 * content["optimised"]["holdout_f1"], 2),
        "holdout_f1_delta": round(100 * (content["optimised"]["holdout_f1"] - content["seed"]["holdout_f1"]), 2),
        "val_score_seed": content["seed"]["val_score"], "val_score_optimised": content["optimised"]["val_score"],
        "metric_calls": cost["metric_calls"], "max_metric_calls": content["budget"]["max_metric_calls"],
        "proposals": cost["proposals"], "accepted": cost["accepted"],
        "kept_seed": int(content["optimised"]["candidate"] == 0), "candidates": len(content["candidates"]), "optimise_s": cost["optimise_s"], **tokens,
    }


def describe_gepa(metrics: dict[str, float]) -> str:
    """The gepa run's one-sentence description (and its part of the parent run's): the instruction it kept and
    why, the held-out F1, the proposals and the metric calls against the budget (`stage_figures.gepa_outcome`)."""
    return f"GEPA {gepa_outcome(metrics)}."


def history_frame(content: dict[str, Any]) -> pd.DataFrame:
    """reports/gepa/history.csv: the best val score so far after each candidate scored (the DVC plot)."""
    rows, best = [], float("-inf")
    for h in content["val_history"]:
        best = max(best, h["val_score"])
        rows.append({**h, "best_val_score": best})
    return pd.DataFrame(rows, columns=["iteration", "candidate", "val_score", "metric_calls", "best_val_score"])


def log_slice_inputs(source: Path, slices: Slices) -> None:
    """The three slices as MLflow dataset inputs of the active run (`source`: train.parquet, with its DVC md5)."""
    from pipeline.tracking.runs import log_dataset_inputs

    frames = {}
    for name in ("train", "val", "holdout"):
        rows = getattr(slices, name)
        frames[f"gepa/{name}"] = (pd.DataFrame({
            "uid": [r.uid for r in rows], "dataset": [r.dataset for r in rows],
            "question": [r.question for r in rows], "gold_answers": [json.dumps(list(r.answers)) for r in rows],
        }), source)
    log_dataset_inputs(frames, context="gepa")


def run_gepa(params: Params) -> dict[str, Any]:
    """Stage `gepa`: optimise, write prompt.json and reports/gepa/*, log the gepa MLflow run."""
    from pipeline.config.specs import tracking_spec
    from pipeline.tracking.runs import stage_run

    plan = GepaPlan.for_gepa(params)
    slices = load_slices(plan.train_file, plan.gepa)
    # The run is open for the whole search, so its duration in MLflow is the stage's.
    with stage_run(tracking_spec(params), "gepa"):
        log_slice_inputs(plan.train_file, slices)
        content = search_instruction(plan, slices)
        metrics = record_search(plan, content)
    log.info("GEPA %s", gepa_outcome(metrics))
    return content


def search_instruction(plan: GepaPlan, slices: Slices) -> dict[str, Any]:
    """Serve the task environment (when the plan says so), run the search against it and the reflection
    model (one cost ledger for both), and return the report with its wall time."""
    from pipeline.environment.client import EnvironmentClient
    from pipeline.environment.ledger import LEDGER_FILE
    from pipeline.environment.servers import serve_environment

    task_env, cache = plan.task.environment, plan.cache
    started = time.perf_counter()
    with serve_environment(plan.task):
        task = EnvironmentClient.in_cache_dir(task_env, plan.task.cache_dir)
        reflection = EnvironmentClient(plan.reflection, cache if task_env.cache else None,
                                       ledger_path=cache.with_name(LEDGER_FILE))
        try:
            content = optimise(plan, slices, task, reflection)
        finally:
            asyncio.run(task.aclose())
            asyncio.run(reflection.aclose())
    content["cost"]["wall_s"] = round(time.perf_counter() - started, 1)
    return content


def record_search(plan: GepaPlan, content: dict[str, Any]) -> dict[str, float]:
    """Write prompt.json and reports/gepa/{metrics.json,history.csv}; log them to the active run; return
    the metrics."""
    import mlflow

    from pipeline.data.schema import write_json_atomic, write_text_atomic
    from pipeline.environment.sanitize import sanitize_text, sanitized_json_copy
    from pipeline.tracking.prompts import PRODUCTION_ALIAS, register_instruction
    from pipeline.tracking.runs import describe_stage

    metrics = report_metrics(content)
    write_json_atomic(content, plan.prompt_file)
    write_json_atomic(metrics, plan.out_dir / METRICS_FILE)
    write_text_atomic(history_frame(content).to_csv(index=False), plan.out_dir / "history.csv")
    describe_stage("gepa", describe_gepa(metrics))
    mlflow.log_params({f"gepa.{k}": v for k, v in plan.gepa.model_dump().items()})
    mlflow.log_metrics({k: float(v) for k, v in metrics.items()})
    # The instruction and the examples are the reflection model's text: untrusted, sanitised.
    mlflow.log_text(sanitize_text(content["optimised"]["instruction"]), "gepa/optimised_instruction.txt")
    uri = register_instruction(sanitize_text(content["optimised"]["instruction"]),
                               kept_seed=bool(metrics["kept_seed"]))
    log.info("GEPA's instruction is %s (alias %s) in the Prompt Registry", uri, PRODUCTION_ALIAS)
    with tempfile.TemporaryDirectory() as tmp:
        mlflow.log_artifact(str(sanitized_json_copy(plan.prompt_file, Path(tmp))), artifact_path="gepa")
    return metrics
