"""Serving the agent: the pyfunc fails fast without its environment (fast, a real closed port), is logged from
code without a CloudPickle warning (a real SQLite registry), and `promptr1 serve` answers a POST (slow)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from demo_project import free_port

from pipeline.errors import EnvironmentUnavailable


def _agent_context(agent_dir: Path, tmp_path: Path, base_url: str):
    """The pyfunc's real load context: the bundled agent, environment JSON and model config, as MLflow passes them."""
    from mlflow.pyfunc import PythonModelContext

    from pipeline.config import load_params
    from pipeline.register import _agent_model_config, environment_json

    params = load_params(Path(__file__).resolve().parents[1] / "params.yaml")
    env_file = tmp_path / "environment.json"
    env_file.write_text(json.dumps(environment_json(params)))
    config = _agent_model_config(params)
    config["environment"] = {"base_url": base_url}
    return PythonModelContext(
        artifacts={"agent": str(agent_dir), "environment": str(env_file)}, model_config=config
    )


def test_predict_without_an_environment_fails_fast_naming_the_url(tiny_llama_dir, tmp_path):
    """Nothing listens on the port: predict raises within seconds, naming the URL and what to start (it used to
    retry every call for ~170 s and return an empty answer with no error)."""
    import pandas as pd

    from pipeline.pyfunc_agent import PromptR1Agent

    url = f"http://127.0.0.1:{free_port()}/v1"  # bound, then closed: a real refused connection
    agent = PromptR1Agent()
    agent.load_context(_agent_context(tiny_llama_dir, tmp_path, url))
    start = time.monotonic()
    with pytest.raises(
        EnvironmentUnavailable, match=r"does not answer at http://127\.0\.0\.1:\d+/v1.*promptr1 env start"
    ):
        agent.predict(None, pd.DataFrame({"question": ["Who directed The Carter?"]}))
    assert time.monotonic() - start < 10
