"""What MLflow shows of the agent's work, read back through MLflow's client API from a real SQLite store.

- A micro evaluation (`run_evaluate`: a tiny random Llama as the merged agent, the agent alone and the
  environment alone as baselines, the fault-injecting test server as the environment, 2 datasets × 2 rows):
  one trace per evaluated trajectory with its tags, one span per turn, the evaluation table naming each
  row's trace, and the parent run's description.
- A scripted two-turn agent through the real rollout and `EnvironmentClient` against that server, whose
  replies carry ANSI escapes, NUL bytes and 10,000 characters: the spans per turn hold the interaction
  prompt, the reply (sanitised), tokens, latency and cost; the same trajectories as train-step traces.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd
import pytest
from fault_server import FaultServer
from helpers import copy_params

from pipeline.agent.policy import Generation
from pipeline.agent.protocol import ConversationBuilder
from pipeline.agent.rollout import RolloutSettings, run_rollout, trajectory_record
from pipeline.config import EnvironmentConfig, RewardConfig, load_params
from pipeline.config.specs import tracking_spec
from pipeline.environment.client import EnvironmentClient
from pipeline.reward import reward_for_trajectory
from pipeline.tracking.traces import MAX_TEXT_CHARS, clean_text
from pipeline.train.plan import TrainPlan
from pipeline.types import PromptItem

AUTHORS_FILES = {"hotpotqa": "hotpot.parquet", "triviaqa": "triviaqa_ood.parquet"}
SETTINGS = RolloutSettings(max_turns=5, max_turn_tokens=64, max_response_tokens=8192, env_reply_max_chars=2048,
                           temperature=1.0, top_p=1.0)
"""The scripted agents' rollout settings: room for every turn they play."""


