"""verl's reward entry point `compute_score` on worked examples, with real turn texts parsed by `parse_turn`."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.train.verl.reward import as_answer_list, compute_score, split_trajectory_text

T1 = "<think>\nNeed the capital.</think>\n<interaction_prompt>What is the capital of France?</interaction_prompt>"
T2 = "<think>\nCheck it.</think>\n<interaction_prompt>Is it Paris?</interaction_prompt>"
FINAL = "<think>\nSure.</think>\n<answer>Paris</answer>"


def score(turns, gold, **kw):
    return compute_score("hotpotqa", "", gold, extra_info={"prompt_r1_turns": turns}, **kw)


def test_paper_preset_worked_examples():
    # 2 valid turns + complete final: R_fmt 1.5 = eps -> R = F1 = 1
    r = score([T1, T2, FINAL], np.array(["Paris"], dtype=object))
    assert r["score"] == 1.0 and r["format"] == 1.5 and r["gated"] == 1.0 and r["num_agent_turns"] == 3.0
    # answer only: 0.3 + 0.4 + 0.3 = 1.0 -> R = -0.5, though the answer is right
    r = score([FINAL], ["Paris"])
    assert r["score"] == pytest.approx(-0.5) and r["answer"] == 1.0 and r["gated"] == 0.0
    # several golds, partial answer: "Paris France" vs "Paris": P 1/2 R 1 -> F1 2/3
    r = score([T1, T2, "<think>\nx</think><answer>Paris, France</answer>"], ["Lyon", "Paris"])
    assert r["score"] == pytest.approx(2 / 3)
    # text after the answer: C_f 0 -> .5 + .3 + .4 = 1.2 -> R = -0.3
    r = score([T1, T2, FINAL + " Done!"], ["Paris"])
    assert r["complete_final"] == 0.0 and r["score"] == pytest.approx(-0.3)
    # empty answer: .5 + .3 + .3 = 1.1 -> R = -0.4
    r = score([T1, T2, "<think>\nx</think><answer> </answer>"], ["Paris"])
    assert r["answer_nonempty"] == 0.0 and r["score"] == pytest.approx(-0.4)
    # no turns at all
    assert score([], ["Paris"])["score"] == -1.5


def test_released_preset_and_coefficient_kwargs():
    # released: .4 + .25 + .25 + .1 = 1.0 = cap -> R = 1
    assert score([T1, FINAL], ["Paris"], preset="released")["score"] == 1.0
    # an override from reward_kwargs: eps 2.0 keeps the gate shut (1.0 < 2.0) -> R = -2 + 1 = -1
    assert score([T1, FINAL], ["Paris"], preset="released", eps=2.0)["score"] == pytest.approx(-1.0)


def test_fallback_splits_the_decoded_response():
    # what tokenizer.decode(skip_special_tokens=True) leaves of a ChatML multi-turn response
    solution = (
        "Need the capital.</think>\n<interaction_prompt>What is the capital of France?</interaction_prompt>\n"
        "user\n<interaction_response>\nParis.\n</interaction_response>\nassistant\n<think>\n"
        "Check it.</think>\n<interaction_prompt>Is it Paris?</interaction_prompt>\n"
        "user\n<interaction_response>\nYes.\n</interaction_response>\nassistant\n<think>\n"
        "Sure.</think>\n<answer>Paris</answer>"
    )
    turns = split_trajectory_text(solution)
    assert [t.text for t in turns] == [T1, T2, FINAL]
    assert compute_score("hotpotqa", solution, ["Paris"], extra_info={})["score"] == 1.0


def test_answer_lists():
    assert as_answer_list(np.array(["a", "b"], dtype=object)) == ["a", "b"]
    assert as_answer_list("a") == ["a"] and as_answer_list(None) == [] and as_answer_list(3) == ["3"]
