"""The per-run summary: evaluation table, promotion decision and MLflow run, as markdown and as data.

Read from the files the stages write (contracts): `reports/eval/summary.md` (evaluate),
`reports/promotion.json` (register), `reports/mlflow_run.json` (train, via pipeline.tracking). A missing file
is reported as missing, never invented. The MLflow link is a real UI link only for an http(s) tracking
server; for the default SQLite store the summary gives the `mlflow ui` command that opens it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from pipeline.config import Params

log = logging.getLogger(__name__)

EVAL_SUMMARY = Path("eval") / "summary.md"
PROMOTION = Path("promotion.json")
MLFLOW_RUN = Path("mlflow_run.json")


@dataclass
class MlflowRunInfo:
    """The pipeline's MLflow parent run, as far as it can be found."""

    run_id: str | None = None
    experiment: str | None = None
    experiment_id: str | None = None
    tracking_uri: str | None = None
    """Credentials stripped."""
    link: str | None = None
    """UI link (http(s) tracking servers only)."""
    open_hint: str | None = None
    """How to open the run when there is no link (SQLite store)."""


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

    def read_results(self, params: Params) -> None:
        """Fill the evaluation table, promotion decision and MLflow run from the files the stages wrote."""
        self.eval_summary = read_eval_summary(params)
        self.promotion = read_promotion(params)
        self.mlflow = mlflow_run_info(params)


def strip_credentials(uri: str) -> str:
    """Drop user:password@ from a URI before it is shown anywhere."""
    parts = urlsplit(uri)
    if parts.username or parts.password:
        host = parts.hostname or ""
        netloc = f"{host}:{parts.port}" if parts.port else host
        return urlunsplit(parts._replace(netloc=netloc))
    return uri


def read_promotion(params: Params) -> dict[str, Any] | None:
    path = params.path(params.paths.reports_dir) / PROMOTION
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else {"value": data}


def read_eval_summary(params: Params) -> str | None:
    path = params.path(params.paths.reports_dir) / EVAL_SUMMARY
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def mlflow_run_info(params: Params) -> MlflowRunInfo:
    """The run recorded in reports/mlflow_run.json, with a UI link when the tracking server is http(s)."""
    path = params.path(params.paths.reports_dir) / MLFLOW_RUN
    try:
        recorded = json.loads(path.read_text())
    except (OSError, ValueError):
        return MlflowRunInfo()
    from pipeline.tracking import tracking_uri

    uri = tracking_uri(params)
    info = MlflowRunInfo(run_id=recorded.get("run_id"), experiment=recorded.get("experiment"),
                         tracking_uri=strip_credentials(uri))
    if not info.run_id:
        return info
    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///"):]).is_file():
        info.open_hint = f"tracking store {info.tracking_uri} not found"
        return info
    try:
        import mlflow

        client = mlflow.MlflowClient(tracking_uri=uri)
        info.experiment_id = client.get_run(info.run_id).info.experiment_id
    except Exception as exc:  # noqa: BLE001 - the summary must not fail the run; say what is missing
        log.warning("MLflow run %s not readable from %s: %s", info.run_id, info.tracking_uri, exc)
    if uri.startswith(("http://", "https://")) and info.experiment_id:
        info.link = f"{strip_credentials(uri).rstrip('/')}/#/experiments/{info.experiment_id}/runs/{info.run_id}"
    else:
        info.open_hint = (f"mlflow ui --backend-store-uri {info.tracking_uri}, then experiment "
                          f"{info.experiment or info.experiment_id!s}, run {info.run_id}")
    return info


def promotion_line(promotion: dict[str, Any] | None) -> str:
    """One line: promoted or not, and why (keys written by register; unknown shapes shown as JSON)."""
    if promotion is None:
        return "no promotion decision (reports/promotion.json missing)"
    promoted = promotion.get("promoted", promotion.get("promote"))
    reason = promotion.get("reason") or promotion.get("reasons") or promotion.get("message")
    if isinstance(reason, list):
        reason = "; ".join(str(r) for r in reason)
    if promoted is None:
        return json.dumps(promotion, sort_keys=True)[:300]
    alias = promotion.get("alias", "champion")
    version = promotion.get("version") or promotion.get("model_version")
    head = f"promoted to @{alias}" if promoted else f"not promoted to @{alias}"
    if version is not None:
        head += f" (model version {version})"
    return f"{head}: {reason}" if reason else head


def mlflow_line(info: MlflowRunInfo) -> str:
    if not info.run_id:
        return "no MLflow run recorded (reports/mlflow_run.json missing)"
    where = info.link or info.open_hint or info.tracking_uri or ""
    return f"run {info.run_id} — {where}"


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
        "| stage | result | seconds |",
        "|---|---|---:|",
    ]
    for stage in report.stages:
        lines.append(f"| {stage['stage']} | {stage['result']} | {stage['seconds']:.1f} |")
    lines += ["", "## Evaluation", "", report.eval_summary or "_reports/eval/summary.md not found_", ""]
    if report.promotion is not None:
        lines += ["## Promotion decision", "", "```json", json.dumps(report.promotion, indent=2, sort_keys=True),
                  "```", ""]
    return "\n".join(lines)
