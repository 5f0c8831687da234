"""The retraining flow: the DVC pipeline as a Prefect 3 flow, one task per stage, on a schedule or on demand.

    promptr1 flow run [--profile paper] [-S train.steps=8] [--force]     # once, now
    python -m flows.retrain --profile paper --environment vllm            # the same, without the CLI

Schedules and deployments are flows/deploy.py's; the environment server's tasks are
flows/environment_tasks.py's; the DVC calls are flows/dvc_steps.py's.

Roles: DVC decides *what* must rerun (hashes, dvc.lock), Prefect decides *when and where* and retries,
MLflow records *what happened*. Design decisions:

- **One task per DVC stage, each `dvc repro --single-item <stage>`** (sources, sample, validate, build, train,
  merge, evaluate, register, in DVC's dependency order read from dvc.yaml, see flows/dvc_steps.py). Going through
  DVC keeps caching, DVC's repo lock and dvc.lock true: a run of the flow leaves exactly the state a
  `dvc repro` would. A first `plan` task asks DVC which stages are stale; stages before the first stale one
  finish as "up to date" without spawning DVC, so a run with nothing to do costs about one `dvc status`.
  Stages marked `always_changed` (`sources`, the fingerprints of external data) always run first, and the
  plan is made again after them: only then does `dvc status` know whether the sources changed.
  Prefect's own task caching is off (`NO_CACHE`): DVC's cache is the result cache, and a second cache keyed
  on task inputs could only ever be wrong about data DVC hashes.
- **Overrides are recorded as a DVC experiment, not run through `dvc exp run`.** `dvc exp run -S …` would
  reproduce the whole pipeline inside one process, i.e. one opaque Prefect task with no per-stage state,
  retries or logs. Instead the flow applies the overrides with the function `dvc exp run --set-param` uses
  (same grammar: `train.steps=8`, `profiles/paper.yaml:train.lr=2e-6`), runs the stage tasks, then
  `dvc exp save -n retrain-<time>-<flow run>`: the experiment holds params, dvc.lock and metrics of exactly
  this run (`dvc exp show`, `dvc exp apply <name>`). Afterwards the touched params files are restored byte
  for byte, so an override never leaks into the next (scheduled) run, not even from a run killed with
  SIGKILL: the originals are journaled first and the next run restores them under the workspace lock
  (flows/dvc_steps.py says why a journal and not a temporary workspace); dvc.lock keeps recording what the
  outputs were built with, and the next run without overrides rebuilds what differs. `profile` and
  `environment` are overrides too (`profile=paper`, `environment.backend=vllm`; `local` means llamacpp).
  An experiment is saved only when something ran or was overridden, and only once the project has a git
  commit (the flow says so otherwise).
- **Environment lifecycle as tasks** (flows/environment_tasks.py): started and health-checked right before
  `train` and `evaluate` only if DVC says that stage will run (or `force`), stopped in a `finally` and by
  the flow's `on_crashed`/`on_cancellation` hooks.
- **Retries only where they are safe** (`STAGE_POLICIES`): `evaluate` (idempotent: same model, same rows,
  cached environment replies) and `register` (idempotent: registering/aliasing the same run again) retry with growing delays. `train` retries once and that is
  safe only because it *resumes*: `checkpoints/agent` is a `persist: true` output (DVC does not delete it
  before rerunning) and the stage restarts from the `latest` checkpoint (local backend) or with verl's
  `trainer.resume_mode=auto`, never from step 0. Data stages and `merge` are deterministic: a retry would
  fail the same way, so they fail fast.
- **Never two runs at once** (flows/run_lock.py): the Prefect global concurrency limit `promptr1-pipeline`
  with `flow.concurrency_limit` slots when the API has it (`promptr1 flow serve` creates it), plus a lock
  file in `.dvc/tmp/` that always guards the workspace. A second run waits up to `flow.lock_timeout_s`
  (manual, default 0) or `flow.scheduled_lock_timeout_s` (deployments) and then fails with a message naming
  the run holding the lock. The deployments also carry a deployment concurrency limit (ENQUEUE).
- **A markdown artifact per run** (`promptr1-retrain`): stage table with each stage's key figure, the
  evaluation table (reports/eval/summary.md), the promotion decision (reports/promotion.json) and the MLflow
  run (reports/mlflow_run.json; a UI link for an http(s) tracking server). Failed runs publish it too, with
  the error. The flow returns the same data as a dict. **Each stage task** logs its key figure
  (pipeline.stages.figures) and attaches an artifact `stage-<name>` with it and the stage's MLflow run, or
  with the error of a failed stage (flows/artifacts.py); its state message carries that error too.
- **Failure notifications** are Prefect automations, configured outside the code (flows/deploy.py,
  docs/prefect.md).
- **SIGTERM unwinds like Ctrl-C** in `promptr1 flow run` and `python -m flows.retrain`
  (`pipeline.runtime.terminate_as_interrupt`): the `finally` blocks stop the environment server and the
  running stage and restore params instead of the process dying mid-way.
- Tests and benchmarks swap the environment launcher and the retry delays through `run_pipeline_flow(…,
  launcher=…, policies=…)`; deployments always use the defaults.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, Literal

import typer
from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run as current_flow_run

from flows import dvc_steps, experiments
from flows.artifacts import publish_quietly, publish_report, publish_stage
from flows.environment_tasks import (
    EnvironmentSession,
    Launcher,
    check_environment,
    default_launcher,
    fetch_weights,
    start_environment,
    stop_environment,
    stop_live_environments,
)
from flows.policies import DEFAULT_POLICY, STAGE_POLICIES, StagePolicy, retry_unless_unhealthy
from flows.run_lock import run_lock
from flows.run_report import RunReport, flow_run_line, run_mlflow_line
from pipeline.checks.layout import assert_runnable
from pipeline.config import PARAMS_FILE, Params, find_root, load_params
from pipeline.errors import UserError
from pipeline.runtime import configure_logging, quiet_telemetry, terminate_as_interrupt
from pipeline.stages.figures import promotion_line
from pipeline.tracking.links import MlflowRunInfo

log = logging.getLogger(__name__)

FLOW_NAME = "promptr1-retrain"

EnvironmentChoice = Literal["local", "vllm", "api"]
ENVIRONMENT_BACKENDS: dict[str, str] = {"local": "llamacpp", "vllm": "vllm", "api": "api"}


@dataclass
class _Hooks:
    launcher: Launcher | None = None
    policies: Mapping[str, StagePolicy] | None = None


_hooks = _Hooks()


# ----------------------------------------------------------------------------------------------- tasks


@task(name="apply-overrides", cache_policy=NO_CACHE)
def apply_run_overrides(project_dir: str, overrides: list[str]) -> dict[Path, bytes]:
    """Write the run's overrides into params files (as `dvc exp run -S` does); return the originals."""
    logger = get_run_logger()
    originals = dvc_steps.apply_overrides(Path(project_dir), overrides)
    if overrides:
        logger.info("overrides applied: %s", " ".join(overrides))
    return originals


