"""What samples the local trainer's GRPO rollouts: the policy in this process, or llama.cpp serving it.

`train.rollout_engine` (local backend):

- `transformers`: `TransformersPolicy` over the model being trained. Every turn re-reads the whole
  conversation (no KV cache between turns), which on a 2-core CPU is most of a multi-turn rollout.
- `llama.cpp`: at each step the policy's current weights are written as GGUF from memory
  (pipeline.agent.gguf_export.export_model: the base GGUF's metadata and tokenizer, `train.rollout_gguf_dtype`
  matrices) and served by llama.cpp's batching server (pipeline.agent.llama_launcher), one slot per trajectory, for
  that step's rollout; the server stops and the file is deleted after it. verl does the same on GPU nodes
  with vLLM (weights synced to the inference engine each step). The update recomputes every log-prob with
  the policy itself (old log-probs included), so the sampler's numerics only decide which tokens are
  sampled; `training/rollout_logprob_diff_*` reports how far llama.cpp's log-probs were from the
  policy's on the tokens both have. Sampling is seeded per (seed, step, turn): a resumed step asks for what
  the killed one did. Each turn's prompts go to the server in one request (a group's copies as `n` samples;
  pipeline.agent.completions_policy.batched_requests), so the server fills its slots at the same decode steps
  on every run and a repeated step samples the same tokens, loaded machine or not (llama.cpp's numerics
  depend on which sequences share a decode batch). `train.rollout_slots: 1` decodes one trajectory at a time.
  The server chooses slots for grouped samples (pipeline.agent.llama_launcher `agent_environment`), so a
  trajectory's later turn reads its new tokens and, for a group's extra samples, their own first turn.
- `auto`: llama.cpp on a machine without CUDA for a full fine-tune (no LoRA) of a Llama agent whose
  `agent.model` is a GGUF file (the export's template); transformers otherwise (the one rule:
  pipeline.agent.engine, fed by the train plan).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipeline.train.plan import TrainPlan

logger = logging.getLogger(__name__)


def rollout_engine(plan: TrainPlan, model: Any = None) -> str:
    """`train.rollout_engine` with `auto` decided (see module docstring); `model`: the policy, if loaded."""
    import torch

    from pipeline.agent.engine import decide_engine

    model_type = None if model is None else getattr(getattr(model, "config", None), "model_type", None) or ""
    return decide_engine(plan.train.rollout_engine, plan.agent_model,
                         prefer_in_process=torch.cuda.is_available() or plan.train.lora.enabled,
                         model_type=model_type)


@contextmanager
def served_step_policy(model: Any, tokenizer: Any, plan: TrainPlan, step: int, parallel: int) -> Iterator[Any]:
    """The policy `model` as it is now, served by llama.cpp for one step's rollout (module docstring)."""
    from pipeline.agent.gguf_export import GGUFExportError, export_model
    from pipeline.agent.llama_launcher import served_policy
    from pipeline.errors import UserError
    from pipeline.modelref import ModelRefError

    try:
        template = plan.require_agent_model()
    except ModelRefError as exc:
        raise UserError(f"train.rollout_engine=llama.cpp: {exc}") from exc
    if not template.gguf_file:
        raise UserError(f"train.rollout_engine=llama.cpp exports the policy with agent.model's GGUF file as its "
                        f"template; agent.model={plan.agent.model!r} is not a GGUF file: set "
                        "train.rollout_engine: transformers")
    folder = plan.cache_dir / "train_rollout"
    path = folder / f"agent-train-step{step}-{os.getpid()}.gguf"
    t0 = time.perf_counter()
    try:
        export_model(model, template.location, path, plan.train.rollout_gguf_dtype)
    except GGUFExportError as exc:
        raise UserError(f"train.rollout_engine=llama.cpp: {exc} (set train.rollout_engine: transformers)") from exc
    logger.debug("step %d policy exported to GGUF in %.1f s", step, time.perf_counter() - t0)
    try:
        with served_policy(path, plan.agent_serving, tokenizer, parallel, quiet=True,
                           grouped=plan.train.group_size > 1) as policy:
            policy.seed = (plan.seed * 1_000_003 + step) % (2**31)
            yield policy
    finally:
        path.unlink(missing_ok=True)
