"""The policy of the local backend: device, tokenizer and model loading, LoRA, the KL reference, weights on disk.

Design decisions:
- **Any model reference** (`agent.model`: a GGUF file, an HF folder, a Hub id or a `pkg://` ref) goes through
  `pipeline.modelref.resolve_model`, so training, merge and inference load the same weights the same way.
- **Reference policy:** full fine-tune → a frozen copy of the base weights (the trainer overwrites it with the
  format warm-up's weights when `train.warmup.steps > 0`, as R1's reference is its SFT'd model); LoRA → the same
  model with adapters disabled (`PolicyModels.reference_context`), so no second copy sits in memory.
- **Checkpoint weights:** full fine-tune → `model/` (safetensors), LoRA → `adapter/`, always `tokenizer/`.
  Loading a full checkpoint refuses one that does not fit the base (anything missing except tied embeddings,
  or unexpected keys), rather than training on silently mixed weights.
- **One device:** CUDA when present, else CPU; gradient checkpointing on request (`train.gradient_checkpointing`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pipeline.errors import UserError
from pipeline.modelref import load_causal_lm
from pipeline.train.checkpoint import DTYPES

if TYPE_CHECKING:
    from pipeline.config import AgentConfig, LoraConfig, TrainConfig
    from pipeline.modelref import ResolvedModel

def pick_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def load_tokenizer(ref: str | ResolvedModel, root: Path):
    """The agent's tokenizer (`pipeline.modelref.load_tokenizer`)."""
    from pipeline.modelref import load_tokenizer as _load

    return _load(ref, root)


def apply_lora(model, lora: LoraConfig):
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    config = PeftLoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                        target_modules=list(lora.target_modules), task_type="CAUSAL_LM")
    return get_peft_model(model, config)


@dataclass
class PolicyModels:
    """The trainable policy, how to get reference log-probs, and the tokenizer."""

    model: torch.nn.Module
    reference: torch.nn.Module | None
    """Frozen base copy (full fine-tune); None with LoRA (adapters disabled instead)."""
    tokenizer: Any
    lora: bool

    def reference_context(self):
        """Context in which `reference_model` computes the reference policy."""
        from contextlib import nullcontext

        return self.model.disable_adapter() if self.lora else nullcontext()

    @property
    def reference_model(self) -> torch.nn.Module:
        return self.model if self.lora else self.reference  # type: ignore[return-value]

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def num_parameters(self) -> int:
        """Parameters of the policy network (base weights, plus adapters with LoRA)."""
        return sum(p.numel() for p in self.model.parameters())


def load_policy_models(agent_model: ResolvedModel, agent: AgentConfig, train: TrainConfig,
                       resume_from: Path | None, device: torch.device) -> PolicyModels:
    """The base model `agent_model` (`agent.model` resolved: GGUF, HF dir or Hub id) in `agent.dtype`,
    optionally with LoRA (`train.lora`), weights from `resume_from`."""
    dtype = DTYPES[agent.dtype]
    lora = train.lora.enabled
    tokenizer = load_tokenizer(agent_model, Path())
    base = load_causal_lm(agent_model, Path(), dtype)
    if lora:
        if resume_from is not None:
            from peft import PeftModel

            model = PeftModel.from_pretrained(base, str(resume_from / "adapter"), is_trainable=True)
        else:
            model = apply_lora(base, train.lora)
        reference = None
    else:
        reference = copy.deepcopy(base)
        model = base
        if resume_from is not None:
            load_full_weights(model, resume_from / "model", agent.model)
        reference.requires_grad_(False)
        reference.eval()
        reference.to(device)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.to(device)
    if train.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        if hasattr(model, "enable_input_require_grads"):
            model.enable_input_require_grads()
    return PolicyModels(model=model, reference=reference, tokenizer=tokenizer, lora=lora)


def load_full_weights(model: torch.nn.Module, folder: Path, base_ref: str) -> None:
    """Load a full fine-tune's safetensors from `folder` into `model` (refuses a foreign checkpoint)."""
    from safetensors.torch import load_file

    state = {}
    for shard in sorted(folder.glob("*.safetensors")):
        state.update(load_file(str(shard)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    # Tied embeddings are saved once; anything else missing means a foreign checkpoint.
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise UserError(f"{folder}: checkpoint does not fit {base_ref} "
                        f"(missing {sorted(set(missing) - tied)[:3]}, unexpected {unexpected[:3]})")


def write_weights(models: PolicyModels, folder: Path) -> None:
    """Save the trainable state into a checkpoint folder: `model/` or `adapter/`, plus `tokenizer/`."""
    if models.lora:
        models.model.save_pretrained(str(folder / "adapter"))
    else:
        models.model.save_pretrained(str(folder / "model"), safe_serialization=True)
    models.tokenizer.save_pretrained(str(folder / "tokenizer"))
