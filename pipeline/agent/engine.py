"""Who samples the agent: llama.cpp's server or the policy in this process. The `auto` rule, written once.

Two params choose it, `train.rollout_engine` (the local GRPO trainer's rollouts, pipeline.train.local.rollout_engine)
and `evaluate.agent_engine` (evaluation, pipeline.agent.evaluation_policy); each is `llama.cpp`,
`transformers` or `auto`. `auto` means llama.cpp exactly when llama.cpp can serve the agent and nothing
prefers the in-process model:

- llama.cpp serves GGUF exports (pipeline.agent.gguf_export), which take the agent's base GGUF file as their
  template: `agent.model` must resolve to a `.gguf` file (unresolvable → transformers);
- the export covers Llama architectures only: a loaded model of another type → transformers;
- training prefers the in-process policy on a CUDA machine and with LoRA (the export would merge adapters
  every step); the caller says so with `prefer_in_process`. Evaluation does not (its agent is merged).

The stage decides once (the train plan, the evaluation's agent) and records what it ran.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeline.modelref import ResolvedModel

ENGINES = ("llama.cpp", "transformers")


def decide_engine(
    requested: str,
    agent_model: ResolvedModel | None,
    *,
    prefer_in_process: bool = False,
    model_type: str | None = None,
) -> str:
    """`requested` (`auto`, `llama.cpp` or `transformers`) with `auto` decided (see module docstring).

    `agent_model`: `agent.model` resolved (None when it resolves to nothing); `model_type`: the loaded
    policy's `config.model_type` when it is loaded."""
    if requested != "auto":
        return requested
    if prefer_in_process or (model_type is not None and model_type != "llama"):
        return "transformers"
    return "llama.cpp" if agent_model is not None and agent_model.gguf_file else "transformers"
