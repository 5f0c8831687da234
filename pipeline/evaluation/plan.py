"""What the evaluate stage resolves from the params, once, at its entry (one plan per stage).

`EvaluatePlan.for_evaluate(params)` decides every fact the stage's parts would otherwise re-derive from the
whole params: the files it reads and writes, who runs the agents (`evaluate.agent_engine` with `auto`
decided: recorded in metrics.json as what ran, not re-decided afterwards), how many questions go together,
the environment every system answers under (the evaluation's sampling), and each plug-and-play
environment's. The runners, the scores, the report and the matrix get this plan or a single section.

Each environment the systems answer with is a `ServerSpec` (its section with the evaluation's sampling, the
project root, the resolved cache folder): what `serve_environment` starts and `EnvironmentClient.in_cache_dir`
talks to; the agent's own llama.cpp server is an `AgentServing` (`pipeline.agent.llama_launcher`). No whole params
travel inside the plan. Open-r1's `grpo.py` is the model: the config is parsed once into typed arguments
handed to `main`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.agent.evaluation_policy import agent_engine, rollout_batch_size
from pipeline.agent.llama_launcher import AgentServing
from pipeline.config import AgentConfig, EnvironmentConfig, EvaluateConfig, Params
from pipeline.environment.spec import ServerSpec
from pipeline.evaluation.matrix import variant_environment
from pipeline.evaluation.systems import evaluation_environment
from pipeline.stage_files import EVAL_REPORTS_DIR, EVAL_SETS_DIR, GEPA_PROMPT_FILE, STEPS_CSV


@dataclass(frozen=True)
class TrainedSetup:
    """How the evaluated agent was trained, as the verdict describes it (`train.*`)."""

    steps: int
    batch_size: int
    group_size: int


@dataclass(frozen=True)
class EnvironmentRun:
    """One plug-and-play environment (`evaluate.environments`): its name and the server its systems answer
    with (`variant_environment`: the entry's environment with the evaluation's sampling)."""

    name: str
    server: ServerSpec


@dataclass(frozen=True)
class EvaluatePlan:
    """Stage `evaluate`, resolved (module docstring)."""

    root: Path
    seed: int
    rows_dir: Path
    """`<paths.rl_dir>/eval`: the built evaluation sets."""
    out_dir: Path
    """`<paths.reports_dir>/eval`: the report."""
    model_dir: Path
    """The merged agent (`paths.model_dir`)."""
    gepa_prompt: Path
    """The gepa stage's optimised instruction (`<paths.gepa_dir>/prompt.json`)."""
    steps_csv: Path
    """The train stage's per-step figures (GRPO's one-off cost, the headline's last reward)."""
    id_datasets: tuple[str, ...]
    ood_datasets: tuple[str, ...]
    evaluate: EvaluateConfig
    agent: AgentConfig
    environment: EnvironmentConfig
    """The training environment: its prices and names (the paper comparison, the matrix's trained-with row)."""
    trained: TrainedSetup
    trace_evaluation: bool
    engine: str
    """What runs the agents: `evaluate.agent_engine` with `auto` decided, once."""
    rollout_batch: int
    """Questions rolled out together (`rollout_batch_size` for `engine`)."""
    server: ServerSpec
    """The environment every system answers with (`evaluation_environment`: the training environment with
    the evaluation's sampling), its project root and `paths.cache_dir`."""
    agent_serving: AgentServing
    """The agent's llama.cpp server and GGUF export (`evaluation_policy`)."""
    variants: tuple[EnvironmentRun, ...]
    """Each plug-and-play environment (`evaluate.environments`), in order."""

    @classmethod
    def for_evaluate(cls, params: Params) -> EvaluatePlan:
        reports_dir = params.path(params.paths.reports_dir)
        cache_dir = params.path(params.paths.cache_dir)
        agent_serving = AgentServing.from_sections(
            params.agent, params.environment, params.evaluate, root=params.root, cache_dir=cache_dir
        )
        engine = agent_engine(params.evaluate, agent_serving)

        def server(environment: EnvironmentConfig) -> ServerSpec:
            return ServerSpec(environment=environment, root=params.root, cache_dir=cache_dir)

        return cls(
            root=params.root,
            seed=params.seed,
            rows_dir=params.path(params.paths.rl_dir) / EVAL_SETS_DIR,
            out_dir=reports_dir / EVAL_REPORTS_DIR,
            model_dir=params.path(params.paths.model_dir),
            gepa_prompt=params.path(params.paths.gepa_dir) / GEPA_PROMPT_FILE,
            steps_csv=reports_dir / STEPS_CSV,
            id_datasets=tuple(params.data.id_eval_datasets),
            ood_datasets=tuple(params.data.ood_eval_datasets),
            evaluate=params.evaluate,
            agent=params.agent,
            environment=params.environment,
            trained=TrainedSetup(
                steps=params.train.steps, batch_size=params.train.batch_size, group_size=params.train.group_size
            ),
            trace_evaluation=params.mlflow.trace_evaluation,
            engine=engine,
            rollout_batch=rollout_batch_size(engine, params.evaluate),
            server=server(evaluation_environment(params.environment, params.evaluate)),
            agent_serving=agent_serving,
            variants=tuple(
                EnvironmentRun(v.name, server(variant_environment(params.environment, params.evaluate, v)))
                for v in params.evaluate.environments
            ),
        )
