"""Typed parameters: `params.yaml` (+ an optional profile) → pydantic models, loaded once.

Design decisions:
- `params.yaml` is the default profile and the file DVC tracks. A profile (`profiles/<name>.yaml`) holds
  only the keys it changes and is deep-merged on top when `profile:` names it, so
  `dvc exp run -S profile=paper` switches the whole setup without editing code.
- Every section is a model with `extra="forbid"`: a misspelt key fails loudly with its dotted path
  instead of being silently ignored.
- Relative paths are resolved against the project root (the folder holding `params.yaml`), so stages
  behave the same whatever the working directory of the caller.
- Secrets never live here: the environment section names the *variable* holding an API key.

Layout: `sections.py` holds the typed sections and `Params` (what a key means, its bounds, its default);
`train.py` holds the `train` section and its sub-sections, `environment.py` the `environment` section;
`loading.py` turns files and overrides into a validated `Params` (profiles, `-S` overrides, output-path
confinement, flattening for MLflow). Import from `pipeline.config`: every section is re-exported here.
"""

from pipeline.config.environment import EnvironmentConfig, KnowledgeConfig, ServerConfig
from pipeline.config.loading import (
    OUTPUT_PATH_KEYS,
    PARAMS_FILE,
    PROFILES_DIR,
    PROTECTED_FOLDERS,
    ConfigError,
    deep_merge,
    find_root,
    flatten,
    flatten_dict,
    load_params,
    output_path_problems,
    parse_override,
)
from pipeline.config.sections import (
    AgentConfig,
    DataConfig,
    EvaluateConfig,
    FlowConfig,
    GepaConfig,
    MlflowConfig,
    Params,
    PathsConfig,
    RegisterConfig,
    RewardConfig,
    evaluated_agent,
)
from pipeline.config.train import (
    KlLossType,
    LoraConfig,
    LossAggMode,
    TrainConfig,
    VerlConfig,
    WarmupConfig,
    WatchdogConfig,
)

__all__ = [
    "OUTPUT_PATH_KEYS", "PARAMS_FILE", "PROFILES_DIR", "PROTECTED_FOLDERS", "AgentConfig", "ConfigError",
    "DataConfig", "EnvironmentConfig", "EvaluateConfig", "FlowConfig", "GepaConfig", "KlLossType",
    "KnowledgeConfig", "LoraConfig", "LossAggMode", "MlflowConfig", "Params", "PathsConfig", "RegisterConfig",
    "RewardConfig", "ServerConfig", "TrainConfig", "VerlConfig", "WarmupConfig", "WatchdogConfig", "deep_merge",
    "evaluated_agent", "find_root", "flatten", "flatten_dict", "load_params", "output_path_problems", "parse_override",
]
