"""The train stage's plan and the facts it resolves once: the agent model, the engine `auto` rule shared by
training and evaluation, and environment configs derived by one validated constructor."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from helpers import agent_serving, server_spec
from pydantic import ValidationError

from pipeline.agent.engine import decide_engine
from pipeline.environment.spec import (
    agent_server_environment,
    environment_with,
)
from pipeline.modelref import ModelRefError, ResolvedModel, resolve_model
from pipeline.train.plan import TrainPlan

REPO = Path(__file__).resolve().parents[1]
GGUF = ResolvedModel(ref="pkg://x/m.gguf", location="/m/m.gguf", gguf_file="m.gguf")
HF_DIR = ResolvedModel(ref="models/agent", location="/m/agent")


@pytest.mark.parametrize(
    ("requested", "model", "kwargs", "expected"),
    [
        ("transformers", GGUF, {}, "transformers"),  # asked for: never re-decided
        ("llama.cpp", HF_DIR, {}, "llama.cpp"),  # asked for: the caller refuses it later, naming the key
        ("auto", GGUF, {}, "llama.cpp"),
        ("auto", GGUF, {"model_type": "llama"}, "llama.cpp"),
        ("auto", GGUF, {"model_type": "qwen3"}, "transformers"),  # the GGUF export covers Llama only
        ("auto", GGUF, {"prefer_in_process": True}, "transformers"),  # CUDA or LoRA while training
        ("auto", HF_DIR, {}, "transformers"),  # no GGUF template to export into
        ("auto", None, {}, "transformers"),  # agent.model resolves to nothing
    ],
)
def test_the_auto_rule(requested, model, kwargs, expected):
    assert decide_engine(requested, model, **kwargs) == expected


def test_training_and_evaluation_decide_auto_alike(params, tmp_path):
    """Both stages' `auto` go through the one rule: with the default GGUF agent and with an agent that
    resolves to nothing, the trainer (on CPU, full fine-tune, before loading) and evaluation agree."""
    import torch

    from pipeline.agent.evaluation_policy import agent_engine
    from pipeline.train.local.rollout_engine import rollout_engine

    if torch.cuda.is_available():
        pytest.skip("training prefers the in-process policy on CUDA, evaluation does not")
    params.train.rollout_engine = params.evaluate.agent_engine = "auto"
    assert rollout_engine(TrainPlan.from_params(params)) == agent_engine(params.evaluate, agent_serving(params))
    assert agent_engine(params.evaluate, agent_serving(params)) == "llama.cpp"
    params.agent.model = str(tmp_path / "missing.gguf")
    assert rollout_engine(TrainPlan.from_params(params)) == agent_engine(params.evaluate, agent_serving(params))
    assert agent_engine(params.evaluate, agent_serving(params)) == "transformers"


def test_the_plan_resolves_the_agent_model_once(params, tmp_path):
    plan = TrainPlan.from_params(params)
    assert plan.agent_model == resolve_model(params.agent.model, params.root)
    assert plan.require_agent_model() is plan.agent_model
    assert plan.steps_csv == params.path(params.paths.reports_dir) / "train" / "steps.csv"
    assert plan.server == server_spec(params)
    params.agent.model = str(tmp_path / "missing.gguf")
    missing = TrainPlan.from_params(params)  # building the plan does not fail: the stage may not need a model
    with pytest.raises(ModelRefError, match="missing.gguf"):
        missing.require_agent_model()


def test_environment_with_validates_the_copy(params):
    env = params.environment
    cold = environment_with(env, temperature=0.0, max_tokens=7)
    assert (cold.temperature, cold.max_tokens) == (0.0, 7) and cold.model == env.model and cold is not env
    with pytest.raises(ValidationError, match="temperature"):
        environment_with(env, temperature=5.0)
    with pytest.raises(ValidationError, match="credentials"):
        environment_with(env, base_url="http://user:token@example.org/v1")


def test_the_agent_server_config_is_the_served_agents(params, tmp_path):
    """What pipeline.agent.llama_launcher serves is the one constructor's config: its own port and threads when a
    caller (ask, the pyfunc, serve) asks for them, the environment section itself never edited."""
    from pipeline.agent.llama_launcher import agent_environment, agent_port

    gguf = tmp_path / "agent-abc.gguf"
    n_ctx = params.agent.max_prompt_tokens + params.agent.max_response_tokens + 64
    built = agent_server_environment(
        params.environment, gguf, port=agent_port(params.evaluate, params.environment), parallel=3, n_ctx=n_ctx
    )
    serving = TrainPlan.from_params(params).agent_serving
    assert serving.port == agent_serving(params).port and serving.cache_dir == agent_serving(params).cache_dir
    assert built == agent_environment(gguf, serving, 3) == agent_environment(gguf, agent_serving(params), 3)
    threads_before = params.environment.server.n_threads
    own = agent_environment(gguf, serving, 2, port=1234, threads=1)
    assert (own.port, own.server.n_threads, own.server.parallel) == (1234, 1, 2)
    assert params.environment.server.n_threads == threads_before
    other = agent_server_environment(params.environment, tmp_path / "x.gguf", port=1, parallel=1, n_ctx=512)
    assert other.served_name == "agent-x" and other.base_url == "" and other.server.extra_args == []


def _calls(root: Path, name: str) -> list[str]:
    found = []
    for path in sorted([*root.joinpath("pipeline").rglob("*.py"), *root.joinpath("flows").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call):
                func = node.func
                called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
                if called == name:
                    found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_model_references_are_resolved_in_few_places():
    """A stage resolves a reference once and hands the ResolvedModel down (at most 3 places)."""
    calls = _calls(REPO, "resolve_model")
    assert len(calls) <= 3, f"resolve_model is called from {len(calls)} places: {calls}"


def test_train_and_environment_code_derive_configs_with_the_one_constructor():
    """No copied-and-edited environment config in the train and environment packages: `environment_with`."""
    copies = [
        c for c in _calls(REPO, "model_copy") if c.startswith(("pipeline/train/", "pipeline/environment/"))
    ]
    assert copies == []
