"""The run summary and each stage task's report, as markdown and as data.

Read from the files the stages write (contracts): `reports/eval/summary.md` (evaluate),
`reports/promotion.json` (register), `reports/mlflow_run.json` (train, via pipeline.tracking.runs), and each
stage's key figure (pipeline.stages.figures). A missing file is reported as missing, never invented. The
MLflow link is a real UI link only for an http(s) tracking server; for the default SQLite store the summary
gives the `mlflow ui` command that opens it (pipeline.tracking.links).

The summary says what *this* run did, never what an earlier one left in those files: the promotion decision
comes from promotion.json only when this run reproduced `register`; otherwise it reads "no new version;
champion is vN, promoted by run … on …" from the MLflow registry (pipeline.tracking.lineage.champion_status).
Likewise the MLflow run is this run's only when a stage that logs to MLflow (`MLFLOW_STAGES`) was
reproduced; otherwise (a run that changed nothing) the summary says `up to date (last run <run>: <link or
command>)`, the same words every stage artifact of an up-to-date stage uses (`up_to_date`), and the evaluation
section links reports/eval/summary.md (the last run's) instead of embedding it as if this run had written it.

A stage task's artifact (`stage_markdown`, published by flows/artifacts.py) holds its result, key figure and
MLflow run, or its error when it failed, and names the flow run (name and id) it belongs to.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pipeline.config import Params
from pipeline.config.specs import tracking_spec
from pipeline.paths import display_path
from pipeline.stage_files import EVAL_REPORTS_DIR, EVAL_SUMMARY_FILE, PROMOTION_FILE
from pipeline.stages.figures import promotion_line
from pipeline.tracking.lineage import champion_status
from pipeline.tracking.links import (
    MlflowRunInfo,
    mlflow_line,
    mlflow_run_info,
    where_to_open,
)
from pipeline.tracking.runs import DESCRIBED_STAGES

__all__ = ["RunReport", "flow_run_line", "read_eval_summary", "read_promotion", "run_mlflow_line", "stage_markdown",
           "to_markdown", "up_to_date"]

EVAL_SUMMARY = Path(EVAL_REPORTS_DIR) / EVAL_SUMMARY_FILE
MLFLOW_STAGES = DESCRIBED_STAGES
"""The stages that log an MLflow run (each a child of the pipeline run; pipeline.tracking.runs)."""
REPRODUCED = "reproduced"


@dataclass
class RunReport:
    """Everything the run summary shows; also the flow's return value (as a dict)."""

    flow_run: str | None
    profile: str
    overrides: list[str]
    environment_backend: str
    forced: bool
    stages: list[dict[str, Any]] = field(default_factory=list)
    experiment: str | None = None
    experiment_note: str | None = None
    environment_url: str | None = None
    eval_summary: str | None = None
    promotion: dict[str, Any] | None = None
    mlflow: MlflowRunInfo = field(default_factory=MlflowRunInfo)
    mlflow_current: bool = True
    """False when no stage of this run logs to MLflow: `mlflow` is then the last pipeline run, not this one's."""
    eval_summary_path: str | None = None
    """reports/eval/summary.md, linked (not embedded) when this run did not reproduce `evaluate`."""
    flow_run_id: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def reproduced(self, stage: str) -> bool:
        """True when this run executed `stage` (not skipped as up to date; `sample@x` counts as `sample`)."""
        return any(str(s.get("stage", "")).split("@", 1)[0] == stage and s.get("result") == REPRODUCED
                   for s in self.stages)

    def read_results(self, params: Params) -> None:
        """Fill the evaluation table, promotion decision and MLflow run: this run's (module docstring)."""
        reports_dir = params.path(params.paths.reports_dir)
        self.eval_summary = read_eval_summary(reports_dir)
        self.eval_summary_path = display_path(reports_dir / EVAL_SUMMARY, params.root)
        tracking = tracking_spec(params)
        self.promotion = (read_promotion(reports_dir) if self.reproduced("register")
                          else champion_status(params.register, tracking))
        self.mlflow = mlflow_run_info(tracking)
        self.mlflow_current = any(self.reproduced(stage) for stage in MLFLOW_STAGES)


def read_promotion(reports_dir: Path) -> dict[str, Any] | None:
    """reports/promotion.json (`reports_dir`: paths.reports_dir), or None when it is missing or unreadable."""
    path = reports_dir / PROMOTION_FILE
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else {"value": data}


