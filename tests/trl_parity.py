"""Our GRPO loss (verl's `core_algos` through `pipeline.train.local.grpo`) and TRL 1.16's `GRPOTrainer._compute_loss` on
one batch: the same model weights, tokens, old and reference log-probs, advantages and masks.

Shared by tests/test_trl_parity.py (tiny random Llama) and benchmarks/bench_vs_trl.py (SmolLM2-135M on sampled
completions), so the test pins exactly what the benchmark reports.

Which settings match (read from both sources, verl 0.9.1 `core_algos`, trl 1.16.0 `grpo_trainer.py`):
- **aggregation**: our `loss_agg_mode: token-mean` (the sum over the batch's agent tokens / their count) is TRL's
  `loss_type="bnpo"` for one batch, and `"dapo"` too (sum / `num_items_in_batch`, the generation batch's token
  count, which is how our micro-batches normalise by the mini-batch's token count). TRL's default `"dapo"` and
  `"bnpo"` agree without gradient accumulation; `"grpo"` (per-sequence mean, then mean) and `"dr_grpo"`
  (sum / (B · max_completion_length)) are other objectives.
- **clip**: verl's `clip_ratio_low/high` = TRL's `epsilon` / `epsilon_high`; verl's dual-clip for negative
  advantages (`clip_ratio_c = 3`) is TRL's `delta = 3` (TRL caps the unclipped ratio at delta; with
  1 + epsilon_high < delta both give -A · min(max(r, clip(r)), 3) for A < 0 and -A · min(r, clip(r)) for A > 0).
- **KL**: verl's `low_var_kl` (k3: exp(ref - lp) - (ref - lp) - 1, clamped to [-10, 10]) = TRL's only estimator
  (k3, unclamped: equal whenever |k3| < 10), weighted by `kl_loss_coef` = TRL's `beta`, added per token before
  the aggregation in both. TRL 1.16 multiplies the KL by the importance ratio by default
  (`use_bias_correction_kl=True`, DeepSeek-V3.2's unbiased KL gradient); verl does not, so it is off here.
- **advantages**: compared apart (`advantage_formulas`): verl divides by (std + 1e-6), TRL by (std + 1e-4), both
  with the unbiased std of the group.

TRL's loss is its real method on a real (minimal) `GRPOTrainer`: its own forward (`_get_per_token_logps_and_
entropies`, a fused LM head at the trainer's temperature), the same left-padded prompt | right-padded completion
layout our `collate` builds.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipeline.train.local.batch import RolloutBatch, response_log_probs
from pipeline.train.local.grpo import GRPOObjective, grpo_loss

TOKEN_MEAN_TRL_LOSS_TYPE = "bnpo"
"""The TRL `loss_type` that computes our `loss_agg_mode: token-mean` over one batch (see module doc)."""

VERL_ADV_EPS = 1e-6
TRL_ADV_EPS = 1e-4
"""The epsilons added to the group std: verl `compute_grpo_outcome_advantage(epsilon=1e-6)` (our default),
TRL `_generate_and_score_completions` (`advantages / (std_rewards + 1e-4)`)."""


@dataclass(frozen=True)
class LossSettings:
    """One set of GRPO loss settings, written for both sides."""

    clip_low: float = 0.2
    clip_high: float = 0.28
    clip_c: float = 3.0
    kl_coef: float = 0.04
    temperature: float = 1.0
    trl_loss_type: str = TOKEN_MEAN_TRL_LOSS_TYPE

    def objective(self) -> GRPOObjective:
        return GRPOObjective(clip_ratio_low=self.clip_low, clip_ratio_high=self.clip_high, clip_ratio_c=self.clip_c,
                             use_kl_loss=True, kl_loss_coef=self.kl_coef, kl_loss_type="low_var_kl",
                             loss_agg_mode="token-mean")

    def trl_args(self, output_dir: Path, group_size: int, batch: int, max_completion_length: int) -> dict[str, Any]:
        """GRPOConfig keyword arguments for these settings (CPU, float32, no gradient accumulation)."""
        return {
            "output_dir": str(output_dir), "use_cpu": True, "bf16": False, "fp16": False, "report_to": [],
            "save_strategy": "no", "per_device_train_batch_size": batch, "num_generations": group_size,
            "gradient_accumulation_steps": 1, "max_completion_length": max_completion_length,
            "temperature": self.temperature, "beta": self.kl_coef, "epsilon": self.clip_low,
            "epsilon_high": self.clip_high, "delta": self.clip_c, "loss_type": self.trl_loss_type,
            "use_bias_correction_kl": False, "scale_rewards": "group", "num_iterations": 1, "logging_steps": 1,
            "disable_tqdm": True, "seed": 0,
        }


def minimal_trl_trainer(model: torch.nn.Module, tokenizer: Any, output_dir: Path, settings: LossSettings,
                        group_size: int, batch: int, max_completion_length: int):
    """A real `GRPOTrainer` around `model` (its `_compute_loss` is what we call; the dataset and reward only
    satisfy the constructor)."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(**settings.trl_args(output_dir, group_size, batch, max_completion_length))
    data = Dataset.from_dict({"prompt": ["unused"] * batch})
    trainer = GRPOTrainer(model=model, reward_funcs=[lambda completions, **_: [0.0] * len(completions)],
                          args=args, train_dataset=data, processing_class=tokenizer)
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's loop; we call _compute_loss directly
    return trainer