@task(name="plan", cache_policy=NO_CACHE)
def plan_run(project_dir: str) -> tuple[list[str], list[str], list[str]]:
    """(stages in run order, always-changed stages, the other stages DVC reports as stale).

    Called once before and once after the always-changed stages (the source fingerprints) have run:
    only then does `dvc status` tell whether the data they fingerprint changed.
    """
    root = Path(project_dir)
    stages = dvc_steps.pipeline_stages(root)
    always = dvc_steps.always_changed_stages(root)
    stale = dvc_steps.stale_stages(root) - always
    get_run_logger().info("stages: %s; always run: %s; stale now: %s", ", ".join(stages),
                          ", ".join(sorted(always)) or "none", ", ".join(sorted(stale)) or "none")
    return stages, sorted(always), sorted(stale)


@task(cache_policy=NO_CACHE, task_run_name="{stage}")
def run_stage(project_dir: str, stage: str, force: bool, skip: bool = False) -> dict[str, Any]:
    """`dvc repro --single-item <stage>`, output streamed to the task's log; key figure and MLflow run after.

    Both, or a failed stage's error, also go to the task's artifact `stage-<name>` (flows/artifacts.py).
    """
    logger = get_run_logger()
    root = Path(project_dir)
    start = datetime.now(UTC)
    result = "up to date"
    if skip:
        logger.info("%s is up to date (dvc status); not reproduced", stage)
    else:
        try:
            reproduced = dvc_steps.repro_stage(root, stage, force=force, on_line=logger.info)
        except dvc_steps.StageFailed as exc:
            publish_stage(root, stage, "failed", (datetime.now(UTC) - start).total_seconds(), error=str(exc))
            raise
        result = "reproduced" if reproduced else "unchanged (dvc skipped it)"
    outcome = publish_stage(root, stage, result, 0.0 if skip else (datetime.now(UTC) - start).total_seconds())
    logger.info("%s %s in %.1f s: %s", stage, result, outcome["seconds"], outcome["key_figure"])
    return outcome


@task(name="record-experiment", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=5)
def record_experiment(project_dir: str, name: str) -> str | None:
    """`dvc exp save -n <name>`: this run's params, dvc.lock and metrics as a DVC experiment."""
    logger = get_run_logger()
    saved = experiments.save_experiment(Path(project_dir), name, on_line=logger.info)
    if saved:
        logger.info("DVC experiment %s recorded (dvc exp show / dvc exp apply %s)", saved, saved)
    return saved


