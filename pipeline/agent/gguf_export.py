"""Write a trained (merged) agent as a GGUF file, so llama.cpp's server can run it at evaluation time.

On a CPU the agent's own generation is the evaluation's largest cost: the in-process transformers loop
re-reads the whole conversation at every turn and decodes at ~30 tokens/s for a batch of four, while
llama.cpp's server keeps each slot's KV cache between the turns of a conversation (prompt caching),
decodes the busy slots together and runs the same 135M model several times faster (figures:
benchmarks/results/agent_server.json). `promptr1 evaluate` therefore serves the merged agent through
llama.cpp when `evaluate.agent_engine: llama.cpp` (the default profile); GPU profiles keep the in-process
model (`transformers`).

Scope and design decisions:
- **Llama-architecture agents whose base model is a GGUF file** (the default profile's SmolLM2-135M-Instruct
  Q4_1). The base GGUF is the template: its metadata (architecture numbers, tokenizer, chat template) is
  copied unchanged and only the tensors are replaced by the merged model's. The merged model's shapes must
  match the template's, tensor by tensor; anything else is refused with the first mismatch named.
  An agent from the Hub in Hugging Face format has no template here: use `evaluate.agent_engine:
  transformers` (or vLLM on GPU nodes).
- **Q and K are permuted back** to llama.cpp's rotary layout. transformers un-permutes them when it reads a
  GGUF (`reverse_permute_weights`), so the merged model holds the Hugging Face layout; writing it unchanged
  would scramble attention. `tests/test_gguf_export.py` checks the round trip with llama.cpp's logits.
- **Matrices in F16 by default** (`evaluate.agent_gguf_dtype`: f16 | f32 | bf16); norms stay F32, as
  llama.cpp's own converter writes them. F16 halves what each decode step reads; the test bounds its
  logit difference from F32.
- **Written atomically**: to a temporary file beside the target, renamed when complete; a reader never sees
  half a file. Exports are cached under `<paths.cache_dir>/agent_gguf/`, named by a hash of the weights
  file(s) and the dtype, so evaluating the same merged model again reuses its export; older exports are
  removed (the newest `KEEP_EXPORTS` stay).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

from pipeline.errors import UserError
from pipeline.paths import display_path

logger = logging.getLogger(__name__)

EXPORT_VERSION = 1
"""Part of the cache key: bump when the written file would change for the same weights."""
KEEP_EXPORTS = 3
DTYPES = ("f16", "f32", "bf16", "q8_0")

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_TOP_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_FILE_TYPES = {"f32": 0, "f16": 1, "q8_0": 7, "bf16": 32}  # llama_ftype: ALL_F32, MOSTLY_F16, MOSTLY_Q8_0, MOSTLY_BF16


class GGUFExportError(UserError):
    """The merged model cannot be written as a GGUF file (names the model and the first problem)."""


def gguf_name(hf_name: str) -> str | None:
    """The llama.cpp tensor name of a Hugging Face Llama tensor (None: not a weight llama.cpp reads)."""
    if hf_name in _TOP_NAMES:
        return _TOP_NAMES[hf_name]
    m = _LAYER.match(hf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"blk.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    return None


def permute_rotary(weight: Any, n_head: int) -> Any:
    """Hugging Face -> llama.cpp row order of a Q or K projection (llama.cpp's converter's `permute`)."""
    rows = weight.shape[0]
    return (weight.reshape(n_head, 2, rows // n_head // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _weight_files(model_dir: Path) -> list[Path]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise GGUFExportError(f"{model_dir}: no *.safetensors weights to export (a merged agent directory holds "
                              "model.safetensors)")
    return files


def export_key(model_dir: Path, dtype: str) -> str:
    """Hash of the weights files, the dtype and EXPORT_VERSION: the cached export's name."""
    h = hashlib.sha256(f"v{EXPORT_VERSION}:{dtype}".encode())
    for path in _weight_files(model_dir):
        h.update(path.name.encode())
        with open(path, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 22), b""):
                h.update(block)
    return h.hexdigest()[:16]


def _load_hf_tensors(model_dir: Path) -> dict[str, Any]:
    """name -> float32 numpy array of every weights file (through torch: numpy has no bfloat16)."""
    import torch
    from safetensors.torch import load_file

    out: dict[str, Any] = {}
    for path in _weight_files(model_dir):
        try:
            tensors = load_file(str(path))
        except Exception as exc:  # the safetensors error names little; ours names the file
            raise GGUFExportError(f"{path}: cannot read as safetensors ({exc})") from exc
        out.update((name, tensor.to(torch.float32).numpy()) for name, tensor in tensors.items())
    return out


