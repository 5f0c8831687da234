"""Where a person finds the pipeline's MLflow runs: the parent run and each stage's child run.

The flow's summary and each stage task's Prefect artifact point here (flows/run_report.py). Design decisions:

- **Found from the files the stages write**, like every report: the parent run is the one named in
  `reports/mlflow_run.json` (pipeline.tracking.runs), a stage's run is the newest child of that parent tagged
  `stage=<name>` (`tracking.stage_run`). A stage that logs no run (the data stages, `merge`) says so.
- **A link a browser opens**: an http(s) tracking server gives `<server>/#/experiments/<id>/runs/<run>`; for the
  default SQLite store the same page under `mlflow ui`'s address (`LOCAL_UI`) with the command that serves it,
  the store shown relative to the project when it lives there.
- **Credentials never shown**: `user:password@` is stripped from every URI before it is kept or printed.
- **Never fails its caller**: an unreadable store is a logged warning and a hint saying what is missing.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from pipeline.config.specs import TrackingSpec
from pipeline.paths import display_path
from pipeline.stage_files import RUN_FILE
from pipeline.tracking.runs import tracking_uri

log = logging.getLogger(__name__)

SQLITE = "sqlite:///"
UI_COMMAND = "MLFLOW_DISABLE_TELEMETRY=true mlflow ui"
"""How the docs and hints open the store: MLflow's usage telemetry (the UI's too) off."""
LOCAL_UI = "http://127.0.0.1:5000"
"""Where `mlflow ui` serves a local store by default."""


@dataclass
class MlflowRunInfo:
    """One MLflow run of the pipeline, as far as it can be found."""

    run_id: str | None = None
    experiment: str | None = None
    experiment_id: str | None = None
    tracking_uri: str | None = None
    """Credentials stripped."""
    link: str | None = None
    """The run's UI page: the tracking server's, or for a SQLite store the page `mlflow ui` serves at
    `LOCAL_UI` (`ui_command` starts it)."""
    ui_command: str | None = None
    """For a SQLite store: the command that serves `link`."""
    open_hint: str | None = None
    """How to open the run when there is no link (SQLite store), or why there is no run."""


@dataclass(frozen=True)
class MlflowStore:
    """Where the pipeline's MLflow runs are: the tracking spec with the URI in use, read once by the public
    functions below."""

    uri: str
    """The real tracking URI (`tracking.tracking_uri`: MLFLOW_TRACKING_URI or mlflow.tracking_uri)."""
    root: Path
    run_file: Path
    """reports/mlflow_run.json: the recorded parent run."""

    @classmethod
    def for_links(cls, tracking: TrackingSpec) -> MlflowStore:
        return cls(uri=tracking_uri(tracking), root=tracking.root, run_file=tracking.run_file)


def strip_credentials(uri: str) -> str:
    """Drop user:password@ from a URI before it is shown anywhere."""
    parts = urlsplit(uri)
    if parts.username or parts.password:
        host = parts.hostname or ""
        netloc = f"{host}:{parts.port}" if parts.port else host
        return urlunsplit(parts._replace(netloc=netloc))
    return uri


def ui_link(uri: str, experiment_id: str, run_id: str) -> str | None:
    """The MLflow UI page of a run on an http(s) tracking server; None for any other store."""
    if not uri.startswith(("http://", "https://")):
        return None
    return f"{strip_credentials(uri).rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"


def mlflow_run_info(tracking: TrackingSpec) -> MlflowRunInfo:
    """The parent run recorded in reports/mlflow_run.json, with a UI link when the tracking server is http(s)."""
    store = MlflowStore.for_links(tracking)
    info, uri = _parent(store)
    if info.run_id is None or info.open_hint is not None:
        return info
    try:
        import mlflow

        info.experiment_id = mlflow.MlflowClient(tracking_uri=uri).get_run(info.run_id).info.experiment_id
    except Exception as exc:  # noqa: BLE001 - a summary must not fail the run; say what is missing
        log.warning("MLflow run %s not readable from %s: %s", info.run_id, info.tracking_uri, exc)
    _point_at(info, store)
    return info


def stage_mlflow_run(tracking: TrackingSpec, stage: str) -> MlflowRunInfo:
    """The newest child run tagged `stage=<stage>` under the recorded parent run (`sample@x` → `sample`)."""
    store = MlflowStore.for_links(tracking)
    parent, uri = _parent(store)
    if parent.run_id is None:
        return parent
    if parent.open_hint is not None:  # the store is gone: nothing to look a child up in
        return MlflowRunInfo(experiment=parent.experiment, tracking_uri=parent.tracking_uri,
                             open_hint=f"{parent.open_hint} (pipeline run {parent.run_id})")
    group = stage.rsplit(":", 1)[-1].split("@", 1)[0]
    info = MlflowRunInfo(experiment=parent.experiment, tracking_uri=parent.tracking_uri)
    try:
        import mlflow

        client = mlflow.MlflowClient(tracking_uri=uri)
        info.experiment_id = client.get_run(parent.run_id).info.experiment_id
        runs = client.search_runs([info.experiment_id], max_results=1, order_by=["attributes.start_time DESC"],
                                  filter_string=(f"tags.mlflow.parentRunId = '{parent.run_id}' "
                                                 f"AND tags.stage = '{group}'"))
    except Exception as exc:  # noqa: BLE001 - a report must not fail the stage; say what is missing
        log.warning("MLflow runs of %s not readable from %s: %s", parent.run_id, parent.tracking_uri, exc)
        info.open_hint = f"MLflow run {parent.run_id} not readable from {parent.tracking_uri}"
        return info
    if not runs:
        info.open_hint = f"stage {group} logged no MLflow run under the pipeline run {parent.run_id}"
        return info
    info.run_id = runs[0].info.run_id
    _point_at(info, store)
    return info


def where_to_open(info: MlflowRunInfo) -> str:
    """A Markdown link a browser opens (with the command that serves it, for a SQLite store), else the hint."""
    if info.link:
        served = f" (served by `{info.ui_command} --port 5000`)" if info.ui_command else ""
        return f"[run {info.run_id}]({info.link}){served}"
    return info.open_hint or info.tracking_uri or ""


def mlflow_line(info: MlflowRunInfo) -> str:
    """One line: the run and where to open it (or why there is none)."""
    if not info.run_id:
        return info.open_hint or f"no MLflow run recorded (reports/{RUN_FILE} missing)"
    where = where_to_open(info)
    return where if info.link else f"run {info.run_id} — {where}"


def _parent(store: MlflowStore) -> tuple[MlflowRunInfo, str]:
    """(the recorded parent run, hint set when its store is missing; the real tracking URI)."""
    try:
        recorded = json.loads(store.run_file.read_text())
    except (OSError, ValueError):
        return MlflowRunInfo(), ""
    uri = store.uri
    info = MlflowRunInfo(run_id=recorded.get("run_id"), experiment=recorded.get("experiment"),
                         tracking_uri=strip_credentials(uri))
    if info.run_id and uri.startswith(SQLITE) and not Path(uri[len(SQLITE):]).is_file():
        info.open_hint = f"tracking store {_shown_store(store)} not found"
    return info, uri


def _point_at(info: MlflowRunInfo, store: MlflowStore) -> None:
    """Set the UI link (http(s) with a known experiment) or the `mlflow ui` hint."""
    uri = store.uri
    info.link = ui_link(uri, info.experiment_id, info.run_id) if info.experiment_id and info.run_id else None
    if info.link is None:
        info.open_hint = (f"{UI_COMMAND} --backend-store-uri {_shown_store(store)}, then experiment "
                          f"{info.experiment or info.experiment_id!s}, run {info.run_id}")
        if uri.startswith(SQLITE) and info.experiment_id and info.run_id:
            info.link = f"{LOCAL_UI}/#/experiments/{info.experiment_id}/runs/{info.run_id}"
            info.ui_command = f"{UI_COMMAND} --backend-store-uri {_shown_store(store)}"


def _shown_store(store: MlflowStore) -> str:
    """The store URI for a person: a SQLite file inside the project relative to it (run from there)."""
    uri = store.uri
    if uri.startswith(SQLITE):
        db = Path(uri[len(SQLITE):])
        if db.resolve().is_relative_to(store.root.resolve()):
            return SQLITE + display_path(db, store.root)
    return strip_credentials(uri)
