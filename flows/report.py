"""The run summary and each stage task's report, as markdown and as data.

Read from the files the stages write (contracts): `reports/eval/summary.md` (evaluate),
`reports/promotion.json` (register), `reports/mlflow_run.json` (train, via pipeline.tracking), and each
stage's key figure (pipeline.stage_figures). A missing file is reported as missing, never invented. The
MLflow link is a real UI link only for an http(s) tracking server; for the default SQLite store the summary
gives the `mlflow ui` command that opens it (pipeline.mlflow_links, re-exported here under the names this
module always had).

The summary says what *this* run did, never what an earlier one left in those files: the promotion decision
comes from promotion.json only when this run reproduced `register`; otherwise it reads "no new version;
champion is vN, promoted by run … on …" from the MLflow registry (pipeline.registry_lineage.champion_status).
Likewise the MLflow run is linked only when a stage that logs to MLflow (`MLFLOW_STAGES`) was reproduced;
otherwise the summary says no stage of this run logged one and names the last pipeline run without linking
it as this run's.

A stage task's artifact (`stage_markdown`, published by flows/artifacts.py) holds its result, key figure and
MLflow run, or its error when it failed.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pipeline.config import Params
from pipeline.mlflow_links import MlflowRunInfo, mlflow_line, mlflow_run_info, strip_credentials
from pipeline.registry_lineage import champion_status
from pipeline.stage_figures import promotion_line
from pipeline.tracking import DESCRIBED_STAGES

__all__ = ["MlflowRunInfo", "RunReport", "mlflow_line", "mlflow_run_info", "promotion_line", "read_eval_summary",
           "read_promotion", "stage_markdown", "strip_credentials", "to_markdown"]

EVAL_SUMMARY = Path("eval") / "summary.md"
PROMOTION = Path("promotion.json")
MLFLOW_STAGES = DESCRIBED_STAGES
"""The stages that log an MLflow run (each a child of the pipeline run; pipeline.tracking)."""
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
        self.promotion = read_promotion(reports_dir) if self.reproduced("register") else champion_status(params)
        if any(self.reproduced(stage) for stage in MLFLOW_STAGES):
            self.mlflow = mlflow_run_info(params)
        else:
            last = mlflow_run_info(params).run_id
            self.mlflow = MlflowRunInfo(open_hint="none: no stage of this run logs to MLflow (nothing was trained, "
                                        "evaluated or registered)" + (f"; the last pipeline run is {last}" if last else ""))


def read_promotion(reports_dir: Path) -> dict[str, Any] | None:
    """reports/promotion.json (`reports_dir`: paths.reports_dir), or None when it is missing or unreadable."""
    path = reports_dir / PROMOTION
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


def to_markdown(report: RunReport) -> str:
    """The run's markdown artifact."""
    url = f" ({report.environment_url})" if report.environment_url else ""
    experiment = f"`{report.experiment}`" if report.experiment else (report.experiment_note or "none")
    lines = [
        f"# Prompt-R1 retraining — {report.flow_run or 'local run'}",
        "",
        f"- **Profile:** `{report.profile}`  **Environment:** `{report.environment_backend}`{url}",
        f"- **Forced:** {'yes' if report.forced else 'no'}",
        f"- **Overrides:** {', '.join(f'`{o}`' for o in report.overrides) or 'none'}",
        f"- **DVC experiment:** {experiment}",
        f"- **MLflow:** {mlflow_line(report.mlflow)}",
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
    lines += ["", "## Evaluation", "", report.eval_summary or "_reports/eval/summary.md not found_", ""]
    if report.promotion is not None:
        lines += ["## Promotion decision", "", "```json", json.dumps(report.promotion, indent=2, sort_keys=True),
                  "```", ""]
    return "\n".join(lines)


def stage_markdown(stage: str, result: str, seconds: float, figure: str | None, mlflow: MlflowRunInfo | None,
                   error: str | None = None) -> str:
    """A stage task's artifact: what came out (key figure, MLflow run) or, for a failed stage, its error."""
    lines = [f"# {stage}: {result}", "", f"- **Seconds:** {seconds:.1f}"]
    if figure is not None:
        lines.append(f"- **Key figure:** {figure}")
    if mlflow is not None:
        where = f"[run {mlflow.run_id}]({mlflow.link})" if mlflow.link else mlflow_line(mlflow)
        lines.append(f"- **MLflow:** {where}")
    if error:
        lines += ["", "## Error", "", "~~~text", error.replace("~~~", "~ ~ ~"), "~~~"]
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    """Text safe inside a markdown table cell (one line, no column breaks)."""
    return " ".join(str(text).split()).replace("|", "\\|")
