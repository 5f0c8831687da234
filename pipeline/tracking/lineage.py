"""What a registered model version carries besides its numbers, how long unwanted versions stay, and what the
registry says about the champion when a run registered nothing.

Used by the `register` stage (pipeline/stages/register.py), `promptr1 serve` and the flow's report
(flows/run_report.py). Design decisions:

- **Lineage as tags, read from the records the pipeline already keeps, never re-derived.** Each version gets
  `lineage.train_run_id` (the newest `stage=train` child of the pipeline run named in reports/mlflow_run.json:
  the run whose checkpoints were merged), `lineage.pipeline_run_id`, `lineage.git_commit` (the commit the
  pipeline run was opened at, its `git_commit` tag; the current commit only when that run has none) and
  `lineage.model_dvc_md5`, the hash dvc.lock records for the merged model directory (`paths.model_dir`).
  DVC writes dvc.lock after `merge` and before `register`, so in a `dvc repro` that is the hash of the
  files being registered; when the directory's file count or size differs from the lock's (a model changed
  outside DVC, `promptr1 register` run by hand), the tag says `unknown` and why instead of a wrong hash.
  A value that cannot be found is written as `unknown: <why>`, never left out silently.
- **A description per version** (`version_description`): one paragraph a person reads in the registry UI,
  with the same lineage, the evaluation averages and the promotion decision with its reason.
- **Retention** (`prune_never_champion`): the versions this stage registered and decided `kept` (never
  moved the alias) pile up at one model copy each. `register.keep_versions` keeps the newest N of them and
  deletes the older ones: the registry version, then the logged model's artifacts (the files, where the
  space is) and the logged model record. Never touched: a version any alias points at, a version that was
  ever promoted (`promotion.decision=promoted`: the champions' history, for rollback), a version without a
  decision (registered by hand, or left by a killed register, which `settle_orphans` handles). `null` keeps
  everything.
- **The champion as the registry has it.** `current_champion` is the one read of the alias: only MLflow's
  "alias not found" / "model not found" mean no champion, any other error raises (the register stage and
  `promptr1 serve` both read it so). `champion_status`: when a flow run registered nothing, its
  report says so and names the current champion, the register run that promoted it and when (the version's
  `promotion.date` tag, or that run's start for versions registered before the tag existed), instead of
  repeating the last promotion.json as if this run had decided it.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.errors import UserError

if TYPE_CHECKING:
    from pipeline.config import RegisterConfig
    from pipeline.config.specs import TrackingSpec

log = logging.getLogger(__name__)

TAG = "lineage."
SQLITE = "sqlite:///"
PROMOTION_DATE_TAG = "promotion.date"


# --- lineage -----------------------------------------------------------------------------------------


def _lock_entry(root: Path, rel: str) -> dict[str, Any] | None:
    """dvc.lock's record of the output at `rel` (md5, size, nfiles), or None."""
    import yaml

    lock = root / "dvc.lock"
    if not lock.is_file():
        return None
    data = yaml.safe_load(lock.read_text(encoding="utf-8")) or {}
    for stage in (data.get("stages") or {}).values():
        for out in stage.get("outs") or []:
            if Path(str(out.get("path", ""))).as_posix().rstrip("/") == rel:
                return out
    return None


def model_dvc_hash(model_dir: Path, root: Path) -> str:
    """The md5 the project's (`root`) dvc.lock records for `model_dir` (`paths.model_dir`), or `unknown: <why>`
    (module docstring)."""
    try:
        rel = model_dir.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return f"unknown: {model_dir} is outside the project"
    entry = _lock_entry(root, rel)
    if entry is None or "md5" not in entry:
        return f"unknown: dvc.lock has no entry for {rel}"
    files = [p for p in model_dir.rglob("*") if p.is_file()] if model_dir.is_dir() else [model_dir]
    size, nfiles = sum(p.stat().st_size for p in files), len(files)
    if ("size" in entry and entry["size"] != size) or (
        model_dir.is_dir() and entry.get("nfiles", nfiles) != nfiles
    ):
        return (
            f"unknown: {rel} ({nfiles} files, {size} bytes) is not what dvc.lock recorded "
            f"({entry.get('nfiles')} files, {entry.get('size')} bytes)"
        )
    return str(entry["md5"])


