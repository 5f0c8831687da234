"""`register.serve`: how `promptr1 serve` runs the registered champion (pipeline/serving.py).

Why a request timeout of its own: MLflow's scoring server answers HTTP 504 after
`MLFLOW_SCORING_SERVER_REQUEST_TIMEOUT` (60 s by default), and one question is a multi-turn rollout
(~100-130 s on 2 CPU cores with the torch agent), so the default cuts every answer off.
"""

from __future__ import annotations

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
