"""The PPO mini-batches of the local GRPO update (`pipeline.train.local.trainer.LocalTrainer.update`): which
trajectories each holds, the log-probs read before the first optimizer step, and what the update reports.

Design decisions:
- **A mini-batch is whole questions**: the G trajectories of each of `train.mini_batch_size` questions (the last
  mini-batch takes the questions left), so a question's group is never split across optimizer steps.
- **Pre-update log-probs are kept per micro-batch** (`PreUpdateLogProbs`, keyed by (mini-batch, micro-batch)):
  the reference's, and old_log_prob where the update's own forward comes after an optimizer step. While the
  policy is the reference, the reference's log-probs are the pre-update ones (`old_log_prob`).
- **A micro-batch's figures are weighted by its share of the mini-batch's agent tokens** (`add_weighted`), save
  the losses, which `grpo_loss` already returns as that share (it normalises by the mini-batch's tokens).
- **Figures are means over the mini-batches that ran a backward** (`UpdateTotals.metrics`); when none ran,
  the losses and the gradient norm are 0, and the KL is NaN if a mini-batch was skipped for want of signal.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from pipeline.train.local.batch import EntropySum, RolloutBatch

if TYPE_CHECKING:
    from pipeline.config import TrainConfig

MicroKey = tuple[int, int]
"""(mini-batch, micro-batch) index of one micro-batch of the update."""


def mini_batch_indices(n_trajectories: int, group_size: int, per_mini: int) -> list[list[int]]:
    """Trajectory indices of each PPO mini-batch: the `group_size` trajectories of `per_mini` questions each."""
    n_items = n_trajectories // group_size
    return [list(range(q * group_size, min(q + per_mini, n_items) * group_size)) for q in range(0, n_items, per_mini)]


@dataclass
class PreUpdateLogProbs:
    """The update's micro-batches, collated, and the log-probs read before its first optimizer step."""

    reference_is_old: bool
    """The policy's weights are the reference's: its log-probs are the pre-update ones (no reference forward)."""
    batches: dict[MicroKey, RolloutBatch] = field(default_factory=dict)
    reference: dict[MicroKey, torch.Tensor] = field(default_factory=dict)
    """The KL reference's log-probs of each micro-batch."""
    old: dict[MicroKey, torch.Tensor] = field(default_factory=dict)
    """old_log_prob of the micro-batches whose update forward follows an optimizer step."""
    timings: dict[str, float] = field(default_factory=lambda: {"timing_s/ref": 0.0, "timing_s/old_log_prob": 0.0})

    def old_log_prob(self, key: MicroKey, log_prob: torch.Tensor) -> torch.Tensor:
        """old_log_prob of micro-batch `key`, whose update forward gave `log_prob`."""
        old = self.old[key] if key in self.old else log_prob.detach()
        if self.reference_is_old and key not in self.reference:
            # No update since the reference was taken: the pre-update log-probs (old, or this first
            # mini-batch's own forward) are the reference's: same weights, same batch.
            self.reference[key] = old.detach()
        return old


def micro_advantages(advantages: torch.Tensor, rows: list[int], like: torch.Tensor) -> torch.Tensor:
    """Rows `rows` of the step's (B, R) advantages, cut or zero-padded to the response width of `like`."""
    adv = torch.zeros_like(like)
    width = min(adv.shape[1], advantages.shape[1])
    adv[:, :width] = advantages[rows, :width].to(adv)
    return adv


def add_weighted(sums: dict[str, float], parts: dict[str, float], share: float) -> None:
    """Add a micro-batch's `grpo_loss` parts to its mini-batch's `sums`; `share`: its agent tokens' share."""
    for key, value in parts.items():
        # losses are already this micro-batch's share; ratios/fractions are weighted here
        sums[key] = sums.get(key, 0.0) + (value if key in ("actor/pg_loss", "actor/kl_loss") else value * share)


def sampling_gaps(old: torch.Tensor, batch: RolloutBatch) -> list[float]:
    """|old_log_prob - the sampler's log-prob| on the batch's agent tokens; none without the sampler's."""
    if batch.sampling_log_probs is None:
        return []
    gap = (old - batch.sampling_log_probs).abs()[batch.response_mask.bool()]
    gap = gap[torch.isfinite(gap)]  # NaN: a token the rollout's server gave no log-prob
    return gap.tolist() if gap.numel() else []


@dataclass
class UpdateTotals:
    """What the update's mini-batches add up to, over the PPO epochs."""

    steps: dict[str, list[float]] = field(default_factory=dict)
    """Each figure's value at every mini-batch that ran a backward (its optimizer step taken or not)."""
    tokens: int = 0
    """Non-padding tokens through the policy forward+backward."""
    skipped: int = 0
    """Mini-batches skipped for want of a non-zero advantage."""
    diffs: list[float] = field(default_factory=list)
    """The first epoch's `sampling_gaps`."""
    entropy: EntropySum = field(default_factory=EntropySum)
    """The policy's, over the agent tokens its first epoch's update read."""

    def add_mini_batch(self, sums: dict[str, float]) -> None:
        for key, value in sums.items():
            self.steps.setdefault(key, []).append(value)

    def metrics(self, train: TrainConfig, lr: float, timings: dict[str, float]) -> dict[str, float]:
        """The update's actor metrics under verl's names, then the diagnostics and `timings`."""
        metrics = {k: statistics.fmean(v) for k, v in self.steps.items()}
        metrics.setdefault("actor/pg_loss", 0.0)
        # No mini-batch ran: the KL to the reference was not measured (NaN: left out of MLflow and the health
        # gate's means, where a 0 would pull the window down).
        metrics.setdefault("actor/kl_loss", float("nan") if train.use_kl_loss and self.skipped else 0.0)
        metrics.setdefault("actor/grad_norm", 0.0)
        metrics["actor/lr"] = lr
        # NaN when no mini-batch ran (as the KL): left out of MLflow, blank in steps.csv.
        metrics["actor/entropy"] = self.entropy.mean
        metrics["actor/kl_coef"] = train.kl_loss_coef if train.use_kl_loss else 0.0
        metrics["actor/num_optimizer_steps"] = float(len(self.steps.get("actor/grad_norm", [])))
        metrics["actor/skipped_no_signal"] = float(self.skipped)
        if self.diffs:
            metrics["training/rollout_logprob_diff_mean"] = statistics.fmean(self.diffs)
            metrics["training/rollout_logprob_diff_max"] = max(self.diffs)
        metrics.update(timings)
        return metrics
