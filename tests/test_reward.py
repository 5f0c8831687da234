"""Worked examples of the double-constrained reward (method.md), computed by hand for both presets.

Turns are built with explicit flags so each example states exactly which indicator is on (the `paper`
preset reads those flags); their texts agree with the flags, because the `released` preset reads the text
the way the authors' code does. The parser's own rules are tested by the protocol tests, real turn texts
in test_verl_reward.py (pipeline/train/verl/reward.py), and the released preset's text rules in test_reward_released.py.
"""

from __future__ import annotations

import pytest

from pipeline.config import RewardConfig
from pipeline.reward import (
    REWARD_PRESETS,
    RewardCoefficients,
    coefficients_for,
    compute_reward,
    reward_for_trajectory,
    reward_parts,
)
from pipeline.types import ParsedTurn, PromptItem, Trajectory, Turn

PAPER = RewardConfig(preset="paper")
RELEASED = RewardConfig(preset="released")


def inter(valid: bool = True) -> ParsedTurn:
    """An intermediate turn (think + interaction prompt); M_t = valid."""
    if valid:
        return ParsedTurn(text="<think>a</think><interaction_prompt>b</interaction_prompt>", think="a",
                          interaction_prompt="b", valid_intermediate=True)
    return ParsedTurn(text="<interaction_prompt>b</interaction_prompt>", interaction_prompt="b")


def final(answer: str | None, complete: bool = True) -> ParsedTurn:
    """A final turn; A_p = answer is not None, A_n = answer non-empty, C_f = complete (and tags present).

    An incomplete final turn has text after `</answer>`, which breaks C_f in both presets."""
    has = answer is not None
    tail = "" if complete else " (checked)"
    return ParsedTurn(text=f"<think>r</think><answer>{answer}</answer>{tail}", think="r", answer=answer,
                      has_answer_tags=has, answer_nonempty=bool(has and answer.strip()),
                      complete_final=bool(has and complete))


def test_presets_have_the_method_md_numbers():
    assert REWARD_PRESETS["paper"] == RewardCoefficients(alpha=0.25, beta=0.3, gamma=0.4, delta=0.3, eps=1.5)
    assert REWARD_PRESETS["released"] == RewardCoefficients(alpha=0.4, beta=0.25, gamma=0.25, delta=0.1, eps=1.0)
    assert coefficients_for(None) == REWARD_PRESETS["paper"]  # paper is the default


def test_non_null_coefficients_override_the_preset():
    c = coefficients_for(RewardConfig(preset="released", eps=2.0, gamma=0.5))
    assert c == RewardCoefficients(alpha=0.4, beta=0.25, gamma=0.5, delta=0.1, eps=2.0)
    with pytest.raises(ValueError, match="alpha"):
        coefficients_for(RewardConfig(alpha=-0.1))


# ---------------------------------------------------------------- paper: alpha .25 beta .3 gamma .4 delta .3 eps 1.5
def test_paper_zero_turns():
    r = compute_reward([], ["Paris"], PAPER)
    assert (r.total, r.format, r.answer, r.gated) == (-1.5, 0.0, 0.0, False)


def test_paper_no_interaction_turn_is_gated_out_even_when_correct():
    # R_fmt = .3 + .4 + .3 = 1.0 < 1.5: the correct answer does not count; R = -1.5 + 1.0
    r = compute_reward([final("Paris")], ["Paris"], PAPER)
    assert r.format == pytest.approx(1.0)
    assert r.answer == 1.0 and not r.gated
    assert r.total == pytest.approx(-0.5)
    assert r.valid_intermediate_turns == 0


def test_paper_one_interaction_turn_still_short_of_the_cap():
    # .25 + 1.0 = 1.25 -> R = -0.25
    r = compute_reward([inter(), final("Paris")], ["Paris"], PAPER)
    assert r.format == pytest.approx(1.25) and not r.gated
    assert r.total == pytest.approx(-0.25)


