"""`environment`: the environment section (the model the agent prompts, where it runs, its server and the
knowledgeable backend's world).

In its own module below `sections.py` because `matrix.py` (the evaluation's extra environments) validates
each entry as a whole environment section: both import it from here, and `sections.py` composes it into
`Params`. Import it from `pipeline.config`, which re-exports every section.
"""

from __future__ import annotations

from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False)


class ServerConfig(_Section):
    n_ctx: int = Field(
        4096,
        ge=256,
        le=1_048_576,
        description="llama.cpp context window (tokens) of one "
        "request (the llama.cpp engine gives each of its `parallel` slots this much).",
    )
    n_threads: int | Literal["auto"] = Field(
        "auto",
        description="llama.cpp CPU threads (environment and agent servers). auto: the cores this "
        "process may use (its affinity mask) less those other work keeps busy when the stage starts its first "
        "server; the count does not change results (pipeline.hardware.server_threads). Giving an environment server half the cores beside a llama.cpp "
        "agent server was measured and made the default profile slower (pipeline/hardware.py).",
    )
    engine: Literal["llama.cpp", "llama-cpp-python"] = Field(
        "llama.cpp",
        description="llamacpp backend: llama.cpp's own batching server (xllamacpp, "
        "pipeline.environment.llama_server) or llama-cpp-python's one-request-at-a-time server.",
    )
    parallel: int = Field(
        1,
        ge=1,
        le=256,
        description="llama.cpp engine: requests decoded together (slots). 1, with "
        "environment.concurrency 1: a reply never depends on which calls were decoded beside it.",
    )
    startup_timeout_s: float = Field(
        180.0, gt=0, le=7200, description="Wait this long for /v1/models to answer."
    )
    tensor_parallel_size: int = Field(8, ge=1, le=64, description="vLLM: GPUs one replica spans.")
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description="vLLM: share of each GPU's memory.")
    max_model_len: int = Field(32768, ge=256, description="vLLM: longest context served.")
    gpus: list[int] = Field(
        default_factory=list,
        description="vLLM: CUDA device ids the server runs on "
        "(CUDA_VISIBLE_DEVICES); empty = the first tensor_parallel_size devices.",
    )
    extra_args: list[str] = Field(
        default_factory=list,
        description="Appended to the server command; may not "
        "rebind the host (`--host` comes from environment.host) or carry secrets.",
    )

    @field_validator("extra_args")
    @classmethod
    def _no_rebinding_or_secrets(cls, args: list[str]) -> list[str]:
        for arg in args:
            name = arg.split("=", 1)[0]
            if name in ("--host", "--api-key", "--api_key"):
                raise ValueError(
                    f"{name} may not be set through extra_args: the host comes from environment.host "
                    "(a server we start listens where params say), and keys never go into params"
                )
            if urlsplit(arg).password:
                raise ValueError(
                    "an extra_args value carries credentials in a URL: pass them through the "
                    "environment instead"
                )
        return args

    @field_validator("n_threads")
    @classmethod
    def _positive_threads(cls, value: int | str) -> int | str:
        if isinstance(value, int) and not 1 <= value <= 1024:
            raise ValueError(f"n_threads must be auto or 1-1024, got {value}")
        return value


class KnowledgeConfig(_Section):
    """The knowledgeable environment (backend `knowledge`, `pipeline.environment.simulated.knowledge`)."""

    sources: list[str] = Field(
        default_factory=lambda: ["data/rl/train.parquet", "data/rl/eval"],
        description="Parquet/JSONL files or folders of questions with gold answers the environment knows.",
    )
    min_overlap: float = Field(
        0.6, gt=0, le=1, description="Share of a stored question's content words the request must contain."
    )
    mode: Literal["question", "terse", "hops"] = Field(
        "question",
        description="question: the verbatim question is the best request (pipeline/environment/"
        "knowledge.py); terse: a request length limit and replies with distractors (pipeline/environment/simulated/terse.py); "
        "hops: one subject per request over single-hop facts, so a 2-hop question needs a second request naming "
        "the first reply's entity (pipeline/environment/simulated/hops.py).",
    )


class EnvironmentConfig(_Section):
    backend: Literal["llamacpp", "vllm", "api", "knowledge"] = "llamacpp"
    model: str
    served_name: str
    host: str = "127.0.0.1"
    port: int = Field(8765, ge=1, le=65535)
    base_url: str = ""
    api_key_env: str = "PROMPTR1_ENV_API_KEY"
    system_prompt: str
    temperature: float = Field(0.0, ge=0, le=2)
    max_tokens: int = Field(128, ge=1, le=131_072)
    timeout_s: float = Field(60.0, gt=0, le=3600, description="Per call; every network wait is bounded.")
    decode_tokens_per_s: float = Field(
        10.0,
        gt=0,
        description="Declared slowest per-request decode speed of the "
        "environment under the run's load; pipeline/environment/budget.py.",
    )
    max_retries: int = Field(5, ge=0, le=20)
    backoff_base_s: float = Field(0.5, ge=0, le=60)
    concurrency: int = Field(
        1,
        ge=1,
        le=1024,
        description="Environment calls in flight at once (0 would hang); 1 "
        "sends them one at a time in a fixed order (reproducible replies from a llama.cpp server).",
    )
    cache: bool = True
    price_per_million_prompt: float = Field(0.0, ge=0)
    price_per_million_completion: float = Field(0.0, ge=0)
    budget_usd: float | None = Field(None, ge=0)
    reasoning_effort: Literal["low", "medium", "high"] | None = Field(
        None, description="GPT-OSS reasoning effort (sent only when set); null for models without one."
    )
    length_retry_factor: float = Field(
        4.0,
        ge=1,
        description="An empty reply after finish_reason=length is asked once more with max_tokens × this.",
    )
    max_failure_rate: float = Field(
        0.05,
        ge=0,
        le=1,
        description="Stop once more than this share of the last `failure_window` calls failed.",
    )
    failure_window: int = Field(50, ge=1, description="Sent calls over which the failure rate is judged.")
    server: ServerConfig = Field(default_factory=ServerConfig)
    knowledge: KnowledgeConfig = Field(default_factory=KnowledgeConfig)

    @model_validator(mode="after")
    def _api_needs_an_endpoint(self) -> EnvironmentConfig:
        # Without this, backend=api would send the key to the default local URL (http://127.0.0.1:port).
        if self.backend == "api" and not self.base_url:
            raise ValueError(
                "backend 'api' needs environment.base_url (the paid endpoint, e.g. profiles/api.yaml)"
            )
        parts = urlsplit(self.base_url)
        if parts.username or parts.password:
            # It would reach MLflow params, dvc.lock, the served model's config, logs and the process list.
            raise ValueError(
                "environment.base_url carries credentials (user:token@host): put the key in the "
                "variable named by environment.api_key_env instead"
            )
        return self

    @property
    def url(self) -> str:
        """The OpenAI-compatible base URL (ending in /v1)."""
        return self.base_url.rstrip("/") if self.base_url else f"http://{self.host}:{self.port}/v1"
