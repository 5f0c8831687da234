"""Stage `register`: log the merged agent to MLflow, register a version, and move `champion` by a stated rule.

The straight path (`run_register`): read the candidate's evaluation averages (reports/eval/metrics.json)
→ inside the `register` child run, log the pyfunc `agent` model, registering a new version of
`register.model_name` → read the current champion's averages from its version tags → decide → set the alias
(or not) → write reports/promotion.json, tag and describe the version (lineage: pipeline/tracking/lineage.py),
delete never-champion versions beyond `register.keep_versions`, print.

Promotion rule: pipeline/tracking/promotion.py (`decide_promotion`).

Fail closed (the alias is what serving trusts, so doubt keeps the champion):
- The champion is read or the stage stops: only MLflow's "alias not found" / "model not found" mean "no
  champion"; any other error (store down, permissions) raises, after the version is registered but before
  the alias could move.
- A champion without recorded evaluation (`eval.*` tags), without a recorded metrics mode, or without the
  promotion metric is *kept*: it cannot be shown worse. (To replace it deliberately, delete the alias.)
- A candidate that lacks an OOD average the champion has is not promoted: the OOD guard cannot be skipped.
- The alias moves under a file lock (`<cache_dir>/register-<model>.lock`) after re-reading the champion, so
  two registers at once cannot both move it on a stale comparison.
- **A killed register leaves no orphan version.** The whole registration (log, tag, decide, record) runs
  under a second lock (`register-<model>.registering.lock`), released by the OS when its holder dies, even
  by SIGKILL. So at the start, under that lock, a version logged by a `register` run but without a
  `promotion.decision` tag was left by a register that died mid-way: it is deleted (its run marked KILLED), unless the alias already points at it
  (the kill came after the alias moved, on a decision already taken with its `eval.*` tags): then it is
  tagged `promoted` with the reason "recovered". The rerun registers its own version as usual.

A model whose train run the health gate stopped (tag `health.breach`, pipeline/train/health_gate.py) is refused first,
and so is one whose train run did not reach its total (`train.progress.*` tags, pipeline/train/completion.py:
the figures the train stage decides "complete" with).

Experiment profiles never touch production: for a profile in `EXPERIMENT_PROFILES` (`learn` and `learn-hops`,
the learning experiments) the stage refuses to run when `register.alias` is the production `champion`, before anything is
logged; those profiles register under their own model name and alias (profiles/learn.yaml).

Where the decision goes: `reports/promotion.json`, tags `promotion.*` on the new version (and the
candidate's averages as `eval.*` tags, which is where the next run reads the champion's numbers from), the
register run's tags/metrics, and one printed line.

Models: one copy per version. The registered pyfunc `agent` (pipeline/serving/agent_model.py) bundles the merged
directory (copied from the *path*, never loaded), the environment configuration (key variable name only) and
the pipeline code, logged from code (pipeline/serving/model_code.py); `artifacts/agent` is the HF model. No second log
(transformers flavor) of the same directory: it would double every registration (1.1 GB a run) for nothing the registry uses.
`pip_requirements` are pinned so MLflow does not load the model again to infer them.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.data.schema import write_json_atomic
from pipeline.errors import UserError
from pipeline.stage_files import EVAL_REPORTS_DIR, EVAL_SETS_DIR, METRICS_FILE, PROMOTION_FILE
from pipeline.tracking.lineage import current_champion
from pipeline.tracking.model_record import describe_logged_model, model_params
from pipeline.tracking.promotion import (
    EvalAverages,
    PromotionDecision,
    check_metric,
    decide_promotion,
    register_sentence,
    rival_scores,
)

if TYPE_CHECKING:
    from pipeline.config import Params, RegisterConfig
    from pipeline.config.specs import TrackingSpec

log = logging.getLogger(__name__)

PRODUCTION_ALIAS = "champion"
EXPERIMENT_PROFILES = frozenset({"learn", "learn-hops"})
"""Profiles whose models are experiments: they may never move the production alias."""


@dataclass(frozen=True)
class RegisterPlan:
    """What the stage resolves from the params, once, at its entry (`run_register`), and hands down."""

    profile: str
    register: RegisterConfig
    root: Path
    model_dir: Path
    """The merged agent (`paths.model_dir`) as the params name it (the version description shows it)."""
    model_dir_param: str
    metrics_file: Path
    """The candidate's evaluation (`<paths.reports_dir>/eval/metrics.json`)."""
    promotion_file: Path
    lock_dir: Path
    """Where the promotion locks live (`paths.cache_dir`)."""
    environment_json: dict[str, Any]
    """What the registered pyfunc bundles as its environment (`environment_json`)."""
    model_config: dict[str, Any]
    """The pyfunc's model config (`_agent_model_config`)."""
    model_params: dict[str, str]
    """The `agent` and `train` settings the agent was trained with, as its LoggedModel's params."""
    eval_sets_dir: Path
    """`<paths.rl_dir>/eval`: the evaluation sets its LoggedModel's metrics were measured on."""

    @classmethod
    def for_register(cls, params: Params) -> RegisterPlan:
        reports_dir = params.path(params.paths.reports_dir)
        return cls(profile=params.profile, register=params.register, root=params.root,
                   model_dir=params.path(params.paths.model_dir), model_dir_param=params.paths.model_dir,
                   metrics_file=reports_dir / EVAL_REPORTS_DIR / METRICS_FILE, promotion_file=reports_dir / PROMOTION_FILE,
                   lock_dir=params.path(params.paths.cache_dir), environment_json=environment_json(params),
                   model_config=_agent_model_config(params),
                   model_params=model_params({"agent": params.agent.model_dump(mode="json"),
                                              "train": params.train.model_dump(mode="json")}),
                   eval_sets_dir=params.path(params.paths.rl_dir) / EVAL_SETS_DIR)