def grad_norm(model: torch.nn.Module) -> float:
    grads = [p.grad.detach().flatten() for p in model.parameters() if p.grad is not None]
    return float(torch.cat(grads).norm()) if grads else 0.0


def ours(model: torch.nn.Module, batch: RolloutBatch, old: torch.Tensor, ref: torch.Tensor, advantages: torch.Tensor,
         settings: LossSettings) -> dict[str, float]:
    """Our loss on `batch` (one micro-batch = the mini-batch): loss, KL (token-mean k3) and gradient norm."""
    model.zero_grad(set_to_none=True)
    model.train()
    log_prob = response_log_probs(model, batch, settings.temperature)
    adv = advantages[:, None].expand_as(log_prob) * batch.response_mask
    loss, parts = grpo_loss(log_prob, old, adv, batch.response_mask, settings.objective(), ref_log_prob=ref)
    loss.backward()
    return {"loss": float(loss.detach()), "kl": parts["actor/kl_loss"], "grad_norm": grad_norm(model)}


def trl_inputs(batch: RolloutBatch, old: torch.Tensor, ref: torch.Tensor, advantages: torch.Tensor
               ) -> dict[str, torch.Tensor]:
    """`batch` in the dict `_compute_loss` reads (what `_generate_and_score_completions` returns)."""
    r = batch.responses.shape[1]
    p = batch.input_ids.shape[1] - r
    return {
        "prompt_ids": batch.input_ids[:, :p], "prompt_mask": batch.attention_mask[:, :p],
        "completion_ids": batch.responses, "completion_mask": batch.response_mask.long(),
        "old_per_token_logps": old, "ref_per_token_logps": ref, "advantages": advantages,
        "num_items_in_batch": batch.response_mask.sum(),
    }


def theirs(trainer: Any, batch: RolloutBatch, old: torch.Tensor, ref: torch.Tensor, advantages: torch.Tensor
           ) -> dict[str, float]:
    """TRL's `_compute_loss` on the same batch: loss, its logged KL, and the gradient norm."""
    model = trainer.model
    model.zero_grad(set_to_none=True)
    model.train()
    loss = trainer._compute_loss(model, trl_inputs(batch, old, ref, advantages))
    loss.backward()
    return {"loss": float(loss.detach()), "kl": trainer._metrics["train"]["kl"][-1], "grad_norm": grad_norm(model)}


def rel_diff(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


def compare(model: torch.nn.Module, tokenizer: Any, batch: RolloutBatch, advantages: torch.Tensor,
            output_dir: Path, settings: LossSettings, group_size: int, noise: float = 0.3, seed: int = 0,
            trl_settings: LossSettings | None = None) -> dict[str, Any]:
    """Both losses on `batch`: old and reference log-probs are the current ones plus seeded noise (so clipping
    and KL act), identical on both sides. `trl_settings` (default `settings`) lets a test break one side."""
    with torch.no_grad():
        model.eval()
        current = response_log_probs(model, batch, settings.temperature)
    g = torch.Generator().manual_seed(seed)
    old = (current + noise * torch.randn(current.shape, generator=g)) * batch.response_mask
    ref = (current + noise * torch.randn(current.shape, generator=g)) * batch.response_mask
    twin = copy.deepcopy(model)
    trainer = minimal_trl_trainer(twin, tokenizer, output_dir, trl_settings or settings, group_size,
                                  batch.input_ids.shape[0], batch.responses.shape[1])
    a = ours(model, batch, old, ref, advantages, settings)
    b = theirs(trainer, batch, old, ref, advantages)
    model.zero_grad(set_to_none=True)
    return {"ours": a, "trl": b, "trl_loss_type": (trl_settings or settings).trl_loss_type,
            "loss_rel_diff": rel_diff(a["loss"], b["loss"]), "kl_rel_diff": rel_diff(a["kl"], b["kl"]),
            "grad_norm_rel_diff": rel_diff(a["grad_norm"], b["grad_norm"])}


def advantage_formulas(scores: torch.Tensor, group_size: int) -> dict[str, Any]:
    """verl's GRPO advantage (ours, through `pipeline.train.local.grpo.grpo_advantages`) against TRL's formula
    (`(r - mean) / (std + 1e-4)`, unbiased std per group: TRL computes it inline in
    `_generate_and_score_completions`, so it is written out here). Returns both and their largest relative gap;
    for a group with std s, ours / TRL's is exactly (s + 1e-4) / (s + 1e-6) (`predicted_ratio`)."""
    from pipeline.train.local.grpo import grpo_advantages

    b = scores.shape[0]
    mask = torch.ones(b, 1)
    ids = [f"q{i // group_size}" for i in range(b)]
    ours_adv = grpo_advantages(scores.float(), mask, ids, epsilon=VERL_ADV_EPS)[:, 0]
    grouped = scores.float().view(-1, group_size)
    mean = grouped.mean(dim=1).repeat_interleave(group_size)
    std = grouped.std(dim=1).repeat_interleave(group_size)
    trl_adv = (scores.float() - mean) / (std + TRL_ADV_EPS)
    nonzero = ours_adv.abs() > 0
    gaps = ((ours_adv - trl_adv).abs() / ours_adv.abs())[nonzero]
    return {"ours": ours_adv.tolist(), "trl": trl_adv.tolist(), "group_std": std[::group_size].tolist(),
            "max_rel_diff": float(gaps.max()) if gaps.numel() else 0.0,
            "predicted_ratio": [(s + TRL_ADV_EPS) / (s + VERL_ADV_EPS) if s > 0 else math.nan
                                for s in std[::group_size].tolist()]}
