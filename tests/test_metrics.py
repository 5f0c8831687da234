"""Metrics: hand-computed examples for both modes (ours vs the authors' eval_scores.py), and bootstrap CIs."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pipeline.metrics import (
    bootstrap_ci,
    bootstrap_ci_average,
    dataset_metrics,
    exact_match,
    normalize_answer,
    paired_bootstrap_delta,
    reported_metrics,
    score_rows,
    substring_match,
    token_f1,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The Cat!", "cat"),
        ("  a  Tale of   Two Cities. ", "tale of two cities"),
        ("An apple, the pear & a plum", "apple pear plum"),
        ("theatre", "theatre"),  # articles only as whole words
        ("", ""),
        (None, ""),
        ("U.S.A.", "usa"),
    ],
)
def test_normalize_answer(text, expected):
    assert normalize_answer(text) == expected


def test_exact_match_max_over_golds_and_str_gold():
    assert exact_match("The Eiffel Tower", ["eiffel tower", "Paris"]) == 1.0
    assert exact_match("Paris.", "paris") == 1.0
    assert exact_match("Paris, France", ["Paris"]) == 0.0
    assert exact_match("", ["Paris"]) == 0.0
    assert exact_match("x", []) == 0.0


def test_token_f1_hand_computed():
    # pred tokens [barack, obama, was, president], gold [barack, obama]: P = 2/4, R = 2/2, F1 = 2/3
    assert token_f1("Barack Obama was president", "Barack Obama") == pytest.approx(2 / 3)
    # multiset: pred [new, new, york], gold [new, york, city]: common = {new:1, york:1} = 2; P=2/3 R=2/3
    assert token_f1("new new york", "New York City") == pytest.approx(2 / 3)
    # max over golds: vs "york" -> P=1/3 R=1 F1=0.5 ; vs "new york" -> P=2/3 R=1 F1=0.8
    assert token_f1("new new york", ["york", "new york"]) == pytest.approx(0.8)
    assert token_f1("nothing shared", ["other words"]) == 0.0
    assert token_f1("The answer", ["answer"]) == 1.0  # "the" is dropped


def test_token_f1_empty_modes():
    # both sides normalise to nothing ("the" is an article)
    assert token_f1("", "the") == 0.0
    assert token_f1("", "the", mode="reference") == 1.0
    assert token_f1("", "Paris", mode="reference") == 0.0
    assert token_f1("Paris", "Paris", mode="reference") == 1.0


def test_substring_match_ours_is_gold_in_prediction():
    assert substring_match("It is Paris, in France.", ["paris"]) == 1.0
    assert substring_match("Paris", ["Paris, France"]) == 0.0  # prediction inside gold does not count
    assert substring_match("", ["Paris"]) == 0.0
    assert substring_match("the", ["Paris"]) == 0.0  # article-only prediction normalises to ''


def test_substring_match_reference_both_directions_and_empty_bug():
    assert substring_match("Paris", ["Paris, France"], mode="reference") == 1.0
    assert substring_match("It is Paris", ["paris"], mode="reference") == 1.0
    # the authors' bug: '' is contained in every gold
    assert substring_match("", ["Paris"], mode="reference") == 1.0
    assert substring_match("a", ["Paris"], mode="reference") == 1.0
    assert substring_match("London", ["Paris"], mode="reference") == 0.0
    with pytest.raises(ValueError):
        substring_match("x", "x", mode="bogus")


def test_dataset_metric_assignment_follows_method_md():
    for ds in ["2wikimultihopqa", "hotpotqa", "gsm8k", "dapo_math", "musique", "popqa", "mathqa", "squad_v2",
               "triviaqa"]:
        assert dataset_metrics(ds) == ("em", "f1")
    for ds in ["booksum", "writingprompts", "xsum"]:
        assert dataset_metrics(ds) == ("f1", "ssim")
    assert "sm" in reported_metrics("hotpotqa") and "sm" in reported_metrics("xsum")


def test_paper_average_convention_reproduces_headline_numbers(params):
    """method.md's per-dataset numbers, fed through evaluation.scores.aggregate (one row per dataset scoring
    that number), give the paper's ID/OOD averages: each metric is averaged over the datasets it is assigned to."""
    from pipeline.evaluation.scores import aggregate
    from pipeline.types import TRAINED, EvalRow

    em = {"2wikimultihopqa": 48.44, "hotpotqa": 44.53, "gsm8k": 97.66, "dapo_math": 26.56, "musique": 18.75,
          "popqa": 28.13, "triviaqa": 70.31, "mathqa": 52.34, "squad_v2": 19.53}
    f1 = {"2wikimultihopqa": 54.41, "hotpotqa": 52.31, "gsm8k": 97.66, "dapo_math": 26.56, "musique": 26.31,
          "popqa": 33.77, "booksum": 26.50, "writingprompts": 22.11,
          "triviaqa": 76.91, "mathqa": 61.59, "squad_v2": 29.28, "xsum": 25.76}
    ssim = {"booksum": 60.87, "writingprompts": 38.54, "xsum": 63.02}
    splits = {**{d: "id" for d in params.data.id_eval_datasets}, **{d: "ood" for d in params.data.ood_eval_datasets}}
    assert set(splits) == set(f1)
    rows = {d: [EvalRow(d, split, 0, f"{d}-0", "q", ["a"], [])] for d, split in splits.items()}
    per_metric = {"em": em, "f1": f1, "ssim": ssim}
    scores = {d: {m: [per_metric[m][d] / 100] for m in reported_metrics(d) if m != "sm"} | {"sm": [0.0]}
              for d in splits}
    params.evaluate.bootstrap_samples = 10
    summary = aggregate({TRAINED: {"ours": scores, "reference": scores}}, rows, params.evaluate, params.seed)
    id_avg, ood_avg = (summary["averages"][TRAINED][s] for s in ("id", "ood"))
    assert id_avg["em"]["mean"] == pytest.approx(44.01, abs=0.01)
    assert id_avg["f1"]["mean"] == pytest.approx(42.45, abs=0.01)
    assert id_avg["ssim"]["mean"] == pytest.approx(49.71, abs=0.01)
    assert ood_avg["f1"]["mean"] == pytest.approx(48.39, abs=0.01)