def read_eval_summary(reports_dir: Path) -> str | None:
    """reports/eval/summary.md (`reports_dir`: paths.reports_dir), or None when it is missing or empty."""
    path = reports_dir / EVAL_SUMMARY
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def up_to_date(info: MlflowRunInfo) -> str:
    """What an up-to-date run or stage says of MLflow: it logged nothing; the last run and where to open it."""
    if not info.run_id:
        return f"up to date (no last run: {mlflow_line(info)})"
    where = where_to_open(info)
    return f"up to date (last run {info.run_id}: {where})" if where else f"up to date (last run {info.run_id})"


def run_mlflow_line(info: MlflowRunInfo, current: bool) -> str:
    """The run's MLflow line: its own pipeline run, or `up to date (last run …)` when it logged none."""
    return mlflow_line(info) if current else up_to_date(info)


def flow_run_line(name: str | None, run_id: str | None) -> str:
    """`<name> (<id>)`, or what is known of it; `local run` outside Prefect."""
    if name and run_id:
        return f"{name} ({run_id})"
    return name or run_id or "local run"


def to_markdown(report: RunReport) -> str:
    """The run's markdown artifact."""
    url = f" ({report.environment_url})" if report.environment_url else ""
    experiment = f"`{report.experiment}`" if report.experiment else (report.experiment_note or "none")
    lines = [
        f"# Prompt-R1 retraining — {flow_run_line(report.flow_run, report.flow_run_id)}",
        "",
        f"- **Profile:** `{report.profile}`  **Environment:** `{report.environment_backend}`{url}",
        f"- **Forced:** {'yes' if report.forced else 'no'}",
        f"- **Overrides:** {', '.join(f'`{o}`' for o in report.overrides) or 'none'}",
        f"- **DVC experiment:** {experiment}",
        f"- **MLflow:** {run_mlflow_line(report.mlflow, report.mlflow_current)}",
        f"- **Promotion:** {promotion_line(report.promotion)}",
        "",
        "## Stages",
        "",
        "| stage | result | seconds | key figure |",
        "|---|---|---:|---|",
    ]
    for stage in report.stages:
        figure = _cell(stage.get("key_figure") or "")
        lines.append(f"| {stage['stage']} | {_cell(stage['result'])} | {stage['seconds']:.1f} | {figure} |")
    if report.mlflow_current or report.eval_summary is None:
        evaluation = report.eval_summary or "_reports/eval/summary.md not found_"
    else:  # a run that logged nothing: the summary is the last run's, shown as such, one heading level down
        shown = "\n".join(f"#{line}" if line.startswith("#") else line for line in report.eval_summary.splitlines())
        evaluation = (f"_This run evaluated nothing: {up_to_date(report.mlflow)}. Its summary "
                      f"({report.eval_summary_path or EVAL_SUMMARY}) follows._\n\n{shown}")
    lines += ["", "## Evaluation", "", evaluation, ""]
    if report.promotion is not None:
        lines += ["## Promotion decision", "", "```json", json.dumps(report.promotion, indent=2, sort_keys=True),
                  "```", ""]
    return "\n".join(lines)


def stage_markdown(stage: str, result: str, seconds: float, figure: str | None, mlflow: MlflowRunInfo | None,
                   error: str | None = None, flow_run: str = "local run") -> str:
    """A stage task's artifact: what came out (key figure, MLflow run) or, for a failed stage, its error; a
    stage this run did not reproduce points at its last MLflow run as such (`up_to_date`)."""
    lines = [f"# {stage}: {result}", "", f"- **Flow run:** {flow_run}", f"- **Seconds:** {seconds:.1f}"]
    if figure is not None:
        lines.append(f"- **Key figure:** {figure}")
    if mlflow is not None:
        if result != REPRODUCED and error is None:
            where = up_to_date(mlflow)
        else:
            where = f"[run {mlflow.run_id}]({mlflow.link})" if mlflow.link else mlflow_line(mlflow)
        lines.append(f"- **MLflow:** {where}")
    if error:
        lines += ["", "## Error", "", "~~~text", error.replace("~~~", "~ ~ ~"), "~~~"]
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    """Text safe inside a markdown table cell (one line, no column breaks)."""
    return " ".join(str(text).split()).replace("|", "\\|")