# ------------------------------------------------------------------------------------------------ flow


def run_overrides(profile: str | None, overrides: Sequence[str] | None,
                  environment: EnvironmentChoice | None) -> list[str]:
    """The `-S` list of one run: profile and environment choice first, explicit overrides last (they win)."""
    items: list[str] = []
    if profile:
        items.append(f"profile={profile}")
    if environment:
        if environment not in ENVIRONMENT_BACKENDS:
            raise UserError(f"environment {environment!r}: choose one of {', '.join(ENVIRONMENT_BACKENDS)}")
        items.append(f"environment.backend={ENVIRONMENT_BACKENDS[environment]}")
    items.extend(o for o in (overrides or []) if o.strip())
    return items


def _project_root(project_dir: str | None) -> Path:
    return find_root(Path(project_dir) if project_dir else None)


def _flow_run_name() -> str | None:
    try:
        return current_flow_run.get_name()
    except Exception:  # noqa: BLE001 - outside a flow run
        return None


def _flow_run_id() -> str | None:
    try:
        return current_flow_run.get_id()
    except Exception:  # noqa: BLE001 - outside a flow run
        return None


@flow(name=FLOW_NAME, on_crashed=[stop_live_environments], on_cancellation=[stop_live_environments],
      description="Prompt-R1 pipeline: DVC stages as tasks, environment lifecycle, DVC experiment, summary.")
def retrain(
    profile: str | None = None,
    overrides: list[str] | None = None,
    environment: EnvironmentChoice | None = None,
    force: bool = False,
    lock_timeout_s: float | None = None,
    project_dir: str | None = None,
) -> dict[str, Any]:
    """Run the Prompt-R1 pipeline once.

    Args:
        profile: profiles/<name>.yaml merged over params.yaml (default: params.yaml's `profile`).
        overrides: `key.sub=value` params overrides, as `dvc exp run -S` takes them.
        environment: local (llama.cpp server), vllm (GPU server) or api (paid endpoint); default: params.
        force: rerun every stage even if DVC finds it up to date.
        lock_timeout_s: seconds to wait for a running pipeline (default: flow.lock_timeout_s).
        project_dir: the project (folder with params.yaml; default: found from the working directory).
    """
    logger = get_run_logger()
    root = _project_root(project_dir)
    dvc_steps.require_dvc_project(root)
    base = load_params(root / PARAMS_FILE)
    items = run_overrides(profile, overrides, environment)
    timeout = base.flow.lock_timeout_s if lock_timeout_s is None else lock_timeout_s
    with run_lock(root, timeout, _flow_run_name()) as held:
        logger.info("holding the %s for %s", held, root)
        dvc_steps.recover_overrides(root)  # a run killed mid-way (SIGKILL) left its overrides: undo them
        originals = apply_run_overrides(str(root), items)
        try:
            params = load_params(root / PARAMS_FILE)
            assert_runnable(params)  # the layout check (`promptr1 check`) before any stage or server starts
            return _run_stages(root, params, items, force)
        finally:
            dvc_steps.restore_files(root, originals)
            if originals:
                logger.info("params files restored: %s", ", ".join(p.name for p in originals))


def _run_stages(root: Path, params: Params, items: list[str], force: bool) -> dict[str, Any]:
    logger = get_run_logger()
    policies = {**STAGE_POLICIES, **(_hooks.policies or {})}
    report = RunReport(flow_run=_flow_run_name(), profile=params.profile, overrides=items,
                       environment_backend=params.environment.backend, forced=force, flow_run_id=_flow_run_id())
    lock_file = root / "dvc.lock"
    lock_before = lock_file.read_bytes() if lock_file.is_file() else b""
    stages, always, stale = plan_run(str(root))
    session = EnvironmentSession(params, _hooks.launcher or default_launcher)
    try:
        # Always-changed stages (source fingerprints) run first; then DVC knows what else is stale.
        for stage in (s for s in stages if s in always):
            report.stages.append(run_stage.with_options(name=f"dvc-{stage}")(str(root), stage, force))
        if always:
            _, _, stale = plan_run(str(root))
        rest = [s for s in stages if s not in always]
        first_stale = 0 if force else next((i for i, s in enumerate(rest) if s in stale), len(rest))
        for index, stage in enumerate(rest):
            policy = policies.get(stage, DEFAULT_POLICY)
            skip = index < first_stale
            wants_environment = not skip and policy.needs_environment and session.url is None
            if wants_environment and (force or dvc_steps.stale_stages(root, [stage])):
                fetch_weights(params)
                report.environment_url = start_environment(session)
                check_environment(report.environment_url, params.environment.api_key_env)
            task_ = run_stage.with_options(name=f"dvc-{stage}", retries=policy.retries,
                                           retry_delay_seconds=list(policy.retry_delays_s) or 0,
                                           retry_condition_fn=retry_unless_unhealthy)
            report.stages.append(task_(str(root), stage, force, skip=skip))
    except BaseException as exc:
        report.stages.append({"stage": "(failed)", "result": f"{type(exc).__name__}: {str(exc)[:300]}",
                              "seconds": 0.0})
        publish_quietly(report, params)
        raise
    finally:
        if session.url is not None:
            stop_environment(session)

    lock_after = lock_file.read_bytes() if lock_file.is_file() else b""
    if items or lock_after != lock_before:
        stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
        name = f"retrain-{stamp}-{report.flow_run or 'local'}".replace("_", "-")
        report.experiment = record_experiment(str(root), name)
        if report.experiment is None:
            report.experiment_note = "not recorded: the project has no git commit yet"
    else:
        report.experiment_note = "none: nothing changed"
    report.read_results(params)
    publish_report(report)
    logger.info("MLflow: %s", run_mlflow_line(report.mlflow, report.mlflow_current))
    logger.info("promotion: %s", promotion_line(report.promotion))
    return report.to_dict()