def check_production_alias(profile: str, cfg: RegisterConfig) -> None:
    """Raise UserError when an experiment profile would move the production `champion` alias."""
    if profile in EXPERIMENT_PROFILES and cfg.alias == PRODUCTION_ALIAS:
        raise UserError(f"profile {profile!r} is an experiment: it may not move the production alias "
                        f"{PRODUCTION_ALIAS!r} (set register.alias to another name, as profiles/{profile}.yaml "
                        "does)")


def check_training_health(tracking: TrackingSpec) -> None:
    """Raise UserError, before anything is logged, when this execution's train run breached the health gate."""
    from pipeline.tracking.runs import HEALTH_BREACH_TAG, breached_train_run

    run = breached_train_run(tracking)
    if run is not None:
        tags = run.data.tags
        raise UserError(f"train run {run.info.run_id} was stopped by the training health gate "
                        f"({HEALTH_BREACH_TAG}={tags[HEALTH_BREACH_TAG]} at step {tags.get('health.breach_step', '?')}):"
                        " its model is never registered or promoted; fix the run (or train.health) and train again")


def check_training_complete(tracking: TrackingSpec) -> None:
    """Raise UserError, before anything is logged, when this execution's train run did not reach its total.

    The train run carries how far training got (`train.progress.*` tags, pipeline/train/completion.py), on the
    figures the train stage decided "complete" with; a run without the record (older than it) is not refused.
    """
    from pipeline.tracking.runs import newest_train_run
    from pipeline.train.completion import TrainingProgress

    run = newest_train_run(tracking)
    progress = TrainingProgress.from_tags(run.data.tags) if run is not None else None
    if progress is not None and not progress.complete:
        raise UserError(f"train run {run.info.run_id} ended at {progress.describe()}: training is not complete, so its "
                        "model is never registered or promoted; run `promptr1 train` again (it resumes from the "
                        "last checkpoint)")


# --- MLflow models -----------------------------------------------------------------------------------


def _pip_requirements() -> list[str]:
    from importlib.metadata import version

    reqs = []
    for pkg in ("mlflow", "torch", "transformers", "openai", "pandas", "pydantic", "pyyaml", "numpy"):
        try:
            reqs.append(f"{pkg}=={version(pkg).split('+')[0]}")
        except Exception:  # noqa: BLE001 - a package missing here is simply not pinned
            reqs.append(pkg)
    return reqs


def _agent_model_config(params: Params) -> dict[str, Any]:
    from pipeline.agent.serving_policy import engine_model_config
    from pipeline.config import evaluated_agent

    return {
        # which engine generates when served (base GGUF, engine, slots)
        **engine_model_config(params.agent, params.register.serve, params.evaluate),
        # the agent as evaluation rolled it out, whole: the pyfunc reads it back with AgentConfig.from_dump
        "agent": evaluated_agent(params.agent, params.evaluate).model_dump(mode="json"),
        "default_dataset": params.data.id_eval_datasets[0] if params.data.id_eval_datasets else "hotpotqa",
        "environment": {},
    }


def environment_json(params: Params) -> dict[str, Any]:
    """The environment configuration the pyfunc bundles: endpoint, model, sampling, key *variable name*."""
    env = params.environment.model_dump(mode="json")
    env["base_url"] = params.environment.url  # a concrete endpoint, whatever host/port/base_url said
    env["cache"] = False
    return env


