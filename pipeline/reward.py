"""The Prompt-R1 double-constrained reward (method.md, "Double-constrained reward").

    R_fmt = min(eps, alpha * sum_{t<T} M_t + beta * A_p + gamma * A_n + delta * C_f)
    R_ans = max over gold answers of token-F1(normalize(answer), normalize(gold))
    R     = -k + R_fmt + R_ans   if R_fmt == k   (k = eps)
            -k + R_fmt           otherwise

Design decisions:
- The indicators come from the protocol's parser (`ParsedTurn.valid_intermediate` = M_t,
  `has_answer_tags` = A_p, `answer_nonempty` = A_n, `complete_final` = C_f); this module only weighs
  them, so the parse rules live in one place (`pipeline.agent.protocol.parse_turn`).
- M_t is summed over the intermediate turns 1..T-1 only; the last turn is the "final" turn whatever
  it contains. A trajectory cut at the turn limit therefore ends on an interaction turn that earns no
  M_t and no A_p/A_n/C_f. An empty trajectory (T = 0) has R_fmt = 0 and R = -k.
- R_ans uses `pipeline.metrics.token_f1` (SQuAD normalisation, multiset overlap, max over golds), the
  same function evaluation reports, so the training signal and the F1 metric cannot drift apart. It is
  computed even when the gate shuts it out, so training logs show how good gated-out answers were.
- Presets are a small registry (`REWARD_PRESETS`, `register_preset`): `paper` (Appendix G, the
  default) and `released` (the authors' code). Any non-null coefficient in `RewardConfig` overrides
  the preset's value.
- The gate `R_fmt == k` is an equality between floats. The cap makes it exact whenever the raw sum
  *exceeds* eps (min returns eps itself), but a sum that equals eps mathematically may land one ulp
  short: with alpha .7, beta .2, gamma .1, eps 1.0 the sum 0.7 + 0.2 + 0.1 is 0.9999999999999999, and
  an exact test would shut out a fully formatted answer. So the gate compares with an absolute
  tolerance of 1e-9 and then snaps R_fmt to k, which keeps R = R_ans exactly when gated. The tolerance
  cannot admit a genuinely incomplete format: R_fmt moves in steps of one coefficient (0.1 at the
  smallest in either preset), eight orders of magnitude above it; coefficients below 1e-6 are refused.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from pipeline.config import RewardConfig
from pipeline.metrics import token_f1
from pipeline.types import ParsedTurn, RewardBreakdown, Trajectory

GATE_TOLERANCE = 1e-9
"""Absolute tolerance of the gate test R_fmt == k (see the module docstring)."""

_MIN_COEFFICIENT = 1e-6


@dataclass(frozen=True)
class RewardCoefficients:
    """Weights of the format reward and its cap (method.md symbols)."""

    alpha: float
    """Weight of each valid intermediate turn (M_t)."""
    beta: float
    """Weight of a parseable `<answer>…</answer>` in the final turn (A_p)."""
    gamma: float
    """Weight of a non-empty answer (A_n)."""
    delta: float
    """Weight of a complete final turn `<think>…</think><answer>…</answer>` (C_f)."""
    eps: float
    """Cap of R_fmt; also k, the offset and the gate threshold."""

    def validate(self) -> RewardCoefficients:
        for name in ("alpha", "beta", "gamma", "delta"):
            value = getattr(self, name)
            if value < 0 or 0 < value < _MIN_COEFFICIENT:
                raise ValueError(f"reward coefficient {name}={value}: must be 0 or >= {_MIN_COEFFICIENT}")
        if self.eps <= 0:
            raise ValueError(f"reward cap eps={self.eps}: must be > 0")
        return self


REWARD_PRESETS: dict[str, RewardCoefficients] = {}


def register_preset(name: str, coefficients: RewardCoefficients) -> RewardCoefficients:
    """Add a named preset (selected with `reward.preset`); returns the coefficients."""
    REWARD_PRESETS[name] = coefficients.validate()
    return coefficients


register_preset("paper", RewardCoefficients(alpha=0.25, beta=0.3, gamma=0.4, delta=0.3, eps=1.5))
register_preset("released", RewardCoefficients(alpha=0.4, beta=0.25, gamma=0.25, delta=0.1, eps=1.0))


def coefficients_for(cfg: RewardConfig | None) -> RewardCoefficients:
    """The preset named by `cfg.preset` with every non-null coefficient of `cfg` applied on top."""
    cfg = cfg or RewardConfig()
    try:
        base = REWARD_PRESETS[cfg.preset]
    except KeyError as exc:
        raise ValueError(f"unknown reward preset {cfg.preset!r}; known: {sorted(REWARD_PRESETS)}") from exc
    overrides = {k: getattr(cfg, k) for k in ("alpha", "beta", "gamma", "delta", "eps") if getattr(cfg, k) is not None}
    return replace(base, **overrides).validate()


def format_reward(turns: Sequence[ParsedTurn], coefficients: RewardCoefficients) -> tuple[float, int, float, float, float]:
    """(R_fmt before the gate snap, sum M_t, A_p, A_n, C_f) for one trajectory."""
    if not turns:
        return 0.0, 0, 0.0, 0.0, 0.0
    *intermediate, final = turns
    valid = sum(1 for t in intermediate if t.valid_intermediate)
    a_p = float(final.has_answer_tags)
    a_n = float(final.answer_nonempty)
    c_f = float(final.complete_final)
    c = coefficients
    raw = c.alpha * valid + c.beta * a_p + c.gamma * a_n + c.delta * c_f
    return min(c.eps, raw), valid, a_p, a_n, c_f


def answer_reward(turns: Sequence[ParsedTurn], gold_answers: Sequence[str]) -> float:
    """R_ans: token F1 of the final turn's answer, max over gold answers (0 without an answer)."""
    if not turns or turns[-1].answer is None:
        return 0.0
    return token_f1(turns[-1].answer, list(gold_answers))


