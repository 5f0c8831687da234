"""Environment replies reach MLflow only sanitised: secrets redacted, control characters escaped, length capped.

A real local server stands in for the environment and answers with everything a hostile or broken endpoint
could send: ANSI escapes, NUL and bell bytes, a terminal-title sequence, a Bearer token, an `sk-` key, an
`api_key=` assignment, the run's own API key echoed back, and a 3 MiB tail. A tiny real evaluation (tiny
agent, real MLflow SQLite store, tracing on) runs against it; then everything MLflow holds — traces, the
predictions table, params, tags, artifacts, the raw `mlflow.db` and artifact files — is read back.
The DVC outputs keep the replies whole but with secrets redacted: `predictions.parquet` (the same run) and
`trajectories.jsonl` (a real client call to the hostile server, logged by the training stage's writer)
hold the raw control bytes and the uncut 3 MiB tail (the positive control: the hostile reply did flow
through) and none of the secrets.
"""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path

import pandas as pd
import pytest
from fault_server import Behaviour, FaultServer

from pipeline.environment.sanitize import (
    MAX_RECORDED_CHARS,
    REDACTED,
    register_secret,
    sanitize_text,
    sanitize_value,
    sanitized_json_copy,
)

SECRETS = ["abcdefghijklmnop1234", "sk-proj-ABCDEFGHIJKLMNOPQRSTUV", "hunter2hunter2"]
BAD_BYTES = ["\x00", "\x1b", "\x07", "\x9b"]


def hostile_reply(canary: str) -> str:
    return ("\x1b[31mred\x1b[0m NUL\x00here \x07bell \x1b]0;pwned-title\x07 \x9b2J "
            f"Authorization: Bearer {SECRETS[0]} key {SECRETS[1]} api_key={SECRETS[2]} echoed {canary} "
            + "y" * (3 * 1024 * 1024))


@pytest.mark.parametrize(("raw", "expected"), [
    ("plain\ntext\twith tabs", "plain\ntext\twith tabs"),
    ("\x1b[1;31mbold red\x1b[0m", "bold red"),
    ("title\x1b]0;evil\x07 done", "title done"),
    ("nul\x00 bell\x07 del\x7f c1\x85", "nul\\x00 bell\\x07 del\\x7f c1\\x85"),
    ("lone \x1b escape", "lone \\x1b escape"),
    ("bad \ud800 surrogate", "bad \ufffd surrogate"),
    ("Authorization: Bearer abc.def-ghi_jkl", f"Authorization: Bearer {REDACTED}"),
    ("key sk-proj-0123456789abcdef here", f"key {REDACTED} here"),
    ("api_key=supersecret99; next", f"api_key={REDACTED}; next"),
    ('{"password": "correct horse"}', f'{{"password": "{REDACTED} horse"}}'),
    ("https://user:pa55word@example.com/v1", f"https://{REDACTED}@example.com/v1"),
    ("tok ghp_abcdefghijklmnopqrstuvwxyz0123456789", f"tok {REDACTED}"),
    ("jwt eyJhbGciOiJI.eyJzdWIiOiIx.SflKxwRJSMeKKF2Q", f"jwt {REDACTED}"),
    ("aws AKIAABCDEFGHIJKLMNOP", f"aws {REDACTED}"),
])
def test_sanitize_text_worked_cases(raw, expected):
    assert sanitize_text(raw) == expected


def test_length_capped_with_marker_after_redaction():
    text = "z" * 10 + f" Bearer {SECRETS[0]}"
    # The cut falls inside the token: it is redacted before the cut, so no half key survives.
    assert sanitize_text(text, max_chars=22) == f"{'z' * 10} Bearer [RED…[cut: {len(REDACTED) - 4} more characters]"
    long = sanitize_text("x" * (MAX_RECORDED_CHARS + 100))
    assert long == "x" * MAX_RECORDED_CHARS + "…[cut: 100 more characters]"


def test_registered_secret_of_any_shape_is_redacted():
    secret = f"plain-{uuid.uuid4().hex}"
    assert secret in sanitize_text(f"echo {secret}")  # no pattern knows it ...
    register_secret(secret)
    assert sanitize_text(f"echo {secret}") == f"echo {REDACTED}"  # ... until it is registered


