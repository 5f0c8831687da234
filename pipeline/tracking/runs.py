"""MLflow: one parent run per pipeline execution, a child run per stage, datasets, models, registry.

Design decisions:
- DVC runs each stage in its own process, so the parent run's id is handed between stages through a
  small file, `reports/mlflow_run.json`. The `train` stage opens a *new* parent run (a new model means
  a new pipeline execution) and writes that file as one of its outputs; `evaluate` and `register`
  attach child runs to the parent named there (creating one if the file is missing, e.g. when a user
  runs `promptr1 evaluate` on its own). The `gepa` stage runs before `train` in a `dvc repro` and opens
  the parent for its own run; `train` continues that parent instead of opening another when it is the
  same execution's (`_gepa_parent`: the newest parent, holding only a gepa summary, same commit, profile
  and params), so one repro is one parent run with gepa, train, evaluate and register under it.
- Tracking store: SQLite file plus a local artifact folder in the project (both ignored by git);
  `MLFLOW_TRACKING_URI` overrides params. Telemetry is off.
- **A spec, not the params**: every function here takes a `TrackingSpec` (the store, the experiment, the run
  file and what a parent run records), built once from the params at the stage's entry
  (`pipeline.config.specs.tracking_spec`).
- **Parents tell apart at a glance**: named `pipeline-<profile>-<short commit>-<UTC start, to the second>`
  (`parent_run_name`), not `pipeline-<profile>` for every run. The experiment is tagged
  `mlflow.experimentKind=custom_model_development`: MLflow 3's UI then opens it on its runs (the training
  and evaluation runs), not on the GenAI overview it infers from the evaluation's traces (empty token and
  cost panels).
- The parent is tagged with the git commit, the profile and the DVC hashes of the data it used. Its params
  are every param plus `git_commit`, so the `KEY_PARAMS` a person compares runs on are all params there;
  its metrics are the headline figures the stages add (`log_parent_metrics`, `pipeline.tracking.headline`).
- **Inputs as datasets**: each stage logs the files it read as MLflow dataset inputs
  (`log_dataset_inputs`), each tagged with the md5 DVC records for that file (`dvc_md5`), on its own run
  and on the parent, so the parent lists every training and evaluation dataset of the execution.
- **Descriptions.** Each stage ends by saying in one sentence what it did and what came out
  (`describe_stage`): the sentence becomes the stage run's description and a `summary.<stage>` tag of the
  parent, and the parent's description (`mlflow.note.content`, shown on its run page) is rewritten from
  every stage's sentence so far, in pipeline order. Stages run in separate processes, so the parent's tags,
  not memory, hold what the earlier stages said.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pipeline.config.specs import TrackingSpec

log = logging.getLogger(__name__)

HEALTH_BREACH_TAG = "health.breach"
"""Tag of a train run the training health gate stopped (pipeline/train/health_gate.py); register refuses it."""

EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
"""What MLflow 3's UI reads to open an experiment on its runs instead of the GenAI overview."""

KEY_PARAMS = ("profile", "git_commit", "agent.model", "environment.model", "train.steps", "train.group_size",
              "train.lr", "reward.preset")
"""The parent run's params a person compares two pipeline runs on (all of them are logged; these first)."""


def tracking_uri(spec: TrackingSpec) -> str:
    """MLFLOW_TRACKING_URI if set, else params' URI with relative sqlite paths anchored at the project root."""
    uri = os.environ.get("MLFLOW_TRACKING_URI") or spec.configured_uri
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri.startswith(prefix + "/"):
        uri = prefix + str((spec.root / uri[len(prefix) :]).resolve())
    return uri


