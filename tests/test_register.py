"""Stage `register`: the promotion rule (unit), both ways in a real SQLite registry, and the pyfunc agent (slow)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import averages, register_params, save_smollm2_agent, write_eval_metrics

from pipeline.config import RegisterConfig
from pipeline.config.specs import tracking_spec
from pipeline.tracking.promotion import EvalAverages, decide_promotion

CFG = RegisterConfig(metric="f1", margin=0.5, ood_tolerance=1.0, ci_rule="confident")


def test_first_version_becomes_champion():
    assert decide_promotion(averages(10, 10), None, CFG).promote


def test_confident_rule_needs_the_lower_bound_to_beat_champion_plus_margin():
    champ = averages(30.0, 40.0)
    # mean 31.4 beats 30 + 0.5, but the lower bound 30.4 does not
    d = decide_promotion(averages(31.4, 40.0), champ, CFG)
    assert not d.promote and "30.40 < champion 30.00 + margin 0.5 = 30.50" in d.reasons[0]
    assert decide_promotion(averages(31.5, 40.0), champ, CFG).promote  # low 30.5 >= 30.5
    # the point rule compares means only
    assert decide_promotion(averages(30.6, 40.0), champ, CFG.model_copy(update={"ci_rule": "point"})).promote


def test_ood_guard_blocks_a_drop_beyond_tolerance():
    champ = averages(30.0, 40.0)
    # ID clearly better; OOD lower bound 38.5 < 40 - 1 = 39 -> blocked
    d = decide_promotion(averages(45.0, 39.5, half=1.0), champ, CFG)
    assert not d.promote
    assert any(r.startswith("OOD em") for r in d.reasons)
    assert [c["passed"] for c in d.checks if c["check"].startswith("ood.")] == [False, False, True]
    # OOD lower bound exactly at the floor passes
    assert decide_promotion(averages(45.0, 40.0, half=1.0), champ, CFG).promote
    # point rule: a 0.5 drop is within tolerance
    assert decide_promotion(averages(45.0, 39.5), champ, CFG.model_copy(update={"ci_rule": "point"})).promote


def test_different_eval_setup_is_noted():
    d = decide_promotion(averages(50, 50, rows=4), averages(30, 40, rows=128), CFG)
    assert d.promote and d.reasons[0].startswith("note:")


def test_different_metrics_mode_is_never_promoted():
    """Reference-mode and ours-mode numbers are not comparable: refuse, even for a large apparent gain."""
    candidate = averages(90.0, 90.0)
    candidate.mode = "reference"
    for rule in ("confident", "point"):
        d = decide_promotion(candidate, averages(30.0, 40.0), CFG.model_copy(update={"ci_rule": rule}))
        assert not d.promote and not d.checks
        assert "metrics mode 'ours'" in d.reasons[0] and "'reference'" in d.reasons[0]


def test_unknown_metric_is_a_user_error_naming_the_available_ones():
    from pipeline.errors import UserError

    bad = CFG.model_copy(update={"metric": "bleu"})
    for champion in (None, averages(30.0, 40.0)):
        with pytest.raises(UserError, match=r"register\.metric='bleu'.*available: em, f1, ssim"):
            decide_promotion(averages(40.0, 40.0), champion, bad)


def test_unknown_metric_fails_before_anything_is_registered(tmp_path, repo_root, monkeypatch):
    import mlflow

    from pipeline.errors import UserError
    from pipeline.stages.register import run_register
    from pipeline.tracking.runs import configure

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    model_dir = tmp_path / "agent"
    model_dir.mkdir()
    params = register_params(tmp_path, repo_root, model_dir)
    params.register.metric = "bleu"
    write_eval_metrics(tmp_path, 30.0, 40.0)
    with pytest.raises(UserError, match=r"register\.metric='bleu'.*available: em, f1, ssim"):
        run_register(params)
    assert not (tmp_path / "reports" / "promotion.json").exists()
    configure(tracking_spec(params))
    assert mlflow.MlflowClient().search_registered_models() == []
    assert mlflow.search_runs(search_all_experiments=True).empty


def test_tags_round_trip():
    a = averages(31.25, 40.5)
    b = EvalAverages.from_tags(a.to_tags())
    assert b == a
    assert EvalAverages.from_tags({"unrelated": "x"}) is None


def test_register_rule_both_ways_in_a_real_sqlite_registry(tmp_path, repo_root, tiny_llama_dir, monkeypatch):
    import mlflow

    from pipeline.stages.register import run_register

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    params = register_params(tmp_path, repo_root, tiny_llama_dir)
    name = params.register.model_name

    write_eval_metrics(tmp_path, 30.0, 40.0)
    metrics_file = tmp_path / "reports" / "eval" / "metrics.json"
    evaluation = json.loads(metrics_file.read_text())  # env_only beat the agent in the same evaluation
    evaluation["averages"]["env_only"] = {"id": {"f1": {"mean": 35.5, "low": 30.0, "high": 41.0}}, "ood": {}}
    metrics_file.write_text(json.dumps(evaluation))
    first = run_register(params)
    assert first["promoted"] and first["version"] == "1" and first["champion_after"] == "1"
    # the description states the real reason (no champion yet: no rule was applied) and the figures
    said = mlflow.MlflowClient().get_run(first["run_id"]).data.tags["mlflow.note.content"]
    assert said.startswith(f"Registered {name} v1: promoted (champion → v1) because no current champion"), said
    assert "confident rule" not in said
    assert "Candidate ID f1 30.00 [" in said and "below env_only (35.50) in the same evaluation" in said

    write_eval_metrics(tmp_path, 30.4, 40.0)  # not a confident gain: kept
    second = run_register(params)
    assert not second["promoted"] and second["champion_before"] == "1" and second["champion_after"] == "1"
    saved = json.loads((tmp_path / "reports" / "promotion.json").read_text())
    assert saved["decision"] == "kept" and "margin" in " ".join(saved["reasons"])

    write_eval_metrics(tmp_path, 45.0, 39.5)  # better ID, but a confident OOD drop: kept
    assert not run_register(params)["promoted"]

    write_eval_metrics(tmp_path, 45.0, 41.0)  # better ID, OOD fine: promoted
    fourth = run_register(params)
    assert fourth["promoted"] and fourth["version"] == "4"

    client = mlflow.MlflowClient()
    assert str(client.get_model_version_by_alias(name, "champion").version) == "4"
    v2 = client.get_model_version(name, "2")
    assert v2.tags["promotion.decision"] == "kept" and "eval.id.f1.mean" in v2.tags
    assert client.get_model_version(name, "4").tags["promotion.decision"] == "promoted"
    # the champion's stored numbers are the candidate's
    assert EvalAverages.from_tags(client.get_model_version(name, "4").tags).id["f1"]["mean"] == 45.0
    # both flavors logged in the register run; the environment config bundles the key variable's name only
    run = client.get_run(fourth["run_id"])
    assert run.data.tags["stage"] == "register" and run.data.tags.get("mlflow.parentRunId")
    parent = client.get_run(run.data.tags["mlflow.parentRunId"])  # the description says the last decision
    assert f"Registered {name} v4: promoted" in parent.data.tags["mlflow.note.content"]
    assert parent.data.tags["registered_model_version"] == f"models:/{name}/4"  # the parent links its version
    from pipeline.tracking.lineage import logged_model_id

    v4_model = logged_model_id(client.get_model_version(name, "4"))
    assert v4_model
    assert client.get_logged_model(v4_model).params["train.lr"] == str(params.train.lr)  # what it was trained with
    assert v4_model in {o.model_id for o in parent.outputs.model_outputs}
    assert run.data.tags["mlflow.note.content"] == parent.data.tags["summary.register"]
    local = Path(mlflow.artifacts.download_artifacts(f"models:/{name}@champion"))
    env = json.loads(next(local.rglob("environment.json")).read_text())
    assert env["api_key_env"] == params.environment.api_key_env and "api_key" not in env
    assert any(p.name == "config.json" for p in local.rglob("config.json"))


@pytest.mark.slow
def test_champion_answers_through_a_real_llamacpp_environment(tmp_path, repo_root, llama_server, monkeypatch):
    """Register the real SmolLM2 agent, load models:/…@champion via pyfunc, answer through llama.cpp."""
    import mlflow
    import pandas as pd

    from pipeline.stages.register import run_register

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("PROMPTR1_CACHE_DIR", str(tmp_path / "cache"))  # the served agent's GGUF export
    agent_dir = save_smollm2_agent(tmp_path / "agent")

    (tmp_path / "proj").mkdir()
    params = register_params(tmp_path / "proj", repo_root, agent_dir)
    params.agent.max_turns = 2
    params.evaluate.agent_max_turn_tokens = 48
    write_eval_metrics(params.root, 30.0, 40.0)
    result = run_register(params)
    assert result["promoted"]

    model = mlflow.pyfunc.load_model(f"models:/{params.register.model_name}@champion",
                                     model_config={"environment": {"base_url": llama_server, "max_tokens": 32}})
    out = model.predict(pd.DataFrame({"question": ["What is the capital of France?"]}))
    assert list(out.columns[:3]) == ["answer", "turns", "stop_reason"]
    assert len(out) == 1 and out.loc[0, "turns"] >= 1
    assert out.loc[0, "agent_engine"] == "llama.cpp"  # the SmolLM2 GGUF base: evaluation's engine
    trajectory = json.loads(out.loc[0, "trajectory"])
    assert trajectory and trajectory[0]["text"].startswith("<think>")
    replies = [t["environment"] for t in trajectory if "environment" in t]
    # whenever the agent prompted the environment, the real llama.cpp server answered it
    assert all(r["error"] is None and r["text"] for r in replies)
    assert out.loc[0, "env_calls"] == len(replies)


# --- fail closed -----------------------------------------------------------------------------------------


def test_champion_without_mode_or_metric_is_kept():
    """Doubt keeps the champion: unknown metrics mode, or no value for the promotion metric."""
    champ = averages(30.0, 40.0)
    champ.mode = ""
    d = decide_promotion(averages(80.0, 80.0), champ, CFG)
    assert not d.promote and "no recorded metrics mode" in d.reasons[0]
    champ = averages(30.0, 40.0)
    champ.id.pop("f1")
    d = decide_promotion(averages(80.0, 80.0), champ, CFG)
    assert not d.promote and "no ID f1 recorded" in d.reasons[-1]


def test_candidate_without_ood_numbers_is_not_promoted():
    """The OOD guard cannot be skipped by a candidate that simply has no OOD averages."""
    candidate = averages(80.0, 80.0)
    candidate.ood = {}
    d = decide_promotion(candidate, averages(30.0, 40.0), CFG)
    assert not d.promote and "candidate has no OOD em, f1, ssim" in d.reasons[-1]


def test_a_failing_registry_is_an_error_not_no_champion(monkeypatch):
    """Only "alias not found" means no champion; a store answering 500 stops the stage."""
    import mlflow
    from fault_server import Behaviour, FaultServer

    from pipeline.errors import UserError
    from pipeline.tracking.lineage import current_champion

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    with FaultServer(Behaviour("status", status=500)) as server:
        client = mlflow.MlflowClient(tracking_uri=f"http://127.0.0.1:{server.port}",
                                     registry_uri=f"http://127.0.0.1:{server.port}")
        with pytest.raises(UserError, match="cannot read the current prompt-r1-agent@champion"):
            current_champion(client, "prompt-r1-agent", "champion")


def test_missing_alias_and_missing_model_mean_no_champion(tmp_path):
    import mlflow

    from pipeline.tracking.lineage import current_champion

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'm.db'}")
    assert current_champion(client, "nope", "champion") is None
    client.create_registered_model("nope")
    assert current_champion(client, "nope", "champion") is None


def test_untagged_champion_is_kept_and_the_alias_moves_under_a_lock_with_a_recheck(
        tmp_path, repo_root, tiny_llama_dir, monkeypatch):
    """A champion with no recorded evaluation is not replaced; a register blocked on the lock re-reads the
    champion that another register promoted meanwhile and compares against that one."""
    import threading

    import mlflow

    from pipeline.stages.register import promotion_lock, run_register

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    params = register_params(tmp_path, repo_root, tiny_llama_dir)
    name = params.register.model_name
    write_eval_metrics(tmp_path, 30.0, 40.0)
    assert run_register(params)["promoted"]
    client = mlflow.MlflowClient()
    for key in list(client.get_model_version(name, "1").tags):
        if key.startswith("eval."):
            client.delete_model_version_tag(name, "1", key)
    write_eval_metrics(tmp_path, 80.0, 80.0)
    second = run_register(params)
    assert not second["promoted"] and second["champion_after"] == "1"
    assert "no recorded evaluation" in second["reasons"][0]

    # v2 is a well-evaluated 80/80 model: make it champion, as a concurrent register would, while v3's
    # register (a 50/50 model that would beat the untagged v1) waits on the lock.
    write_eval_metrics(tmp_path, 50.0, 50.0)
    result: dict = {}
    lock = promotion_lock(params.path(params.paths.cache_dir), name)
    lock.acquire()
    worker = threading.Thread(target=lambda: result.update(run_register(params)))
    worker.start()
    try:
        client.set_registered_model_alias(name, "champion", "2")
    finally:
        lock.release()
    worker.join(timeout=300)
    assert result["version"] == "3" and not result["promoted"]
    assert result["champion_before"] == "2" and result["champion_after"] == "2"