# -------------------------------------------------------------------------------------- entry points


def run_pipeline_flow(
    project_dir: str | Path,
    profile: str | None = None,
    overrides: Sequence[str] = (),
    force: bool = False,
    *,
    environment: EnvironmentChoice | None = None,
    lock_timeout_s: float | None = None,
    launcher: Launcher | None = None,
    policies: Mapping[str, StagePolicy] | None = None,
    return_state: bool = False,
) -> Any:
    """Run the flow on `project_dir` in this process (tests, benchmarks, the CLI).

    `launcher` replaces `default_launcher` (a context manager yielding the base URL) and `policies`
    replaces per-stage retry policies; both only for this call. Returns the flow's summary dict, or its
    final Prefect state with `return_state=True` (then a failure does not raise).
    """
    global _hooks
    previous = _hooks
    _hooks = _Hooks(launcher=launcher, policies=policies)
    try:
        return retrain(profile=profile, overrides=list(overrides), environment=environment, force=force,
                       lock_timeout_s=lock_timeout_s, project_dir=str(project_dir), return_state=return_state)
    finally:
        _hooks = previous


def cli_flow_run(profile: str | None, sets: list[str], force: bool,
                 environment: EnvironmentChoice | None = None) -> None:
    """`promptr1 flow run`: run the flow now and print the MLflow run and the promotion decision."""
    root = find_root()
    with terminate_as_interrupt():
        state = run_pipeline_flow(root, profile, sets, force, environment=environment, return_state=True)
    if not state.is_completed():
        raise UserError(f"pipeline flow {state.name.lower()}: {state.message or 'see the Prefect logs'}")
    summary = state.result()
    info = MlflowRunInfo(**summary["mlflow"])  # this run's (flows/run_report.py), not whatever the files name now
    typer.echo(f"flow run:   {flow_run_line(summary.get('flow_run'), summary.get('flow_run_id'))}")
    for stage in summary.get("stages", []):
        typer.echo(f"  {stage['stage']:<10} {stage['result']} ({stage['seconds']:.1f} s): {stage.get('key_figure')}")
    typer.echo(f"experiment: {summary.get('experiment') or summary.get('experiment_note')}")
    typer.echo(f"MLflow:     {run_mlflow_line(info, summary.get('mlflow_current', True))}")
    typer.echo(f"promotion:  {promotion_line(summary.get('promotion'))}")


def _main(
    profile: Annotated[str | None, typer.Option("--profile", help="Profile to run (default: params.yaml's).")] = None,
    set_: Annotated[list[str] | None, typer.Option("--set", "-S", help="Override a param: key.sub=value.")] = None,
    environment: Annotated[str | None, typer.Option("--environment", help="local | vllm | api")] = None,
    force: Annotated[bool, typer.Option("--force", help="Rerun every stage.")] = False,
    project_dir: Annotated[str | None, typer.Option("--project-dir", help="Project folder (default: cwd).")] = None,
) -> None:
    """Run the Prompt-R1 pipeline once as a Prefect flow."""
    if project_dir:
        import os

        os.chdir(project_dir)
    cli_flow_run(profile, set_ or [], force, environment)  # type: ignore[arg-type]


if __name__ == "__main__":
    quiet_telemetry()
    configure_logging()
    try:
        typer.run(_main)
    except UserError as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise SystemExit(1) from None
