"""Stage `gepa`: the real GEPA engine against a real OpenAI-compatible server on 127.0.0.1.

The server (tests/fault_server.py with a `responder`) plays both models by content, so the outcome is known:
- as the reflection model (GEPA's reflection prompt) it proposes `SHORT`;
- as the task model it answers a question with its bare gold answer when the instruction is `SHORT`, and
  with a hedged sentence around it otherwise (token F1 well below 1).
So GEPA must accept the proposal, and the held-out slice must score the optimised instruction above the seed.
"""

from __future__ import annotations

import json

import pandas as pd
import pytest
from fault_server import FaultServer

from pipeline import metrics as M
from pipeline.config.specs import tracking_spec
from pipeline.evaluation.gepa_adapter import COMPONENT, EnvironmentInstructionAdapter, TaskExample
from pipeline.stages.gepa import load_slices, run_gepa

SHORT = "Reply with the bare answer only: a few words, no sentence."
HEDGE = "I believe the answer to this could well be {gold}, although I am honestly not completely sure."
CITIES = ["Paris", "Berlin", "Madrid", "Rome", "Vienna", "Lisbon", "Warsaw", "Prague", "Dublin", "Oslo",
          "Athens", "Helsinki", "Budapest", "Bern", "Sofia", "Riga"]
QUESTIONS = {f"Which city is the capital of country number {i}?": city for i, city in enumerate(CITIES)}
GEPA_REFLECTION_OPENING = "I provided an assistant with the following instructions"


def respond(messages: list[dict]) -> str:
    user = messages[-1]["content"]
    if user.startswith(GEPA_REFLECTION_OPENING):
        return f"Here is a better instruction:\n```\n{SHORT}\n```"
    question, _, instruction = user.partition("\n\n")
    gold = QUESTIONS[question]
    return gold if instruction == SHORT else HEDGE.format(gold=gold)


