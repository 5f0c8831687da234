"""GEPA's instruction in MLflow's Prompt Registry (pipeline/tracking/prompts.py), in a real SQLite store: a
version per distinct instruction, the `production` alias on the one in use, the run linked, and evaluate
naming the version whose text equals data/gepa/prompt.json's."""

from __future__ import annotations

import json

from pipeline.tracking.prompts import (
    PRODUCTION_ALIAS,
    PROMPT_NAME,
    PROMPT_URI_TAG,
    matching_version,
    register_instruction,
    version_uri,
)


def test_a_version_per_distinct_instruction_and_the_alias_on_the_one_in_use(tmp_path):
    import mlflow
    import mlflow.genai

    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    mlflow.set_experiment("prompts")
    assert version_uri("Answer briefly.") is None  # nothing registered yet
    with mlflow.start_run() as first:
        assert register_instruction("Answer briefly.", kept_seed=True) == f"prompts:/{PROMPT_NAME}/1"
    with mlflow.start_run():  # the same instruction again: no new version
        assert register_instruction("Answer briefly.", kept_seed=True) == f"prompts:/{PROMPT_NAME}/1"
    with mlflow.start_run() as third:
        assert register_instruction("Answer with a name only.", kept_seed=False) == f"prompts:/{PROMPT_NAME}/2"
    assert mlflow.genai.load_prompt(f"prompts:/{PROMPT_NAME}@{PRODUCTION_ALIAS}").template == "Answer with a name only."
    with mlflow.start_run():  # back to the first text: its version gets the alias, no third version
        register_instruction("Answer briefly.", kept_seed=True)
    assert int(mlflow.genai.load_prompt(f"prompts:/{PROMPT_NAME}@{PRODUCTION_ALIAS}").version) == 1
    assert matching_version("Answer briefly.") == 1 and matching_version("Something else.") is None
    client = mlflow.MlflowClient()
    assert client.get_run(third.info.run_id).data.tags[PROMPT_URI_TAG] == f"prompts:/{PROMPT_NAME}/2"
    assert client.get_run(first.info.run_id).data.tags[PROMPT_URI_TAG] == f"prompts:/{PROMPT_NAME}/1"
    assert len(client.search_prompt_versions(PROMPT_NAME)) == 2


def test_evaluate_names_the_version_of_the_instruction_it_read(tmp_path):
    import mlflow

    from pipeline.evaluation.report import link_gepa_prompt

    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    mlflow.set_experiment("prompts")
    prompt_file = tmp_path / "prompt.json"
    prompt_file.write_text(json.dumps({"optimised": {"instruction": "Answer with a name only.", "candidate": 1}}))
    with mlflow.start_run():
        register_instruction("Answer briefly.", kept_seed=True)
        register_instruction("Answer with a name only.", kept_seed=False)
    with mlflow.start_run() as run:
        assert link_gepa_prompt({"systems": ["prompt_r1", "gepa"]}, prompt_file) == f"prompts:/{PROMPT_NAME}/2"
        assert link_gepa_prompt({"systems": ["prompt_r1"]}, prompt_file) is None  # gepa not evaluated
    assert mlflow.MlflowClient().get_run(run.info.run_id).data.tags[PROMPT_URI_TAG] == f"prompts:/{PROMPT_NAME}/2"
    prompt_file.write_text(json.dumps({"optimised": {"instruction": "Edited by hand.", "candidate": 1}}))
    with mlflow.start_run():
        assert link_gepa_prompt({"systems": ["gepa"]}, prompt_file) is None  # no version holds that text
