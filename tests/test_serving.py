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


def test_register_logs_the_agent_from_code_without_a_cloudpickle_warning(
    tmp_path, repo_root, tiny_llama_dir, monkeypatch, capfd
):
    """The register stage's model logging says nothing about CloudPickle (not in logs, warnings or the
    console), logs one copy of the model, and the champion loads from its code without pickle."""
    import logging
    import shutil
    import warnings

    import mlflow
    from test_register import _write_metrics

    from pipeline.config import load_params
    from pipeline.register import run_register

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_PICKLE_DESERIALIZATION", raising=False)
    shutil.copy(repo_root / "params.yaml", tmp_path / "params.yaml")
    params = load_params(tmp_path / "params.yaml", {"paths": {"model_dir": str(tiny_llama_dir)}})
    _write_metrics(tmp_path, 30.0, 40.0)

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger().addHandler(handler)
    logging.getLogger("mlflow").addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert run_register(params)["promoted"]
    finally:
        logging.getLogger().removeHandler(handler)
        logging.getLogger("mlflow").removeHandler(handler)
    said = "\n".join([*records, *(str(w.message) for w in caught), *capfd.readouterr()])
    assert records, "no log record captured: the capture itself is broken"
    assert "cloudpickle" not in said.lower(), said

    local = Path(mlflow.artifacts.download_artifacts(f"models:/{params.register.model_name}@champion"))
    assert "model_code_path" in (local / "MLmodel").read_text()
    assert not list(local.rglob("python_model.pkl"))
    assert len(list(local.rglob("config.json"))) == 1  # one copy of the model per version
    model = mlflow.pyfunc.load_model(str(local))  # pickle deserialization stays disallowed
    assert type(model.unwrap_python_model()).__name__ == "PromptR1Agent"
