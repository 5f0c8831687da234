"""Weights before GPU time: fetch and verify every model the merged params need, before anything starts.

A GPT-OSS-20B environment is ~13 GB and a Qwen3-4B agent ~8 GB; downloading them inside vLLM's startup
timeout, while 16 GPUs wait, is the wrong place. `promptr1 weights` (pipeline/commands/weights.py, and the
flow's task before training) puts every model into the Hugging Face cache first, with progress, and verifies what it got;
`promptr1 weights --check` only reports what is missing (exit 2), so a scheduler can gate a GPU job on it.
Servers and trainers then start with `HF_HUB_OFFLINE=1`.

Decisions:
- **Which models** follow from the active components only: the agent (`agent.model`), the environment
  (`environment.model`) when the pipeline serves it itself on this machine (llamacpp, vllm; a paid API, or a
  server at an `environment.base_url` elsewhere, as on the paper's training node, needs nothing here), and
  the SSim embedding model (`evaluate.ssim_model`). Each is reported under the params key that names it.
  `RequiredWeights.needed_by` decides them once from the three sections; the checks below take that list.
- **Each model's check** (structural verification, the Hub files fetched, the local path the offline
  processes load) is `pipeline.local_weights`'s: the environment servers and the verl trainer, which sit below
  this module, ask it about one model each.
- **GPT-OSS's harmony encoding** (`o200k_base.tiktoken`, not in the model repository) is fetched and checked
  with the weights when vLLM serves a GPT-OSS environment here (pipeline/environment/harmony.py), reported as
  one more line under `environment.model`; without it vLLM cannot start offline.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.local_weights import ModelStatus, model_status
from pipeline.placement import started_here

if TYPE_CHECKING:
    from pipeline.config import AgentConfig, EnvironmentConfig, EvaluateConfig

HARMONY_KEY = "environment.model"


def required_models(agent: AgentConfig, environment: EnvironmentConfig, evaluate: EvaluateConfig) -> dict[str, str]:
    """Params key → model reference, for the models the active components load."""
    needed = {"agent.model": agent.model}
    if environment.backend in ("llamacpp", "vllm") and started_here(environment):
        needed["environment.model"] = environment.model
    needed["evaluate.ssim_model"] = evaluate.ssim_model
    return needed


@dataclass(frozen=True)
class RequiredWeights:
    """The models a run loads on this machine (module docstring: which), as the weights checks take them."""

    models: tuple[tuple[str, str], ...]
    """(params key, model reference) for each model, in `required_models`' order."""
    root: Path
    """The project root: relative references are resolved against it."""
    harmony: bool
    """Whether GPT-OSS's harmony encoding is needed too (vLLM serves a GPT-OSS environment here)."""

    @classmethod
    def needed_by(cls, agent: AgentConfig, environment: EnvironmentConfig, evaluate: EvaluateConfig,
           root: Path) -> RequiredWeights:
        from pipeline.environment.harmony import needs_harmony

        return cls(models=tuple(required_models(agent, environment, evaluate).items()), root=root,
                   harmony=needs_harmony(environment))


def harmony_status(*, fetch: bool) -> ModelStatus:
    """GPT-OSS's harmony encoding file(s) for vLLM: present, fetched, or missing (pipeline.environment.harmony)."""
    from pipeline.environment import harmony

    folder = harmony.encodings_dir()
    ref = "harmony encoding " + ", ".join(harmony.ENCODING_FILES)
    problem = harmony.verify_encodings(folder)
    if problem is None:
        return ModelStatus(HARMONY_KEY, ref, "present", str(folder))
    if not fetch:
        return ModelStatus(HARMONY_KEY, ref, "missing", f"{problem} (run `promptr1 weights`)")
    try:
        harmony.fetch_encodings(folder)
    except (OSError, ValueError) as exc:
        return ModelStatus(HARMONY_KEY, ref, "missing", f"download failed: {exc}")
    return ModelStatus(HARMONY_KEY, ref, "fetched", str(folder))


def ensure_weights(required: RequiredWeights, *, fetch: bool = True) -> list[ModelStatus]:
    """Every required model: present, fetched, missing or invalid (never raises for one model)."""
    statuses = [model_status(key, ref, required.root, fetch=fetch) for key, ref in required.models]
    if required.harmony:
        statuses.append(harmony_status(fetch=fetch))
    return statuses