def compute_reward(
    turns: Sequence[ParsedTurn], gold_answers: Sequence[str], cfg: RewardConfig | None = None
) -> RewardBreakdown:
    """The double-constrained reward of one trajectory and all its parts."""
    c = coefficients_for(cfg)
    r_fmt, valid, a_p, a_n, c_f = format_reward(turns, c)
    r_ans = answer_reward(turns, gold_answers)
    k = c.eps
    gated = math.isclose(r_fmt, k, rel_tol=0.0, abs_tol=GATE_TOLERANCE)
    if gated:
        r_fmt = k
    total = -k + r_fmt + r_ans if gated else -k + r_fmt
    return RewardBreakdown(
        total=total,
        format=r_fmt,
        answer=r_ans,
        gated=gated,
        valid_intermediate_turns=valid,
        answer_tags=a_p,
        answer_nonempty=a_n,
        complete_final=c_f,
    )


def reward_for_trajectory(traj: Trajectory, cfg: RewardConfig | None = None) -> RewardBreakdown:
    """`compute_reward` over a rolled-out trajectory's parsed turns and its item's gold answers."""
    return compute_reward([t.parsed for t in traj.turns], traj.item.gold_answers, cfg)


def reward_parts(breakdown: RewardBreakdown, prefix: str = "") -> dict[str, float]:
    """Flat, numeric view of a breakdown (for verl's reward_extra_info, MLflow metrics, tables)."""
    parts = {
        "score": breakdown.total,
        "format": breakdown.format,
        "answer": breakdown.answer,
        "gated": float(breakdown.gated),
        "valid_intermediate_turns": float(breakdown.valid_intermediate_turns),
        "answer_tags": breakdown.answer_tags,
        "answer_nonempty": breakdown.answer_nonempty,
        "complete_final": breakdown.complete_final,
    }
    return {f"{prefix}{k}": v for k, v in parts.items()}