def _project(tmp_path: Path, repo_root: Path, shared_datasets: Path) -> Path:
    copy_params(tmp_path)
    out = tmp_path / "data" / "rl" / "eval"
    out.mkdir(parents=True)
    for name, file in AUTHORS_FILES.items():
        frame = pd.read_parquet(shared_datasets / "prompt-r1" / "eval" / file).head(2)
        frame["data_source"] = name
        frame.to_parquet(out / f"{name}.parquet", index=False)
    return tmp_path


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    """One real MLflow SQLite store for the module's small tests (creating one takes seconds)."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


def _spans_by_name(trace) -> dict[str, object]:
    return {s.name: s for s in trace.data.spans}


def test_clean_text_escapes_control_characters_redacts_and_caps_the_length():
    assert clean_text("a\x1b[31mred\x1b[0m\x00b\x07\r\nc\td") == "ared\\x00b\\x07\\x0d\nc\td"
    assert clean_text(None) == ""
    assert clean_text("key: Bearer abcdefghijklmnop") == "key: Bearer [REDACTED]"
    long = clean_text("x" * (MAX_TEXT_CHARS + 25))
    assert long == "x" * MAX_TEXT_CHARS + "…[cut: 25 more characters]"
    assert clean_text("abcdef", limit=3) == "abc…[cut: 3 more characters]"


def test_micro_evaluation_traces_table_and_description(tmp_path, repo_root, shared_datasets, tiny_llama_dir):
    import mlflow

    from pipeline.stages import evaluate as E
    from pipeline.tracking.runs import parent_run_id

    project = _project(tmp_path, repo_root, shared_datasets)
    with FaultServer() as server:
        params = load_params(project / "params.yaml", {
            "paths": {"model_dir": str(tiny_llama_dir)},
            "data": {"id_eval_datasets": ["hotpotqa"], "ood_eval_datasets": ["triviaqa"]},
            "agent": {"max_turns": 2, "max_prompt_tokens": 1536},
            "environment": {"base_url": server.url, "served_name": "fault-model", "max_tokens": 16,
                            "max_retries": 0},
            "evaluate": {"agent_engine": "transformers", "rows_per_dataset": 2, "agent_max_turn_tokens": 12, "bootstrap_samples": 20,
                         "env_cache": False, "baselines": ["env_only", "agent_only"]},
        })
        summary = E.run_evaluate(params)
    preds = pd.read_parquet(project / "reports" / "eval" / "predictions.parquet")
    assert len(preds) == 3 * 2 * 2 and summary["systems"] == ["prompt_r1", "env_only", "agent_only"]

    client = mlflow.MlflowClient()
    experiment = client.get_experiment_by_name(params.mlflow.experiment).experiment_id
    (run,) = client.search_runs([experiment], filter_string="tags.stage = 'evaluate'")
    assert run.data.params["evaluate.agent_engine"] == "transformers" == summary["agent_engine"]
    traces = mlflow.search_traces(locations=[experiment], run_id=run.info.run_id, return_type="list")
    assert len(traces) == len(preds)  # one trace per evaluated trajectory, nothing per environment call
    by_id = {t.info.trace_id: t for t in traces}
    table = mlflow.load_table("eval/predictions.json", run_ids=[run.info.run_id])
    assert len(table) == len(preds) and "trajectory" not in table.columns
    assert set(table["trace_id"]) == set(by_id)
    assert {"system", "dataset", "row", "question", "prediction", "gold", "f1", "em"} <= set(table.columns)

    for row in preds.itertuples():
        match = table[(table.system == row.system) & (table.dataset == row.dataset) & (table.row == row.row)]
        trace = by_id[match.trace_id.item()]
        tags = trace.info.tags
        assert (tags["stage"], tags["system"], tags["dataset"], tags["row"], tags["uid"], tags["split"]) == (
            "evaluate", row.system, row.dataset, str(row.row), row.uid, row.split)
        root = trace.data.spans[0]
        assert root.parent_id is None and root.name == f"{row.system} · {row.dataset} #{row.row}"
        assert root.inputs["question"] == row.question and root.inputs["gold_answers"] == list(row.gold)
        assert root.outputs["prediction"] == row.prediction
        assert root.outputs["scores"]["f1"] == pytest.approx(row.f1, abs=1e-4)
        turns = [s for s in trace.data.spans[1:] if s.parent_id == root.span_id]
        assert [s.name for s in turns] == [f"turn {i}" for i in range(1, row.turns + 1)]
        env_spans = [s for s in turns if "env.prompt_tokens" in s.attributes]
        # under each environment turn: its queue and the environment's own latency
        assert len(trace.data.spans) == 1 + row.turns + 2 * len(env_spans)
        for turn in env_spans:
            assert sorted(s.name for s in trace.data.spans if s.parent_id == turn.span_id) == [
                "environment", "environment queue"]
        assert sum(s.attributes["env.prompt_tokens"] for s in env_spans) == row.env_prompt_tokens
    env_only = [by_id[t] for t in table[table.system == "env_only"].trace_id]
    for trace in env_only:
        (turn,) = [s for s in trace.data.spans if s.name == "turn 1"]
        assert len(trace.data.spans) == 1 + 1 + 2  # root, the one turn, its queue and environment spans
        assert turn.outputs["environment_reply"].startswith("echo: ")
        assert turn.attributes["env.completion_tokens"] > 0 and turn.attributes["env.latency_s"] > 0

    parent = client.get_run(parent_run_id(tracking_spec(params)))
    note = parent.data.tags["mlflow.note.content"]
    assert note.startswith("Prompt-R1 pipeline run, profile `default`")
    assert "Evaluated 3 systems on 2 datasets × 2 rows" in note and "prompt_r1 " in note
    assert run.data.tags["mlflow.note.content"] == parent.data.tags["summary.evaluate"]


# --- a scripted two-turn agent: spans per turn, sanitised replies, train-step traces ------------------------

ASK = "I will ask.</think>\n<interaction_prompt>Who wrote Hamlet? round {n}</interaction_prompt>"
ANSWER = "It says so.</think>\n<answer>William Shakespeare</answer>"
NASTY = "\x1b[31mShakespeare\x1b[0m wrote it\x00\x07 " + "y" * 10_000


class TwoAsksThenAnswer:
    """Asks the environment twice, then answers (a Policy with fixed turns, the real tokenizer)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.builder = ConversationBuilder(tokenizer)

    def generate(self, prompts, max_new_tokens, temperature, top_p, stop, return_logprobs):
        out = []
        for prompt in prompts:
            n = self.tokenizer.decode(prompt).count("<interaction_response>") + 1
            text = ASK.format(n=n) if n <= 2 else ANSWER
            ids = self.builder.encode(text)
            out.append(Generation(ids, [-1.0] * len(ids) if return_logprobs else None, text, "stop"))
        return out


