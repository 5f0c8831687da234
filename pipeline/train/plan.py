"""The train stage's plan: what its params decide, resolved once at the stage's entry and handed down.

open-r1's `grpo.py` parses its config once into typed arguments handed to `main`; `TrainPlan.from_params`
is that step here. Every layer below the stage entry (`pipeline.stages.train.run_train`) reads the plan,
or one of its config sections, instead of the whole `Params`, and none re-derives what the plan holds:

- `agent_model`: `agent.model` resolved once (`pipeline.modelref`); an unresolvable reference is kept as
  its error and raised by `require_agent_model` where a model is needed;
- the rollout engine's `auto` is decided once, by the one rule (`pipeline.agent.engine`), when the policy is
  loaded (`pipeline.train.local.rollout_engine`: the plan's resolved model, CUDA, LoRA and the model's type); the
  stage tags the run with what ran;
- the folders (`checkpoint_dir`, `reports_dir`, `cache_dir`, `rl_dir`) as paths, and the files inside them
  that the stage reads and writes (`steps_csv`, `train_file`, `eval_files`);
- `server`: the environment server to start or reuse (`pipeline.environment.spec.ServerSpec`);
- `tracking`: where the stage's MLflow runs go (`pipeline.tracking.runs.TrackingSpec`);
- `agent_serving`: the served agent's launcher (`pipeline.agent.llama_launcher.served_policy`) for the llama.cpp
  rollout engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.agent.llama_launcher import AgentServing, agent_port
from pipeline.config.specs import tracking_spec
from pipeline.environment.spec import ServerSpec
from pipeline.modelref import ModelRefError, ResolvedModel, resolve_model
from pipeline.stage_files import EVAL_SETS_DIR, STEPS_CSV, TRAIN_FILE

if TYPE_CHECKING:
    from pipeline.config import AgentConfig, EnvironmentConfig, Params, RewardConfig, TrainConfig
    from pipeline.config.specs import TrackingSpec


@dataclass(frozen=True)
class TrainPlan:
    """The train stage's params, resolved (see module docstring)."""

    profile: str
    seed: int
    root: Path
    agent: AgentConfig
    environment: EnvironmentConfig
    reward: RewardConfig
    train: TrainConfig
    experiment: str
    trace_train_samples: int
    eval_datasets: tuple[str, ...]
    rl_dir: Path
    reports_dir: Path
    checkpoint_dir: Path
    cache_dir: Path
    server: ServerSpec
    """The environment server the stage makes reachable (pipeline.environment.servers.serve_environment)."""
    tracking: TrackingSpec
    """The MLflow store, experiment and parent-run record of the stage's run (pipeline.tracking.runs)."""
    agent_serving: AgentServing
    """The llama.cpp server of each step's policy (`train.rollout_engine: llama.cpp`)."""
    agent_model: ResolvedModel | None
    agent_model_error: str | None

    @classmethod
    def from_params(cls, params: Params) -> TrainPlan:
        """Resolve the plan (the stage's one call that reads `Params` for what lies below it)."""
        try:
            model, error = resolve_model(params.agent.model, params.root), None
        except ModelRefError as exc:
            model, error = None, str(exc)
        cache_dir = params.path(params.paths.cache_dir)
        return cls(
            profile=params.profile,
            seed=params.seed,
            root=params.root,
            agent=params.agent,
            environment=params.environment,
            reward=params.reward,
            train=params.train,
            experiment=params.mlflow.experiment,
            trace_train_samples=params.mlflow.trace_train_samples,
            eval_datasets=tuple(params.eval_datasets),
            rl_dir=params.path(params.paths.rl_dir),
            reports_dir=params.path(params.paths.reports_dir),
            checkpoint_dir=params.path(params.paths.checkpoint_dir),
            cache_dir=cache_dir,
            server=ServerSpec(environment=params.environment, root=params.root, cache_dir=cache_dir),
            tracking=tracking_spec(params),
            agent_serving=AgentServing(
                agent=params.agent,
                environment=params.environment,
                port=agent_port(params.evaluate, params.environment),
                gguf_dtype=params.train.rollout_gguf_dtype,
                root=params.root,
                cache_dir=cache_dir,
            ),
            agent_model=model,
            agent_model_error=error,
        )

    def require_agent_model(self) -> ResolvedModel:
        """`agent.model` resolved; raises the ModelRefError resolving it raised."""
        if self.agent_model is None:
            raise ModelRefError(self.agent_model_error or f"model {self.agent.model!r} did not resolve")
        return self.agent_model

    @property
    def steps_csv(self) -> Path:
        """`reports/train/steps.csv`: one row per training step."""
        return self.reports_dir / STEPS_CSV

    @property
    def train_file(self) -> Path:
        """The training set the build stage writes."""
        return self.rl_dir / TRAIN_FILE

    @property
    def eval_files(self) -> list[Path]:
        """The evaluation sets the build stage writes, in params' order (ID then OOD)."""
        return [self.rl_dir / EVAL_SETS_DIR / f"{name}.parquet" for name in self.eval_datasets]
