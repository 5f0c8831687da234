"""The agent outside evaluation and training (`promptr1 ask`, the registered pyfunc, `promptr1 serve`): which
engine generates its turns, and the policy that engine yields.

`agent_policy(ref, serving, requested)` is the one entry point (`serving`: a
`pipeline.agent.llama_launcher.AgentServing`). `requested` is `register.serve.agent_engine`
(`auto | llama.cpp | transformers`, default `auto`; `promptr1 ask --engine` overrides it for one question):

- `auto` applies the rule evaluation and training apply (`pipeline.agent.engine.decide_engine`):
  llama.cpp when `agent.model` (the agent's base model) is a GGUF file. "Where the model allows": an
  agent that cannot be written as GGUF (not a Llama with the base GGUF's shapes, e.g. the tests' tiny
  random Llama) is answered by transformers under `auto`, with a warning naming why; `llama.cpp` asked for
  explicitly refuses it instead.
- `llama.cpp`: evaluation's machinery, reused as it is: `agent_gguf` (the GGUF file itself, or the cached
  export of a merged directory under `<paths.cache_dir>/agent_gguf/`) and `served_policy` (llama.cpp's
  server, stopped when the block ends or this interpreter exits, even on SIGKILL: pipeline.environment.guard).
  The server is this caller's own, with `register.serve.agent_threads` threads (1 by default: see that key),
  on a free port (`evaluate.agent_port` is evaluation's): an `ask` or a
  served model never meets, or has to match, the server an evaluation runs at `environment.port + 1`.
- `transformers`: `TransformersPolicy` in this process (any agent; ~2.4 tokens/s for SmolLM2 on 2 cores).

Why: on 2 CPU cores the torch agent made one served question take 41-47 s; llama.cpp keeps the
conversation's KV cache between turns and decodes several times faster (docs/serving.md has the figures).

The pyfunc has no params.yaml: `pyfunc_params` builds the `AgentServing` this module reads from what the
register stage logged (`engine_model_config` + the environment JSON), with the GGUF cache in
`cache_dir` (default: `$PROMPTR1_CACHE_DIR`, else the user's cache folder, `~/.cache/promptr1`).
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.agent.engine import ENGINES, decide_engine
from pipeline.errors import UserError
from pipeline.paths import default_cache_dir

if TYPE_CHECKING:
    from pipeline.agent.llama_launcher import AgentServing
    from pipeline.agent.policy import PolicyBackend
    from pipeline.config import AgentConfig, EvaluateConfig
    from pipeline.config.serving import ServeConfig

logger = logging.getLogger(__name__)

ENGINE_KEY = "register.serve.agent_engine"
REQUESTS = ("auto", *ENGINES)
"""What `register.serve.agent_engine` and `promptr1 ask --engine` accept."""
"""Where a served pyfunc caches its GGUF export and agent-server log (`promptr1 serve` sets the project's)."""


@dataclass
class AgentEngine:
    """The policy generating the agent's turns, and what runs it (reported by ask and in the pyfunc's output)."""

    policy: PolicyBackend
    engine: str
    """`llama.cpp` or `transformers`: the engine actually used."""
    model: str
    """What that engine loaded: the GGUF file (llama.cpp) or the agent reference (transformers)."""


def choose_engine(serving: AgentServing, requested: str) -> str:
    """`requested` with `auto` decided by the one rule (`pipeline.agent.engine.decide_engine`: llama.cpp when `agent.model`,
    the agent's base model, is a GGUF file), as evaluation decides it."""
    from pipeline.modelref import resolved_or_none

    if requested not in REQUESTS:
        raise UserError(f"{ENGINE_KEY}={requested!r}: expected one of {', '.join(REQUESTS)}")
    return decide_engine(requested, resolved_or_none(serving.agent.model, serving.root))


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (bound, then released)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@contextmanager
def agent_policy(
    ref: str, serving: AgentServing, requested: str = "auto", *, parallel: int = 1,
    threads: int | str | None = None,
) -> Iterator[AgentEngine]:
    """The agent at `ref` generating through the engine `requested` decides (see module docstring).

    `parallel`: llama.cpp server slots (questions answered at once); `threads`: its threads (None: the
    environment server's `environment.server.n_threads`). The server, when one is started, stops when the
    block ends."""
    from pipeline.agent.evaluation_policy import agent_gguf

    engine = choose_engine(serving, requested)
    gguf: Path | None = None
    if engine == "llama.cpp":
        try:
            gguf = agent_gguf(ref, serving)
        except UserError as exc:
            if requested != "auto":
                raise UserError(f"{ENGINE_KEY}=llama.cpp: {exc}") from exc
            logger.warning(
                "agent %s cannot be served by llama.cpp (%s): transformers generates instead", ref, exc
            )
            engine = "transformers"
    if gguf is None:
        from pipeline.agent.policy import TransformersPolicy

        policy = TransformersPolicy.from_ref(ref, serving.root, serving.agent.dtype)
        logger.info("agent engine: transformers, in this process (%s)", ref)
        yield AgentEngine(policy, "transformers", ref)
        return

    from pipeline.agent.llama_launcher import served_policy
    from pipeline.modelref import load_tokenizer

    host = serving.environment.host if serving.environment.host != "0.0.0.0" else "127.0.0.1"
    tokenizer = load_tokenizer(ref, serving.root)
    with served_policy(gguf, serving, tokenizer, parallel, port=free_port(host), threads=threads) as policy:
        logger.info("agent engine: llama.cpp server at %s (%s)", policy.base_url, gguf.name)
        yield AgentEngine(policy, "llama.cpp", str(gguf))


# --- the registered pyfunc ------------------------------------------------------------------------------


def engine_model_config(agent: AgentConfig, serve: ServeConfig, evaluate: EvaluateConfig) -> dict[str, Any]:
    """The pyfunc `model_config` keys this module reads, as the register stage logs them.

    Top-level keys, so that `mlflow models serve` (through `SERVING_MODEL_CONFIG`) and `load_model(...,
    model_config=...)` can override each (MLflow overrides only keys the logged config has, whole values)."""
    return {
        "base_model": agent.model,
        "agent_engine": serve.agent_engine,
        "agent_parallel": serve.agent_parallel,
        "agent_threads": serve.agent_threads,
        "gguf_dtype": evaluate.agent_gguf_dtype,
        "cache_dir": None,
    }


def pyfunc_params(agent_ref: str, config: dict[str, Any], environment: dict[str, Any]) -> AgentServing:
    """The `AgentServing` for `agent_policy` inside the pyfunc, from its logged `model_config` and environment
    JSON; the cache folder is also the root its references resolve against.

    A version logged before these keys existed has no `base_model`: the agent is its own base then, which
    `auto` reads as "not a GGUF file", so transformers answers as it did."""
    from pipeline.agent.llama_launcher import AgentServing
    from pipeline.config import AgentConfig, EnvironmentConfig, EvaluateConfig

    if "agent" not in config:
        raise ValueError(
            "the pyfunc's model_config lacks `agent` (the serialised AgentConfig the register stage writes)"
        )
    agent = AgentConfig.from_dump(config["agent"], "model_config agent")
    cache = Path(config.get("cache_dir") or default_cache_dir()).expanduser().resolve()
    cache.mkdir(parents=True, exist_ok=True)
    return AgentServing.from_sections(
        agent.model_copy(update={"model": config.get("base_model") or agent_ref}),
        EnvironmentConfig.model_validate(environment),
        EvaluateConfig(agent_gguf_dtype=config.get("gguf_dtype") or "f16"),
        root=cache,
        cache_dir=cache,
    )
