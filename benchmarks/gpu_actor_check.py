"""One verl 0.9.1 FSDP2 actor update on one GPU, offline: memory against our rule, checkpoint, merge.

What it runs, in order, as verl's trainer runs one GRPO step's actor side (`RayPPOTrainer` in
`verl/trainer/ppo/ray_trainer.py`: `_compute_ref_log_prob`, `_compute_old_log_prob`, `_update_actor`, then
`update_weights` and `_save_checkpoint`), minus Ray and the rollout:
1. torch.distributed at world size 1 through `env://` on 127.0.0.1 (backend `cpu:gloo,cuda:nccl` on a GPU, as
   verl's `initialize_global_process_group_ray` builds it; `gloo` with `--device cpu`);
2. a Qwen3 model with random weights from `--config` (default: Qwen3-0.6B's config.json, the smoke-1gpu
   profile's agent, shipped in benchmarks/fixtures/qwen3-0.6b/) and a small word-level tokenizer, written as a
   Hugging Face directory (no Hub, no download);
3. verl's config for the smoke-1gpu profile as our train stage composes it (`pipeline.train.verl.config.
   compose_plan` of the train plan: params.yaml + profiles/smoke-1gpu.yaml through pipeline/train/verl/overrides.yaml into verl's
   ppo_trainer.yaml), with the model path pointed at the random model and the attention switches of the
   command line; then verl's own workers from it: `ActorRolloutRefWorker(role="actor")` (the FSDP2 engine
   `FSDPEngineWithLMHead`, AdamW, gradient checkpointing, bf16 mixed precision over the `model_dtype` master
   weights, verl's `ppo_loss`) and, when the profile's KL loss needs it, `role="ref"` (forward-only: verl puts
   the fsdp2 reference on `CPUOffloadPolicy(pin_memory=True)`);
4. a random rollout batch in the trainer's layout (left-padded prompts, right-padded responses of random
   lengths, GRPO advantages from verl's `compute_grpo_outcome_advantage` on random rewards, groups of
   `rollout.n`), the reference and old log-probs through the workers, one `update_actor` (ppo_epochs over
   mini-batches of `ppo_mini_batch_size` x n, micro-batches of `ppo_micro_batch_size_per_gpu`);
5. GPU memory: the peak over the update (`torch.cuda.max_memory_allocated`), and what stays allocated at the
   point where verl hands the GPU to the rollout (after the update: gradients freed on leaving train mode,
   Adam states kept; after the weight sync's generator of full tensors, `get_per_tensor_param`, has been
   drained) against our memory rule (`pipeline/train/verl/memory.py`, called in `memory_rule` below only);
6. verl's `FSDPCheckpointManager` (through the engine's `save_checkpoint`), then `python -m verl.model_merger
   merge --backend fsdp ...` (the command our merge stage runs, run in this process by `runpy`), and the merged
   weights against the trained ones: every key present, each merged tensor equal to the trained fp32 weight
   rounded to bfloat16 (the merger writes bfloat16), and different from the initial weights when the update
   moved them by more than bfloat16's rounding (the CPU test's `--lr 1e-3`; the profile's 1e-6 does not).

Attention: `sdpa` and verl's `use_remove_padding` off by default, because flash-attn is not assumed on the
GPU machine; our GPU profiles run `flash_attention_2` with remove-padding on (verl's defaults, and
pipeline/train/verl/overrides.yaml): `--attn-implementation flash_attention_2 --remove-padding` checks that
path where flash-attn is installed.

With `--device cpu` (what `tests/test_gpu_actor_check.py` runs, with `--tiny`: the same config at 2 layers,
hidden 64, vocab 1024) the same workers run on gloo, with three switches and no change to verl:
- verl 0.9.1 has no CPU platform (it falls back to CUDA): `use_cpu_platform` registers one through verl's
  platform plugin interface (`PlatformRegistry`, `set_platform`), and `VERL_ENGINE_DEVICE=cuda` (verl's own
  override) selects the FSDP engine, which is registered for cuda/npu only;
- eager attention, remove-padding off (flash-attn's varlen kernels are GPU-only);
- no reference worker: verl builds the fsdp2 reference with `CPUOffloadPolicy(pin_memory=True)` whatever
  its config says, and pinning memory needs an accelerator. The reference log-probs come from the actor
  before its update, which at step 1 has the reference's weights.

Run (one GPU, no network; benchmarks/README.md lists the packages):
    python benchmarks/gpu_actor_check.py --out benchmarks/results/gpu_actor_check.json
Writes one JSON (fields: benchmarks/README.md, "The verl actor on one GPU").
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import socket
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DEFAULT_CONFIG = ROOT / "benchmarks" / "fixtures" / "qwen3-0.6b" / "config.json"
PROFILE = "smoke-1gpu"
GIB = 1024**3
TINY = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 1024,
    "max_window_layers": 2,
}
"""`--tiny`: the config.json's architecture at test size (2 layers, hidden 64, vocab 1024)."""
TOKENIZER_WORDS = 256