def configure(spec: TrackingSpec) -> str:
    """Point MLflow at the project's store and experiment; return the experiment id."""
    import mlflow

    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    uri = tracking_uri(spec)
    exported = {k: os.environ.get(k) for k in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")}
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    # mlflow.set_*_uri also export MLFLOW_TRACKING_URI/MLFLOW_REGISTRY_URI; undo that, or a later
    # `tracking_uri()` in this process (another project, another test) would take it for the user's override.
    for key, value in exported.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    client = mlflow.MlflowClient()
    experiment = client.get_experiment_by_name(spec.experiment)
    if experiment is None:
        artifact_root = spec.artifact_root.resolve()
        artifact_root.mkdir(parents=True, exist_ok=True)
        experiment_id = client.create_experiment(spec.experiment, artifact_location=artifact_root.as_uri())
    else:
        experiment_id = experiment.experiment_id
    if experiment is None or experiment.tags.get(EXPERIMENT_KIND_TAG) != EXPERIMENT_KIND:
        client.set_experiment_tag(experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
    mlflow.set_experiment(experiment_id=experiment_id)
    return experiment_id


def git_commit(root: Path) -> str:
    """The current git commit of the project ('unknown' outside a repo), '-dirty' when uncommitted changes exist."""
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def dvc_data_hashes(root: Path) -> dict[str, str]:
    """md5 of every DVC-tracked output recorded in dvc.lock (path → md5); {} when there is no lock yet."""
    import yaml

    lock = root / "dvc.lock"
    if not lock.is_file():
        return {}
    data = yaml.safe_load(lock.read_text()) or {}
    hashes: dict[str, str] = {}
    for stage in (data.get("stages") or {}).values():
        for out in stage.get("outs") or []:
            if "md5" in out:
                hashes[out["path"]] = out["md5"]
    return hashes


def parent_run_id(spec: TrackingSpec) -> str | None:
    """The parent run recorded by the last `train` stage, if any."""
    return _recorded_parent(spec.run_file)


def _recorded_parent(path: Path) -> str | None:
    if path.is_file():
        return json.loads(path.read_text()).get("run_id")
    return None


def newest_train_run(spec: TrackingSpec) -> Any | None:
    """The newest train run of the recorded parent (reports/mlflow_run.json), or None.

    A train stage rerun (after a breach, a stall) may continue the same parent (`_gepa_parent`), so only its
    newest train run counts.
    """
    import mlflow

    parent = parent_run_id(spec)
    if parent is None:
        return None
    configure(spec)
    client = mlflow.MlflowClient()
    try:
        experiment = client.get_run(parent).info.experiment_id
    except Exception:  # noqa: BLE001 - a stale run file from another store: no train run recorded here
        return None
    runs = client.search_runs([experiment], f"tags.mlflow.parentRunId = '{parent}' and tags.stage = 'train'",
                              order_by=["attributes.start_time DESC"], max_results=1)
    return runs[0] if runs else None


def breached_train_run(spec: TrackingSpec) -> Any | None:
    """The newest train run of the recorded parent when the health gate stopped it (`HEALTH_BREACH_TAG`), else None."""
    run = newest_train_run(spec)
    return run if run is not None and HEALTH_BREACH_TAG in run.data.tags else None


def parent_run_name(profile: str, commit: str, started: float) -> str:
    """`pipeline-<profile>-<short commit>[-dirty]-<UTC start>`: two parents differ at a glance."""
    short = "unknown" if commit == "unknown" else commit[:7] + ("-dirty" if commit.endswith("-dirty") else "")
    return f"pipeline-{profile}-{short}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime(started))}"


def _start_parent(record: TrackingSpec) -> str:
    import mlflow

    root = record.root
    commit = git_commit(root)
    tags = {
        "git_commit": commit,
        "profile": record.profile,
        "pipeline": "prompt-r1",
        **{f"dvc.{k}": v for k, v in dvc_data_hashes(root).items()},
    }
    with mlflow.start_run(run_name=parent_run_name(record.profile, commit, time.time()), tags=tags) as run:
        for chunk in _chunks(_parent_params(record), 100):
            mlflow.log_params(chunk)
        run_id = run.info.run_id
    _record_parent(record, run_id)
    log.info("MLflow parent run %s", run_id)
    return run_id


def _record_parent(record: TrackingSpec, run_id: str) -> None:
    """Write reports/mlflow_run.json (atomically): the parent the later stages attach to."""
    path = record.run_file
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"run_id": run_id, "experiment": record.experiment,
                               "tracking_uri_env": "MLFLOW_TRACKING_URI"}, indent=2))
    tmp.replace(path)