def test_json_copy_sanitises_every_string(tmp_path):
    source = tmp_path / "trajectories.jsonl"
    record = {"step": 1, "turns": [{"env_reply": "\x1b[2Jwipe\x00", "nested": [f"Bearer {SECRETS[0]}"]}]}
    source.write_text(json.dumps(record) + "\n\n" + json.dumps({"step": 2, "turns": []}) + "\n")
    (tmp_path / "out").mkdir()
    copy = sanitized_json_copy(source, tmp_path / "out")
    lines = [json.loads(line) for line in copy.read_text().splitlines()]
    assert lines[0] == {"step": 1, "turns": [{"env_reply": "wipe\\x00", "nested": [f"Bearer {REDACTED}"]}]}
    assert lines[1] == {"step": 2, "turns": []} and copy.name == source.name
    assert sanitize_value(("a\x00", 3, None)) == ("a\\x00", 3, None)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_hostile_replies_reach_mlflow_only_sanitised(tmp_path, repo_root, shared_datasets, tiny_llama_dir,
                                                     monkeypatch):
    import mlflow

    from pipeline.config import load_params
    from pipeline.stages import evaluate as E

    canary = f"canary{uuid.uuid4().hex}"
    monkeypatch.setenv("PROMPTR1_SANITISE_KEY", canary)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    project = tmp_path / "project"
    (project / "data" / "rl" / "eval").mkdir(parents=True)
    shutil.copy(repo_root / "params.yaml", project / "params.yaml")
    frame = pd.read_parquet(shared_datasets / "prompt-r1" / "eval" / "hotpot.parquet").head(2)
    frame["data_source"], frame["agent_name"] = "hotpotqa", "prompt_r1"
    frame.to_parquet(project / "data" / "rl" / "eval" / "hotpotqa.parquet", index=False)

    with FaultServer(Behaviour("ok", text=hostile_reply(canary))) as server:
        params = load_params(project / "params.yaml", {
            "paths": {"model_dir": str(tiny_llama_dir)},
            "data": {"id_eval_datasets": ["hotpotqa"], "ood_eval_datasets": []},
            "agent": {"max_turns": 2, "max_prompt_tokens": 1536},
            "environment": {"backend": "api", "base_url": server.url, "served_name": "fault-model",
                            "api_key_env": "PROMPTR1_SANITISE_KEY", "max_tokens": 24, "max_retries": 0},
            "evaluate": {"agent_engine": "transformers", "rows_per_dataset": 2, "agent_max_turn_tokens": 24, "bootstrap_samples": 20,
                         "baselines": ["env_only"]},
            "mlflow": {"trace_evaluation": True},
        })
        E.run_evaluate(params)
        assert server.chat_requests, "the environment was never called"

    # The DVC output keeps the raw reply (control bytes, full length: the hostile text flowed through), but
    # not one secret: a server echoing the key leaves 0 hits in it.
    raw = pd.read_parquet(project / "reports" / "eval" / "predictions.parquet")
    assert any("\x00" in p and "y" * (3 * 1024 * 1024) in p and REDACTED in p for p in raw.prediction)
    dvc_output = (project / "reports" / "eval" / "predictions.parquet").read_bytes()
    cells = json.dumps(raw.astype(str).to_dict(orient="list"), ensure_ascii=False)
    for secret in [*SECRETS, canary]:
        assert secret not in cells and secret.encode() not in dvc_output, secret

    client = mlflow.MlflowClient()
    (run,) = client.search_runs([client.get_experiment_by_name(params.mlflow.experiment).experiment_id],
                                filter_string="tags.stage = 'evaluate'")
    traces = mlflow.search_traces(locations=[run.info.experiment_id], run_id=run.info.run_id, return_type="list")
    assert traces, "environment calls were made but not traced"
    table = json.loads(Path(client.download_artifacts(run.info.run_id, "eval/predictions.json", str(tmp_path)))
                       .read_text())
    recorded = {
        "traces": [t.to_json() for t in traces],
        "table": table,
        "params": run.data.params,
        "tags": run.data.tags,
    }
    text = json.dumps(recorded, ensure_ascii=False)
    decoded = json.loads(text)  # escapes (\u0000) become the characters again, so they are caught too
    flat = json.dumps(decoded, ensure_ascii=False) + "".join(t.to_json() for t in traces)
    for secret in [*SECRETS, canary]:
        assert secret not in flat, secret
    for bad in BAD_BYTES:
        assert bad not in "".join(_strings(decoded)) and bad not in "".join(_strings([json.loads(t) for t in
                                                                                      recorded["traces"]])), repr(bad)
    assert "pwned-title" not in flat  # the terminal-title sequence is removed whole
    assert REDACTED in flat and "…[cut:" in flat  # the replies were there, sanitised and capped
    assert max(len(s) for s in _strings(decoded)) <= MAX_RECORDED_CHARS + 40
    # Nothing raw anywhere in the store: the SQLite file and every artifact file.
    stored = [project / "mlflow.db", *(p for p in (project / "mlartifacts").rglob("*") if p.is_file())]
    for path in stored:
        data = path.read_bytes()
        assert not any(s.encode() in data for s in [*SECRETS, canary]), path
        assert b"\x1b[31m" not in data and b"y" * (MAX_RECORDED_CHARS + 1) not in data, path


