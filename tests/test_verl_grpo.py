"""verl's GRPO advantage on a hand-computed example (method.md: A_i = (R_i - mean(R)) / (std(R) + 1e-6)).

The local backend calls the same function, so this pins what both backends optimise. Note: verl's std is
torch.std, the sample standard deviation (divides by n - 1), which is what "std" means here.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage


def test_grpo_advantage_by_hand():
    # two questions, G = 4 and G = 2; the outcome reward sits on each trajectory's last response token
    rewards = [1.0, -0.5, 0.0, 0.5, -1.5, -1.5]
    index = np.array(["q1", "q1", "q1", "q1", "q2", "q2"], dtype=object)
    mask = torch.tensor([
        [1, 1, 0, 0, 1],  # agent, agent, environment, environment, agent
        [1, 1, 1, 0, 0],
        [1, 0, 0, 1, 1],
        [1, 1, 1, 1, 1],
        [1, 1, 0, 0, 0],
        [1, 0, 0, 0, 0],
    ], dtype=torch.float32)
    token_rewards = torch.zeros_like(mask)
    for i, r in enumerate(rewards):
        last = int(mask[i].nonzero().max())
        token_rewards[i, last] = r

    advantages, returns = compute_grpo_outcome_advantage(token_rewards, mask, index, epsilon=1e-6)

    # q1: mean 0.25; deviations .75 -.75 -.25 .25; sum of squares 1.25; sample std sqrt(1.25 / 3)
    std = math.sqrt(1.25 / 3)
    expected_q1 = [d / (std + 1e-6) for d in (0.75, -0.75, -0.25, 0.25)]
    assert expected_q1[0] == pytest.approx(1.161893, abs=1e-6)
    # q2: identical rewards -> std 0 -> advantage 0 (no signal from a group that all scored the same)
    expected = [*expected_q1, 0.0, 0.0]
    for i, a in enumerate(expected):
        # the trajectory's advantage on every agent token, 0 on environment tokens
        assert advantages[i].tolist() == pytest.approx((mask[i] * a).tolist(), abs=1e-6)
    assert torch.equal(advantages, returns)