for _k, _v in {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "RAY_USAGE_STATS_ENABLED": "0",
    "MLFLOW_DISABLE_TELEMETRY": "true",
}.items():
    os.environ.setdefault(_k, _v)

log = logging.getLogger("gpu_actor_check")

# verl's FSDP engine (`apply_monkey_patch`) imports trl's `AutoModelForCausalLMWithValueHead` whenever trl is
# importable, to patch a critic's state_dict; trl 1.16 (our dev extra) no longer has it, and the import
# error stops the actor's build. The check trains no critic and never uses trl: hide it from this process.
sys.modules["trl"] = None


# -- device and process group -------------------------------------------------------------------------------


def use_cpu_platform() -> None:
    """Give verl a CPU platform through its plugin interface, before any verl module reads the platform."""
    import torch
    from verl.plugin.platform.platform_base import PlatformBase
    from verl.plugin.platform.platform_manager import PlatformRegistry, set_platform

    class CPUDeviceModule:
        """What verl asks of `get_torch_device()` (memory stats, RNG, cache), answered for the CPU."""

        def __getattr__(self, name: str) -> Any:
            return getattr(torch.cpu, name)

        @staticmethod
        def memory_allocated(*_: Any) -> int:
            return 0

        max_memory_allocated = memory_reserved = max_memory_reserved = memory_allocated

        @staticmethod
        def mem_get_info(*_: Any) -> tuple[int, int]:
            return 0, 0

        @staticmethod
        def get_device_name(*_: Any) -> str:
            return "CPU"

        @staticmethod
        def empty_cache() -> None:
            return None

        reset_peak_memory_stats = empty_cache

        @staticmethod
        def manual_seed(seed: int) -> None:
            torch.manual_seed(seed)

        manual_seed_all = manual_seed

        @staticmethod
        def get_rng_state() -> Any:
            return torch.get_rng_state()

        @staticmethod
        def set_rng_state(state: Any) -> None:
            torch.set_rng_state(state)

    @PlatformRegistry.register(platform="cpu")
    class CPUPlatform(PlatformBase):
        device_name = "cpu"
        vendor_name = "cpu"
        device_module = CPUDeviceModule()

        def is_available(self) -> bool:
            return True

        def current_device(self) -> str:  # `.to(current_device())` must mean the CPU
            return "cpu"

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None:
            return None

        def synchronize(self, device_index: int | None = None) -> None:
            return None

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        manual_seed_all = manual_seed

        def set_allocator_settings(self, settings: str) -> None:
            return None

        def empty_cache(self) -> None:
            return None

        def get_device_capability(self, device_index: int = 0) -> tuple[None, None]:
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"

        @contextmanager
        def nvtx_range(self, msg: str):
            yield

        def profiler_start(self) -> None:
            return None

        def profiler_stop(self) -> None:
            return None

        def ray_resource_name(self) -> str:
            return "CPU"

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self) -> None:
            return None

    set_platform(CPUPlatform())
    os.environ["VERL_ENGINE_DEVICE"] = "cuda"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def init_process_group(device: str) -> None:
    """World size 1 through env:// on 127.0.0.1; the environment verl's `Worker` reads, too."""
    import torch
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="1",
    )
    if device == "cuda":
        torch.cuda.set_device(0)
        dist.init_process_group(backend="cpu:gloo,cuda:nccl", init_method="env://")
    else:
        dist.init_process_group(backend="gloo", init_method="env://")


