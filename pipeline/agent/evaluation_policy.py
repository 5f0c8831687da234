"""The agent during evaluation: in this process (transformers) or behind llama.cpp's server (a GGUF export).

`evaluation_policy(ref, serving, evaluate)` is a context manager yielding a `Policy` for the agent at `ref`
(the merged agent directory, or `agent.model` for the untrained `base_agent`), chosen by
`evaluate.agent_engine`; `serving` (pipeline.agent.llama_launcher.AgentServing) is what the evaluate plan resolved:

- `transformers`: `TransformersPolicy` in this process (any agent; GPU nodes). Every turn re-reads the
  whole conversation: on a 2-core CPU that prefill is most of a multi-turn evaluation.
- `llama.cpp` (the default profile, through `auto`: chosen when `agent.model` is a GGUF file): the agent
  is served by llama.cpp's own server (pipeline.environment.llama_server, the same launcher as the
  environment) on a second port, and the
  rollout talks to it through `OpenAICompletionsPolicy` with token-id prompts (exact: no re-tokenisation of
  the prompt). A merged Hugging Face directory is first written as GGUF (pipeline.agent.gguf_export, cached
  by the weights' hash); a GGUF reference (the untrained agent) is served as it is. The server has one
  slot per conversation in flight (`evaluate.agent_parallel`), so the next turn's prompt, which begins with
  the previous prompt and reply, finds that prefix in its slot's KV cache (llama.cpp's prompt cache) and only
  the environment's reply and the new turn are read. `evaluate.agent_rollout_batch` questions are rolled out
  together (more than the slots): the extra requests queue at the server, and llama.cpp's host-memory prompt
  cache (`cache_ram_mib`, 8 GiB) hands a conversation's earlier turns back to whichever slot takes its next
  turn. Greedy outputs are llama.cpp's: they can differ from the in-process model's in near-ties
  (F16 export: max logit difference ~0.05 on the test prompt, same argmax everywhere).

The served name carries the GGUF file's stem, so a server found already running at the port is reused only
if it serves exactly this export (otherwise starting fails with the name it serves).
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.agent.llama_launcher import served_policy
from pipeline.errors import UserError
from pipeline.hardware import resolve_autocast
from pipeline.paths import display_path

if TYPE_CHECKING:
    from pipeline.agent.llama_launcher import AgentServing
    from pipeline.config import EvaluateConfig

logger = logging.getLogger(__name__)


def agent_engine(evaluate: EvaluateConfig, serving: AgentServing) -> str:
    """`evaluate.agent_engine`, with `auto` decided by the one rule (pipeline.agent.engine): llama.cpp when
    `agent.model` is a GGUF file."""
    from pipeline.agent.engine import decide_engine
    from pipeline.modelref import resolved_or_none

    engine = evaluate.agent_engine
    if engine != "auto":
        return engine
    return decide_engine(engine, resolved_or_none(serving.agent.model, serving.root))


def rollout_batch_size(engine: str, evaluate: EvaluateConfig) -> int:
    """Questions the evaluation rolls out together, one batch at a time, with `engine` (`agent_engine`'s
    decision) running the agents: `evaluate.agent_rollout_batch` (llama.cpp; at least one per server slot)
    or `evaluate.batch_size` (transformers).

    One batch at a time: with two in flight, one batch's agent turns and the other's environment calls ran
    at once, the two servers' 2 + 2 threads fought over the 2 cores and llama.cpp's decode fell from ~7 to
    0.8 tokens/s per slot (measured in a default-profile repro).
    """
    if engine == "llama.cpp":
        return max(evaluate.agent_parallel, evaluate.agent_rollout_batch)
    return evaluate.batch_size


def agent_gguf(ref: str, serving: AgentServing) -> Path:
    """The GGUF file that serves agent `ref`: the file itself, or the cached export of a merged directory."""
    from pipeline.agent.gguf_export import cached_export
    from pipeline.modelref import ModelRefError, as_resolved

    try:
        resolved = as_resolved(ref, serving.root)
        if resolved.gguf_file:
            return Path(resolved.location)
        template = as_resolved(serving.agent.model, serving.root)
    except ModelRefError as exc:
        raise UserError(f"evaluate.agent_engine=llama.cpp: {exc}") from exc
    if not template.gguf_file:
        raise UserError(
            f"evaluate.agent_engine=llama.cpp serves GGUF exports of agents whose base model is a GGUF file; "
            f"agent.model={serving.agent.model!r} is not: set evaluate.agent_engine: transformers")
    if not Path(resolved.location).is_dir():
        raise UserError(f"agent {ref!r} is neither a GGUF file nor a local model directory")
    return cached_export(resolved.location, template.location, serving.cache_dir, serving.gguf_dtype,
                         root=serving.root)


def _tokenizer(ref: str, root: Path) -> Any:
    from pipeline.modelref import load_tokenizer

    return load_tokenizer(ref, root)


@contextmanager
def evaluation_policy(ref: str, serving: AgentServing, evaluate: EvaluateConfig, tokenizer: Any = None, *,
                      engine: str | None = None) -> Iterator[Any]:
    """The agent at `ref` as a Policy for the evaluation's rollouts (see module docstring); released after.

    `tokenizer` (llama.cpp engine): the agent's tokenizer when the caller has it already (the untrained
    agent's is the merged agent's: merge writes the base model's tokenizer); else loaded from `ref`
    (~10 s from a GGUF file). `engine`: what runs the agent as the stage decided it once
    (`EvaluatePlan.engine`), so what ran is what metrics.json records; None decides it here."""
    engine = agent_engine(evaluate, serving) if engine is None else engine
    logger.info("evaluation agent %s: %s", display_path(ref, serving.root) if Path(ref).exists() else ref,
                "llama.cpp server" if engine == "llama.cpp" else "transformers, in this process")
    if engine == "transformers":
        from pipeline.agent.policy import TransformersPolicy

        policy = TransformersPolicy.from_ref(ref, serving.root, serving.agent.dtype,
                                             max_batch_size=evaluate.batch_size)
        policy.autocast = resolve_autocast(evaluate.autocast, policy.device, "evaluate.autocast")
        yield policy  # the caller drops its name for it and calls release_memory()
        return

    gguf_path = agent_gguf(ref, serving)
    tokenizer = tokenizer if tokenizer is not None else _tokenizer(ref, serving.root)
    with served_policy(gguf_path, serving, tokenizer, evaluate.agent_parallel) as policy:
        yield policy


def release_memory() -> None:
    """Collect garbage and return cached CUDA blocks. Callers drop their own model references first
    (`del policy`): a function cannot free an object its caller still names."""
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