@pytest.mark.timeout(60)
def test_hostile_reply_reaches_trajectories_jsonl_without_secrets(tmp_path, monkeypatch):
    import asyncio

    from pipeline.agent.protocol import parse_turn
    from pipeline.config import EnvironmentConfig
    from pipeline.environment.client import EnvironmentClient
    from pipeline.stage_files import TRAJECTORIES_FILE
    from pipeline.train.local.trajectory_log import TrajectoryLog
    from pipeline.types import PromptItem, Trajectory, Turn

    canary = f"canary{uuid.uuid4().hex}"
    monkeypatch.setenv("PROMPTR1_SANITISE_KEY", canary)

    async def ask(url: str):
        client = EnvironmentClient(EnvironmentConfig(
            backend="api", model="m", base_url=url, served_name="fault-model", system_prompt="Help.",
            api_key_env="PROMPTR1_SANITISE_KEY", max_tokens=24, max_retries=0, cache=False))
        try:
            return await client.reply([], "what is the capital of France?")
        finally:
            await client.aclose()

    with FaultServer(Behaviour("ok", text=hostile_reply(canary))) as server:
        reply = asyncio.run(ask(server.url))
        assert server.chat_requests[0].headers["authorization"] == f"Bearer {canary}"
    assert canary in reply.text  # the key really came back in the reply
    turn = Turn(parse_turn("<think>ask</think><interaction_prompt>capital?</interaction_prompt>"), [1, 2],
                env_reply=reply)
    item = PromptItem("q1", [{"role": "user", "content": "q"}], ["Paris"], "hotpotqa", "capital of France?")
    path = tmp_path / TRAJECTORIES_FILE
    TrajectoryLog(path, keep_upto=0).append(1, [Trajectory(item, [0], turns=[turn])])

    data = path.read_bytes()
    (line,) = [json.loads(raw) for raw in path.read_text(encoding="utf-8").splitlines()]
    logged = line["turns"][0]["environment"]["text"]
    assert "\x00" in logged and "y" * (3 * 1024 * 1024) in logged and REDACTED in logged  # whole, not capped
    for secret in [*SECRETS, canary]:
        assert secret not in logged and secret.encode() not in data, secret


def _strings(value) -> list[str]:
    """The leaf strings of a JSON-like value; a string holding a JSON object or list counts as its leaves."""
    if isinstance(value, str):
        if value[:1] in "[{":
            try:
                return _strings(json.loads(value))
            except ValueError:
                pass
        return [value]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in (*_strings(k), *_strings(v))]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


def test_hostile_reply_is_cached_without_secrets_and_replayed_redacted(tmp_path, monkeypatch):
    """The response cache is a file in the project too: a reply echoing the key is stored redacted, and a
    cache hit (temperature 0) returns that redacted text."""
    import asyncio

    from pipeline.config import EnvironmentConfig
    from pipeline.environment.client import EnvironmentClient

    canary = f"canary{uuid.uuid4().hex}"
    monkeypatch.setenv("PROMPTR1_SANITISE_KEY", canary)
    cache_path = tmp_path / "environment_cache.sqlite"

    async def ask_twice(url: str):
        client = EnvironmentClient(EnvironmentConfig(
            backend="api", model="m", base_url=url, served_name="fault-model", system_prompt="Help.",
            api_key_env="PROMPTR1_SANITISE_KEY", max_tokens=24, max_retries=0, cache=True,
            temperature=0.0), cache_path)
        try:
            return (await client.reply([], "what is the capital of Italy?"),
                    await client.reply([], "what is the capital of Italy?"))
        finally:
            await client.aclose()

    with FaultServer(Behaviour("ok", text=hostile_reply(canary))) as server:
        live, again = asyncio.run(ask_twice(server.url))
        assert len(server.chat_requests) == 1  # the second answer came from the cache
    assert canary in live.text and not live.cached
    assert again.cached and canary not in again.text and REDACTED in again.text
    stored = b"".join(p.read_bytes() for p in tmp_path.glob("environment_cache.sqlite*"))
    for secret in [*SECRETS, canary]:
        assert secret.encode() not in stored, secret
