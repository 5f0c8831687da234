"""Where one model's weights are on this machine, verified: a local file or folder as it is, a Hub id's
snapshot folder in the Hugging Face cache (fetched on request).

A leaf below the environment servers, the verl trainer and `pipeline.weights` (which decides the models a run
needs and reports them all): each of them asks the same two questions about one model, "is its complete copy
here, and where" (`model_status`, `cached_location`), and starts the processes that load it with the same
offline variables (`OFFLINE_ENV`). It imports only the package root's leaves.

Decisions:
- **Verification** is structural, not a load: a model directory needs `config.json` and its weights (every
  shard an `*.index.json` lists, or at least one `*.safetensors`/`*.bin`); a GGUF must be a non-empty file
  starting with the `GGUF` magic. A load would cost minutes and GPU memory; a missing shard is what breaks.
- **Local forms** (`pkg://…`, a path) are verified where they are; only Hub ids are fetched.
- **Only what the loaders read** (`HUB_PATTERNS` minus `HUB_IGNORE`): openai/gpt-oss-20b also carries
  `original/` (the checkpoint in OpenAI's own format, ~13.8 GB) and `metal/` (Apple Metal), which neither
  vLLM nor transformers read; its top-level safetensors are what they load.
- **The processes that load weights run offline, on local paths**: once a model's check passed,
  `cached_location` gives its verified local folder (for a Hub id, the snapshot folder in the Hugging Face
  cache, found by `snapshot_download(local_files_only=True)`), and the vLLM server and verl's trainer and Ray
  workers are started on that path with `OFFLINE_ENV`. Set only for those processes, never globally: the
  data stages still read the Hub where the profile says so (the GPU profiles have no mirror).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pipeline.errors import UserError
from pipeline.modelref import ModelRefError, as_resolved

log = logging.getLogger("pipeline.weights")  # the fetch lines are `promptr1 weights`'s, under its logger

State = Literal["present", "fetched", "missing", "invalid"]
HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken", "tokenizer*"]
"""Files fetched from a Hub repository: config, tokenizer, safetensors weights (no *.bin / *.pth copies)."""
HUB_IGNORE = ["original/*", "metal/*"]
"""Folders no loader reads: GPT-OSS's original-format checkpoint (~13.8 GB) and its Metal weights."""
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
"""The environment of a process that loads verified weights: neither huggingface_hub nor transformers asks the
Hub (a missing file fails at once instead of a download inside a GPU job's startup)."""


@dataclass(frozen=True)
class ModelStatus:
    """What one model the params need looks like on this machine."""

    key: str
    """The params key that names it (e.g. `environment.model`)."""
    ref: str
    """The reference as written in params."""
    state: State
    detail: str
    """Where it is, or what is wrong / missing."""
    location: Path | None = None
    """The verified local file or folder (a Hub id's snapshot folder); None unless present or fetched."""

    @property
    def ok(self) -> bool:
        return self.state in ("present", "fetched")


def verify_local(location: Path) -> str | None:
    """None when `location` holds a complete model (see module docstring), else what is wrong."""
    if location.is_file():
        if location.suffix != ".gguf":
            return f"{location.name} is a file but not a .gguf model"
        with open(location, "rb") as handle:
            return None if handle.read(4) == b"GGUF" else f"{location.name} does not start with the GGUF magic"
    if not location.is_dir():
        return f"{location} does not exist"
    if not (location / "config.json").is_file() and not (location / "modules.json").is_file():
        return f"{location} has no config.json"
    for index in location.glob("*.index.json"):
        shards = set(json.loads(index.read_text(encoding="utf-8")).get("weight_map", {}).values())
        missing = sorted(s for s in shards if not (location / s).is_file())
        if missing:
            return f"{index.name} lists shards that are missing: {missing}"
        return None
    if any(location.rglob("*.safetensors")) or any(location.rglob("*.bin")):
        return None
    return f"{location} has no weights (*.safetensors or *.bin)"


def _hub_snapshot(repo_id: str, *, fetch: bool) -> Path | None:
    """The local snapshot folder of a Hub model; downloaded (with tqdm progress) when `fetch`, else cache only."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_PATTERNS, ignore_patterns=HUB_IGNORE,
                                      local_files_only=not fetch))
    except LocalEntryNotFoundError:
        if fetch:
            raise
        return None


def model_status(key: str, ref: str, root: Path, *, fetch: bool) -> ModelStatus:
    """Resolve, (fetch,) and verify one model (`ref` relative to the project `root`)."""
    try:
        resolved = as_resolved(ref, root)
    except ModelRefError as exc:
        return ModelStatus(key, ref, "missing", str(exc))
    if resolved.is_local:
        problem = verify_local(Path(resolved.location))
        if problem:
            return ModelStatus(key, ref, "invalid", problem)
        return ModelStatus(key, ref, "present", resolved.location, Path(resolved.location))
    snapshot = _hub_snapshot(resolved.location, fetch=False)
    state: State = "present"
    if snapshot is None and fetch:
        log.info("fetching %s (%s) from the Hugging Face Hub", ref, key)
        try:
            snapshot = _hub_snapshot(resolved.location, fetch=True)
        except (OSError, ValueError) as exc:  # offline, network, auth, unknown repo: reported per model
            return ModelStatus(key, ref, "missing", f"download failed: {type(exc).__name__}: {exc}")
        state = "fetched"
    if snapshot is None:
        return ModelStatus(key, ref, "missing", "not in the Hugging Face cache (run `promptr1 weights`)")
    problem = verify_local(snapshot)
    if problem:
        return ModelStatus(key, ref, "invalid", problem)
    return ModelStatus(key, ref, state, str(snapshot), snapshot)


def cached_location(key: str, ref: str, root: Path) -> Path:
    """The verified local copy of the model `ref` (params key `key`) for a process that runs with `OFFLINE_ENV`:
    a local file or folder as it is, a Hub id's snapshot folder in the Hugging Face cache. Looks only on this
    machine; raises UserError naming the key and `promptr1 weights` when the model is missing or incomplete."""
    status = model_status(key, ref, root, fetch=False)
    if status.location is None:
        raise UserError(f"{key}={ref!r} is {status.state} on this machine ({status.detail}): run `promptr1 weights` "
                        "first (the processes that load it run offline)")
    return status.location
