"""The agent behind llama.cpp's own server: one launcher for evaluation and for local training rollouts.

A GGUF file of the agent (pipeline.agent.gguf_export) is served by llama.cpp's batching server
(pipeline.environment.llama_server, the environment's launcher, under the same owner guard) on
`evaluate.agent_port` (default: the environment's port + 1), and the rollout talks to it through
`OpenAICompletionsPolicy` with token-id prompts. One slot per conversation, each with its own KV cache large
enough for a whole conversation, so a conversation's next turn finds its earlier turns in the slot's cache.

Two users:
- evaluation (pipeline.agent.evaluation_policy): the merged agent, greedy;
- the local GRPO trainer (pipeline.train.local.rollout_engine): the policy of the current step, exported from memory,
  sampled at `agent.temperature`. llama.cpp's server truncates the distribution by default (top-k 40,
  min-p 0.05); `served_policy` turns those off so that the sampled distribution is the policy's, as the
  in-process sampler's is (temperature and top-p only).

What serving needs from the params is an `AgentServing`, built once by the caller's plan or entry (the
evaluate plan, the train plan, `promptr1 ask`, the pyfunc from its logged config): the functions here and
in pipeline.agent.serving_policy / pipeline.agent.evaluation_policy take it, never the whole params.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipeline.agent.completions_policy import OpenAICompletionsPolicy
    from pipeline.config import AgentConfig, EnvironmentConfig, EvaluateConfig

logger = logging.getLogger(__name__)

UNTRUNCATED = {"top_k": 0, "min_p": 0.0, "typical_p": 1.0, "repeat_penalty": 1.0}
"""llama.cpp sampler settings that leave the distribution as temperature and top-p make it."""


def agent_port(evaluate: EvaluateConfig, environment: EnvironmentConfig) -> int:
    """`evaluate.agent_port`, or the port after the environment's."""
    return evaluate.agent_port or environment.port + 1


@dataclass(frozen=True)
class AgentServing:
    """What serving the agent (evaluation, `ask`, the pyfunc, the trainer's llama.cpp rollouts) needs from
    the params, resolved once by the caller's plan or entry (module docstring)."""

    agent: AgentConfig
    """The agent section: its base model (a GGUF template), dtype and the token budgets that size a slot."""
    environment: EnvironmentConfig
    """The environment section: the agent's server takes its host and server settings (threads)."""
    port: int
    """The agent server's port (`agent_port`) when the caller names none."""
    gguf_dtype: str
    """The precision of a merged agent's GGUF export (`evaluate.agent_gguf_dtype`; the trainer's per-step
    exports: `train.rollout_gguf_dtype`)."""
    root: Path
    """The project root: relative model references and the server's working folder."""
    cache_dir: Path
    """`paths.cache_dir`, resolved: GGUF exports and the agent server's log."""

    @classmethod
    def from_sections(cls, agent: AgentConfig, environment: EnvironmentConfig, evaluate: EvaluateConfig, *,
                      root: Path, cache_dir: Path) -> AgentServing:
        """The agent as evaluation serves it: `evaluate.agent_port` and `evaluate.agent_gguf_dtype`."""
        return cls(agent=agent, environment=environment, port=agent_port(evaluate, environment),
                   gguf_dtype=evaluate.agent_gguf_dtype, root=root, cache_dir=cache_dir)


GROUPED_SLOTS = ["--slot_prompt_similarity", "1.0"]
"""llama.cpp server settings for rollouts that sample one prompt several times (`n`, a GRPO group): every
request takes the least recently used slot, and llama.cpp moves that slot's conversation to its host-memory
prompt cache and loads the longest cached prefix of the new prompt into it (`agent_environment`)."""


def agent_environment(gguf_path: Path, serving: AgentServing, parallel: int, *, port: int | None = None,
                      threads: int | str | None = None, grouped: bool = False) -> EnvironmentConfig:
    """The environment config of the agent's llama.cpp server (pipeline.environment.spec's one constructor):
    `parallel` slots, each holding one whole conversation (prompt and every turn of its response), at `port`
    (default `serving.port`), with `threads` threads (default: the environment server's).

    `grouped`: the rollout asks for several samples of one prompt (`n`), and the slots are chosen as
    `GROUPED_SLOTS` says. Why: llama.cpp decodes a prompt's extra samples in slots it clears when they
    finish (server-context.cpp `release()`: "do not keep context of the child slots"), and by default a
    request takes the free slot whose tokens share the longest prefix with it, so at the next turn an extra
    sample's conversation took its group's first sample's slot (the question's prompt is most of it) and
    re-read all of itself while displacing that conversation. Chosen by least recent use instead, each slot
    handed over is first saved to the host cache, so every conversation kept in a slot comes back from the
    cache and an extra sample reads its own first turn and the new tokens, not the question's prompt
    (benchmarks/results/engines.json `learning`: 2,172 → 662 prompt tokens beyond the new ones at a step's
    second turn, 8 trajectories). Evaluation asks for one sample of each prompt and keeps the default: there
    the longest prefix is the conversation's own slot."""
    from pipeline.environment.spec import agent_server_environment, environment_with

    env = serving.environment
    if threads is not None:
        env = environment_with(env, server=env.server.model_dump() | {"n_threads": threads})
    return agent_server_environment(
        env, gguf_path, port=port or serving.port, parallel=parallel,
        n_ctx=serving.agent.max_prompt_tokens + serving.agent.max_response_tokens + 64,
        extra_args=GROUPED_SLOTS if grouped else None)


@contextmanager
def served_policy(gguf_path: Path, serving: AgentServing, tokenizer: Any, parallel: int,
                  quiet: bool = False, *, port: int | None = None,
                  threads: int | str | None = None, grouped: bool = False) -> Iterator[OpenAICompletionsPolicy]:
    """Serve `gguf_path` for the block and yield the policy talking to it; the server stops after (unless
    one serving exactly this file was already answering at the port: then it is reused and left running).
    `quiet`: its start and cache share are logged at DEBUG (training starts one per step). `grouped`: the
    rollout samples prompts several times (`agent_environment`)."""
    from pipeline.agent.completions_policy import OpenAICompletionsPolicy
    from pipeline.environment.servers import serve_environment
    from pipeline.environment.spec import ServerSpec

    env = agent_environment(gguf_path, serving, parallel, port=port, threads=threads, grouped=grouped)
    spec = ServerSpec(environment=env, root=serving.root, cache_dir=serving.cache_dir)
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
