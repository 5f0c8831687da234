"""Our GRPO loss against TRL 1.16's `GRPOTrainer._compute_loss`, a second, independent implementation.

Matching settings (tests/trl_parity.py explains each): our `loss_agg_mode: token-mean` is TRL's
`loss_type="bnpo"` (and `"dapo"`, without gradient accumulation); clip 0.2 / 0.28 = `epsilon` / `epsilon_high`;
verl's dual-clip 3 = TRL's `delta=3`; `low_var_kl` with `kl_loss_coef` = TRL's k3 with `beta`. Both sides get a
tiny random Llama's identical weights, the same tokens (prompts of different lengths, left-padded; completions
right-padded), the same old and reference log-probs and advantages; loss, KL and gradient norm must agree within
1e-4 relative. The advantage formulas differ by design (verl std + 1e-6, TRL std + 1e-4) and are pinned apart.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
pytest.importorskip("trl")

from helpers import item
from trl_parity import LossSettings, advantage_formulas, compare

from pipeline.train.local.batch import collate
from pipeline.types import Trajectory

G = 4


def tiny_batch(vocab: int) -> tuple[object, torch.Tensor]:
    """2 prompts × G=4 completions of random tokens: prompt lengths 7 and 11, completion lengths 3..9."""
    g = torch.Generator().manual_seed(1)
    trajectories = []
    for q, p_len in enumerate((7, 11)):
        prompt = torch.randint(5, vocab, (p_len,), generator=g).tolist()
        for k in range(G):
            r_len = 3 + 2 * k if q == 0 else 9 - k
            response = torch.randint(5, vocab, (r_len,), generator=g).tolist()
            trajectories.append(Trajectory(item=item(f"q{q}"), prompt_ids=list(prompt), response_ids=response,
                                           response_mask=[1] * r_len))
    scores = torch.tensor([1.0, 0.0, 0.5, 0.0, 0.2, 0.9, 0.9, 0.0])
    return collate(trajectories, pad_id=0), scores


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    return model, tokenizer


@pytest.mark.parametrize("loss_type", ["bnpo", "dapo"])
def test_loss_kl_and_grad_norm_match_trl(tiny, tmp_path, loss_type):
    model, tokenizer = tiny
    batch, scores = tiny_batch(model.config.vocab_size)
    advantages = torch.tensor(advantage_formulas(scores, G)["ours"])
    settings = LossSettings(trl_loss_type=loss_type)
    result = compare(model, tokenizer, batch, advantages, tmp_path, settings, G)
    assert result["ours"]["kl"] > 1e-3 and result["ours"]["grad_norm"] > 0  # the comparison is not vacuous
    for key in ("loss_rel_diff", "kl_rel_diff", "grad_norm_rel_diff"):
        assert result[key] < 1e-4, (key, result)


def test_a_different_kl_coefficient_on_one_side_is_caught(tiny, tmp_path):
    """The comparison has power: TRL with beta doubled no longer agrees on the loss or the gradient."""
    model, tokenizer = tiny
    batch, scores = tiny_batch(model.config.vocab_size)
    advantages = torch.tensor(advantage_formulas(scores, G)["ours"])
    settings = LossSettings()
    result = compare(model, tokenizer, batch, advantages, tmp_path, settings, G,
                     trl_settings=LossSettings(kl_coef=2 * settings.kl_coef))
    assert result["loss_rel_diff"] > 1e-3 or result["grad_norm_rel_diff"] > 1e-3, result


def test_advantage_formulas_differ_only_by_the_std_epsilon():
    """verl: (r - mean) / (std + 1e-6); TRL: / (std + 1e-4). Same unbiased std, so per group the ratio is
    exactly (std + 1e-4) / (std + 1e-6) (ours / TRL's): ~2e-4 relative at std 0.5, 2 % at std 0.005."""
    scores = torch.tensor([1.0, 0.0, 0.5, 0.0, 0.2, 0.21, 0.2, 0.2])
    out = advantage_formulas(scores, G)
    ours, trl = torch.tensor(out["ours"]), torch.tensor(out["trl"])
    for q in range(2):
        sl = slice(q * G, (q + 1) * G)
        ratio = out["predicted_ratio"][q]
        assert torch.allclose(trl[sl] * ratio, ours[sl], rtol=1e-5, atol=1e-7)
    assert 1e-3 < out["max_rel_diff"] < 0.05  # the small-std group (std 0.005) shows the gap
