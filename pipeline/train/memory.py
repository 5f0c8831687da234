"""Memory and disk that verl's FSDP actor needs, estimated from the parameter count (no GPU, no network).

What verl 0.9.1 keeps, read from its source (the legacy trainer's workers, `verl/workers/engine_workers.py`,
build the FSDP engine `verl/workers/engine/fsdp/transformer_impl.py`):
- **Weights**: loaded in `fsdp_config.model_dtype` (ppo_trainer.yaml: `fp32` for the actor and the reference;
  `transformer_impl.py` `_build_module`), sharded over the FSDP group (`fsdp_size`, -1 = every training GPU).
  Mixed precision (`dtype: bfloat16`) only casts for compute; the sharded fp32 master weights stay.
- **Gradients**: one per weight, in the weights' dtype. **Optimizer**: AdamW, two states (`exp_avg`,
  `exp_avg_sq`) per weight in the weights' dtype. So a full fine-tune in fp32 holds 16 bytes per parameter,
  divided by the FSDP group. `param_offload` moves weights and gradients to CPU between uses,
  `optimizer_offload` the optimizer states (`fsdp_config` of `actor_rollout_ref.actor`).
- **Reference model** (when `use_kl_loss` or `use_kl_in_reward`): weights only, its own `model_dtype`, unless
  `actor_rollout_ref.ref.fsdp_config.param_offload`. With LoRA the reference is the actor without its adapter
  (`ray_trainer.py` `ref_in_actor`): no second copy, and gradients/optimizer cover only the (small, ignored)
  adapter.
- These stay on the GPU while vLLM's rollout holds its `gpu_memory_utilization` share (and a colocated
  environment server its own), so they must fit in what the fractions leave. Activations, the CUDA context
  and fragmentation are not counted: the estimate is a floor, and a layout under it certainly fails.
- **Checkpoints** (`verl/utils/checkpoint/fsdp_checkpoint_manager.py::save_checkpoint`): each rank saves its
  model shard (weights, `model_dtype`), its optimizer shard (both Adam states) and a small extra state (RNG,
  LR scheduler) per save (`checkpoint.save_contents` = model, optimizer, extra); `hf_model` adds a bf16
  Hugging Face copy. Rotation (`checkpoint_manager.py`): with `max_ckpt_to_keep` k >= 2 the oldest goes
  before a save (k on disk at most), with k = 1 the previous one stays until the new save completes (2 at
  most), with null every save stays.

Parameter counts: from the model's `config.json` when it is on disk (a local model directory, or the Hugging
Face cache, looked up offline), else the published counts below (model cards).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GIB = 1024**3
PUBLISHED_PARAMETERS = {
    "qwen3-0.6b": 0.6e9, "qwen3-1.7b": 1.7e9, "qwen3-4b": 4.0e9, "qwen3-8b": 8.2e9, "qwen3-14b": 14.8e9,
    "qwen3-32b": 32.8e9,
    "qwen2.5-0.5b": 0.49e9, "qwen2.5-1.5b": 1.54e9, "qwen2.5-3b": 3.09e9, "qwen2.5-7b": 7.61e9,
    "qwen2.5-14b": 14.7e9, "qwen2.5-32b": 32.5e9, "qwen2.5-72b": 72.7e9,
}
"""Parameters of the models our profiles train, as their Hugging Face model cards publish them, by the Hub
id's name lower-cased (an -Instruct/-Base suffix is ignored: same size)."""
DENSE_DECODERS = frozenset({"qwen2", "qwen3", "llama", "mistral"})
DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}


def _table_key(model: str) -> str:
    name = model.rstrip("/").rsplit("/", 1)[-1].lower()
    for suffix in ("-instruct", "-base"):
        name = name.removesuffix(suffix)
    return name


def count_from_config(config: dict[str, Any]) -> int | None:
    """Parameters of a dense Qwen/Llama-style decoder from its config.json; None for other architectures."""
    if config.get("model_type") not in DENSE_DECODERS or config.get("num_experts"):
        return None
    h, layers = config["hidden_size"], config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    kv = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or h // heads
    attention = h * heads * head_dim * 2 + h * kv * head_dim * 2  # q and o; k and v
    if config["model_type"] == "qwen2" or config.get("attention_bias"):
        attention += heads * head_dim + 2 * kv * head_dim
    if config["model_type"] == "qwen3":
        attention += 2 * head_dim  # q_norm, k_norm
    layer = attention + 3 * h * config["intermediate_size"] + 2 * h
    embeddings = config["vocab_size"] * h * (1 if config.get("tie_word_embeddings") else 2)
    return layers * layer + embeddings + h