# -- the random model ---------------------------------------------------------------------------------------


def model_config(path: Path, tiny: bool) -> dict[str, Any]:
    config = json.loads(path.read_text(encoding="utf-8"))
    if config.get("model_type") != "qwen3":
        raise SystemExit(f"{path}: model_type {config.get('model_type')!r}, expected 'qwen3'")
    return {**config, **TINY} if tiny else config


def write_random_model(config: dict[str, Any], out: Path, seed: int) -> Path:
    """A Hugging Face directory: `config` with random weights (bfloat16 safetensors) and a word-level tokenizer."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(out), dtype=torch.bfloat16)
    model.save_pretrained(out)
    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i + 2 for i in range(TOKENIZER_WORDS)}}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", eos_token="<eos>").save_pretrained(out)
    return out


# -- verl's config and workers ------------------------------------------------------------------------------


def actor_config(
    model_dir: Path,
    ckpt_root: Path,
    *,
    attn: str,
    remove_padding: bool,
    lr: float | None,
    compile_entropy: bool,
) -> Any:
    """verl's config for the smoke-1gpu profile as our train stage composes it, with the random model (and
    another learning rate if `lr` is given; `compile_entropy` False turns off verl's torch.compile of the
    entropy, which needs a C compiler at run time)."""
    from omegaconf import OmegaConf

    from pipeline.config import load_params
    from pipeline.train.plan import TrainPlan
    from pipeline.train.verl.config import compose_plan

    params = load_params(ROOT / "params.yaml", {"profile": PROFILE})
    cfg = OmegaConf.create(OmegaConf.to_container(compose_plan(TrainPlan.from_params(params)).cfg, resolve=False))
    for key, value in {
        "actor_rollout_ref.model.path": str(model_dir),
        "actor_rollout_ref.model.use_remove_padding": remove_padding,
        "actor_rollout_ref.model.override_config.attn_implementation": attn,
        "trainer.default_local_dir": str(ckpt_root),
        **({"actor_rollout_ref.actor.optim.lr": lr} if lr is not None else {}),
        **(
            {}
            if compile_entropy
            else {
                f"actor_rollout_ref.{key}": False
                for key in (
                    "actor.use_torch_compile",
                    "actor.fsdp_config.use_torch_compile",
                    "ref.use_torch_compile",
                    "ref.fsdp_config.use_torch_compile",
                )
            }
        ),
    }.items():
        OmegaConf.update(cfg, key, value, force_add=True)
    return cfg


def needs_reference(cfg: Any) -> bool:
    return bool(cfg.actor_rollout_ref.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward)


def build_workers(cfg: Any, device: str) -> tuple[Any, Any | None]:
    """verl's actor worker, and its reference worker when the KL loss needs one (as `init_model` builds them).

    On the CPU there is no reference worker: verl builds the fsdp2 reference with
    `CPUOffloadPolicy(pin_memory=True)` whatever its config says, and pinning needs an accelerator. The
    reference log-probs then come from the actor before its update, which at step 1 has the reference's
    weights (both load the same model)."""
    from verl.workers.engine_workers import ActorRolloutRefWorker

    actor = ActorRolloutRefWorker(cfg.actor_rollout_ref, role="actor")
    actor.init_model()
    ref = None
    if needs_reference(cfg) and device == "cuda":
        ref = ActorRolloutRefWorker(cfg.actor_rollout_ref, role="ref")
        ref.init_model()
    return actor, ref


# -- the rollout batch and one step -------------------------------------------------------------------------


def rollout_batch(
    cfg: Any, *, prompts: int, prompt_tokens: int, response_tokens: int, vocab: int, seed: int
) -> Any:
    """A DataProto as the trainer holds it after rollout and advantages: random ids of random lengths."""
    import numpy as np
    import torch
    from verl.protocol import DataProto
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    n = int(cfg.actor_rollout_ref.rollout.n)
    rows = prompts * n
    g = torch.Generator().manual_seed(seed)
    prompt_len = torch.randint(
        prompt_tokens // 2, prompt_tokens + 1, (prompts,), generator=g
    ).repeat_interleave(n)
    response_len = torch.randint(response_tokens // 2, response_tokens + 1, (rows,), generator=g)
    prompt_ids = torch.zeros(rows, prompt_tokens, dtype=torch.long)
    response_ids = torch.zeros(rows, response_tokens, dtype=torch.long)
    prompt_mask = torch.zeros(rows, prompt_tokens, dtype=torch.long)
    response_mask = torch.zeros(rows, response_tokens, dtype=torch.long)
    for i in range(rows):
        p, r = int(prompt_len[i]), int(response_len[i])
        prompt_ids[i, prompt_tokens - p :] = torch.randint(2, vocab, (p,), generator=g)  # left padding
        response_ids[i, :r] = torch.randint(2, vocab, (r,), generator=g)  # right padding
        prompt_mask[i, prompt_tokens - p :] = 1
        response_mask[i, :r] = 1
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    rewards = torch.zeros(rows, response_tokens)
    outcome = torch.rand(rows, generator=g)
    rewards[torch.arange(rows), response_len - 1] = outcome
    uid = np.array([f"q{i // n}" for i in range(rows)], dtype=object)
    advantages, returns = compute_grpo_outcome_advantage(rewards, response_mask.float(), uid)
    return DataProto.from_dict(
        tensors={
            "prompts": prompt_ids,
            "responses": response_ids,
            "input_ids": torch.cat([prompt_ids, response_ids], dim=1),
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "response_mask": response_mask,
            "advantages": advantages,
            "returns": returns,
            "token_level_rewards": rewards,
        },
        non_tensors={"uid": uid},
        meta_info={"temperature": cfg.actor_rollout_ref.rollout.temperature},
    )


def log_probs(worker: Any, batch: Any, *, reference: bool) -> Any:
    """The trainer's `_compute_ref_log_prob` / `_compute_old_log_prob` (padding → no padding → back)."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

    td = left_right_2_no_padding(batch.to_tensordict())
    tu.assign_non_tensor(td, calculate_entropy=not reference, compute_loss=False)
    out = worker.compute_ref_log_prob(td) if reference else worker.compute_log_prob(td)
    return no_padding_2_padding(tu.get(out, "log_probs"), td).float()