def _gepa_parent(record: TrackingSpec) -> str | None:
    """The parent run this execution's gepa stage opened, for `train` to continue (module docstring): the
    newest pipeline parent in the experiment, if it holds a gepa summary and no later stage's, and was
    opened at this commit with this profile and exactly these params. None otherwise."""
    import mlflow

    client = mlflow.MlflowClient()
    experiment = client.get_experiment_by_name(record.experiment)
    if experiment is None:
        return None
    runs = client.search_runs([experiment.experiment_id], filter_string="tags.pipeline = 'prompt-r1'",
                              order_by=["attributes.start_time DESC"], max_results=1)
    if not runs:
        return None
    run = runs[0]
    tags = run.data.tags
    if "summary.gepa" not in tags or any(f"summary.{s}" in tags for s in DESCRIBED_STAGES if s != "gepa"):
        return None
    if tags.get("git_commit") != git_commit(record.root) or tags.get("profile") != record.profile:
        return None
    expected = {k: v for chunk in _chunks(_parent_params(record), 100) for k, v in chunk.items()}
    if run.data.params != expected:
        return None
    return run.info.run_id


def _parent_params(record: TrackingSpec) -> dict[str, Any]:
    """Every param, plus the commit the run was made at (a tag too; a param so runs compare on it)."""
    return {**dict(record.flat_params), "git_commit": git_commit(record.root)}


def _chunks(d: dict[str, Any], n: int) -> Iterator[dict[str, Any]]:
    items = [(k, "" if v is None else str(v)[:500]) for k, v in d.items()]
    for i in range(0, len(items), n):
        yield dict(items[i : i + n])


@contextmanager
def stage_run(spec: TrackingSpec, stage: str, new_parent: bool = False) -> Iterator[Any]:
    """Open the child run `stage` under the pipeline's parent run and yield it (an active mlflow run).

    `new_parent=True` (the train stage) starts a new parent run, or continues the one this execution's gepa
    stage opened, and records it in reports/mlflow_run.json.
    """
    import mlflow

    configure(spec)
    parent = None if new_parent else _recorded_parent(spec.run_file)
    if new_parent and (parent := _gepa_parent(spec)) is not None:
        _record_parent(spec, parent)
        log.info("MLflow parent run %s (the gepa stage's, continued)", parent)
    if parent is not None:
        try:
            mlflow.MlflowClient().get_run(parent)
        except Exception:  # noqa: BLE001 - a stale file from another store: start afresh
            log.warning("parent run %s not found in %s; starting a new one", parent, tracking_uri(spec))
            parent = None
    if parent is None:
        parent = _start_parent(spec)
    with (
        mlflow.start_run(run_id=parent),
        mlflow.start_run(run_name=stage, nested=True, tags={"stage": stage}) as child,
    ):
        yield child


DESCRIBED_STAGES = ("train", "gepa", "evaluate", "register")
"""The stages whose sentences make up the parent run's description, in this order."""
NOTE_TAG = "mlflow.note.content"
"""The tag MLflow's UI shows (and edits) as a run's description."""


def describe_stage(stage: str, sentence: str) -> str | None:
    """Describe the active stage run with `sentence` and rewrite its parent's description (module docstring).

    Returns the parent's new description, or None when the active run has no parent.
    """
    import mlflow

    client = mlflow.MlflowClient()
    child = mlflow.active_run()
    if child is None:
        return None
    client.set_tag(child.info.run_id, NOTE_TAG, sentence)
    parent = client.get_run(child.info.run_id).data.tags.get("mlflow.parentRunId")
    if parent is None:
        return None
    client.set_tag(parent, f"summary.{stage}", sentence)
    tags = client.get_run(parent).data.tags
    header = (f"Prompt-R1 pipeline run, profile `{tags.get('profile', '?')}`, "
              f"commit {tags.get('git_commit', 'unknown')[:12]}.")
    said = [tags[f"summary.{s}"] for s in DESCRIBED_STAGES if f"summary.{s}" in tags]
    note = " ".join([header, *said])
    client.set_tag(parent, NOTE_TAG, note)
    return note