def log_models(plan: RegisterPlan, tmp_dir: Path) -> Any:
    """Log the registered pyfunc agent (one copy of the model) in the active run; return its ModelInfo."""
    import mlflow
    import mlflow.pyfunc

    import pipeline
    from pipeline.serving.agent_model import AGENT_ARTIFACT, ENVIRONMENT_ARTIFACT, MODEL_CODE, signature

    reqs = _pip_requirements()
    env_file = tmp_dir / "environment.json"
    env_file.write_text(json.dumps(plan.environment_json, indent=2))
    return mlflow.pyfunc.log_model(
        name="agent",
        python_model=str(MODEL_CODE),  # models from code: no CloudPickle (pipeline/serving/model_code.py)
        artifacts={AGENT_ARTIFACT: str(plan.model_dir), ENVIRONMENT_ARTIFACT: str(env_file)},
        model_config=plan.model_config,
        code_paths=[str(Path(pipeline.__file__).parent)],
        signature=signature(),
        pip_requirements=reqs,
        registered_model_name=plan.register.model_name,
    )


def judge_against_champion(client: Any, candidate: EvalAverages, cfg: RegisterConfig) -> tuple[Any, EvalAverages | None,
                                                                                               PromotionDecision]:
    """(champion version or None, its averages, the decision) from the registry as it is now."""
    champ_version = current_champion(client, cfg.model_name, cfg.alias)
    champion = EvalAverages.from_tags(dict(champ_version.tags)) if champ_version is not None else None
    if champ_version is not None and champion is None:
        return champ_version, None, PromotionDecision(False, [
            (f"champion v{champ_version.version} has no recorded evaluation (eval.* tags): it cannot be compared, "
            "kept (delete the alias to replace it deliberately)")])
    return champ_version, champion, decide_promotion(candidate, champion, cfg)


# --- the stage ---------------------------------------------------------------------------------------


def promotion_lock(folder: Path, model_name: str, purpose: str = "", timeout_s: float = 600.0) -> Any:
    """An inter-process lock (one per registered model) in `folder` (`paths.cache_dir`): around reading the
    champion and moving the alias, or with `purpose="registering"` around a whole registration."""
    from filelock import FileLock

    folder.mkdir(parents=True, exist_ok=True)
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in model_name)
    return FileLock(str(folder / f"register-{safe}{'.' + purpose if purpose else ''}.lock"), timeout=timeout_s)


def settle_orphans(client: Any, cfg: RegisterConfig) -> list[str]:
    """Delete the versions a killed register left without a decision (see the module docstring); returns them.

    Call only under `promotion_lock(folder, name, "registering")`: no live register holds an undecided version.
    """
    champion = current_champion(client, cfg.model_name, cfg.alias)
    settled = []
    for mv in client.search_model_versions(f"name = '{cfg.model_name}'"):
        run = client.get_run(mv.run_id) if mv.run_id else None
        if "promotion.decision" in mv.tags or run is None or run.data.tags.get("stage") != "register":
            continue  # decided, or not made by this stage (registered by hand): never ours to settle
        if champion is not None and str(champion.version) == str(mv.version):
            client.set_model_version_tag(cfg.model_name, mv.version, "promotion.decision", "promoted")
            client.set_model_version_tag(cfg.model_name, mv.version, "promotion.reason",
                                         "recovered: its register was killed after the alias moved")
        else:
            client.delete_model_version(cfg.model_name, mv.version)
        if run.info.status == "RUNNING":
            client.set_terminated(mv.run_id, "KILLED")
        settled.append(str(mv.version))
    if settled:
        log.warning("register: settled version(s) %s of %s left by a register that was killed",
                    ", ".join(settled), cfg.model_name)
    return settled


def run_register(params: Params) -> dict[str, Any]:
    """Stage 7: register a new version; move the champion alias when the rule holds. Returns promotion.json."""
    import tempfile

    import mlflow

    from pipeline.config.specs import tracking_spec
    from pipeline.tracking.runs import stage_run

    plan = RegisterPlan.for_register(params)
    tracking = tracking_spec(params)
    evaluation, candidate = read_candidate(plan)
    check_training_health(tracking)
    check_training_complete(tracking)
    with (promotion_lock(plan.lock_dir, plan.register.model_name, "registering"),
          stage_run(tracking, "register") as run, tempfile.TemporaryDirectory() as tmp):
        result = register_and_promote(plan, tracking, run, evaluation, candidate, Path(tmp))
        write_json_atomic(result, plan.promotion_file)
        mlflow.log_artifact(str(plan.promotion_file))
    # the stage's closing line (pipeline.stages.figures) says it once on the console
    log.debug("%s v%s: %s (%s → v%s). %s", result["model_name"], result["version"], result["decision"],
              result["alias"], result["champion_after"], "; ".join(result["reasons"]))
    return result


def read_candidate(plan: RegisterPlan) -> tuple[dict[str, Any], EvalAverages]:
    """The evaluation (reports/eval/metrics.json) and its averages, after the checks that come before any
    version is registered: the profile may move this alias, the merged agent exists, the metric is there."""
    check_production_alias(plan.profile, plan.register)
    if not plan.model_dir.exists():
        raise UserError(f"no merged agent at {plan.model_dir}: run `promptr1 merge` (dvc repro merge) first")
    if not plan.metrics_file.is_file():
        raise UserError(f"{plan.metrics_file} is missing: run `promptr1 evaluate` first")
    evaluation = json.loads(plan.metrics_file.read_text())
    candidate = EvalAverages.from_metrics_json(evaluation)
    check_metric(candidate, plan.register.metric)
    return evaluation, candidate