def update_actor(worker: Any, cfg: Any, batch: Any) -> dict[str, Any]:
    """The trainer's `_update_actor` on this batch; verl's metrics (lists per micro-batch)."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    actor, rollout = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    batch.meta_info["multi_turn"] = rollout.multi_turn.enable
    td = left_right_2_no_padding(batch.to_tensordict())
    mini = actor.ppo_mini_batch_size * rollout.n
    tu.assign_non_tensor(
        td,
        calculate_entropy=actor.calculate_entropy or actor.entropy_coeff != 0,
        distillation_use_topk=False,
        distillation_only=False,
        global_batch_size=mini,
        mini_batch_size=mini,
        epochs=actor.ppo_epochs,
        seed=actor.data_loader_seed,
        dataloader_kwargs={"shuffle": actor.shuffle},
        compute_loss=True,
    )
    return tu.get(worker.update_actor(td), "metrics")


def full_state(worker: Any) -> dict[str, Any]:
    """The actor's full fp32 state dict on the CPU (DTensor shards gathered)."""
    state = worker.actor.engine.module.state_dict()
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().float().cpu().clone()
        for k, v in state.items()
    }


def drain_weight_sync(worker: Any) -> int:
    """Walk the generator verl's `update_weights` sends to the rollout (full tensors, one at a time)."""
    per_tensor, _ = worker.actor.engine.get_per_tensor_param()
    count = 0
    for _, tensor in per_tensor:
        del tensor
        count += 1
    return count


# -- memory -------------------------------------------------------------------------------------------------