def test_paper_two_interaction_turns_gate_opens():
    # .25 * 2 + .3 + .4 + .3 = 1.5 = eps -> R = -1.5 + 1.5 + F1 = F1 = 1
    r = compute_reward([inter(), inter(), final("Paris")], ["Paris"], PAPER)
    assert r.gated and r.format == 1.5
    assert r.total == 1.0


def test_paper_partial_answer_f1():
    # pred "the Eiffel Tower, Paris" -> [eiffel, tower, paris]; gold [eiffel, tower]: P 2/3, R 1, F1 0.8
    r = compute_reward([inter(), inter(), final("the Eiffel Tower, Paris")], ["Eiffel Tower"], PAPER)
    assert r.gated
    assert r.answer == pytest.approx(0.8)
    assert r.total == pytest.approx(0.8)


def test_paper_several_gold_answers_take_the_max():
    # vs "NYC": 0; vs "New York": [new, york, city] / [new, york] -> F1 0.8; vs "New York City": 1.0
    turns = [inter(), inter(), final("New York City")]
    assert compute_reward(turns, ["NYC", "New York"], PAPER).total == pytest.approx(0.8)
    assert compute_reward(turns, ["NYC", "New York", "new york city"], PAPER).total == 1.0


def test_paper_malformed_final_turn():
    # answer tags and non-empty answer but text outside the tags (C_f = 0): .5 + .3 + .4 = 1.2 -> R = -0.3
    r = compute_reward([inter(), inter(), final("Paris", complete=False)], ["Paris"], PAPER)
    assert (r.answer_tags, r.answer_nonempty, r.complete_final) == (1.0, 1.0, 0.0)
    assert not r.gated and r.total == pytest.approx(-0.3)
    # no answer tags at all (e.g. the turn stopped mid-way): .5 -> R = -1.0, R_ans 0
    broken = ParsedTurn(text="<think>I will answer</think> Paris")
    r = compute_reward([inter(), inter(), broken], ["Paris"], PAPER)
    assert (r.format, r.answer, r.total) == (pytest.approx(0.5), 0.0, pytest.approx(-1.0))


def test_paper_empty_answer():
    # A_p 1, A_n 0, C_f 1: .5 + .3 + .3 = 1.1 -> R = -0.4; R_ans 0
    r = compute_reward([inter(), inter(), final("")], ["Paris"], PAPER)
    assert (r.answer_tags, r.answer_nonempty) == (1.0, 0.0)
    assert r.answer == 0.0 and r.total == pytest.approx(-0.4)


def test_paper_invalid_intermediate_turns_do_not_count():
    # M = [1, 0]: .25 + 1.0 = 1.25 -> R = -0.25
    r = compute_reward([inter(), inter(valid=False), final("Paris")], ["Paris"], PAPER)
    assert r.valid_intermediate_turns == 1 and r.total == pytest.approx(-0.25)


def test_paper_cap_and_gate_without_complete_format():
    # 4 valid turns + answer tags + non-empty, C_f 0: 1.0 + .7 = 1.7 -> capped at 1.5 -> gated, R = F1
    r = compute_reward([inter()] * 4 + [final("Paris", complete=False)], ["Paris"], PAPER)
    assert r.format == 1.5 and r.gated and r.total == 1.0
    # 4 valid + complete: 2.0 -> 1.5, wrong answer -> R = 0
    r = compute_reward([inter()] * 4 + [final("Lyon")], ["Paris"], PAPER)
    assert r.format == 1.5 and r.gated and r.total == 0.0


def test_paper_turn_limit_without_answer():
    # 5 interaction turns: M summed over turns 1..4 (1.0); the last turn is the final one and has no answer
    r = compute_reward([inter()] * 5, ["Paris"], PAPER)
    assert r.valid_intermediate_turns == 4
    assert (r.format, r.total, r.answer_tags) == (pytest.approx(1.0), pytest.approx(-0.5), 0.0)


# ---------------------------------------------------------------- released: .4 per turn, .25, .25, .1, cap 1.0
def test_released_zero_turns():
    assert compute_reward([], ["x"], RELEASED).total == -1.0


