"""Environment configs derived from params, built in one place: the server to start, and the variants callers need.

- `ServerSpec`: what starting a local OpenAI-compatible server needs (its `EnvironmentConfig`, the project root
  that model paths are relative to, the cache folder for its log), built once by the stage's plan or entry
  from its sections and resolved paths, and handed to `pipeline.environment.servers`.
- `environment_with(env, **changes)`: the one way to derive a config from another (temperature 0 for the
  warm-up's demonstrations, the URL the stage started for verl's workers, a worker's share of the
  concurrency and budget). A copy is validated again, as a config read from params is: a change that would
  not pass `EnvironmentConfig`'s checks fails here, naming the field, rather than in a server or a client.
- `agent_server_environment(...)`: the config of llama.cpp's server for the agent (evaluation, and the local
  trainer's rollouts): a GGUF file under an `agent-` name on its own port, one slot per conversation.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipeline.config import EnvironmentConfig


@dataclass(frozen=True)
class ServerSpec:
    """The environment server a stage makes reachable (pipeline.environment.servers)."""

    environment: EnvironmentConfig
    root: Path
    """The project root: relative model paths and the server's working folder."""
    cache_dir: Path
    """`paths.cache_dir`, resolved: the server's log goes there (and the client's cache and ledger)."""


def environment_with(env: EnvironmentConfig, **changes: Any) -> EnvironmentConfig:
    """`env` with `changes` applied, validated as params are (see module docstring)."""
    return type(env).model_validate({**env.model_dump(), **changes})


def agent_server_environment(
    env: EnvironmentConfig, gguf_path: Path, *, port: int, parallel: int, n_ctx: int,
    extra_args: list[str] | None = None,
) -> EnvironmentConfig:
    """The environment config of llama.cpp's server for the agent's GGUF file `gguf_path`: served as
    `agent-<stem>` at `port` on `env.host`, `parallel` slots of `n_ctx` tokens each (one whole conversation),
    with llama.cpp server settings `extra_args` (`--name value` pairs; none by default)."""
    name = gguf_path.stem if gguf_path.stem.startswith("agent-") else f"agent-{gguf_path.stem}"
    server = env.server.model_dump() | {
        "engine": "llama.cpp",
        "parallel": parallel,
        "n_ctx": n_ctx,
        "extra_args": list(extra_args or []),
    }
    return environment_with(
        env, backend="llamacpp", model=str(gguf_path), served_name=name, port=port, base_url="", server=server
    )