def export_gguf(model_dir: str | Path, template_gguf: str | Path, out_path: str | Path, dtype: str = "f16") -> Path:
    """Write the merged Llama model in `model_dir` as GGUF at `out_path`, with `template_gguf`'s metadata.

    Raises GGUFExportError naming the file and the first mismatch (architecture, layer count, a missing or
    differently shaped tensor). The file appears complete or not at all.
    """
    model_dir = Path(model_dir)
    if dtype not in DTYPES:
        raise GGUFExportError(f"evaluate.agent_gguf_dtype={dtype!r}: expected one of {', '.join(DTYPES)}")
    try:
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise GGUFExportError(f"{model_dir / 'config.json'}: cannot read the model config ({exc})") from exc
    return write_gguf(config, lambda: _load_hf_tensors(model_dir), template_gguf, out_path, dtype, str(model_dir))


def export_model(model: Any, template_gguf: str | Path, out_path: str | Path, dtype: str = "f16") -> Path:
    """Write an in-memory transformers Llama (`model`, e.g. the policy being trained) as GGUF at `out_path`:
    `export_gguf` without saving the model first (its state dict is read in float32)."""
    import torch

    if dtype not in DTYPES:
        raise GGUFExportError(f"GGUF dtype {dtype!r}: expected one of {', '.join(DTYPES)}")

    def tensors() -> dict[str, Any]:
        with torch.no_grad():
            return {name: t.detach().to(torch.float32).cpu().numpy() for name, t in model.state_dict().items()}

    return write_gguf(model.config.to_dict(), tensors, template_gguf, out_path, dtype, f"the {type(model).__name__}")


def write_gguf(config: dict[str, Any], tensors: Any, template_gguf: str | Path, out_path: str | Path, dtype: str,
               source: str) -> Path:
    """The export itself: `config` (a Hugging Face config dict) and `tensors()` (name -> float32 array, by
    Hugging Face names) checked against `template_gguf` and written atomically; `source` names the model in
    errors."""
    import gguf

    template_gguf, out_path = Path(template_gguf), Path(out_path)
    if config.get("model_type") != "llama":
        raise GGUFExportError(
            f"{source}: model_type {config.get('model_type')!r}; the GGUF export writes Llama models only "
            "(set evaluate.agent_engine: transformers for this agent)")
    reader = gguf.GGUFReader(str(template_gguf))
    n_head, n_head_kv = _check_architecture(config, reader, template_gguf, source)
    by_gguf, shapes = _match_tensors(tensors(), reader, template_gguf, source)
    names = list(shapes)
    if "output.weight" in by_gguf and "output.weight" not in shapes and not config.get("tie_word_embeddings"):
        names.append("output.weight")  # an untied head the quantised template did not store
    arrays = {name: _rotary_layout(name, by_gguf[name][1], n_head, n_head_kv) for name in names}
    _write_atomically(reader, arrays, dtype, out_path)
    return out_path


def _check_architecture(config: dict[str, Any], reader: Any, template_gguf: Path, source: str) -> tuple[int, int]:
    """Refuse a model whose architecture numbers differ from the template's; returns the template's attention
    and KV head counts."""
    arch = reader.fields["general.architecture"].contents()
    if arch != "llama":
        raise GGUFExportError(f"{template_gguf}: architecture {arch!r}, expected llama")
    n_head = int(reader.fields["llama.attention.head_count"].contents())
    n_head_kv = int(reader.fields["llama.attention.head_count_kv"].contents())
    if config.get("num_attention_heads") != n_head or config.get("num_key_value_heads", n_head) != n_head_kv:
        raise GGUFExportError(
            f"{source}: {config.get('num_attention_heads')}/{config.get('num_key_value_heads')} attention/KV "
            f"heads, the template {template_gguf.name} has {n_head}/{n_head_kv}: not the same architecture")

    theta = config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta")
    checks = [("num_hidden_layers", config.get("num_hidden_layers"), "llama.block_count"),
              ("hidden_size", config.get("hidden_size"), "llama.embedding_length"),
              ("rope_theta", theta, "llama.rope.freq_base"),
              ("rms_norm_eps", config.get("rms_norm_eps"), "llama.attention.layer_norm_rms_epsilon")]
    for key, ours, field in checks:
        theirs = reader.fields[field].contents() if field in reader.fields else None
        if ours is not None and theirs is not None and abs(float(ours) - float(theirs)) > 1e-6 * abs(float(theirs)):
            raise GGUFExportError(f"{source}: config {key}={ours}, the template {template_gguf.name} has "
                                  f"{field}={theirs}: not the same architecture")
    return n_head, n_head_kv


