"""Memory and disk that verl's FSDP actor needs, estimated from the parameter count (no GPU, no network).

`actor_memory` is an **estimate** of what one training GPU holds for the actor while vLLM's rollout runs
beside it (the rollout's `gpu_memory_utilization` share and a colocated environment server's are separate).
Read from verl 0.9.1's source: the legacy trainer (`main_ppo_v0`) builds `verl/workers/engine_workers.py`
workers, whose FSDP engine is `verl/workers/engine/fsdp/transformer_impl.py`. Its assumptions:
- **Weights**: loaded in `fsdp_config.model_dtype` (ppo_trainer.yaml: `fp32` for the actor; `_build_module`),
  sharded over the FSDP group (`fsdp_size`, -1 = every training GPU). Mixed precision (`dtype: bfloat16`)
  only casts for compute; the sharded fp32 master weights stay. **Optimizer**: AdamW, two states
  (`exp_avg`, `exp_avg_sq`) per weight in the weights' dtype. So an fp32 full fine-tune keeps 4 + 8 = 12
  bytes per parameter, divided by the FSDP group. `param_offload` moves the weights to CPU between uses,
  `optimizer_offload` the Adam states (`fsdp_config` of `actor_rollout_ref.actor`).
- **No gradients**: they exist only inside an update. The engine's train mode ends with
  `optimizer_zero_grad` (`transformer_impl.py` `EngineTrainModeCtx.__exit__`, `zero_grad_on_exit` defaults to
  true in `verl/workers/engine/base.py` `BaseEngineCtx`), which calls `optimizer.zero_grad()`, and torch's
  default `set_to_none=True` frees them before the next rollout.
- **Reference model** (when `use_kl_loss` or `use_kl_in_reward`): not on the GPU. verl's reference config is
  `forward_only` (`trainer/config/ref/dp_ref.yaml`), and a forward-only FSDP engine keeps its parameters in CPU
  memory: fsdp2 with `CPUOffloadPolicy(pin_memory=True)`, fsdp with `CPUOffload(offload_params=True)`
  (`transformer_impl.py` `_build_fsdp_module`); a layer is copied to the GPU only while its forward runs. A
  reference built without `forward_only` (an override) would count its weights in `ref_dtype`. With LoRA the
  reference is the actor without its adapter (`ray_trainer.py` `ref_in_actor`): no second copy, and the Adam
  states cover only the (small, ignored) adapter.
- **CUDA context**: one per training GPU (the worker process), `CUDA_CONTEXT_BYTES` = 1 GiB, an estimate
  (typically 0.5-1 GiB with torch's kernels and NCCL's buffers; not measured here).
- **Weight-sync bucket**: before each rollout the actor sends its weights to vLLM through a buffer of
  `actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes` (2048 MiB by default) that it
  allocates on its own GPU (`verl/workers/rollout/vllm_rollout/bucketed_weight_transfer.py`
  `BucketedWeightSender._init_buffer`) while vLLM's weights are already loaded; it is freed after the sync, but
  the sync must fit too, so it is counted.
- Not counted: activations of a forward or an update (they come after vLLM has released its KV cache,
  `free_cache_engine`), allocator fragmentation, and a layer of the reference copied in for its forward.
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
CUDA_CONTEXT_BYTES = GIB
"""One CUDA context per training GPU (torch, its kernels, NCCL): an estimate, not a measurement."""


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
        return int(published), "published count, pipeline/train/verl/memory.py"
    return None


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a verl dtype name (fp32, bf16, bfloat16, …)."""
    try:
        return DTYPE_BYTES[str(dtype).lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}") from None


@dataclass(frozen=True)
class ActorMemory:
    """Bytes one training GPU holds for verl's FSDP actor while the rollout runs: an estimate (module docstring)."""

    weights: float
    optimizer: float
    """Both AdamW states."""
    reference: float
    """The reference model's weights: 0 when verl keeps them in CPU memory (its default)."""
    cuda_context: float
    weight_sync: float
    """The bucket the actor's weights travel to vLLM through."""

    @property
    def total(self) -> float:
        return self.weights + self.optimizer + self.reference + self.cuda_context + self.weight_sync

    def describe(self) -> str:
        parts = [("weights", self.weights), ("Adam states", self.optimizer), ("reference", self.reference),
                 ("CUDA context", self.cuda_context), ("weight-sync bucket", self.weight_sync)]
        shown = " + ".join(f"{name} {value / GIB:.1f}" for name, value in parts if value)
        return f"{shown} = {self.total / GIB:.1f} GiB"


def actor_memory(parameters: int, *, shards: int, model_dtype: str, param_offload: bool, optimizer_offload: bool,
                 lora: bool, reference: bool, ref_dtype: str, ref_on_cpu: bool,
                 weight_sync_megabytes: int) -> ActorMemory:
    """Per-GPU memory of verl's FSDP actor during rollout, an estimate (the module docstring's assumptions).

    `ref_on_cpu`: the reference keeps its parameters in CPU memory (verl's `forward_only` reference, or its
    `param_offload`); `weight_sync_megabytes`: `checkpoint_engine.update_weights_bucket_megabytes`.
    """
    per_gpu = parameters / shards
    weight_bytes = dtype_bytes(model_dtype)
    weights = 0.0 if param_offload else per_gpu * weight_bytes
    optimizer = 0.0 if optimizer_offload or lora else 2 * per_gpu * weight_bytes
    ref = per_gpu * dtype_bytes(ref_dtype) if reference and not lora and not ref_on_cpu else 0.0
    return ActorMemory(weights, optimizer, ref, float(CUDA_CONTEXT_BYTES), float(weight_sync_megabytes * 1024**2))


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