# --- helpers added by the eval stage (additive; stage_run's behaviour is unchanged) ----------------------


def log_dataset_inputs(frames: dict[str, tuple[Any, Path]], context: str) -> None:
    """Log each (DataFrame, source file) as a named MLflow dataset input of the active run.

    `mlflow.data.from_pandas` computes the dataset's digest from its content, so two runs that scored the
    same rows show the same digest in the UI; the source is the file the rows came from, and the input's
    `dvc.md5` tag the md5 DVC records for that file (`dvc_md5`), when it exists.
    """
    import mlflow
    import mlflow.data
    from mlflow.entities import DatasetInput, InputTag

    child = mlflow.active_run()
    parent = (mlflow.MlflowClient().get_run(child.info.run_id).data.tags.get("mlflow.parentRunId")
              if child is not None else None)
    on_parent = []
    for name, (frame, source) in frames.items():
        dataset = mlflow.data.from_pandas(frame, source=str(source), name=name)
        md5 = dvc_md5(Path(source))
        tags = {"dvc.md5": md5, "path": str(source)} if md5 else {}
        mlflow.log_input(dataset, context=context, tags=tags or None)
        input_tags = [InputTag("mlflow.data.context", context), *(InputTag(k, v) for k, v in tags.items())]
        on_parent.append(DatasetInput(dataset._to_mlflow_entity(), input_tags))
    if parent is not None and on_parent:
        mlflow.MlflowClient().log_inputs(parent, datasets=on_parent)


def dvc_md5(path: Path) -> str | None:
    """The md5 DVC records for a file (dvc.lock's deps/outs, and the entries of a `.dir` manifest): DVC 3
    hashes a file's bytes with md5, so it is computed here from the file itself. None when it is absent."""
    if not path.is_file():
        return None
    digest = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _active_parent() -> tuple[Any, str | None]:
    """(an MLflow client, the id of the active stage run's parent); the id is None without an active run or
    without a parent."""
    import mlflow

    client = mlflow.MlflowClient()
    child = mlflow.active_run()
    if child is None:
        return client, None
    return client, client.get_run(child.info.run_id).data.tags.get("mlflow.parentRunId")


def link_parent_to_model_version(name: str, version: str, model_id: str | None) -> str | None:
    """On the parent of the active stage run: tags naming the registered version (`registered_model_version`:
    `models:/<name>/<version>`; `registered_model_page`: the UI page's path) and, in MLflow 3, the logged
    model as an output of the parent (its "Logged models" section). Returns the parent's id, None without one."""
    client, parent = _active_parent()
    if parent is None:
        return None
    client.set_tag(parent, "registered_model_version", f"models:/{name}/{version}")
    client.set_tag(parent, "registered_model_page", f"#/models/{name}/versions/{version}")
    if model_id:
        from mlflow.entities import LoggedModelOutput

        client.log_outputs(parent, [LoggedModelOutput(model_id=model_id, step=0)])
    return parent


def log_parent_metrics(metrics: dict[str, float]) -> str | None:
    """Log `metrics` (finite numbers only) on the parent of the active stage run: the figures a person
    compares pipeline runs on (`pipeline.tracking.headline`). Returns the parent's id, None without a parent."""
    from mlflow.entities import Metric

    client, parent = _active_parent()
    if parent is None:
        return None
    now = int(time.time() * 1000)
    entries = [Metric(key, float(v), now, 0) for key, v in metrics.items()
               if isinstance(v, (int, float)) and math.isfinite(float(v))]
    for i in range(0, len(entries), 500):
        client.log_batch(parent, metrics=entries[i : i + 500])
    return parent