def _match_tensors(hf: dict[str, Any], reader: Any, template_gguf: Path,
                   source: str) -> tuple[dict[str, tuple[str, Any]], dict[str, tuple[int, ...]]]:
    """The model's tensors by llama.cpp name (name -> (Hugging Face name, array)) and the template's shapes
    (numpy order); refuses a missing, differently shaped or extra tensor."""
    by_gguf = {gguf_name(name): (name, array) for name, array in hf.items() if gguf_name(name)}
    shapes = {t.name: tuple(int(x) for x in reversed(t.shape)) for t in reader.tensors}  # ggml -> numpy order
    for name, shape in shapes.items():
        if name not in by_gguf:
            raise GGUFExportError(f"{source}: no tensor for {name} of {template_gguf.name}")
        got = tuple(by_gguf[name][1].shape)
        if got != shape:
            raise GGUFExportError(f"{source}: {by_gguf[name][0]} has shape {got}, {template_gguf.name}'s "
                                  f"{name} has {shape}")
    extra = sorted(set(by_gguf) - set(shapes) - {"output.weight"})
    if extra:
        raise GGUFExportError(f"{source}: tensors the template has no place for: {extra[:5]}")
    return by_gguf, shapes


def _rotary_layout(name: str, array: Any, n_head: int, n_head_kv: int) -> Any:
    """`array` in llama.cpp's layout: Q and K projections permuted back to its rotary row order."""
    if name.endswith("attn_q.weight"):
        return permute_rotary(array, n_head)
    if name.endswith("attn_k.weight"):
        return permute_rotary(array, n_head_kv)
    return array


def _write_atomically(reader: Any, arrays: dict[str, Any], dtype: str, out_path: Path) -> None:
    """Write the template's metadata and `arrays` (llama.cpp names, in file order) to a temporary file beside
    `out_path`, renamed to it when complete."""
    import gguf

    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(f".{out_path.name}.{os.getpid()}.tmp")
    writer = gguf.GGUFWriter(str(tmp), arch="llama")
    try:
        for key, field in reader.fields.items():
            if key.startswith("GGUF.") or key in {"general.architecture", "general.file_type"}:
                continue
            sub = field.types[1] if len(field.types) > 1 else None
            writer.add_key_value(key, field.contents(), field.types[0], sub)
        writer.add_file_type(_FILE_TYPES[dtype])
        for name, array in arrays.items():
            _add_tensor(writer, name, array, dtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, out_path)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise


def _add_tensor(writer: Any, name: str, array: Any, dtype: str) -> None:
    """One tensor in `dtype`: vectors (norms) always F32, matrices F32, F16, or packed BF16 / Q8_0."""
    import gguf
    import numpy as np

    if array.ndim == 1 or dtype == "f32":
        writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
    elif dtype == "f16":
        writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float16))
    else:
        kind = gguf.GGMLQuantizationType.BF16 if dtype == "bf16" else gguf.GGMLQuantizationType.Q8_0
        packed = gguf.quants.quantize(np.ascontiguousarray(array, dtype=np.float32), kind)
        writer.add_tensor(name, packed, raw_dtype=kind)  # the packed bytes' shape gives the row size


def cached_export(model_dir: str | Path, template_gguf: str | Path, cache_root: str | Path, dtype: str = "f16",
                  root: Path | None = None) -> Path:
    """The GGUF export of `model_dir` under `<cache_root>/agent_gguf/`, written if not there yet."""
    model_dir = Path(model_dir)
    folder = Path(cache_root) / "agent_gguf"
    target = folder / f"agent-{export_key(model_dir, dtype)}-{dtype}.gguf"
    if target.exists():
        logger.info("agent GGUF export reused: %s", display_path(target, root or Path.cwd()))
        return target
    export_gguf(model_dir, template_gguf, target, dtype)
    logger.info("agent exported to GGUF (%s, %.0f MB): %s", dtype, target.stat().st_size / 1e6,
                display_path(target, root or Path.cwd()))
    old = sorted(folder.glob("agent-*.gguf"), key=lambda p: p.stat().st_mtime, reverse=True)[KEEP_EXPORTS:]
    for path in old:
        path.unlink(missing_ok=True)
    return target