def lineage_tags(client: Any, model_dir: Path, root: Path, pipeline_run_id: str | None) -> dict[str, str]:
    """`lineage.*` tags for a version of `model_dir` registered under the pipeline run `pipeline_run_id`."""
    from pipeline.tracking.runs import git_commit

    train_run = commit = None
    if pipeline_run_id:
        parent = client.get_run(pipeline_run_id)
        commit = parent.data.tags.get("git_commit")
        runs = client.search_runs(
            [parent.info.experiment_id],
            max_results=1,
            order_by=["attributes.start_time DESC"],
            filter_string=f"tags.mlflow.parentRunId = '{pipeline_run_id}' AND tags.stage = 'train'",
        )
        train_run = runs[0].info.run_id if runs else None
    return {
        f"{TAG}train_run_id": train_run or f"unknown: no train run under pipeline run {pipeline_run_id}",
        f"{TAG}pipeline_run_id": pipeline_run_id or "unknown",
        f"{TAG}git_commit": commit or git_commit(root),
        f"{TAG}model_dvc_md5": model_dvc_hash(model_dir, root),
    }


def version_description(
    lineage: dict[str, str], id_avg: dict[str, dict[str, float]], verdict: str, reason: str, *, metric: str,
    profile: str, model_dir: str
) -> str:
    """The version's description: lineage, evaluation averages (`metric`: register.metric), promotion decision;
    `model_dir` as the params name it (`paths.model_dir`)."""
    figure = id_avg.get(metric)
    scored = (
        f"ID {metric} {figure['mean']:.2f} [{figure['low']:.2f}, {figure['high']:.2f}]"
        if figure
        else f"no ID {metric}"
    )
    return (
        f"Prompt-R1 agent, profile `{profile}`: trained by run {lineage[f'{TAG}train_run_id']} "
        f"(pipeline run {lineage[f'{TAG}pipeline_run_id']}) at commit {lineage[f'{TAG}git_commit']}; "
        f"{model_dir} DVC md5 {lineage[f'{TAG}model_dvc_md5']}. Evaluation: {scored}. "
        f"Promotion: {verdict} — {reason}"
    )[:4900]


# --- retention ---------------------------------------------------------------------------------------


def logged_model_id(mv: Any) -> str | None:
    """The logged model behind a version: its `model_id`, which the registry leaves empty for versions
    registered by `log_model(registered_model_name=...)`, or the id in its `models:/<id>` source."""
    if getattr(mv, "model_id", None):
        return mv.model_id
    source = str(mv.source or "")
    return source.removeprefix("models:/") if source.startswith("models:/m-") else None


def _delete_model_files(client: Any, model_id: str | None) -> None:
    """Delete a logged model's artifacts (the files) and mark the logged model deleted."""
    if not model_id:
        return
    from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

    try:
        model = client.get_logged_model(model_id)
        get_artifact_repository(model.artifact_location).delete_artifacts()
        client.delete_logged_model(model_id)
    except Exception as exc:  # noqa: BLE001 - the version is gone either way; say what was left
        log.warning("register: logged model %s of a pruned version not fully deleted: %s", model_id, exc)


