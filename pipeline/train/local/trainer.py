"""One GRPO step of the local backend (`LocalTrainer.step`): transformers + PyTorch on CPU or one GPU.

A step reads top to bottom:
1. draw `batch_size` questions (`pipeline.train.local.questions`: seeded shuffle per epoch, position checkpointed);
2. roll out G trajectories per question with the core rollout (`pipeline.agent.rollout`, the same code
   evaluation and `promptr1 ask` use) against the environment, scored by `pipeline.reward`; the policy
   samples in this process or through llama.cpp's server (`train.rollout_engine`,
   `pipeline.train.local.rollout_engine`);
3. GRPO update (`pipeline.train.local.grpo`: verl's advantage, clipped loss, low-var KL, token-mean), over
   PPO mini-batches of `mini_batch_size` questions (`pipeline.train.local.minibatches`), in micro-batches of
   `micro_batch_size` trajectories; a mini-batch without a non-zero advantage takes no optimizer step
   (`actor/skipped_no_signal`);
4. its metrics under verl's names (`pipeline.train.local.step_metrics`), with the share of groups whose G
   trajectories all scored the same (`pipeline.train.health_gate`); the caller judges, logs and checkpoints them.

Design decisions:
- **old_log_prob is recomputed by the training forward, not taken from the sampler.** The sampler's
  log-probs come from a different code path (KV-cache decoding, temperature/top-p processing), so their
  ratio to the training forward is not exactly 1 even before any update, and PPO clipping would act on
  numerical noise. verl recomputes them for the same reason. The recompute is free in the common
  on-policy case: for the first mini-batch of the first PPO epoch no parameter has changed since
  sampling, so `old_log_prob = log_prob.detach()` is exact. Only later mini-batches/epochs need an extra
  no-grad forward, done before the first optimizer step. The sampler's log-probs are still requested
  and their gap to the recomputed ones is logged (`training/rollout_logprob_diff_*`) as a sanity check.
- **Layout and log-probs as verl's** (`pipeline.train.local.batch`): left-padded prompts, right-padded responses,
  logits on response positions only, at temperature `agent.temperature`.
- **The first update of a fresh run skips the reference forward.** Until the first optimizer step the
  policy's weights are the reference's (the base, or the warmed copy), so the reference log-probs are the
  pre-update log-probs the update computes anyway; `timing_s/ref` is 0 there (15 s of the default
  profile's first 112-s step on 2 cores). Every later update runs the reference forward.
- **Each question's prompt is read once** (`train.share_prompt_forward`, on by default): the update's
  forwards run `batch.shared_prompt_log_probs` (the prompt's KV cache shared by its G responses, each
  response unpadded) instead of the padded layout, and micro-batches keep a question's trajectories
  together (item order); without it micro-batches are sorted by length within a mini-batch to cut padding.
  Either way the loss is normalised by the mini-batch's agent-token count, so the split does not change the
  gradient.
- Timing: the rollout alternates batched generation rounds with rounds of concurrent environment calls,
  so its wall time splits cleanly: `timing_s/gen` = generation wall time, `timing_s/env` = the rest of
  the rollout (environment rounds), `timing_s/rollout` = both (what verl calls `timing_s/gen`, which
  includes the agent loop's tool/environment calls). `timing_s/update` covers the reference forward, any
  old-log-prob recompute and all forward/backward/optimizer work; `timing_s/step` everything.
- Sampling is seeded per step (`seed`, step number): a resumed run draws the same questions and samples
  with the same generator state as the killed run would have.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import pandas as pd
import torch

from pipeline.hardware import resolve_autocast
from pipeline.train.health_gate import ZERO_VARIANCE_METRIC, flat_groups, zero_variance_share
from pipeline.train.local.batch import (
    EntropySum,
    RolloutBatch,
    collate,
    response_log_probs,
    shared_prompt_log_probs,
)
from pipeline.train.local.grpo import GRPOObjective, grpo_advantages, grpo_loss
from pipeline.train.local.minibatches import (
    MicroKey,
    PreUpdateLogProbs,
    UpdateTotals,
    add_weighted,
    micro_advantages,
    mini_batch_indices,
    sampling_gaps,
)
from pipeline.train.local.models import PolicyModels
from pipeline.train.local.questions import QuestionSampler, prompt_item_from_row
from pipeline.train.local.rollout_engine import rollout_engine
from pipeline.train.local.step_metrics import rollout_metrics
from pipeline.types import PromptItem, Trajectory

if TYPE_CHECKING:
    from pipeline.train.plan import TrainPlan

log = logging.getLogger(__name__)


@dataclass
class UpdateResult:
    metrics: dict[str, float]
    tokens: int
    """Non-padding tokens through the policy forward+backward (all PPO epochs)."""
    policy_s: float
    """Wall time of the policy forward/backward/optimizer work alone (for throughput)."""


def step_advantages(scores: torch.Tensor, mask: torch.Tensor, group_ids: list[str]) -> torch.Tensor:
    """verl's GRPO advantages (`grpo.grpo_advantages`), exactly 0 for every group whose scores are all equal.

    Such a group's advantage is 0 by definition, but for a group size that is not a power of two verl's float32
    group mean of G equal scores can be an ulp off the score while their std is exactly 0, and dividing by
    std + 1e-6 turns that ulp into an advantage of a few hundredths: five scores of 0.4 + 0.25 x 1/3 (a partial
    answer F1) get +-0.029, and about 7% of random float32 scores do at G = 5 (1,326 of 20,000 measured). Noise,
    not a signal: zeroed, a mini-batch of such groups is skipped by the update (`LocalTrainer.update`).
    """
    advantages = grpo_advantages(scores, mask, group_ids)
    flat = flat_groups(scores.tolist(), group_ids)
    advantages[[i for i, group in enumerate(group_ids) if group in flat]] = 0.0
    return advantages


class LocalTrainer:
    """Holds the policy, optimizer and data position; `step()` runs one GRPO iteration."""

    def __init__(self, plan: TrainPlan, models: PolicyModels, frame: pd.DataFrame, device: torch.device,
                 sampler: QuestionSampler) -> None:
        self.plan = plan
        self.cfg = plan.train
        self.last_trajectories: list[Trajectory] = []
        self.models = models
        self.frame = frame
        self.device = device
        self.sampler = sampler
        self.objective = GRPOObjective.from_config(self.cfg)
        self.optimizer = torch.optim.AdamW(models.trainable_parameters(), lr=self.cfg.lr,
                                           weight_decay=self.cfg.weight_decay)
        self.temperature = plan.agent.temperature if plan.agent.temperature > 0 else 1.0
        self._policy = None
        self.autocast_dtype = resolve_autocast(self.cfg.autocast, device, "train.autocast")
        """`train.autocast` resolved on this device (`auto`: bfloat16 where bf16 is native): a dtype or None."""
        self.engine = rollout_engine(plan, models.model)
        """What samples the rollouts: `transformers` or `llama.cpp` (pipeline.train.local.rollout_engine)."""
        self.reference_is_policy = False
        """True while the policy's weights are the KL reference's (set by the caller for a fresh run: the
        reference is the base or warmed copy of the policy; cleared by the first optimizer step). Then the
        reference log-probs are the policy's own pre-update ones and the reference forward is skipped."""

    def autocast(self):
        """`train.autocast`: the update's forwards (and so their backward) under torch.autocast; a no-op when
        null. Log-probs are taken in float32 from the autocast logits (`batch.response_log_probs`)."""
        dtype = self.autocast_dtype
        return torch.autocast(self.device.type, dtype=getattr(torch, dtype or "bfloat16"), enabled=dtype is not None)

    # -- rollout -----------------------------------------------------------------------------------
    def policy(self):
        if self._policy is None:
            from pipeline.agent.policy import TransformersPolicy

            self._policy = TransformersPolicy(self.models.model, self.models.tokenizer, self.device)
        return self._policy

    @contextmanager
    def rollout_policy(self, step: int, trajectories: int) -> Iterator[Any]:
        """The policy that samples this step's rollout (`train.rollout_engine`, pipeline.train.local.rollout_engine).
        Sampling depends on (seed, step) only, so a resumed run samples what the killed one would have."""
        if self.engine == "llama.cpp":
            from pipeline.train.local.rollout_engine import served_step_policy

            slots = self.cfg.rollout_slots or trajectories
            with served_step_policy(self.models.model, self.models.tokenizer, self.plan, step,
                                    min(slots, trajectories)) as policy:
                yield policy
            return
        policy = self.policy()
        policy.generator.manual_seed(self.plan.seed * 1_000_003 + step)
        yield policy

    def draw_items(self) -> list[PromptItem]:
        rows = self.sampler.next_batch(self.cfg.batch_size)
        records = self.frame.iloc[rows].to_dict("records")
        return [prompt_item_from_row(r, i) for r, i in zip(records, rows, strict=True)]

    def rollout(self, env, items: list[PromptItem], step: int) -> list[Trajectory]:
        from pipeline.agent.rollout import RolloutSettings, run_rollout
        from pipeline.reward import reward_for_trajectory

        a = self.plan.agent
        self.models.model.eval()
        with torch.no_grad(), self.rollout_policy(step, len(items) * self.cfg.group_size) as policy:
            trajectories = run_rollout(
                policy, env, items, RolloutSettings.sampled(a), group_size=self.cfg.group_size,
                return_logprobs=True, reward_fn=partial(reward_for_trajectory, cfg=self.plan.reward),
                progress=False,
            )
        if len(trajectories) != len(items) * self.cfg.group_size:
            raise RuntimeError(f"rollout returned {len(trajectories)} trajectories for {len(items)} questions "
                               f"x G={self.cfg.group_size}")
        for t in trajectories:
            if t.reward is None:
                t.reward = reward_for_trajectory(t, self.plan.reward)
        return trajectories

    # -- update ------------------------------------------------------------------------------------
    @property
    def share_prompts(self) -> bool:
        """Whether the update reads each prompt once (`TrainConfig.shares_prompts`)."""
        return self.cfg.shares_prompts

    def log_probs(self, model: torch.nn.Module, batch: RolloutBatch,
                  entropy: EntropySum | None = None) -> torch.Tensor:
        """(B, R) response log-probs of `batch` under `model`: shared-prompt or padded forward (with `entropy`,
        the agent tokens' entropies added to it)."""
        if self.share_prompts:
            return shared_prompt_log_probs(model, batch, self.temperature, entropy)
        return response_log_probs(model, batch, self.temperature, entropy)

    def lr_at(self, step: int) -> float:
        """The learning rate of GRPO step `step` (1-based): `train.lr` after a linear `train.lr_warmup_steps`."""
        warmup = self.cfg.lr_warmup_steps
        return self.cfg.lr * min(1.0, step / warmup) if warmup > 0 else self.cfg.lr

    def micro_batches(self, trajectories: Sequence[Trajectory], indices: Sequence[int]) -> list[list[int]]:
        """Split a mini-batch into micro-batches: a question's trajectories together when prompts are
        shared (item order), else of similar length (less padding)."""
        if self.share_prompts:
            ordered = list(indices)
        else:
            ordered = sorted(indices,
                             key=lambda i: len(trajectories[i].prompt_ids) + len(trajectories[i].response_ids))
        size = self.cfg.micro_batch_size
        return [ordered[k : k + size] for k in range(0, len(ordered), size)]

    def update(self, trajectories: list[Trajectory], advantages: torch.Tensor) -> UpdateResult:
        """GRPO update over PPO epochs × mini-batches; returns the averaged actor metrics.

        A mini-batch whose advantages are all zero is skipped: no forward, no backward, no optimizer step
        (`actor/skipped_no_signal` counts them over the epochs). Its policy-gradient loss is exactly 0, yet
        an AdamW step would still move every weight by its first moment (~0.9x the last real update, in that
        update's direction) and feed the KL term's gradient into both moments.
        """
        mini_batches = mini_batch_indices(len(trajectories), self.cfg.group_size, self.cfg.mini_batch_size)
        signal = [bool(advantages[mb].ne(0).any()) for mb in mini_batches]
        plan = [self.micro_batches(trajectories, mb) if has else [] for mb, has in zip(mini_batches, signal,
                                                                                        strict=True)]
        pre = self.pre_update_log_probs(trajectories, plan)
        self.models.model.train()
        totals = UpdateTotals()
        t_policy = time.perf_counter()
        for epoch in range(self.cfg.ppo_epochs):
            for m, micros in enumerate(plan):
                if not signal[m]:
                    totals.skipped += 1
                    continue
                self.mini_batch_step(pre, [((m, k), idx) for k, idx in enumerate(micros)], advantages, epoch,
                                     totals)
        policy_s = time.perf_counter() - t_policy
        metrics = totals.metrics(self.cfg, float(self.optimizer.param_groups[0]["lr"]), pre.timings)
        self.models.model.eval()
        return UpdateResult(metrics=metrics, tokens=totals.tokens, policy_s=policy_s)

    def pre_update_log_probs(self, trajectories: list[Trajectory], plan: list[list[list[int]]]) -> PreUpdateLogProbs:
        """Collate every micro-batch of `plan` and read, before any optimizer step, the reference's log-probs
        (unless the policy is the reference) and old_log_prob where the update's own forward comes too late:
        every mini-batch after the first, and the first too with several PPO epochs."""
        pad_id = self.models.tokenizer.pad_token_id
        need_old = {m for m in range(len(plan)) if m > 0 or self.cfg.ppo_epochs > 1}
        # Reference log-probs = the pre-update ones when no update has happened since the reference was taken
        # (decided once: the update's first optimizer step changes the policy, not the reference).
        pre = PreUpdateLogProbs(reference_is_old=self.cfg.use_kl_loss and self.reference_is_policy)
        self.models.model.eval()
        for m, micros in enumerate(plan):
            for k, idx in enumerate(micros):
                batch = collate([trajectories[i] for i in idx], pad_id).to(self.device)
                pre.batches[(m, k)] = batch
                with torch.no_grad():
                    if self.cfg.use_kl_loss and not pre.reference_is_old:
                        t0 = time.perf_counter()
                        with self.models.reference_context(), self.autocast():
                            pre.reference[(m, k)] = self.log_probs(self.models.reference_model, batch)
                        pre.timings["timing_s/ref"] += time.perf_counter() - t0
                    if m in need_old:
                        t0 = time.perf_counter()
                        with self.autocast():
                            pre.old[(m, k)] = self.log_probs(self.models.model, batch)
                        pre.timings["timing_s/old_log_prob"] += time.perf_counter() - t0
        return pre

    def mini_batch_step(self, pre: PreUpdateLogProbs, micros: list[tuple[MicroKey, list[int]]],
                        advantages: torch.Tensor, epoch: int, totals: UpdateTotals) -> None:
        """One optimizer step on a mini-batch: the gradients of its micro-batches (`micros`: each one's key and
        trajectory rows) accumulated, each loss normalised by the mini-batch's agent tokens; none without any."""
        mb_tokens = int(sum(pre.batches[key].response_mask.sum() for key, _ in micros))
        mb_size = sum(len(idx) for _, idx in micros)
        if mb_tokens == 0:
            return
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        for key, idx in micros:
            batch = pre.batches[key]
            with self.autocast():
                log_prob = self.log_probs(self.models.model, batch, totals.entropy if epoch == 0 else None)
            old = pre.old_log_prob(key, log_prob)
            loss, parts = grpo_loss(log_prob, old, micro_advantages(advantages, idx, log_prob), batch.response_mask,
                                    self.objective, ref_log_prob=pre.reference.get(key), batch_num_tokens=mb_tokens,
                                    global_batch_size=mb_size)
            loss.backward()
            totals.tokens += batch.num_tokens
            add_weighted(sums, parts, float(batch.response_mask.sum()) / mb_tokens)
            if epoch == 0:
                totals.diffs.extend(sampling_gaps(old, batch))
        sums["actor/grad_norm"] = self.optimizer_step()
        totals.add_mini_batch(sums)

    def optimizer_step(self) -> float:
        """Clip the gradient to `train.grad_clip` and step; a non-finite norm drops the gradient instead.
        Returns the norm before clipping."""
        grad_norm = torch.nn.utils.clip_grad_norm_(self.models.trainable_parameters(), self.cfg.grad_clip)
        if not torch.isfinite(grad_norm):
            log.warning("non-finite grad norm %s: skipping this optimizer step", grad_norm)
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.optimizer.step()
            self.reference_is_policy = False
        return float(grad_norm)

    # -- one step ----------------------------------------------------------------------------------
    def step(self, env, step: int) -> dict[str, float]:
        t_step = time.perf_counter()
        for group in self.optimizer.param_groups:  # set every step: a resume restores the saved group's lr
            group["lr"] = self.lr_at(step)
        items = self.draw_items()
        t0 = time.perf_counter()
        trajectories = self.rollout(env, items, step)
        self.last_trajectories = trajectories  # for the trajectory log (pipeline.train.local.trajectory_log)
        t_rollout = time.perf_counter() - t0

        t0 = time.perf_counter()
        scores = torch.tensor([t.reward.total for t in trajectories], dtype=torch.float32)  # type: ignore[union-attr]
        r_max = max(1, max(len(t.response_ids) for t in trajectories))
        mask = torch.zeros((len(trajectories), r_max))
        for i, t in enumerate(trajectories):
            mask[i, : len(t.response_mask)] = torch.tensor(t.response_mask, dtype=torch.float32)
        group_ids = [f"q{i // self.cfg.group_size}" for i in range(len(trajectories))]
        advantages = step_advantages(scores, mask, group_ids)
        update = self.update(trajectories, advantages)
        t_update = time.perf_counter() - t0

        metrics = rollout_metrics(trajectories, scores, advantages, mask)
        metrics[ZERO_VARIANCE_METRIC] = zero_variance_share(scores.tolist(), group_ids)
        metrics.update(update.metrics)
        metrics.update(self.sampler_metrics())
        # The rollout alternates batched generation rounds and environment rounds; the trajectory that
        # lives longest took part in every generation round, so its generation_s is the generation wall.
        gen_wall = max((t.generation_s for t in trajectories), default=0.0)
        metrics["timing_s/rollout"] = t_rollout
        metrics["timing_s/gen"] = gen_wall
        metrics["timing_s/env"] = max(0.0, t_rollout - gen_wall)
        metrics["timing_s/update"] = t_update
        metrics["perf/update_tokens"] = float(update.tokens)
        metrics["perf/update_tokens_per_s"] = update.tokens / update.policy_s if update.policy_s > 0 else 0.0
        metrics["perf/update_policy_s"] = update.policy_s
        metrics["perf/num_params"] = float(self.models.num_parameters())
        metrics["perf/total_num_tokens"] = float(sum(len(t.prompt_ids) + len(t.response_ids)
                                                     for t in trajectories))
        metrics["timing_s/step"] = time.perf_counter() - t_step
        metrics["perf/throughput"] = metrics["perf/total_num_tokens"] / metrics["timing_s/step"]
        return metrics

    def sampler_metrics(self) -> dict[str, float]:
        return {"training/epoch": float(self.sampler.epoch), "training/data_position": float(self.sampler.position)}