def memory_rule(cfg: Any, parameters: int) -> Any:
    """Our memory rule's estimate for this actor: the one call into pipeline/train/verl/memory.py."""
    from omegaconf import OmegaConf

    from pipeline.checks.layout import WEIGHT_SYNC_BUCKET
    from pipeline.train.verl import memory

    actor, ref = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.ref
    return memory.actor_memory(
        parameters,
        shards=1,
        model_dtype=actor.fsdp_config.model_dtype,
        param_offload=bool(actor.fsdp_config.param_offload),
        optimizer_offload=bool(actor.fsdp_config.optimizer_offload),
        lora=bool(cfg.actor_rollout_ref.model.lora_rank),
        reference=bool(actor.use_kl_loss or cfg.algorithm.use_kl_in_reward),
        ref_dtype=ref.fsdp_config.model_dtype or "fp32",
        ref_on_cpu=bool(OmegaConf.select(cfg, "actor_rollout_ref.ref.fsdp_config.forward_only")
                        or ref.fsdp_config.param_offload),
        weight_sync_megabytes=int(OmegaConf.select(cfg, WEIGHT_SYNC_BUCKET)),
    )


class GpuMemory:
    """torch.cuda's memory figures in GiB; every method answers None (or does nothing) on the CPU."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def reset_peak(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.reset_peak_memory_stats()

    def peak_gib(self) -> float | None:
        if not self.cuda:
            return None
        import torch

        return torch.cuda.max_memory_allocated() / GIB

    def snapshot(self, *, empty_cache: bool = False) -> dict[str, float] | None:
        """This process's allocated and reserved memory, and the device-wide use (CUDA context, NCCL)."""
        if not self.cuda:
            return None
        import torch

        if empty_cache:
            torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        return {
            "allocated_gib": torch.cuda.memory_allocated() / GIB,
            "reserved_gib": torch.cuda.memory_reserved() / GIB,
            "device_used_gib": (total - free) / GIB,
            "device_total_gib": total / GIB,
        }