def prune_never_champion(client: Any, name: str, keep: int | None) -> list[str]:
    """Delete the oldest never-champion versions of `name` beyond the newest `keep` (module docstring).

    Returns the deleted version numbers. Call under the registration lock (pipeline/stages/register.py).
    """
    if keep is None:
        return []
    aliased = {str(v) for v in client.get_registered_model(name).aliases.values()}
    versions = client.search_model_versions(f"name = '{name}'")
    never = [
        mv
        for mv in versions
        if mv.tags.get("promotion.decision") == "kept" and str(mv.version) not in aliased
    ]
    never.sort(key=lambda mv: int(mv.version), reverse=True)
    doomed = never[keep:]
    # a logged model another version still points at (re-registered by hand) keeps its files
    in_use = {mv.source for mv in versions if all(mv.version != d.version for d in doomed)}
    deleted = []
    for mv in doomed:
        client.delete_model_version(name, mv.version)
        if mv.source not in in_use:
            _delete_model_files(client, logged_model_id(mv))
        deleted.append(str(mv.version))
    if deleted:
        log.info(
            "register: deleted never-champion version(s) %s of %s (register.keep_versions=%d)",
            ", ".join(deleted),
            name,
            keep,
        )
    return deleted


# --- the champion, for a run that registered nothing --------------------------------------------------


def _date(ms: int | None) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%d %H:%M UTC") if ms else "an unknown date"


def current_champion(client: Any, name: str, alias: str) -> Any | None:
    """The model version the alias points at; None only when the alias (or the model) does not exist.

    Any other MLflow error raises UserError: an unreadable champion is never taken for "no champion" (the
    register stage fails closed on it; `promptr1 serve` says so before starting a server).
    """
    import mlflow.exceptions

    try:
        return client.get_model_version_by_alias(name, alias)
    except mlflow.exceptions.MlflowException as exc:
        message = str(exc)
        if (exc.error_code == "INVALID_PARAMETER_VALUE" and f"alias {alias} not found" in message) or (
                exc.error_code == "RESOURCE_DOES_NOT_EXIST" and "Registered Model" in message):
            return None
        raise UserError(f"cannot read the current {name}@{alias} from the MLflow registry ({exc.error_code}: "
                        f"{message.splitlines()[0][:200]}); the alias was not moved") from None


def champion_status(cfg: RegisterConfig, tracking: TrackingSpec) -> dict[str, Any]:
    """For a run that registered no version: the champion as the registry has it, as a promotion record.

    Returns {"new_version": False, "alias", "champion_version", "promoted_by_run", "promoted_on"} or, when
    the registry cannot say, {"new_version": False, "alias", "note": why}. Never raises (a report).
    """
    from pipeline.tracking.runs import tracking_uri

    out: dict[str, Any] = {"new_version": False, "alias": cfg.alias, "model_name": cfg.model_name}
    uri = tracking_uri(tracking)
    if uri.startswith(SQLITE) and not Path(uri[len(SQLITE) :]).is_file():
        return {**out, "note": f"no MLflow registry at {tracking.configured_uri}"}
    try:
        import mlflow

        client = mlflow.MlflowClient(tracking_uri=uri, registry_uri=uri)
        try:
            champion = client.get_model_version_by_alias(cfg.model_name, cfg.alias)
        except mlflow.exceptions.MlflowException as exc:
            if "not found" not in str(exc) and exc.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            return {**out, "note": f"{cfg.model_name} has no @{cfg.alias} in the registry"}
        run_id = champion.tags.get("source_run_id") or champion.run_id
        when = champion.tags.get(PROMOTION_DATE_TAG)
        if not when and run_id:
            when = _date(client.get_run(run_id).info.start_time)
    except Exception as exc:  # noqa: BLE001 - a report must not fail the run; say what is missing
        log.warning("champion not readable from %s: %s", tracking.configured_uri, exc)
        return {**out, "note": f"champion not readable from the registry ({str(exc).splitlines()[0][:200]})"}
    return {
        **out,
        "champion_version": str(champion.version),
        "promoted_by_run": run_id,
        "promoted_on": when or _date(champion.creation_timestamp),
    }


def promotion_date() -> str:
    """The `promotion.date` tag's value for a promotion happening now."""
    return _date(int(datetime.now(UTC).timestamp() * 1000))