def test_score_rows_without_ssim():
    out = score_rows(["Paris", ""], [["Paris"], ["London"]], "ours", None)
    assert out == {"em": [1.0, 0.0], "sm": [1.0, 0.0], "f1": [1.0, 0.0]}
    ref = score_rows(["Paris", ""], [["Paris"], ["London"]], "reference", None)
    assert ref["sm"] == [1.0, 1.0]


def test_bootstrap_ci_properties():
    mean, low, high = bootstrap_ci([1.0, 0.0, 1.0, 1.0], samples=2000, confidence=0.95, seed=1)
    assert mean == 0.75
    assert 0.0 <= low <= mean <= high <= 1.0
    assert low < high
    # deterministic for a seed
    assert bootstrap_ci([1.0, 0.0, 1.0, 1.0], 2000, 0.95, 1) == (mean, low, high)
    # constant values: a degenerate interval
    assert bootstrap_ci([0.5] * 10, 500, 0.95, 0) == (0.5, 0.5, 0.5)
    assert bootstrap_ci([0.3], 500, 0.95, 0) == (0.3, 0.3, 0.3)
    with pytest.raises(ValueError):
        bootstrap_ci([], 10, 0.95, 0)


def test_bootstrap_ci_matches_normal_approximation_on_large_sample():
    rng = np.random.default_rng(0)
    values = rng.integers(0, 2, size=400).astype(float)
    _mean, low, high = bootstrap_ci(values, samples=4000, confidence=0.95, seed=3)
    half = 1.96 * values.std() / math.sqrt(values.size)
    assert (high - low) / 2 == pytest.approx(half, rel=0.15)


def test_bootstrap_average_is_mean_of_group_means_and_paired_delta():
    groups = [[1.0, 1.0], [0.0, 0.0, 0.0, 1.0]]
    mean, low, high = bootstrap_ci_average(groups, 1000, 0.95, 0)
    assert mean == pytest.approx((1.0 + 0.25) / 2)
    assert low <= mean <= high
    a = [[1.0, 1.0, 0.0], [1.0, 0.0]]
    b = [[0.0, 1.0, 0.0], [1.0, 0.0]]
    delta, dlow, _dhigh = paired_bootstrap_delta(a, b, 1000, 0.95, 0)
    assert delta == pytest.approx((1 / 3 + 0.0) / 2)
    assert dlow >= 0.0  # paired differences are never negative here
    assert paired_bootstrap_delta(a, a, 500, 0.95, 0) == (0.0, 0.0, 0.0)


def test_golds_that_normalise_to_nothing_neither_match_empty_nor_become_unmatchable() -> None:
    # The authors' rows have golds "A" (TriviaQA), "a" (MathQA), "$" (MuSiQue): SQuAD normalisation
    # turns them into "", which in plain SQuAD code matches an empty prediction.
    for gold in ("A", "a", "$"):
        assert exact_match("", [gold]) == 0.0
        assert exact_match(gold, [gold]) == 1.0
        assert token_f1(gold.lower(), [gold]) == 1.0
        assert token_f1("", [gold]) == 0.0
    assert exact_match("Paris", ["a"]) == 0.0
    # the authors' behaviour stays available for comparison
    assert exact_match("", ["a"], mode="reference") == 1.0
    assert token_f1("", ["a"], mode="reference") == 1.0