class Clock:
    """Seconds per named phase."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        yield
        self.seconds[name] = round(time.perf_counter() - start, 3)


# -- checkpoint, merge, comparison --------------------------------------------------------------------------


def merge(actor_dir: Path, target: Path) -> str:
    """`python -m verl.model_merger merge --backend fsdp ...`, the command our merge stage runs, run in this
    process (`runpy`, the module's own `__main__`): a second interpreter would import verl again."""
    import runpy

    from pipeline.train.merge import verl_merge_command

    command = verl_merge_command(actor_dir, target)
    module, argv = command[2], command[3:]
    saved, sys.argv = sys.argv, [module, *argv]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    finally:
        sys.argv = saved
    return " ".join(["python", *command[1:3], *argv])


def compare(trained: dict[str, Any], initial: dict[str, Any], merged_dir: Path, tied: bool) -> dict[str, Any]:
    """Merged (bfloat16) against trained (fp32): keys, and the largest differences; and against the initial
    weights (which a merge of the wrong checkpoint would equal)."""
    from safetensors.torch import load_file

    merged: dict[str, Any] = {}
    for f in sorted(merged_dir.glob("*.safetensors")):
        merged.update(load_file(f))
    expected = {k for k in trained if not (tied and k == "lm_head.weight")}
    missing, unexpected = sorted(expected - merged.keys()), sorted(merged.keys() - trained.keys())
    common = sorted(expected & merged.keys())
    vs_trained = max((float((merged[k].float() - trained[k]).abs().max()) for k in common), default=math.nan)
    vs_rounded = max(
        (float((merged[k] - trained[k].bfloat16()).float().abs().max()) for k in common), default=math.nan
    )
    vs_initial = max(
        (float((merged[k] - initial[k].bfloat16()).float().abs().max()) for k in common), default=math.nan
    )
    return {
        "keys_trained": len(expected),
        "keys_merged": len(merged),
        "missing": missing,
        "unexpected": unexpected,
        "merged_dtypes": sorted({str(t.dtype) for t in merged.values()}),
        "max_abs_diff": vs_trained,
        "max_abs_diff_vs_bf16_rounded": vs_rounded,
        "max_abs_diff_vs_initial": vs_initial,
        "equal": not missing and not unexpected and vs_rounded == 0.0,
    }


def weight_change(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    changed = sum(int(not bool((after[k] == before[k]).all())) for k in before)
    return {
        "max_abs_change": max(float((after[k] - before[k]).abs().max()) for k in before),
        "tensors_changed": changed,
        "tensors": len(before),
    }


# -- the check ----------------------------------------------------------------------------------------------


def mean(values: Any) -> float | None:
    """verl metrics come as a value or a list over micro-batches: their mean."""
    if values is None:
        return None
    values = [float(v) for v in (values if isinstance(values, list) else [values])]
    return sum(values) / len(values)


def run_check(args: argparse.Namespace) -> dict[str, Any]:
    """The steps of the module docstring; the JSON report."""
    import torch

    wall, clock = time.perf_counter(), Clock()
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device (use --device cpu for the CPU run)")
    if device == "cpu":
        use_cpu_platform()
    init_process_group(device)
    gpu = GpuMemory(cuda=device == "cuda")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="gpu_actor_check_"))
    config = model_config(Path(args.config), args.tiny)
    with clock.phase("write_model"):
        model_dir = write_random_model(config, work / "model", args.seed)
    cfg = actor_config(
        model_dir,
        work / "ckpt",
        attn=args.attn_implementation,
        remove_padding=args.remove_padding,
        lr=args.lr,
        compile_entropy=args.torch_compile,
    )

    with clock.phase("build"):
        actor, ref = build_workers(cfg, device)
    initial = full_state(actor)
    built = gpu.snapshot()
    batch = rollout_batch(
        cfg,
        prompts=int(cfg.data.train_batch_size),
        prompt_tokens=args.prompt_tokens,
        response_tokens=args.response_tokens,
        vocab=config["vocab_size"],
        seed=args.seed,
    )
    with clock.phase("log_probs"):
        if needs_reference(cfg):
            batch.batch["ref_log_prob"] = (
                log_probs(ref, batch, reference=True)
                if ref is not None
                else log_probs(actor, batch, reference=False)
            )
        batch.batch["old_log_probs"] = log_probs(actor, batch, reference=False)
    gpu.reset_peak()
    with clock.phase("update"):
        metrics = update_actor(actor, cfg, batch)
    peak, after_update = gpu.peak_gib(), gpu.snapshot()
    gpu.reset_peak()
    with clock.phase("weight_sync"):
        synced = drain_weight_sync(actor)
    sync_peak, resident = gpu.peak_gib(), gpu.snapshot(empty_cache=True)
    trained = full_state(actor)

    actor_dir = work / "ckpt" / "global_step_1" / "actor"
    with clock.phase("save"):
        actor.save_checkpoint(str(actor_dir), global_step=1)
    with clock.phase("merge"):
        command = merge(actor_dir, work / "merged")
    comparison = compare(trained, initial, work / "merged", bool(config["tie_word_embeddings"]))
    ckpt_files = sorted(p.name for p in actor_dir.iterdir())
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)

    parameters = sum(
        t.numel() for k, t in initial.items() if not (config["tie_word_embeddings"] and k == "lm_head.weight")
    )
    rule = memory_rule(cfg, parameters)
    a = cfg.actor_rollout_ref
    loss = mean(metrics.get("loss"))
    change = weight_change(initial, trained)
    report = {
        "device": device,
        "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None,
        "versions": {name: __import__(name).__version__
                     for name in ("torch", "transformers", "tokenizers", "verl", "ray")},  # ray: or its stand-in
        "model": {
            "config": str(args.config),
            "tiny": args.tiny,
            "parameters": parameters,
            "layers": config["num_hidden_layers"],
            "hidden": config["hidden_size"],
            "vocab": config["vocab_size"],
        },
        "actor": {
            "profile": PROFILE,
            "strategy": a.actor.strategy,
            "model_dtype": a.actor.fsdp_config.model_dtype,
            "compute_dtype": (a.actor.fsdp_config.get("mixed_precision") or {}).get("param_dtype", "bf16"),
            "gradient_checkpointing": bool(a.model.enable_gradient_checkpointing),
            "attn_implementation": args.attn_implementation,
            "use_remove_padding": args.remove_padding,
            "param_offload": bool(a.actor.fsdp_config.param_offload),
            "optimizer_offload": bool(a.actor.fsdp_config.optimizer_offload),
            "reference": (
                "fsdp2 worker, pinned CPU offload"
                if ref is not None
                else "the actor before its update"
                if needs_reference(cfg)
                else None
            ),
            "lr": float(a.actor.optim.lr),
            "torch_compile": bool(a.actor.fsdp_config.use_torch_compile),
        },
        "batch": {
            "sequences": len(batch),
            "group": int(a.rollout.n),
            "prompt_tokens": args.prompt_tokens,
            "response_tokens": args.response_tokens,
            "tokens": int(batch.batch["attention_mask"].sum()),
            "mini_batch": int(a.actor.ppo_mini_batch_size) * int(a.rollout.n),
            "micro_batch": int(a.actor.ppo_micro_batch_size_per_gpu),
        },
        "update": {
            "loss": loss,
            "pg_loss": mean(metrics.get("actor/pg_loss")),
            "kl_loss": mean(metrics.get("kl_loss")),
            "grad_norm": mean(metrics.get("grad_norm")),
            **change,
            "ran": loss is not None and math.isfinite(loss) and change["max_abs_change"] > 0,
        },
        "memory": {
            "rule_gib": rule.total / GIB,
            "rule": rule.describe(),
            "after_build": built,
            "peak_update_allocated_gib": peak,
            "after_update": after_update,
            "weight_sync_peak_allocated_gib": sync_peak,
            "weight_sync_tensors": synced,
            "resident": resident,
            "resident_allocated_minus_rule_gib": None
            if resident is None
            else resident["allocated_gib"] - rule.total / GIB,
        },
        "checkpoint": {
            "files": ckpt_files,
            "saved": {"model_world_size_1_rank_0.pt", "optim_world_size_1_rank_0.pt"} <= set(ckpt_files),
        },
        "merge": command,
        "compare": comparison,
        "seconds": clock.seconds,
        "metrics": {k: v for k, v in metrics.items() if isinstance(v, (int, float, list))},
    }
    report["ok"] = report["update"]["ran"] and report["checkpoint"]["saved"] and comparison["equal"]
    report["wall_s"] = round(time.perf_counter() - wall, 3)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--out", required=True, help="where the JSON report goes")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="a Qwen3 config.json (random weights)")
    parser.add_argument(
        "--tiny", action="store_true", help="shrink the config to 2 layers, hidden 64 (CPU test)"
    )
    parser.add_argument(
        "--prompt-tokens",
        type=int,
        default=None,
        help="longest prompt (default: the profile's agent.max_prompt_tokens)",
    )
    parser.add_argument(
        "--response-tokens",
        type=int,
        default=None,
        help="longest response (default: the profile's agent.max_response_tokens)",
    )
    parser.add_argument(
        "--attn-implementation",
        default=None,
        help="transformers attention (default: sdpa on cuda, eager on cpu; flash_attention_2 "
        "needs flash-attn)",
    )
    parser.add_argument(
        "--remove-padding",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="verl's use_remove_padding (default off: packed sequences need flash_attention_2)",
    )
    parser.add_argument(
        "--lr", type=float, default=None, help="learning rate (default: the profile's train.lr)"
    )
    parser.add_argument(
        "--torch-compile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="verl's torch.compile of the entropy (the profile's setting; off where no C compiler is installed)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default=None, help="keep the model, checkpoint and merge here")
    parser.add_argument("--keep", action="store_true", help="do not delete the work folder")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.prompt_tokens is None or args.response_tokens is None:
        from pipeline.config import load_params

        agent = load_params(ROOT / "params.yaml", {"profile": PROFILE}).agent
        args.prompt_tokens = args.prompt_tokens or agent.max_prompt_tokens
        args.response_tokens = args.response_tokens or agent.max_response_tokens
    args.attn_implementation = args.attn_implementation or ("sdpa" if args.device == "cuda" else "eager")
    args.remove_padding = bool(args.remove_padding)
    try:
        report = run_check(args)
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    memory = report["memory"]
    log.info(
        "wrote %s: ok=%s, loss %.4f, merged max |diff| %.3g; memory rule %.2f GiB%s",
        out,
        report["ok"],
        report["update"]["loss"],
        report["compare"]["max_abs_diff"],
        memory["rule_gib"],
        f", resident {memory['resident']['allocated_gib']:.2f} GiB, peak {memory['peak_update_allocated_gib']:.2f} GiB"
        if memory["resident"]
        else "",
    )
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
