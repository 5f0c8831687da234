"""The GRPO objective (method.md), computed with verl's own functions so CPU and GPU runs optimise the same loss.

Every formula comes from `verl.trainer.ppo.core_algos` (verl 0.9.1):
- advantage: `compute_grpo_outcome_advantage` — A_i = (R_i - mean(R_group)) / (std(R_group) + 1e-6), the
  same value on every agent token of trajectory i (std is torch's unbiased std, as in verl);
- policy loss: `compute_policy_loss_vanilla` — PPO clipped ratio with dual-clip (clip_ratio_c = 3) for
  negative advantages;
- KL to the frozen reference: `kl_penalty(..., "low_var_kl")` (Schulman's k3, clamped to [-10, 10]);
- aggregation: `agg_loss` with `loss_agg_mode` (token-mean by default).

Design decisions:
- Environment tokens never reach the loss: `response_mask` (1 = agent token, 0 = environment/template
  token or padding) is the loss mask everywhere. verl's `masked_sum` uses `torch.where`, so masked
  positions contribute neither value nor gradient (a test checks the gradient is exactly zero).
- Micro-batching does not change the objective: like verl's engine workers (`workers/utils/losses.py`
  `ppo_loss`), each micro-batch's loss is normalised by the *mini-batch* token count
  (`global_batch_info["batch_num_tokens"]`), so summing the micro-batch gradients gives exactly the
  gradient of the token-mean over the whole mini-batch, however it is split.
- `compute_policy_loss_vanilla` reads its clip settings from an `ActorConfig`. Building a full
  `ActorConfig` needs a strategy, rollout n, optimiser and engine sections that mean nothing here, so
  `PolicyLossConfig` is the minimal object with exactly the attributes that function reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from verl.trainer.ppo.core_algos import (
    agg_loss,
    compute_grpo_outcome_advantage,
    compute_policy_loss_vanilla,
    kl_penalty,
)

from pipeline.config import TrainConfig


@dataclass
class PolicyLossConfig:
    """The attributes of verl's `ActorConfig` that `compute_policy_loss_vanilla` reads, and nothing else."""

    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    clip_ratio_c: float = 3.0
    """Dual-clip lower bound for negative advantages (verl's default)."""
    global_batch_info: dict[str, Any] = field(default_factory=dict)
    """dp_size / batch_num_tokens / global_batch_size / loss_scale_factor, as `agg_loss` takes them."""

    def get(self, key: str, default: Any = None) -> Any:
        """Dict-style access, as verl's config objects offer."""
        return getattr(self, key, default)


@dataclass(frozen=True)
class GRPOObjective:
    """The knobs of the GRPO loss, taken from `train:` in params."""

    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0
    use_kl_loss: bool = True
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    loss_agg_mode: str = "token-mean"

    @classmethod
    def from_config(cls, cfg: TrainConfig) -> GRPOObjective:
        return cls(
            clip_ratio_low=cfg.clip_ratio_low,
            clip_ratio_high=cfg.clip_ratio_high,
            use_kl_loss=cfg.use_kl_loss,
            kl_loss_coef=cfg.kl_loss_coef,
            kl_loss_type=cfg.kl_loss_type,
            loss_agg_mode=cfg.loss_agg_mode,
        )


def outcome_token_rewards(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """(B, R) token-level rewards: each trajectory's scalar reward on its last agent token (the end of its
    final turn, where verl's agent loop puts it), 0 elsewhere. verl's GRPO sums them over the response, so
    the position does not change the advantage; it says which action earned the reward."""
    rewards = torch.zeros(response_mask.shape, dtype=torch.float32)
    positions = torch.arange(response_mask.shape[1]).expand(response_mask.shape)
    last = torch.where(response_mask > 0, positions, -1).max(dim=1).values.clamp(min=0)
    rewards[torch.arange(response_mask.shape[0]), last] = scores.to(torch.float32)
    return rewards


def grpo_advantages(
    scores: torch.Tensor, response_mask: torch.Tensor, group_ids: Sequence[str], epsilon: float = 1e-6
) -> torch.Tensor:
    """Group-normalised advantages (B, R): each trajectory's scalar reward, normalised within its group of
    G trajectories (same `group_ids` entry), broadcast over its agent tokens (0 elsewhere)."""
    if scores.ndim != 1 or scores.shape[0] != response_mask.shape[0] or len(group_ids) != scores.shape[0]:
        raise ValueError(f"shapes disagree: scores {tuple(scores.shape)}, mask {tuple(response_mask.shape)}, "
                         f"{len(group_ids)} group ids")
    advantages, _ = compute_grpo_outcome_advantage(
        token_level_rewards=outcome_token_rewards(scores, response_mask),
        response_mask=response_mask.to(torch.float32),
        index=np.asarray(list(group_ids), dtype=object),
        epsilon=epsilon,
        norm_adv_by_std_in_grpo=True,
    )
    return advantages


def grpo_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    objective: GRPOObjective,
    ref_log_prob: torch.Tensor | None = None,
    batch_num_tokens: int | None = None,
    global_batch_size: int | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss to back-propagate for one (micro-)batch, and its parts as metrics.

    All tensors are (B, R), aligned with the response tokens. `batch_num_tokens` / `global_batch_size`:
    the agent-token and trajectory counts of the whole mini-batch when this is one micro-batch of it
    (None: this batch is the whole mini-batch). Returns `(loss, {"actor/pg_loss", "actor/kl_loss",
    "actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"})`; the loss values in the dict are
    this micro-batch's share, so summing them over micro-batches gives the mini-batch value.
    """
    mask = response_mask.to(log_prob.dtype)
    info = {"dp_size": 1, "batch_num_tokens": batch_num_tokens, "global_batch_size": global_batch_size,
            "loss_scale_factor": None}
    config = PolicyLossConfig(
        clip_ratio=objective.clip_ratio_low,
        clip_ratio_low=objective.clip_ratio_low,
        clip_ratio_high=objective.clip_ratio_high,
        clip_ratio_c=objective.clip_ratio_c,
        global_batch_info=info,
    )
    pg_loss, pg_metrics = compute_policy_loss_vanilla(
        old_log_prob=old_log_prob,
        log_prob=log_prob,
        advantages=advantages,
        response_mask=mask,
        loss_agg_mode=objective.loss_agg_mode,
        config=config,  # type: ignore[arg-type]  # duck-typed: the attributes it reads
    )
    metrics = {"actor/pg_loss": float(pg_loss.detach()), **pg_metrics}
    loss = pg_loss
    if objective.use_kl_loss:
        if ref_log_prob is None:
            raise ValueError("use_kl_loss is on but no reference log-probs were given")
        kld = kl_penalty(logprob=log_prob, ref_logprob=ref_log_prob, kl_penalty=objective.kl_loss_type)
        kl_loss = agg_loss(loss_mat=kld, loss_mask=mask, loss_agg_mode=objective.loss_agg_mode, **info)
        loss = loss + objective.kl_loss_coef * kl_loss
        metrics["actor/kl_loss"] = float(kl_loss.detach())
    else:
        metrics["actor/kl_loss"] = 0.0
    return loss, metrics