def test_released_no_interaction_turn():
    # .25 + .25 + .1 = .6 -> R = -0.4
    r = compute_reward([final("Paris")], ["Paris"], RELEASED)
    assert not r.gated and r.total == pytest.approx(-0.4)


def test_released_one_interaction_turn_opens_the_gate():
    # .4 + .25 + .25 + .1 = 1.0 -> R = F1
    r = compute_reward([inter(), final("Paris")], ["Paris"], RELEASED)
    assert r.gated and r.format == 1.0 and r.total == 1.0


def test_released_malformed_final():
    # .4 + .25 + .25 = .9 -> R = -0.1
    r = compute_reward([inter(), final("Paris", complete=False)], ["Paris"], RELEASED)
    assert not r.gated and r.total == pytest.approx(-0.1)


def test_released_empty_answer():
    # their A_p needs non-empty answer content, and A_n and C_f are only checked under A_p: .4 -> R = -0.6
    r = compute_reward([inter(), final("")], ["Paris"], RELEASED)
    assert (r.answer_tags, r.answer_nonempty, r.complete_final) == (0.0, 0.0, 0.0)
    assert r.total == pytest.approx(-0.6)


def test_released_several_golds_and_cap():
    # 2 valid turns + complete: .8 + .6 = 1.4 -> 1.0 (cap) -> R = max F1 = 0.8 ("New York City" vs "New York")
    r = compute_reward([inter(), inter(), final("New York City")], ["NYC", "New York"], RELEASED)
    assert r.format == 1.0 and r.gated and r.total == pytest.approx(0.8)


def test_released_cap_opens_the_gate_with_no_answer_at_all():
    # 4 interaction turns: their loop answers the last call too, so all 4 are intermediate blocks and the
    # final block is the bare `<think>\n` opener: 1.6 -> 1.0 (cap), gated, R = -1 + 1 + 0 = 0
    r = compute_reward([inter()] * 4, ["Paris"], RELEASED)
    assert r.gated and r.total == 0.0 and r.answer == 0.0 and r.valid_intermediate_turns == 4


# ---------------------------------------------------------------- floating point at the gate
def test_gate_tolerates_one_ulp_below_the_cap():
    cfg = RewardConfig(alpha=0.7, beta=0.2, gamma=0.1, delta=0.0, eps=1.0)
    assert 0.7 * 1 + 0.2 * 1 + 0.1 * 1 < 1.0  # the float sum really is short: 0.9999999999999999
    r = compute_reward([inter(), final("Paris")], ["Paris"], cfg)
    assert r.gated
    assert r.format == 1.0  # snapped to k
    assert r.total == 1.0  # exactly R_ans, no 1e-16 residue


def test_gate_stays_shut_one_coefficient_below():
    cfg = RewardConfig(alpha=0.7, beta=0.2, gamma=0.1, delta=0.0, eps=1.0)
    r = compute_reward([inter(), final("")], ["Paris"], cfg)  # A_n = 0: 0.9
    assert not r.gated and r.total == pytest.approx(-0.1)


def test_reward_for_trajectory_and_parts():
    item = PromptItem(uid="q1", messages=[{"role": "user", "content": "Q"}], gold_answers=["Paris", "paris, France"],
                      data_source="hotpotqa")
    traj = Trajectory(item=item, prompt_ids=[1, 2],
                      turns=[Turn(parsed=inter(), agent_token_ids=[3]), Turn(parsed=inter(), agent_token_ids=[4]),
                             Turn(parsed=final("Paris"), agent_token_ids=[5])])
    r = reward_for_trajectory(traj, PAPER)
    assert r.total == 1.0
    parts = reward_parts(r, prefix="reward/")
    assert parts == {"reward/score": 1.0, "reward/format": 1.5, "reward/answer": 1.0, "reward/gated": 1.0,
                     "reward/valid_intermediate_turns": 2.0, "reward/answer_tags": 1.0,
                     "reward/answer_nonempty": 1.0, "reward/complete_final": 1.0}
