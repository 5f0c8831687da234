"""`train.health`: the thresholds of the training health gate (pipeline/train/health.py).

GRPO runs are known to collapse while they keep running: groups whose G trajectories all score the same
(no advantage, no learning signal), the format reward rising while answers get worse (the policy learns the
tags, not the task), responses shrinking to nothing, the policy running away from the reference (KL). The
gate checks four figures after every training step, on both backends, and stops the run on a breach.

Why a window after a grace period: single steps are noisy at small batches. The `learn` profile (2 questions
x G=4 per step) has steps where every trajectory scored 0 (steps 2, 15, 17, 20 and 21 of
benchmarks/results/learning/previous_question_mode.json, a run that went on to gain 38 F1 points), so a per-step rule would stop a
healthy run. Each figure is therefore the mean over the last `window` steps, and nothing is judged before
`grace_steps` + `window` steps have run (the default profile's 2 steps are never judged). The defaults were
checked against the recorded healthy runs (tests/test_train_health.py replays them).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class HealthConfig(BaseModel):
    """Thresholds of the training health gate; each figure is a mean over the last `window` steps."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(True, description="Judge every training step; false: never stop a run for its health.")
    grace_steps: int = Field(
        10, ge=0, description="Steps never judged, and never part of a judged window: early GRPO steps are "
        "flat or noisy while the policy finds the format.")
    window: int = Field(8, ge=1, description="Steps each figure is averaged over (the steps after grace_steps).")
    max_zero_variance_share: float = Field(
        0.95, ge=0, le=1, description="Breach when the window's mean share of groups whose G trajectories all "
        "scored the same exceeds this: GRPO's advantage is 0 for them, so the window taught (almost) nothing.")
    max_answer_drop: float = Field(
        0.3, ge=0, description="Breach when the answer reward's window mean fell by more than this from the "
        "window before ... (learn's healthy run dips by 0.21 around its flat steps 15-21, format +0.075)")
    min_format_rise: float = Field(
        0.05, ge=0, description="... while the format reward's window mean rose by at least this (the policy "
        "learns the tags while its answers get worse).")
    min_length_ratio: float = Field(
        0.25, ge=0, le=1, description="Breach when the window's mean response length (agent tokens on the "
        "local backend, verl's response_length/mean) falls below this share of the first window's mean.")
    max_kl: float = Field(
        1.0, gt=0, description="Breach when the window's mean KL to the reference (actor/kl_loss, in "
        "train.kl_loss_type's estimator) exceeds this; healthy runs stay near 0.001-0.05.")
