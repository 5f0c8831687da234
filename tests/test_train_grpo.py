"""The GRPO objective: agreement with verl's functions, a worked example by hand, masking, micro-batching."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from verl.trainer.ppo.core_algos import agg_loss, compute_grpo_outcome_advantage, kl_penalty

from pipeline.train.local.grpo import GRPOObjective, PolicyLossConfig, grpo_advantages, grpo_loss


def reference_loss(log_prob, old, adv, mask, ref, obj: GRPOObjective) -> torch.Tensor:
    """method.md's objective written out independently of verl: token-mean PPO-clip (+dual clip) + k3 KL."""
    ratio = torch.exp(torch.clamp(log_prob - old, -20, 20))
    clipped = torch.clamp(ratio, 1 - obj.clip_ratio_low, 1 + obj.clip_ratio_high)
    pg = torch.maximum(-adv * ratio, -adv * clipped)
    pg = torch.where(adv < 0, torch.minimum(pg, -adv * obj.clip_ratio_c), pg)
    d = torch.clamp(ref - log_prob, -20, 20)
    kl = torch.clamp(torch.exp(d) - d - 1, -10, 10)
    n = mask.sum()
    return (pg * mask).sum() / n + obj.kl_loss_coef * (kl * mask).sum() / n


def random_batch(seed: int, b: int = 6, r: int = 11):
    g = torch.Generator().manual_seed(seed)
    log_prob = -torch.rand(b, r, generator=g) * 3
    old = log_prob + 0.3 * torch.randn(b, r, generator=g)
    ref = log_prob + 0.3 * torch.randn(b, r, generator=g)
    mask = (torch.rand(b, r, generator=g) > 0.3).float()
    mask[:, 0] = 1.0
    scores = torch.randn(b, generator=g)
    return log_prob, old, ref, mask, scores


@pytest.mark.parametrize("seed", range(5))
def test_advantages_match_verl_with_reward_on_last_agent_token(seed):
    _, _, _, mask, scores = random_batch(seed)
    groups = ["a", "a", "a", "b", "b", "b"]
    ours = grpo_advantages(scores, mask, groups)
    # verl's own reward manager puts the outcome reward on the last valid response token.
    last = mask.shape[1] - 1 - mask.flip(-1).argmax(-1)
    token_rewards = torch.zeros_like(mask)
    token_rewards[torch.arange(len(scores)), last] = scores
    theirs, _ = compute_grpo_outcome_advantage(token_rewards, mask, np.array(groups, dtype=object))
    assert torch.allclose(ours, theirs, atol=1e-7)


def test_advantage_worked_example():
    # group a: rewards 1, 0 -> mean .5, unbiased std .7071 -> +-.7071; group b: all equal -> 0.
    scores = torch.tensor([1.0, 0.0, 2.0, 2.0, 2.0])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0], [0, 1, 1]], dtype=torch.float32)
    adv = grpo_advantages(scores, mask, ["a", "a", "b", "b", "b"])
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    expected = torch.tensor([[a, a, 0], [-a, 0, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0]])
    assert torch.allclose(adv, expected, atol=1e-6)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_loss_matches_verl_functions_and_independent_formula(seed, mode):
    log_prob, old, ref, mask, scores = random_batch(seed)
    adv = grpo_advantages(scores, mask, ["a"] * 3 + ["b"] * 3)
    obj = GRPOObjective(clip_ratio_low=0.2, clip_ratio_high=0.28, kl_loss_coef=0.01, loss_agg_mode=mode)
    loss, metrics = grpo_loss(log_prob, old, adv, mask, obj, ref_log_prob=ref)

    from verl.trainer.ppo.core_algos import compute_policy_loss_vanilla

    cfg = PolicyLossConfig(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28)
    pg, _ = compute_policy_loss_vanilla(old, log_prob, adv, mask, mode, cfg)
    kl = agg_loss(kl_penalty(log_prob, ref, "low_var_kl"), mask, mode)
    assert torch.allclose(loss, pg + 0.01 * kl, atol=1e-6)
    assert metrics["actor/pg_loss"] == pytest.approx(float(pg), abs=1e-6)
    assert metrics["actor/kl_loss"] == pytest.approx(float(kl), abs=1e-6)
    if mode == "token-mean":
        assert torch.allclose(loss, reference_loss(log_prob, old, adv, mask, ref, obj), atol=1e-6)


