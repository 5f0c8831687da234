"""GEPA's environment instruction in MLflow's Prompt Registry: versions, the `production` alias, and which version
a run used.

MLflow 3 keeps prompts as versioned registry entries with aliases (`mlflow.genai.register_prompt`,
`load_prompt`, `set_prompt_alias`), shown on the UI's Prompts page and linked from the runs that used them.
- **The gepa stage** registers the instruction it keeps as `PROMPT_NAME` (`register_instruction`): a new version
  only when no version holds this exact text (a rerun that keeps the same instruction adds nothing), and the
  alias `PRODUCTION_ALIAS` on the version in use, linked to the gepa run.
- **Evaluate, `ask` and the served model** still read `data/gepa/prompt.json` (evaluate's DVC dependency: what
  it scores is what DVC tracked); they name the registry version whose template equals it
  (`version_uri`, `prompts:/<name>/<version>`), or None when no version does (gepa ran without a tracking
  store, or the file was edited by hand), so what a run evaluated is findable in the registry without making
  the registry a second source of the text.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

PROMPT_NAME = "prompt-r1-environment-instruction"
"""The Prompt Registry entry holding GEPA's environment instruction."""
PRODUCTION_ALIAS = "production"
"""The alias on the version the pipeline uses."""
PROMPT_URI_TAG = "gepa.prompt_uri"
"""Run tag naming the registry version a run registered or evaluated (`prompts:/<name>/<version>`)."""


def _versions(client: Any, name: str) -> list[Any]:
    """Every version of the prompt `name`, newest first; [] when it does not exist yet."""
    import mlflow.exceptions

    try:
        found, token = [], None
        while True:
            page = client.search_prompt_versions(name, page_token=token)
            found += list(page)
            token = getattr(page, "token", None)
            if not token:
                break
    except mlflow.exceptions.MlflowException as exc:
        if exc.error_code == "RESOURCE_DOES_NOT_EXIST" or "not found" in str(exc).lower():
            return []
        raise
    return sorted(found, key=lambda v: int(v.version), reverse=True)


def matching_version(instruction: str, name: str = PROMPT_NAME) -> int | None:
    """The newest version of `name` whose template is exactly `instruction`, or None."""
    import mlflow

    client = mlflow.MlflowClient()
    return next((int(v.version) for v in _versions(client, name) if v.template == instruction), None)


def version_uri(instruction: str, name: str = PROMPT_NAME) -> str | None:
    """`prompts:/<name>/<version>` of the version holding `instruction`, or None (none does, or the store
    cannot be read: the caller still has the instruction itself)."""
    try:
        version = matching_version(instruction, name)
    except Exception as exc:  # noqa: BLE001 - naming the version must never stop an evaluation or an answer
        log.warning("could not read the Prompt Registry for %s: %s", name, exc)
        return None
    return f"prompts:/{name}/{version}" if version is not None else None


def register_instruction(instruction: str, *, kept_seed: bool, name: str = PROMPT_NAME) -> str:
    """Register `instruction` (a new version only when no version holds it), move `PRODUCTION_ALIAS` to it,
    link it to the active run and tag the run with its URI; returns the URI."""
    import mlflow
    import mlflow.genai

    version = matching_version(instruction, name)
    if version is None:
        registered = mlflow.genai.register_prompt(
            name=name, template=instruction,
            commit_message="GEPA kept the seed instruction" if kept_seed else "GEPA's optimised instruction",
            tags={"source": "gepa", "kept_seed": str(kept_seed).lower()})
        version = int(registered.version)
    mlflow.genai.set_prompt_alias(name, alias=PRODUCTION_ALIAS, version=version)
    uri = f"prompts:/{name}/{version}"
    run = mlflow.active_run()
    if run is not None:
        mlflow.MlflowClient().link_prompt_version_to_run(run.info.run_id, uri)
        mlflow.set_tag(PROMPT_URI_TAG, uri)
    return uri
