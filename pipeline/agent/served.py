"""The agent behind llama.cpp's own server: one launcher for evaluation and for local training rollouts.

A GGUF file of the agent (pipeline.agent.gguf_export) is served by llama.cpp's batching server
(pipeline.environment.llama_server, the environment's launcher, under the same owner guard) on
`evaluate.agent_port` (default: the environment's port + 1), and the rollout talks to it through
`OpenAICompletionsPolicy` with token-id prompts. One slot per conversation, each with its own KV cache large
enough for a whole conversation, so a conversation's next turn finds its earlier turns in the slot's cache.

Two users:
- evaluation (pipeline.evaluation.agent_server): the merged agent, greedy;
- the local GRPO trainer (pipeline.train.rollout_engine): the policy of the current step, exported from memory,
  sampled at `agent.temperature`. llama.cpp's server truncates the distribution by default (top-k 40,
  min-p 0.05); `served_policy` turns those off so that the sampled distribution is the policy's, as the
  in-process sampler's is (temperature and top-p only).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipeline.agent.completions_policy import OpenAICompletionsPolicy
    from pipeline.config import EnvironmentConfig, Params

logger = logging.getLogger(__name__)

UNTRUNCATED = {"top_k": 0, "min_p": 0.0, "typical_p": 1.0, "repeat_penalty": 1.0}
"""llama.cpp sampler settings that leave the distribution as temperature and top-p make it."""


def agent_port(params: Params) -> int:
    """`evaluate.agent_port`, or the port after the environment's."""
    return params.evaluate.agent_port or params.environment.port + 1


def agent_environment(gguf_path: Path, params: Params, parallel: int, *, port: int | None = None,
                      threads: int | str | None = None) -> EnvironmentConfig:
    """The environment config of the agent's llama.cpp server (pipeline.environment.spec's one constructor):
    `parallel` slots, each holding one whole conversation (prompt and every turn of its response), at `port`
    (default `agent_port`), with `threads` threads (default: the environment server's)."""
    from pipeline.environment.spec import agent_server_environment, environment_with

    env = params.environment
    if threads is not None:
        env = environment_with(env, server=env.server.model_dump() | {"n_threads": threads})
    return agent_server_environment(
        env, gguf_path, port=port or agent_port(params), parallel=parallel,
        n_ctx=params.agent.max_prompt_tokens + params.agent.max_response_tokens + 64)


@contextmanager
def served_policy(gguf_path: Path, params: Params, tokenizer: Any, parallel: int,
                  quiet: bool = False, *, port: int | None = None,
                  threads: int | str | None = None) -> Iterator[OpenAICompletionsPolicy]:
    """Serve `gguf_path` for the block and yield the policy talking to it; the server stops after (unless
    one serving exactly this file was already answering at the port: then it is reused and left running).
    `quiet`: its start and cache share are logged at DEBUG (training starts one per step)."""
    from pipeline.agent.completions_policy import OpenAICompletionsPolicy
    from pipeline.environment.servers import serve_environment
    from pipeline.environment.spec import ServerSpec

    env = agent_environment(gguf_path, params, parallel, port=port, threads=threads)
    spec = ServerSpec(environment=env, root=params.root, cache_dir=params.path(params.paths.cache_dir))
    with serve_environment(spec, role="agent", quiet=quiet) as url:
        policy = OpenAICompletionsPolicy(url, env.served_name, tokenizer, concurrency=parallel,
                                         token_prompts=True, sampling=UNTRUNCATED)
        policy.metrics_url = url.removesuffix("/").removesuffix("/v1") + "/metrics"
        policy.start_counting()
        try:
            yield policy
        finally:
            policy.close()
            if policy.prompt_tokens:
                logger.log(logging.DEBUG if quiet else logging.INFO, "agent server: %d of %d prompt tokens came from its cache (%.0f%%)",
                            policy.cached_prompt_tokens, policy.prompt_tokens,
                            100 * policy.cached_prompt_tokens / policy.prompt_tokens)