def register_and_promote(plan: RegisterPlan, tracking: TrackingSpec, run: Any, evaluation: dict[str, Any],
                         candidate: EvalAverages, tmp: Path) -> dict[str, Any]:
    """Inside the open register run, under the registering lock: settle orphans, log and register the
    model, decide against the champion and move the alias, tag and describe the version, prune; return
    what reports/promotion.json records."""
    import mlflow

    from pipeline.tracking import lineage
    from pipeline.tracking.runs import (
        describe_stage,
        link_parent_to_model_version,
        log_parent_metrics,
        parent_run_id,
    )

    cfg = plan.register
    client = mlflow.MlflowClient()
    settle_orphans(client, cfg)
    info = log_models(plan, tmp)
    version = str(info.registered_model_version)
    for key, value in candidate.to_tags().items():
        client.set_model_version_tag(cfg.model_name, version, key, value)
    # Decide and move under one lock, on the champion as it is at that moment.
    with promotion_lock(plan.lock_dir, cfg.model_name):
        champ_version, champion, decision = judge_against_champion(client, candidate, cfg)
        if decision.promote:
            client.set_registered_model_alias(cfg.model_name, cfg.alias, version)
    current = current_champion(client, cfg.model_name, cfg.alias)
    after = current.version if current is not None else None
    tag_decision(client, cfg, version, decision, run.info.run_id)
    tags = lineage.lineage_tags(client, plan.model_dir, plan.root, parent_run_id(tracking))
    for key, value in tags.items():
        client.set_model_version_tag(cfg.model_name, version, key, value)
    description = lineage.version_description(tags, candidate.id, decision.verdict, decision.reason,
                                              metric=cfg.metric, profile=plan.profile, model_dir=plan.model_dir_param)
    client.update_model_version(cfg.model_name, version, description)
    pruned = lineage.prune_never_champion(client, cfg.model_name, cfg.keep_versions)
    mlflow.set_tags({"promotion.decision": decision.verdict, "registered_model": cfg.model_name,
                     "registered_version": version})
    mlflow.log_metric("promoted", float(decision.promote))
    log_parent_metrics({"promoted": float(decision.promote)})  # a headline figure of the pipeline run
    link_parent_to_model_version(cfg.model_name, version, getattr(info, "model_id", None))
    describe_logged_model(getattr(info, "model_id", None), plan.model_params, evaluation,
                          {name: plan.eval_sets_dir / f"{name}.parquet" for name in evaluation.get("per_dataset", {})})
    describe_stage("register", register_sentence(cfg.model_name, version, decision, cfg.alias, after, candidate,
                                                 cfg.metric, rival_scores(evaluation, cfg.metric)))
    return {
        "model_name": cfg.model_name, "version": version, "alias": cfg.alias, "promoted": decision.promote,
        "decision": decision.verdict, "champion_before": str(champ_version.version) if champ_version is not None else None,
        "champion_after": str(after) if after is not None else None, "model_uri": f"models:/{cfg.model_name}@{cfg.alias}",
        "rule": {"metric": cfg.metric, "margin": cfg.margin, "ood_tolerance": cfg.ood_tolerance,
                 "ci_rule": cfg.ci_rule},
        "reasons": decision.reasons, "checks": decision.checks,
        "candidate": asdict(candidate), "champion": asdict(champion) if champion is not None else None,
        "run_id": run.info.run_id, "lineage": tags, "pruned_versions": pruned,
    }


def tag_decision(client: Any, cfg: RegisterConfig, version: str, decision: PromotionDecision, run_id: str) -> None:
    """The `promotion.*` tags on the new version: verdict, reasons, the rule as configured, the deciding run
    (and the promotion date when promoted). A version with `promotion.decision` is never an orphan."""
    from pipeline.tracking import lineage

    client.set_model_version_tag(cfg.model_name, version, "promotion.decision", decision.verdict)
    client.set_model_version_tag(cfg.model_name, version, "promotion.reason", decision.reason[:4900])
    client.set_model_version_tag(cfg.model_name, version, "promotion.rule",
                                 f"{cfg.ci_rule}; metric={cfg.metric}; margin={cfg.margin}; "
                                 f"ood_tolerance={cfg.ood_tolerance}")
    client.set_model_version_tag(cfg.model_name, version, "source_run_id", run_id)
    if decision.promote:
        client.set_model_version_tag(cfg.model_name, version, lineage.PROMOTION_DATE_TAG, lineage.promotion_date())
