"""What a register killed mid-way leaves in a real SQLite registry, and how the next register settles it.

`settle_orphans` (pipeline/stages/register.py) runs under the registration lock at the start of every register: a
version logged by a `register` run that never recorded its decision is deleted (its run marked KILLED); one
the alias already points at is kept and tagged as recovered; a version registered by hand (not by a
`register` run) and decided versions are never touched. The kill itself, inside `dvc repro`, is
tests/hardening/test_kill_repro.py.
"""

from __future__ import annotations

import pytest

from pipeline.config import RegisterConfig
from pipeline.stages.register import settle_orphans

NAME = "orphan-test-agent"


@pytest.fixture()
def client(tmp_path, monkeypatch):
    import mlflow

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    mlflow.set_registry_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    yield mlflow.MlflowClient()
    mlflow.set_tracking_uri(None)


def _version(client, tmp_path, stage: str | None, tags: dict[str, str] | None = None, finished: bool = False):
    experiment = client.get_experiment_by_name("orphans") or client.get_experiment(
        client.create_experiment("orphans", artifact_location=str(tmp_path / "artifacts")))
    run = client.create_run(experiment.experiment_id, tags={"stage": stage} if stage else {})
    if finished:
        client.set_terminated(run.info.run_id)
    mv = client.create_model_version(NAME, f"runs:/{run.info.run_id}/agent", run_id=run.info.run_id,
                                     tags=tags or {})
    return str(mv.version), run.info.run_id


def test_settle_orphans_deletes_recovers_and_leaves_the_rest(client, tmp_path):
    client.create_registered_model(NAME)
    decided, _ = _version(client, tmp_path, "register", {"promotion.decision": "kept"}, finished=True)
    orphan, orphan_run = _version(client, tmp_path, "register")
    by_hand, _ = _version(client, tmp_path, None)
    aliased, aliased_run = _version(client, tmp_path, "register", {"eval.mode": "ours"})
    client.set_registered_model_alias(NAME, "champion", aliased)

    settled = settle_orphans(client, RegisterConfig(model_name=NAME, alias="champion"))

    assert sorted(settled, key=int) == [orphan, aliased]
    remaining = {str(mv.version): mv.tags for mv in client.search_model_versions(f"name = '{NAME}'")}
    assert set(remaining) == {decided, by_hand, aliased}  # the orphan is gone
    assert remaining[aliased]["promotion.decision"] == "promoted"
    assert remaining[aliased]["promotion.reason"].startswith("recovered")
    assert "promotion.decision" not in remaining[by_hand]
    assert str(client.get_model_version_by_alias(NAME, "champion").version) == aliased
    assert client.get_run(orphan_run).info.status == "KILLED"
    assert client.get_run(aliased_run).info.status == "KILLED"
    assert settle_orphans(client, RegisterConfig(model_name=NAME, alias="champion")) == []  # idempotent


def test_no_registered_model_yet_settles_nothing(client):
    assert settle_orphans(client, RegisterConfig(model_name=NAME, alias="champion")) == []
