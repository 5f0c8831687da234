"""The registered agent's LoggedModel page (pipeline/tracking/model_record.py): the settings it was trained with
as params, prompt_r1's scores per evaluation set as metrics linked to that set, in a real SQLite store."""

from __future__ import annotations

import pandas as pd
import pytest

from pipeline.tracking.model_record import describe_logged_model, model_params


def test_a_logged_model_carries_its_training_settings_and_metrics_per_evaluation_set(tmp_path, params):
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    mlflow.set_experiment("logged-model")
    hotpot = tmp_path / "hotpotqa.parquet"
    pd.DataFrame({"question": ["q1", "q2"], "answers": [["a"], ["b"]]}).to_parquet(hotpot)
    evaluation = {
        "per_dataset": {"hotpotqa": {"prompt_r1": {"f1": {"mean": 41.5}, "em": {"mean": 30.0}},
                                     "env_only": {"f1": {"mean": 50.0}}},
                        "popqa": {"prompt_r1": {"f1": {"mean": 12.0}}}},
        "averages": {"prompt_r1": {"id": {"f1": {"mean": 26.75}}, "ood": {}}}}
    settings = model_params({"agent": params.agent.model_dump(mode="json"),
                             "train": params.train.model_dump(mode="json")})
    with mlflow.start_run():
        model = mlflow.create_external_model(name="agent")
        sets = describe_logged_model(model.model_id, settings, evaluation, {"hotpotqa": hotpot,
                                                                            "popqa": tmp_path / "missing.parquet"})
    assert sets == 2
    stored = mlflow.MlflowClient().get_logged_model(model.model_id)
    assert stored.params["train.lr"] == str(params.train.lr)
    assert stored.params["agent.max_turns"] == str(params.agent.max_turns)
    assert stored.params["train.health.max_kl"] == str(params.train.health.max_kl)
    by = {(m.key, m.dataset_name): m.value for m in stored.metrics}
    assert by[("f1", "hotpotqa")] == pytest.approx(41.5) and by[("em", "hotpotqa")] == pytest.approx(30.0)
    assert by[("f1", None)] == pytest.approx(12.0)  # popqa's file is missing: no dataset to link
    assert by[("id/f1", None)] == pytest.approx(26.75)
    assert not any(k == "f1" and v == pytest.approx(50.0) for (k, _), v in by.items())  # only prompt_r1's
    hotpot_metric = next(m for m in stored.metrics if m.dataset_name == "hotpotqa")
    assert hotpot_metric.dataset_digest  # the rows' content digest, as the run's dataset inputs have


def test_without_a_model_id_nothing_is_logged():
    assert describe_logged_model(None, {"train.lr": "1e-5"}, {"per_dataset": {}}, {}) == 0