@pytest.fixture()
def two_turn_trajectories(tiny_llama_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    items = [PromptItem(uid=f"hamlet-{i}", messages=[{"role": "user", "content": "Question: Who wrote Hamlet?\n"}],
                        gold_answers=["William Shakespeare"], data_source="hotpotqa", question="Who wrote Hamlet?")
             for i in range(2)]
    with FaultServer(responder=lambda messages: NASTY) as server:
        env = EnvironmentClient(EnvironmentConfig(
            model="fault-model", served_name="fault-model", base_url=server.url, cache=False, max_retries=0,
            system_prompt="You are a helpful assistant.",
            max_tokens=16_000, price_per_million_prompt=1.0, price_per_million_completion=2.0))
        return run_rollout(TwoAsksThenAnswer(tokenizer), env, items, SETTINGS, group_size=2, return_logprobs=False,
                           reward_fn=lambda t: reward_for_trajectory(t, RewardConfig(preset="released")))


def test_spans_per_turn_hold_prompt_reply_tokens_latency_cost_sanitised(store, two_turn_trajectories):
    import mlflow

    from pipeline.tracking.traces import flush_traces, log_trajectory_trace

    mlflow.set_tracking_uri(store)
    mlflow.set_experiment("traces")
    traj = two_turn_trajectories[0]
    assert (traj.num_turns, traj.stop_reason) == (3, "answer")
    with mlflow.start_run() as run:
        trace_id = log_trajectory_trace(
            name="prompt_r1 · hotpotqa #0", tags={"system": "prompt_r1", "dataset": "hotpotqa", "row": 0},
            question=traj.item.question, gold_answers=traj.item.gold_answers, turns=trajectory_record(traj),
            prediction=traj.answer, scores={"f1": 1.0}, stop_reason=traj.stop_reason)
        flush_traces()
    trace = mlflow.get_trace(trace_id)
    assert trace.info.trace_metadata["mlflow.sourceRun"] == run.info.run_id
    spans = _spans_by_name(trace)
    assert set(spans) == {"prompt_r1 · hotpotqa #0", "turn 1", "turn 2", "turn 3", "environment queue", "environment"}
    for n, turn in ((1, traj.turns[0]), (2, traj.turns[1])):
        span = spans[f"turn {n}"]
        assert span.span_type == "CHAT_MODEL"
        assert span.inputs["interaction_prompt"] == f"Who wrote Hamlet? round {n}"
        reply = span.outputs["environment_reply"]
        assert reply.startswith("Shakespeare wrote it\\x00\\x07 y") and not re.search(r"[\x00-\x08\x1b]", reply)
        assert reply == clean_text(NASTY) and len(clean_text(NASTY, limit=10**6)) == 29 + 10_000
        assert reply.endswith(f"…[cut: {29 + 10_000 - MAX_TEXT_CHARS} more characters]")
        assert span.attributes["env.prompt_tokens"] == turn.env_reply.prompt_tokens > 0
        assert span.attributes["env.completion_tokens"] == turn.env_reply.completion_tokens == len(NASTY.split())
        assert span.attributes["env.cost_usd"] == pytest.approx(
            (turn.env_reply.prompt_tokens * 1.0 + turn.env_reply.completion_tokens * 2.0) / 1e6)
        assert span.attributes["env.latency_s"] > 0 and span.attributes["agent_tokens"] == len(turn.agent_token_ids)
        assert span.end_time_ns > span.start_time_ns
    final = spans["turn 3"]
    assert final.span_type == "LLM" and final.outputs == {"answer": "William Shakespeare"}
    assert spans["turn 1"].end_time_ns <= spans["turn 2"].start_time_ns <= spans["turn 3"].start_time_ns
    assert json.loads(trace.info.response_preview)["prediction"] == "William Shakespeare"


class AsksThenAnswers:
    """Question A: ask once, then answer; question B: ask twice, then answer."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.builder = ConversationBuilder(tokenizer)

    def generate(self, prompts, max_new_tokens, temperature, top_p, stop, return_logprobs):
        out = []
        for prompt in prompts:
            decoded = self.tokenizer.decode(prompt)
            n = decoded.count("<interaction_response>") + 1
            asks = 1 if "Question: A" in decoded else 2
            text = ASK.format(n=n) if n <= asks else ANSWER
            ids = self.builder.encode(text)
            out.append(Generation(ids, None, text, "stop"))
        return out


def test_traces_time_each_trajectory_and_separate_queueing_from_latency(store, tiny_llama_dir):
    """Two trajectories ask a 0.3 s environment at once through one connection: one waits for the other.
    Each trace lasts its own turns' time (A finishes a round before B), and the waiting one's turn shows 0.3 s of
    queue before the environment's own 0.3 s."""
    import mlflow
    from fault_server import Behaviour
    from transformers import AutoTokenizer

    from pipeline.tracking.traces import flush_traces, log_trajectory_trace

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    items = [PromptItem(uid=q, messages=[{"role": "user", "content": f"Question: {q}?\n"}], gold_answers=["x"],
                        data_source="hotpotqa", question=f"{q}?") for q in ("A", "B")]
    with FaultServer(default=Behaviour(delay_s=0.3)) as server:
        env = EnvironmentClient(EnvironmentConfig(model="fault-model", served_name="fault-model",
                                                  base_url=server.url, cache=False, max_retries=0, concurrency=1,
                                                  system_prompt="You are a helpful assistant."))
        a, b = run_rollout(AsksThenAnswers(tokenizer), env, items, SETTINGS, group_size=1, return_logprobs=False,
                           reward_fn=None)
    assert (a.num_turns, b.num_turns) == (2, 3)
    assert b.wall_s - a.wall_s >= 0.25  # B's second question: its own time, not the batch's
    first = [a.turns[0], b.turns[0]]
    waited = max(first, key=lambda t: t.env_wait_s)
    assert waited.env_wait_s >= 0.55 and 0.25 <= waited.env_reply.latency_s < 0.5  # queued behind the other

    mlflow.set_tracking_uri(store)
    mlflow.set_experiment("trace-times")
    with mlflow.start_run():
        ids = [log_trajectory_trace(name=t.item.uid, tags={}, question=t.item.question, gold_answers=["x"],
                                    turns=trajectory_record(t), prediction=t.answer, scores={},
                                    seconds=t.wall_s) for t in (a, b)]
        flush_traces()
    for traj, trace_id in zip((a, b), ids, strict=True):
        spans = mlflow.get_trace(trace_id).data.spans
        root = spans[0]
        turns = trajectory_record(traj)  # its own time: the first turn's start to the last turn's end
        last = turns[-1]
        own_s = last["started_s"] + last["generation_s"] + max(last.get("env_wait_s", 0.0), 0.0) - turns[0]["started_s"]
        assert (root.end_time_ns - root.start_time_ns) / 1e9 == pytest.approx(own_s, abs=0.01)
        assert own_s <= traj.wall_s + 0.01
        turn1 = next(s for s in spans if s.name == "turn 1")
        queue, call = (next(s for s in spans if s.parent_id == turn1.span_id and s.name == n)
                       for n in ("environment queue", "environment"))
        record = trajectory_record(traj)[0]
        queue_s = (queue.end_time_ns - queue.start_time_ns) / 1e9
        assert queue_s == pytest.approx(record["env_wait_s"] - record["environment"]["latency_s"], abs=0.01)
        assert (call.end_time_ns - call.start_time_ns) / 1e9 == pytest.approx(record["environment"]["latency_s"],
                                                                               abs=0.01)
        assert queue.end_time_ns == call.start_time_ns and call.end_time_ns <= turn1.end_time_ns
        if traj.turns[0] is waited:
            assert queue_s >= 0.2 and turn1.attributes["env.queue_s"] >= 0.2


def test_a_sample_of_each_training_step_becomes_traces_of_the_train_run(store, two_turn_trajectories):
    import mlflow

    from pipeline.train.local.trajectory_log import log_step_traces

    mlflow.set_tracking_uri(store)
    experiment = mlflow.set_experiment("train-traces").experiment_id
    assert log_step_traces(1, two_turn_trajectories) == []  # no active run: nothing logged
    with mlflow.start_run() as run:
        for step in (1, 2):
            assert len(log_step_traces(step, two_turn_trajectories[:2])) == 2
    traces = mlflow.search_traces(locations=[experiment], run_id=run.info.run_id, return_type="list")
    assert sorted((t.info.tags["step"], t.info.tags["sample"]) for t in traces) == [
        ("1", "0"), ("1", "1"), ("2", "0"), ("2", "1")]
    for trace in traces:
        assert trace.info.tags["stage"] == "train" and trace.info.tags["dataset"] == "hotpotqa"
        root = trace.data.spans[0]
        reward = two_turn_trajectories[int(trace.info.tags["sample"])].reward
        assert root.outputs["scores"] == {"reward": round(reward.total, 4), "format": round(reward.format, 4),
                                          "answer": round(reward.answer, 4)}
        assert len(trace.data.spans) == 1 + 3 + 2 * 2  # 3 turns, 2 of them with queue and environment spans


def test_parent_description_lists_each_stage_in_pipeline_order(store, params):
    import mlflow

    from pipeline.stages.train import describe_training
    from pipeline.tracking.runs import NOTE_TAG, describe_stage

    mlflow.set_tracking_uri(store)
    mlflow.set_experiment("described")
    trained = describe_training(TrainPlan.from_params(params), {"critic/score/mean": 0.25})
    assert trained == (f"Trained the agent {params.agent.model} with GRPO (local backend) for {params.train.steps} "
                       f"steps of {params.train.batch_size} questions × {params.train.group_size} trajectories; "
                       "mean reward at the last step 0.250.")
    assert describe_training(TrainPlan.from_params(params), {"critic/score/mean": float("nan")}).endswith("trajectories.")
    with mlflow.start_run(tags={"profile": "default", "git_commit": "0123456789abcdef-dirty"}) as parent:
        with mlflow.start_run(run_name="evaluate", nested=True):
            describe_stage("evaluate", "Evaluated it.")
        with mlflow.start_run(run_name="train", nested=True) as child:
            note = describe_stage("train", trained)
    assert note == f"Prompt-R1 pipeline run, profile `default`, commit 0123456789ab. {trained} Evaluated it."
    client = mlflow.MlflowClient()
    assert client.get_run(parent.info.run_id).data.tags[NOTE_TAG] == note
    assert client.get_run(child.info.run_id).data.tags[NOTE_TAG] == trained
    with mlflow.start_run():  # a run without a parent describes itself only
        assert describe_stage("evaluate", "alone") is None


def test_a_trace_of_cache_hits_says_so_and_carries_system_and_dataset_tags(store, two_turn_trajectories):
    """Replies from the response cache take no time ("0s" in the Traces tab): such a trace is named
    `… (cached)` and tagged `env_cached=all`; system and dataset are tags a search (and a column) can use."""
    import copy

    import mlflow

    from pipeline.tracking.traces import flush_traces, log_trajectory_trace

    mlflow.set_tracking_uri(store)
    mlflow.set_experiment("cached")
    turns = trajectory_record(two_turn_trajectories[0])
    cached = copy.deepcopy(turns)
    for turn in cached:
        if turn.get("environment"):
            turn["environment"]["cached"] = True
    partly = copy.deepcopy(cached)
    next(t for t in partly if t.get("environment"))["environment"]["cached"] = False
    ids = {}
    with mlflow.start_run():
        for label, records in (("live", turns), ("cached", cached), ("partly", partly)):
            ids[label] = log_trajectory_trace(
                name=f"gepa · hotpotqa #{label}", tags={"system": "gepa", "dataset": "hotpotqa", "row": 0},
                question="Who wrote Hamlet?", gold_answers=["Shakespeare"], turns=records, prediction="x",
                scores={"f1": 0.0})
        flush_traces()
    traces = {label: mlflow.get_trace(trace_id) for label, trace_id in ids.items()}
    assert {label: t.info.tags["env_cached"] for label, t in traces.items()} == {
        "live": "none", "cached": "all", "partly": "some"}
    assert traces["cached"].data.spans[0].name == "gepa · hotpotqa #cached (cached)"
    assert traces["live"].data.spans[0].name == "gepa · hotpotqa #live"
    found = mlflow.search_traces(filter_string="tags.system = 'gepa' AND tags.dataset = 'hotpotqa'",
                                 return_type="list")
    assert len(found) == 3


def test_parent_runs_differ_at_a_glance_and_list_the_datasets_and_the_registered_version(tmp_path, params, monkeypatch):
    """A parent is named by profile, short commit and start time; it lists the datasets its stages read and
    links the registered version; the experiment opens on its runs in MLflow 3's UI (experimentKind)."""
    import mlflow

    from pipeline.tracking.runs import (
        EXPERIMENT_KIND,
        EXPERIMENT_KIND_TAG,
        link_parent_to_model_version,
        log_dataset_inputs,
        parent_run_name,
        stage_run,
    )

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    params.mlflow.tracking_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    params.mlflow.artifact_root = str(tmp_path / "artifacts")
    params.paths.reports_dir = str(tmp_path / "reports")
    assert parent_run_name("default", "0123456789abcdef-dirty", 0.0) == "pipeline-default-0123456-dirty-19700101-000000"
    train_file, eval_file = tmp_path / "train.parquet", tmp_path / "hotpotqa.parquet"
    frame = pd.DataFrame({"question": ["q"], "gold_answers": ['["a"]']})
    for path in (train_file, eval_file):
        frame.to_parquet(path)
    with stage_run(tracking_spec(params), "train", new_parent=True):
        log_dataset_inputs({"train": (frame, train_file)}, context="training")
    with stage_run(tracking_spec(params), "evaluate") as child:
        log_dataset_inputs({"eval/hotpotqa": (frame, eval_file)}, context="evaluation")
        link_parent_to_model_version("prompt-r1-agent", "3", None)
    client = mlflow.MlflowClient()
    parent = client.get_run(client.get_run(child.info.run_id).data.tags["mlflow.parentRunId"])
    name = parent.info.run_name
    assert re.fullmatch(r"pipeline-default-([0-9a-f]{7}(-dirty)?|unknown)-\d{8}-\d{6}", name), name
    inputs = {i.dataset.name: {t.key: t.value for t in i.tags} for i in parent.inputs.dataset_inputs}
    assert set(inputs) == {"train", "eval/hotpotqa"}
    assert inputs["train"]["mlflow.data.context"] == "training" and inputs["train"]["dvc.md5"]
    assert parent.data.tags["registered_model_version"] == "models:/prompt-r1-agent/3"
    assert parent.data.tags["registered_model_page"] == "#/models/prompt-r1-agent/versions/3"
    experiment = client.get_experiment(parent.info.experiment_id)
    assert experiment.tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND == "custom_model_development"


def test_scores_are_assessments_tokens_are_token_usage_and_a_batch_does_not_set_the_duration(
        store, two_turn_trajectories):
    """The Traces tab sorts and filters by assessments and sums token usage: each trace carries F1, EM and
    format as feedback of source CODE, the environment calls' tokens as MLflow's token-usage attribute, and
    lasts its own turns' time even when the system's wall time (`seconds`) is its whole batch's."""
    import mlflow

    from pipeline.tracking.traces import TOKEN_USAGE, flush_traces, log_trajectory_trace

    mlflow.set_tracking_uri(store)
    mlflow.set_experiment("trace-assessments")
    traj = two_turn_trajectories[0]
    record = trajectory_record(traj)
    last = record[-1]  # the final turn asks nothing: it ends when its generation does
    own_s = last["started_s"] + last["generation_s"] - record[0]["started_s"]
    with mlflow.start_run():
        trace_id = log_trajectory_trace(
            name="base_agent · hotpotqa #0", tags={"system": "base_agent"}, question=traj.item.question,
            gold_answers=traj.item.gold_answers, turns=record, prediction=traj.answer, scores={"f1": 1.0},
            stop_reason=traj.stop_reason, seconds=111.99, assessments={"f1": 1.0, "em": 0.0, "format": 1.0})
        flush_traces()
    trace = mlflow.get_trace(trace_id)
    feedback = {a.name: a for a in trace.info.assessments}
    assert {n: a.value for n, a in feedback.items()} == {"f1": 1.0, "em": 0.0, "format": 1.0}
    assert {a.source.source_type for a in feedback.values()} == {"CODE"}
    env_spans = [s for s in trace.data.spans if s.name == "environment"]
    prompt = sum(t.env_reply.prompt_tokens for t in traj.turns if t.env_reply)
    completion = sum(t.env_reply.completion_tokens for t in traj.turns if t.env_reply)
    assert len(env_spans) == 2 and all(TOKEN_USAGE in s.attributes for s in env_spans)
    usage = trace.info.token_usage
    assert (usage["input_tokens"], usage["output_tokens"]) == (prompt, completion) and prompt > 0
    root = trace.data.spans[0]
    assert (root.end_time_ns - root.start_time_ns) / 1e9 == pytest.approx(own_s, abs=0.05) and own_s < 10
    found = mlflow.search_traces(locations=[trace.info.experiment_id], filter_string="feedback.f1 = '1.0'",
                                 return_type="list")
    assert [t.info.trace_id for t in found] == [trace_id]