def _cached_config(model: str, root: Path | None) -> dict[str, Any] | None:
    """config.json of a local model directory, or from the Hugging Face cache (offline lookup), if present."""
    local = Path(model) if Path(model).is_absolute() or root is None else root / model
    candidates = [local / "config.json"]
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(model, "config.json")
        if isinstance(cached, str):
            candidates.append(Path(cached))
    except (ImportError, ValueError):  # not a Hub id (a path): only the local directory counts
        pass
    for path in candidates:
        if path.is_file():
            return json.loads(path.read_text(encoding="utf-8"))
    return None


def parameter_count(model: str, root: Path | None = None) -> tuple[int, str] | None:
    """(parameters, where the number comes from) for `model`, or None when neither a config.json on disk
    nor the table knows it."""
    config = _cached_config(model, root)
    if config is not None:
        count = count_from_config(config)
        if count:
            return count, "its config.json"
    published = PUBLISHED_PARAMETERS.get(_table_key(model))
    if published:
        return int(published), "published count, pipeline/train/memory.py"
    return None


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a verl dtype name (fp32, bf16, bfloat16, …)."""
    try:
        return DTYPE_BYTES[str(dtype).lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}") from None


@dataclass(frozen=True)
class ActorMemory:
    """Bytes one training GPU holds for the FSDP actor and reference model, outside any forward pass."""

    weights: float
    gradients: float
    optimizer: float
    reference: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.reference

    def describe(self) -> str:
        parts = [("weights", self.weights), ("gradients", self.gradients), ("Adam states", self.optimizer),
                 ("reference", self.reference)]
        return " + ".join(f"{name} {value / GIB:.1f}" for name, value in parts) + f" = {self.total / GIB:.1f} GiB"


def actor_memory(parameters: int, *, shards: int, model_dtype: str, param_offload: bool, optimizer_offload: bool,
                 lora: bool, reference: bool, ref_dtype: str, ref_offload: bool) -> ActorMemory:
    """Per-GPU resident memory of verl's FSDP actor (module docstring)."""
    per_gpu = parameters / shards
    weight_bytes = dtype_bytes(model_dtype)
    weights = 0.0 if param_offload else per_gpu * weight_bytes
    gradients = 0.0 if param_offload or lora else per_gpu * weight_bytes
    optimizer = 0.0 if optimizer_offload or lora else 2 * per_gpu * weight_bytes
    ref = per_gpu * dtype_bytes(ref_dtype) if reference and not lora and not ref_offload else 0.0
    return ActorMemory(weights, gradients, optimizer, ref)


def checkpoint_bytes(parameters: int, *, save_contents: list[str], model_dtype: str, lora: bool) -> int:
    """Bytes of one verl actor checkpoint (all ranks' shards together; module docstring)."""
    size = 0.0
    if "model" in save_contents:
        size += parameters * dtype_bytes(model_dtype)
    if "optimizer" in save_contents and not lora:
        size += 2 * parameters * dtype_bytes(model_dtype)
    if "hf_model" in save_contents:
        size += parameters * 2
    return int(size)


def checkpoints_on_disk(keep: int | None, saves: int | None) -> int | None:
    """Most actor checkpoints verl holds at once with `max_actor_ckpt_to_keep` = keep, over `saves` saves
    (None: unknown); None when unbounded (keep null and the number of saves unknown)."""
    if keep is None or keep <= 0:
        return saves
    peak = max(keep, 2)
    return peak if saves is None else min(peak, saves)


def saves_in_run(save_freq: int, total_steps: int | None) -> int | None:
    """Checkpoints a run of `total_steps` writes (every save_freq steps and at the last one); 0 if none."""
    if save_freq <= 0:
        return 0
    if total_steps is None:
        return None
    return math.ceil(total_steps / save_freq)


def disk_problem(free_bytes: int, one_checkpoint: int, copies: int | None) -> str | None:
    """Why the retained checkpoints cannot fit in `free_bytes`, or None when they fit."""
    if copies == 0:
        return None
    if copies is None:
        return (f"verl keeps every checkpoint (max_actor_ckpt_to_keep null) of ~{one_checkpoint / GIB:.1f} GiB "
                f"each, and {free_bytes / GIB:.1f} GiB are free")
    needed = one_checkpoint * copies
    if needed <= free_bytes:
        return None
    return (f"{copies} retained checkpoint(s) of ~{one_checkpoint / GIB:.1f} GiB need ~{needed / GIB:.1f} GiB, "
            f"but only {free_bytes / GIB:.1f} GiB are free")