def worked_example() -> dict[str, tuple[float, float]]:
    """The loss of two trajectories worked by hand: (computed, expected) for each figure."""
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    adv = grpo_advantages(torch.tensor([1.0, 0.0]), mask, ["q", "q"])
    old = torch.zeros(2, 3)
    # ratios: traj0 1.5 (clipped to 1.2 for A>0), 1.0; traj1 0.5 (clipped to 0.8 for A<0); masked: 100.
    log_prob = torch.log(torch.tensor([[1.5, 1.0, 100.0], [0.5, 100.0, 100.0]]))
    ref = log_prob.clone()
    ref[0, 0] += math.log(2.0)  # k3 = e^d - d - 1 with d = ref - log_prob = ln 2: 1 - ln 2 on that token
    obj = GRPOObjective(clip_ratio_low=0.2, clip_ratio_high=0.2, kl_loss_coef=0.001)
    loss, metrics = grpo_loss(log_prob, old, adv, mask, obj, ref_log_prob=ref)
    pg = (-a * 1.2 - a * 1.0 + a * 0.8) / 3  # token-mean: 3 agent tokens in the mini-batch
    kl = (1 - math.log(2.0)) / 3
    return {"pg_loss": (metrics["actor/pg_loss"], pg), "kl_loss": (metrics["actor/kl_loss"], kl),
            "loss": (float(loss), pg + 0.001 * kl), "clipfrac": (metrics["actor/pg_clipfrac"], 2 / 3)}


def test_loss_worked_example_by_hand():
    for name, (computed, expected) in worked_example().items():
        assert computed == pytest.approx(expected, abs=1e-6), name


def _no_clipping(original):
    def broken(**kw):
        c = kw["config"]
        kw["config"] = PolicyLossConfig(clip_ratio=1e9, clip_ratio_low=1e9, clip_ratio_high=1e9,
                                        clip_ratio_c=c.clip_ratio_c, global_batch_info=c.global_batch_info)
        return original(**kw)

    return broken


def _seq_mean(original):
    def broken(**kw):
        return original(**{**kw, "loss_agg_mode": "seq-mean-token-mean"})

    return broken


BROKEN_OBJECTIVES = {
    "kl_sign": ("kl_penalty", lambda original: lambda **kw: -original(**kw)),
    "kl_direction": ("kl_penalty", lambda original: lambda logprob, ref_logprob, kl_penalty: original(
        logprob=ref_logprob, ref_logprob=logprob, kl_penalty=kl_penalty)),
    "no_clipping": ("compute_policy_loss_vanilla", _no_clipping),
    "sequence_mean_aggregation": ("compute_policy_loss_vanilla", _seq_mean),
}


@pytest.mark.parametrize("variant", list(BROKEN_OBJECTIVES))
def test_worked_example_catches_a_broken_objective(monkeypatch, variant):
    """Each bug, injected into the functions grpo_loss calls, changes a figure the worked example pins."""
    from pipeline.train.local import grpo

    name, breaker = BROKEN_OBJECTIVES[variant]
    monkeypatch.setattr(grpo, name, breaker(getattr(grpo, name)))
    wrong = [k for k, (computed, expected) in worked_example().items() if abs(computed - expected) > 1e-6]
    assert wrong, f"the {variant} variant leaves the worked example intact"


def test_masked_tokens_get_zero_gradient():
    log_prob, old, ref, mask, scores = random_batch(7)
    log_prob = log_prob.clone().requires_grad_(True)
    # Extreme values on masked tokens must not leak (NaN/inf there included).
    with torch.no_grad():
        log_prob[mask == 0] = 50.0
    adv = grpo_advantages(scores, mask, ["a"] * 3 + ["b"] * 3)
    loss, _ = grpo_loss(log_prob, old, adv, mask, GRPOObjective(), ref_log_prob=ref)
    loss.backward()
    assert torch.all(log_prob.grad[mask == 0] == 0)
    assert torch.any(log_prob.grad[mask == 1] != 0)
    assert torch.isfinite(log_prob.grad).all()


def test_micro_batches_sum_to_the_mini_batch_loss_and_gradient():
    log_prob, old, ref, mask, scores = random_batch(3, b=8)
    adv = grpo_advantages(scores, mask, ["a"] * 4 + ["b"] * 4)
    obj = GRPOObjective()
    full_lp = log_prob.clone().requires_grad_(True)
    full, _ = grpo_loss(full_lp, old, adv, mask, obj, ref_log_prob=ref)
    full.backward()
    micro_lp = log_prob.clone().requires_grad_(True)
    total = torch.zeros(())
    n_tokens, n_seqs = int(mask.sum()), mask.shape[0]
    for idx in ([0, 5, 2], [1, 3], [4, 6, 7]):
        part, _ = grpo_loss(micro_lp[idx], old[idx], adv[idx], mask[idx], obj, ref_log_prob=ref[idx],
                            batch_num_tokens=n_tokens, global_batch_size=n_seqs)
        part.backward()
        total = total + part.detach()
    assert torch.allclose(total, full.detach(), atol=1e-6)
    assert torch.allclose(micro_lp.grad, full_lp.grad, atol=1e-7)


def test_kl_needs_reference():
    log_prob, old, _, mask, scores = random_batch(1)
    adv = grpo_advantages(scores, mask, ["a"] * 6)
    with pytest.raises(ValueError, match="reference"):
        grpo_loss(log_prob, old, adv, mask, GRPOObjective(use_kl_loss=True))
    loss, metrics = grpo_loss(log_prob, old, adv, mask, GRPOObjective(use_kl_loss=False))
    assert metrics["actor/kl_loss"] == 0.0 and torch.isfinite(loss)