def write_train_set(path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame({
        "data_source": ["hotpotqa"] * len(QUESTIONS),
        "reward_model": [{"ground_truth": [g], "style": "rule"} for g in QUESTIONS.values()],
        "extra_info": [{"id": f"hotpotqa-{i}", "question": q} for i, q in enumerate(QUESTIONS)],
    }).to_parquet(path, index=False)


@pytest.fixture()
def gepa_params(tmp_path, repo_root):
    from pipeline.config import load_params

    def make(server_url: str, **gepa):
        write_train_set(tmp_path / "data" / "rl" / "train.parquet")
        return load_params(repo_root / "params.yaml", {
            "paths": {"rl_dir": str(tmp_path / "data" / "rl"), "gepa_dir": str(tmp_path / "data" / "gepa"),
                      "reports_dir": str(tmp_path / "reports"), "cache_dir": str(tmp_path / ".cache")},
            "environment": {"base_url": server_url, "served_name": "fault-model", "max_retries": 0},
            "gepa": {"train_size": 4, "val_size": 3, "holdout_size": 5, "minibatch_size": 2, "max_metric_calls": 14,
                     **gepa},
            "mlflow": {"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
                       "artifact_root": str(tmp_path / "mlartifacts")},
        })

    return make


def test_slices_are_disjoint_seeded_and_read_the_training_rows(gepa_params):
    params = gepa_params("http://127.0.0.1:9/v1")
    slices = load_slices(params.path(params.paths.rl_dir) / "train.parquet", params.gepa)
    uids = [e.uid for part in (slices.train, slices.val, slices.holdout) for e in part]
    assert (len(slices.train), len(slices.val), len(slices.holdout)) == (4, 3, 5)
    assert len(set(uids)) == 12  # disjoint: the held-out rows are never seen by the optimiser
    assert [e.uid for e in load_slices(params.path(params.paths.rl_dir) / "train.parquet", params.gepa).holdout] == [e.uid for e in slices.holdout]  # seeded
    params.gepa.seed = 1
    assert [e.uid for e in load_slices(params.path(params.paths.rl_dir) / "train.parquet", params.gepa).train] != [e.uid for e in slices.train]
    ex = slices.train[0]
    assert ex.answers == (QUESTIONS[ex.question],)


def test_adapter_sends_the_env_only_messages_and_scores_with_the_reward_f1(gepa_params):
    """The exact chat messages of the env_only baseline; the score is the answer reward's token F1."""
    import asyncio

    from pipeline.environment.client import EnvironmentClient

    with FaultServer(responder=respond) as server:
        params = gepa_params(server.url)
        env = EnvironmentClient(params.environment)
        example = TaskExample("u0", "hotpotqa", "Which city is the capital of country number 0?", ("Paris",))
        try:
            batch = EnvironmentInstructionAdapter(env).evaluate([example], {COMPONENT: "Be careful."},
                                                                capture_traces=True)
        finally:
            asyncio.run(env.aclose())
        sent = server.chat_requests[0].body["messages"]
    assert sent == [{"role": "system", "content": params.environment.system_prompt},
                    {"role": "user", "content": f"{example.question}\n\nBe careful."}]
    hedge = HEDGE.format(gold="Paris")
    # F1 by hand: the normalised hedge has 16 tokens ("the" dropped), one of them "paris": P = 1/16, R = 1,
    # F1 = 2PR / (P + R) = 2/17
    assert len(M.normalize_answer(hedge).split()) == 16
    assert batch.scores == [pytest.approx(2 / 17)]
    assert batch.trajectories[0]["gold"] == ["Paris"] and batch.trajectories[0]["prediction"] == hedge


def test_gepa_stage_accepts_a_proposal_and_reports_held_out_scores(gepa_params):
    import mlflow

    with FaultServer(responder=respond) as server:
        params = gepa_params(server.url)
        content = run_gepa(params)
        requests = len(server.chat_requests)

    saved = json.loads((params.path(params.paths.gepa_dir) / "prompt.json").read_text())
    assert saved == json.loads(json.dumps(content))
    assert saved["seed"]["instruction"] == params.evaluate.env_only_instruction
    assert saved["optimised"]["instruction"] == SHORT
    accepted = [p for p in saved["proposals"] if p["accepted"]]
    assert accepted and accepted[0]["instruction"] == SHORT
    # held-out slice: the seed gets the hedged sentence on every row, the optimised instruction the gold
    assert saved["holdout"]["rows"] == 5 and not set(saved["holdout"]["uids"]) & set(saved["slices"]["train"])
    assert saved["optimised"]["holdout_f1"] == 1.0
    assert 0 < saved["seed"]["holdout_f1"] < 0.2
    assert saved["val_history"][0] == {"iteration": 0, "candidate": 0, "metric_calls": 3,
                                       "val_score": saved["seed"]["val_score"]}
    assert saved["val_history"][-1]["val_score"] == 1.0 and saved["val_history"][-1]["metric_calls"] > 3
    cost = saved["cost"]
    assert cost["metric_calls"] <= params.gepa.max_metric_calls
    assert cost["reflection"]["calls"] == cost["proposals"] >= 1
    # every request the server saw is accounted for: task, reflection, then the held-out scoring
    assert cost["task"]["calls"] + cost["reflection"]["calls"] + cost["holdout"]["calls"] == requests
    assert cost["holdout"]["calls"] == 2 * 5

    metrics = json.loads((params.path(params.paths.reports_dir) / "gepa" / "metrics.json").read_text())
    assert metrics["holdout_f1_optimised"] == 100.0 and metrics["accepted"] >= 1
    assert metrics["holdout_f1_delta"] == pytest.approx(100.0 - metrics["holdout_f1_seed"])
    history = pd.read_csv(params.path(params.paths.reports_dir) / "gepa" / "history.csv")
    assert history["best_val_score"].is_monotonic_increasing and history["best_val_score"].iloc[-1] == 1.0

    client = mlflow.MlflowClient()
    runs = client.search_runs([client.get_experiment_by_name(params.mlflow.experiment).experiment_id],
                              filter_string="tags.stage = 'gepa'")
    assert len(runs) == 1 and runs[0].data.metrics["holdout_f1_optimised"] == 100.0
    said = runs[0].data.tags["mlflow.note.content"]
    assert said.startswith("GEPA chose a proposal (val score 1.000, the seed's ") and "→ 100.00" in said
    parent = client.get_run(runs[0].data.tags["mlflow.parentRunId"]).data.tags
    assert parent["summary.gepa"] == said and said in parent["mlflow.note.content"]
    # the run lasts the whole search (not opened after it: 65 ms for a 114 s stage) ...
    info = runs[0].info
    assert info.end_time - info.start_time >= 1000 * cost["wall_s"] - 100, (info.end_time - info.start_time, cost)
    # ... and logs the three slices it read as datasets, each with the DVC md5 of train.parquet
    from pipeline.tracking.runs import dvc_md5

    inputs = {i.dataset.name: ({t.key: t.value for t in i.tags}, json.loads(i.dataset.profile))
              for i in runs[0].inputs.dataset_inputs}
    assert set(inputs) == {"gepa/train", "gepa/val", "gepa/holdout"}
    md5 = dvc_md5(params.path(params.paths.rl_dir) / "train.parquet")
    assert all(tags["dvc.md5"] == md5 for tags, _ in inputs.values()) and md5
    assert inputs["gepa/holdout"][1]["num_rows"] == saved["holdout"]["rows"]

    # The train stage of the same execution continues this parent (one repro, one parent run) ...
    from pipeline.tracking.runs import parent_run_id, stage_run

    gepa_parent = runs[0].data.tags["mlflow.parentRunId"]
    (params.path(params.paths.reports_dir) / "mlflow_run.json").unlink()  # DVC removes train's outputs first
    with stage_run(tracking_spec(params), "train", new_parent=True) as run:
        assert client.get_run(run.info.run_id).data.tags["mlflow.parentRunId"] == gepa_parent
        from pipeline.tracking.runs import describe_stage

        describe_stage("train", "Trained.")
    assert parent_run_id(tracking_spec(params)) == gepa_parent
    # ... but a later training (the parent already has a train summary) or other params open a new one.
    with stage_run(tracking_spec(params), "train", new_parent=True) as run:
        assert client.get_run(run.info.run_id).data.tags["mlflow.parentRunId"] != gepa_parent


def test_a_proposal_that_does_not_help_is_rejected_within_the_metric_call_budget(gepa_params):
    """The check can fail: a reflection model that proposes nothing better leaves the seed as the result, and
    the line says so. GEPA's own budget is checked between iterations only: with 10 calls, a val slice of 3
    and minibatches of 2 it ran 3 (seed) + 4 + 4 = 11; the stage never exceeds `gepa.max_metric_calls`."""
    import mlflow

    def stubborn(messages: list[dict]) -> str:
        user = messages[-1]["content"]
        if user.startswith(GEPA_REFLECTION_OPENING):
            return "```\nPlease answer the question.\n```"
        question = user.partition("\n\n")[0]
        return HEDGE.format(gold=QUESTIONS[question])

    with FaultServer(responder=stubborn) as server:
        params = gepa_params(server.url, max_metric_calls=10)
        content = run_gepa(params)
    assert content["proposals"] and not any(p["accepted"] for p in content["proposals"])
    assert content["optimised"]["instruction"] == content["seed"]["instruction"]
    assert content["optimised"]["holdout_f1"] == content["seed"]["holdout_f1"]
    assert content["cost"]["metric_calls"] <= 10
    assert content["cost"]["task"]["calls"] + content["cost"]["task"]["cache_hits"] <= 10

    client = mlflow.MlflowClient()
    (run,) = client.search_runs([client.get_experiment_by_name(params.mlflow.experiment).experiment_id],
                                filter_string="tags.stage = 'gepa'")
    said = run.data.tags["mlflow.note.content"]
    assert said.startswith("GEPA kept the seed instruction (no proposal beat its val score "), said
    assert f"{len(content['proposals'])} proposals, 0 better than their parent" in said
    assert f"{content['cost']['metric_calls']} metric calls of 10 allowed" in said


@pytest.mark.slow
def test_gepa_stage_on_the_bundled_model(built_data, llama_server, tmp_path):
    """The real stage on the real training set with SmolLM2 behind llama.cpp as task and reflection model."""
    params = built_data.model_copy(deep=True)
    params.root = built_data.root
    params.paths.gepa_dir = str(tmp_path / "gepa")
    params.paths.reports_dir = str(tmp_path / "reports")
    params.environment.base_url = llama_server
    params.mlflow.tracking_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    params.mlflow.artifact_root = str(tmp_path / "mlartifacts")
    params.gepa = params.gepa.model_copy(update={"train_size": 4, "val_size": 3, "holdout_size": 4,
                                                 "minibatch_size": 2, "max_metric_calls": 12})
    content = run_gepa(params)
    assert content["cost"]["proposals"] >= 1 and content["cost"]["reflection"]["calls"] >= 1
    assert content["cost"]["metric_calls"] <= 12
    assert content["holdout"]["rows"] == 4 and len(content["holdout"]["optimised_scores"]) == 4
    for side in ("seed", "optimised"):
        assert 0.0 <= content[side]["holdout_f1"] <= 1.0
    best = max(c["val_score"] for c in content["candidates"])
    assert content["optimised"]["val_score"] == best >= content["seed"]["val_score"]
    assert (tmp_path / "reports" / "gepa" / "history.csv").is_file()


def test_the_reflection_model_is_configurable(gepa_params):
    """`gepa.reflection_*` sends GEPA's reflection prompts to another endpoint and model; tasks stay put."""
    with FaultServer(responder=respond) as task_server, \
            FaultServer(responder=respond, model="reflector") as reflection_server:
        params = gepa_params(task_server.url, reflection_base_url=reflection_server.url,
                             reflection_served_name="reflector", reflection_max_tokens=64)
        content = run_gepa(params)
        task_bodies = [r.body for r in task_server.chat_requests]
        reflection_bodies = [r.body for r in reflection_server.chat_requests]
    assert content["models"] == {"task": "fault-model", "reflection": "reflector"}
    assert len(reflection_bodies) == content["cost"]["reflection"]["calls"] >= 1
    assert all(b["model"] == "reflector" and b["max_tokens"] == 64 for b in reflection_bodies)
    assert all(b["messages"][-1]["content"].startswith(GEPA_REFLECTION_OPENING) for b in reflection_bodies)
    assert not any(b["messages"][-1]["content"].startswith(GEPA_REFLECTION_OPENING) for b in task_bodies)
    assert content["optimised"]["instruction"] == SHORT


def test_train_opens_its_own_parent_when_params_changed_since_gepa(gepa_params):
    """A gepa parent opened with other params is not continued: MLflow params are immutable, and the run
    would claim settings it did not train with."""
    import mlflow

    from pipeline.tracking.runs import describe_stage, stage_run

    with FaultServer(responder=respond) as server:
        params = gepa_params(server.url)
        with stage_run(tracking_spec(params), "gepa") as run:
            describe_stage("gepa", "GEPA did something.")
            gepa_parent = mlflow.MlflowClient().get_run(run.info.run_id).data.tags["mlflow.parentRunId"]
        params.train.steps += 1
        with stage_run(tracking_spec(params), "train", new_parent=True) as run:
            parent = mlflow.MlflowClient().get_run(run.info.run_id).data.tags["mlflow.parentRunId"]
    assert parent != gepa_parent
