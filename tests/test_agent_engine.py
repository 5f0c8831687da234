"""The agent's engine outside evaluation (pipeline/agent/engine.py): `auto` follows evaluation's rule, an agent
llama.cpp cannot take falls back (auto) or is refused (llama.cpp), and the served pyfunc gets the serving
project's choice. Fast: the tiny random Llama, no server. The real SmolLM2 agent answering through llama.cpp
is tests/test_serving.py's slow `promptr1 serve` test and tests/test_ask.py's."""

from __future__ import annotations

import json
import logging

import pytest
from helpers import agent_serving

from pipeline.agent.serving_policy import agent_policy, choose_engine, pyfunc_params
from pipeline.errors import UserError


def test_auto_is_llama_cpp_for_a_gguf_base_model_as_in_evaluation(params, tiny_llama_dir):
    assert params.agent.model.endswith(".gguf")  # the default profile's SmolLM2 Q4_1
    assert choose_engine(agent_serving(params), "auto") == "llama.cpp"
    assert choose_engine(agent_serving(params), "transformers") == "transformers"
    params.agent.model = str(tiny_llama_dir)  # a Hugging Face directory: no GGUF template to export with
    assert choose_engine(agent_serving(params), "auto") == "transformers"
    assert choose_engine(agent_serving(params), "llama.cpp") == "llama.cpp"
    with pytest.raises(
        UserError, match=r"register\.serve\.agent_engine='vllm': expected one of auto, llama\.cpp"
    ):
        choose_engine(agent_serving(params), "vllm")


def test_an_agent_llama_cpp_cannot_take_is_refused_when_asked_and_falls_back_under_auto(
    params, tiny_llama_dir, tmp_path, caplog
):
    """The tiny random Llama's heads differ from the SmolLM2 GGUF template's: `llama.cpp` names the key and
    the mismatch; `auto` warns and answers with transformers."""
    params.paths.cache_dir = str(tmp_path)
    refused = r"register\.serve\.agent_engine=llama\.cpp: .*attention/KV heads.*not the same architecture"
    with pytest.raises(UserError, match=refused), agent_policy(str(tiny_llama_dir), agent_serving(params), "llama.cpp"):
        pass
    with (
        caplog.at_level(logging.WARNING, logger="pipeline.agent.engine"),
        agent_policy(str(tiny_llama_dir), agent_serving(params), "auto") as agent,
    ):
        assert agent.engine == "transformers"
        assert type(agent.policy).__name__ == "TransformersPolicy"
    assert "cannot be served by llama.cpp" in caplog.text and "transformers generates instead" in caplog.text
    assert not list(tmp_path.rglob("*.gguf"))  # no half-written export left behind


def test_the_pyfunc_decides_from_what_register_logged(params, tiny_llama_dir, tmp_path):
    """The logged model config carries the base GGUF, so a served agent exported from it is llama.cpp's; a
    version logged before that key existed stays on transformers, as it was."""
    from pipeline.stages.register import _agent_model_config, environment_json

    config = _agent_model_config(params)
    config["cache_dir"] = str(tmp_path / "cache")
    rebuilt = pyfunc_params(str(tiny_llama_dir), config, environment_json(params))
    assert rebuilt.agent.model == params.agent.model
    assert rebuilt.gguf_dtype == params.evaluate.agent_gguf_dtype
    assert rebuilt.cache_dir == rebuilt.root == tmp_path / "cache"
    assert choose_engine(rebuilt, config["agent_engine"]) == "llama.cpp"
    del config["base_model"]
    older = pyfunc_params(str(tiny_llama_dir), config, environment_json(params))
    assert choose_engine(older, "auto") == "transformers"


def test_serve_hands_its_engine_choice_to_the_served_model(params, tmp_path, monkeypatch):
    """`promptr1 serve` sets MLflow's SERVING_MODEL_CONFIG from register.serve and the project's cache folder;
    MLflow applies only keys the logged config has, so each must be one register logs."""
    from pipeline.commands.serve import MODEL_CONFIG_VARIABLE, serve_command
    from pipeline.stages.register import _agent_model_config

    monkeypatch.delenv(MODEL_CONFIG_VARIABLE, raising=False)
    params.register.serve.agent_engine = "transformers"
    params.paths.cache_dir = str(tmp_path / "c")
    _, env = serve_command(params)
    served = json.loads(env[MODEL_CONFIG_VARIABLE])
    assert served == {
        "agent_engine": "transformers",
        "agent_parallel": 4,
        "agent_threads": 1,
        "cache_dir": str(tmp_path / "c"),
    }
    assert set(served) <= set(_agent_model_config(params))
    monkeypatch.setenv(MODEL_CONFIG_VARIABLE, json.dumps({"agent_engine": "llama.cpp"}))  # the operator's own
    assert json.loads(serve_command(params)[1][MODEL_CONFIG_VARIABLE])["agent_engine"] == "llama.cpp"
