"""The Prefect artifacts of a flow run: its summary, and one per stage task with what the stage produced.

- `promptr1-retrain` (`publish_report`): the run's summary (flows/run_report.py `to_markdown`): stage table with
  key figures, evaluation table, promotion decision, MLflow run. Failed runs publish it too, with the error.
- `stage-<name>` (`publish_stage`), attached to the stage's task run: the flow run (name and id), result,
  seconds, key figure
  (pipeline.stages.figures), the stage's MLflow run (pipeline.tracking.links), or the error of a failed stage,
  so a task's Prefect page answers "what came out" without opening its logs. Prefect artifact keys allow
  lowercase letters, digits and dashes only (`stage_artifact_key`).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from flows.run_report import RunReport, flow_run_line, stage_markdown, to_markdown
from pipeline.config import PARAMS_FILE, ConfigError, Params, load_params
from pipeline.config.specs import stage_folders, tracking_spec
from pipeline.stages.figures import key_figure
from pipeline.tracking.links import MlflowRunInfo, stage_mlflow_run

log = logging.getLogger(__name__)

ARTIFACT_KEY = "promptr1-retrain"


def stage_artifact_key(stage: str) -> str:
    """Prefect artifact key of a stage task: `stage-<name>` in lowercase letters, digits and dashes only."""
    return "stage-" + re.sub(r"[^a-z0-9-]+", "-", stage.lower()).strip("-")


def current_flow_run() -> tuple[str | None, str | None]:
    """(name, id) of the Prefect flow run this runs in; (None, None) outside one."""
    from prefect.runtime import flow_run

    try:
        return flow_run.get_name(), flow_run.get_id()
    except Exception:  # noqa: BLE001 - outside a flow run
        return None, None


def stage_figure_and_run(root: Path, stage: str) -> tuple[str, MlflowRunInfo]:
    """The stage's key figure and its MLflow run, read with the params at `root` (a line saying why there is
    neither when the params are unreadable)."""
    try:
        params = load_params(root / PARAMS_FILE)
    except ConfigError as exc:
        return f"no figure (params unreadable: {exc})", MlflowRunInfo(open_hint=f"params unreadable: {exc}")
    return key_figure(stage_folders(params), stage), stage_mlflow_run(tracking_spec(params), stage)


def publish_stage(root: Path, stage: str, result: str, seconds: float, error: str | None = None) -> dict[str, Any]:
    """Attach the stage's artifact to the running task; return its outcome (the task's return value).

    A failed stage (`error`) gets its error and no figure: its outputs, if any, are the previous run's.
    Never raises: a report that cannot be published must not fail (and retry) the stage it reports on.
    """
    figure: str | None = None
    mlflow: MlflowRunInfo | None = None
    if error is None:
        figure, mlflow = stage_figure_and_run(root, stage)
    try:
        markdown = stage_markdown(stage, result, seconds, figure, mlflow, error=error,
                                  flow_run=flow_run_line(*current_flow_run()))
        create_markdown_artifact(markdown=markdown,
                                 key=stage_artifact_key(stage), description=f"{stage}: {figure or result}"[:500])
    except Exception as exc:  # noqa: BLE001 - see docstring
        log.warning("could not publish the artifact of stage %s: %s", stage, exc)
    return {"stage": stage, "result": result, "seconds": seconds, "key_figure": figure,
            "mlflow_run_id": mlflow.run_id if mlflow else None, "mlflow_link": mlflow.link if mlflow else None,
            "mlflow_hint": mlflow.open_hint if mlflow else None}


@task(name="publish-report", cache_policy=NO_CACHE)
def publish_report(report: RunReport) -> str:
    """The run's markdown artifact (key promptr1-retrain)."""
    markdown = to_markdown(report)
    create_markdown_artifact(markdown=markdown, key=ARTIFACT_KEY,
                             description=f"Prompt-R1 retraining ({report.profile}): evaluation, promotion, MLflow")
    return markdown


def publish_quietly(report: RunReport, params: Params) -> None:
    """Publish the failure summary; never mask the stage's own error."""
    try:
        report.read_results(params)
        publish_report(report)
    except Exception as exc:  # noqa: BLE001
        log.warning("could not publish the failure summary: %s", exc)
