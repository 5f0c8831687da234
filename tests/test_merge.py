"""Stage merge: local full fine-tune and LoRA checkpoints → a verified HF model dir; the verl command."""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

import pytest
import torch

from pipeline.config import load_params
from pipeline.stages.merge import run_merge
from pipeline.train import checkpoint as ckpt
from pipeline.train.merge import (
    MergeVerificationError,
    _verify,
    probe_input,
    probe_logits,
    verl_merge_command,
)

REPO_ROOT = Path(__file__).resolve().parents[1]


def merge_params(tmp: Path, model_dir: Path, lora: bool):
    return load_params(REPO_ROOT / "params.yaml", {
        "paths": {"checkpoint_dir": str(tmp / "ckpt"), "model_dir": str(tmp / "models/agent"),
                  "reports_dir": str(tmp / "reports"), "rl_dir": str(tmp / "rl")},
        "agent": {"model": str(model_dir)},
        "train": {"lora": {"enabled": lora, "r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}},
    })


def trained_checkpoint(params, lora: bool):
    """A checkpoint whose weights differ from the base (so a merge that ignored them would be caught)."""
    from pipeline.modelref import load_causal_lm
    from pipeline.train.local.models import PolicyModels, apply_lora, load_tokenizer, write_weights

    torch.manual_seed(1)
    model = load_causal_lm(params.agent.model, params.root, torch.float32)
    if lora:
        model = apply_lora(model, params.train.lora)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad and (not lora or "lora_" in name):
                p.add_(0.05 * torch.randn_like(p))
    models = PolicyModels(model=model, reference=None, tokenizer=load_tokenizer(params.agent.model, params.root),
                          lora=lora)
    state = ckpt.TrainerState(step=3, base_model=params.agent.model, lora=lora)
    ckpt.save_checkpoint(params.path(params.paths.checkpoint_dir), state, partial(write_weights, models), None)
    return model, models.tokenizer


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_merge_produces_a_verified_hf_model(tmp_path, tiny_llama_dir, lora):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    params = merge_params(tmp_path, tiny_llama_dir, lora)
    trained, tokenizer = trained_checkpoint(params, lora)
    (tmp_path / "reports/train").mkdir(parents=True)
    (tmp_path / "reports/train/steps.csv").write_text("step,critic/score/mean\n1,-1.5\n2,-1.2\n3,-0.9\n")

    report = run_merge(params)

    out = tmp_path / "models/agent"
    assert report.source == ("local-lora" if lora else "local-full") and report.step == 3
    assert list(out.glob("*.safetensors")) and (out / "config.json").is_file()
    assert not list(out.glob("adapter_*")), "the adapter must be merged, not shipped"
    reloaded_tok = AutoTokenizer.from_pretrained(str(out))
    assert reloaded_tok.chat_template
    merged = AutoModelForCausalLM.from_pretrained(str(out))
    inputs = probe_input(tokenizer)
    diff = (probe_logits(merged, inputs) - probe_logits(trained, inputs)).abs().max()
    assert float(diff) < 1e-4
    base = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir))
    assert float((probe_logits(base, inputs) - probe_logits(merged, inputs)).abs().max()) > 1e-3
    card = (out / "README.md").read_text()
    assert "base_model:" in card and str(tiny_llama_dir) in card and "Git commit" in card
    assert "-0.9" in card and (out / "MODEL_CARD.md").read_text() == card
    assert not list(tmp_path.glob("models/.agent.*")), "temporary folders must not remain"


def test_merge_replaces_the_previous_output_atomically(tmp_path, tiny_llama_dir):
    params = merge_params(tmp_path, tiny_llama_dir, lora=False)
    trained_checkpoint(params, lora=False)
    run_merge(params)
    (tmp_path / "models/agent/stale.txt").write_text("old")
    run_merge(params)
    assert not (tmp_path / "models/agent/stale.txt").exists()


def test_verification_fails_loudly_on_mismatched_logits(tmp_path, tiny_llama_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir))
    wrong = probe_logits(model, probe_input(tokenizer)) + 1.0
    with pytest.raises(MergeVerificationError, match="differ"):
        _verify(tiny_llama_dir, wrong, torch.float32)


def test_merge_without_checkpoint_is_a_user_error(tmp_path, tiny_llama_dir):
    from pipeline.errors import UserError

    with pytest.raises(UserError, match="no checkpoint"):
        run_merge(merge_params(tmp_path, tiny_llama_dir, lora=False))
    assert not (tmp_path / "models/agent").exists()


def test_verl_merge_command_and_checkpoint_lookup(tmp_path):
    (tmp_path / "global_step_10/actor").mkdir(parents=True)
    (tmp_path / "global_step_20/actor").mkdir(parents=True)
    assert ckpt.latest_verl_step(tmp_path) == tmp_path / "global_step_20/actor"
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("10")
    actor = ckpt.latest_verl_step(tmp_path)
    assert actor == tmp_path / "global_step_10/actor"
    cmd = verl_merge_command(actor, tmp_path / "out")
    assert cmd == [sys.executable, "-m", "verl.model_merger", "merge", "--backend", "fsdp",
                   "--local_dir", str(actor), "--target_dir", str(tmp_path / "out")]
