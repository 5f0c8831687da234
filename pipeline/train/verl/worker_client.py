"""What a verl agent-loop worker needs to reach the environment: its settings and its `EnvironmentClient`.

Split from `pipeline.train.verl.agent_loop` so that it imports no verl (nor torch): the client a worker builds can be
tested, and reasoned about, on its own. Design decisions:

- **Settings from the trainer config.** verl carries the `prompt_r1` block that
  `pipeline.train.verl.overrides.build_overrides` writes (environment endpoint, the serialised `AgentConfig`,
  cache path) to every agent-loop worker, on any node. The agent block is read back whole
  (`AgentConfig.from_dump`): a missing key is an error naming it, never a default of this module's. The
  reward is not the loop's business: verl's reward loop computes it. Without that block (verl run by hand)
  the params file named by `PROMPTR1_PARAMS`, else the nearest params.yaml, is read.
- **One client per worker process**, kept at module level (a loop object lives for one trajectory), keyed
  by its configuration. `environment.concurrency` is split evenly over verl's agent-loop workers
  (`rollout.agent.num_workers`) so the cluster-wide number of calls in flight matches params.
- **One budget for the whole project.** Every worker's client spends from the project's cost ledger,
  `<paths.cache_dir>/environment_ledger.json` (the path the `prompt_r1` block carries), the file every
  other stage and process of the project spends from: the budget is a hard cap over all workers together
  and over the stages before and after training, not an even share per worker. Every worker of one node
  reaches that file. A multi-node run needs `paths.cache_dir` on the shared filesystem it already needs
  for data and checkpoints, with working `flock` (NFSv4, Lustre, CephFS): a node that sees a different
  folder keeps a ledger of its own and the cluster can spend the budget once per such node.
  Only a worker without any cache dir (none in the settings) keeps its state in memory, with an even
  share of the budget, so the total still holds.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from pipeline.config import AgentConfig, EnvironmentConfig
from pipeline.environment.client import CACHE_FILE, EnvironmentClient
from pipeline.environment.ledger import LEDGER_FILE
from pipeline.environment.spec import environment_with

log = logging.getLogger(__name__)

PARAMS_ENV_VAR = "PROMPTR1_PARAMS"


@dataclass(frozen=True)
class LoopSettings:
    """What one agent-loop worker needs besides verl's own rollout config."""

    environment: EnvironmentConfig
    agent: AgentConfig
    """The params' agent section: the turn settings (`max_turns` unless verl's `multi_turn.max_assistant_turns`
    is set, `max_turn_tokens`, `env_reply_max_chars`); verl's `response_length` is the response budget."""
    cache_dir: Path | None

    @classmethod
    def from_trainer_config(cls, config: DictConfig) -> LoopSettings:
        """From the `prompt_r1` block of the trainer config, else from params.yaml."""
        block = config.get("prompt_r1")
        if block is None:
            return cls.from_params_file(os.environ.get(PARAMS_ENV_VAR))
        data = _plain(block)
        for key in ("environment", "agent"):
            if key not in data:
                raise ValueError(f"the trainer config's prompt_r1 block lacks `{key}` "
                                 "(verl_overrides.agent_loop_overrides writes it)")
        cache_dir = data.get("cache_dir")
        return cls(
            environment=EnvironmentConfig.model_validate(data["environment"]),
            agent=AgentConfig.from_dump(data["agent"], "prompt_r1.agent"),
            cache_dir=Path(cache_dir) if cache_dir else None,
        )

    @classmethod
    def from_params_file(cls, path: str | None) -> LoopSettings:
        from pipeline.config import load_params

        params = load_params(path)
        return cls(
            environment=params.environment,
            agent=params.agent,
            cache_dir=params.path(params.paths.cache_dir),
        )


def _plain(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node


_CLIENTS: dict[str, EnvironmentClient] = {}


def environment_client(settings: LoopSettings, num_workers: int = 1) -> EnvironmentClient:
    """This process's client for `settings.environment` (made once, shared by every trajectory)."""
    env = settings.environment
    workers = max(1, num_workers)
    ledger_path = settings.cache_dir / LEDGER_FILE if settings.cache_dir else None
    per_worker = environment_with(
        env, concurrency=max(1, math.ceil(env.concurrency / workers)),
        budget_usd=env.budget_usd if env.budget_usd is None or ledger_path else env.budget_usd / workers)
    cache_path = settings.cache_dir / CACHE_FILE if (settings.cache_dir and env.cache) else None
    key = json.dumps([per_worker.model_dump(mode="json"), str(cache_path), str(ledger_path)], sort_keys=True)
    client = _CLIENTS.get(key)
    if client is None:
        if settings.cache_dir is not None:
            settings.cache_dir.mkdir(parents=True, exist_ok=True)
        client = _CLIENTS[key] = EnvironmentClient(per_worker, cache_path, ledger_path=ledger_path)
        log.info("environment client for %s (concurrency %d per worker, budget ledger %s)", env.url,
                 per_worker.concurrency, ledger_path or "in memory")
    return client


__all__ = ["PARAMS_ENV_VAR", "LoopSettings", "environment_client"]
