"""`register.serve`: how `promptr1 serve` runs the registered champion (pipeline/commands/serve.py), and which engine
generates the agent's turns outside evaluation (`promptr1 ask`, the pyfunc, `promptr1 serve`:
pipeline/agent/engine.py).

Why a request timeout of its own: MLflow's scoring server answers HTTP 504 after
`MLFLOW_SCORING_SERVER_REQUEST_TIMEOUT` (60 s by default), and one question is a multi-turn rollout
(~100-130 s on 2 CPU cores with the torch agent), so the default cuts every answer off.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class ServeConfig(BaseModel):
    """Where `promptr1 serve` listens and how long one request may take."""

    model_config = ConfigDict(extra="forbid")

    host: str = Field("127.0.0.1", description="Address the scoring server binds (0.0.0.0 exposes it).")
    port: int = Field(5001, ge=1, le=65535, description="Port of POST /invocations.")
    request_timeout_s: int = Field(
        900,
        ge=1,
        description="Seconds one POST /invocations may take before MLflow answers 504 (sets "
        "MLFLOW_SCORING_SERVER_REQUEST_TIMEOUT); one question takes ~100-130 s on 2 CPU cores.",
    )
    agent_engine: Literal["auto", "llama.cpp", "transformers"] = Field(
        "auto",
        description="What generates the agent's turns in `promptr1 ask`, the registered pyfunc and `promptr1 "
        "serve`: llama.cpp's server on a GGUF export of the agent (evaluation's engine, exported at load and "
        "cached) or transformers in the process. auto: llama.cpp when agent.model is a GGUF file and the agent "
        "can be exported, as evaluate.agent_engine decides.",
    )
    agent_parallel: int = Field(
        4,
        ge=1,
        le=64,
        description="llama.cpp engine of the served pyfunc: server slots, i.e. questions of one request "
        "generated together (more queue).",
    )
    agent_threads: int | Literal["auto"] = Field(
        1,
        description="llama.cpp engine: the agent server's threads (auto = the usable cores). 1 by default: on "
        "a shared 2-core machine (load average ~8) one thread decoded SmolLM2's 96-token turn in 5-10 s and two "
        "in 69-104 s (llama.cpp's threads spin at every barrier waiting for a descheduled peer); docs/serving.md.",
    )
