"""Weights before GPU time: fetch and verify every model the merged params need, before anything starts.

A GPT-OSS-20B environment is ~13 GB and a Qwen3-4B agent ~8 GB; downloading them inside vLLM's startup
timeout, while 16 GPUs wait, is the wrong place. `promptr1 weights` (pipeline/commands/weights.py, and the
flow's task before training) puts every model into the Hugging Face cache first, with progress, and verifies what it got;
`promptr1 weights --check` only reports what is missing (exit 2), so a scheduler can gate a GPU job on it.
Servers and trainers then start with `HF_HUB_OFFLINE=1`.

Decisions:
- **Which models** follow from the active components only: the agent (`agent.model`), the environment
  (`environment.model`) when the pipeline serves it itself on this machine (llamacpp, vllm; a paid API, or a
  server at an `environment.base_url` elsewhere, as on the paper's training node, needs nothing here), and
  the SSim embedding model (`evaluate.ssim_model`). Each is reported under the params key that names it.
  `RequiredWeights.needed_by` decides them once from the three sections; the checks below take that list.
- **Verification** is structural, not a load: a model directory needs `config.json` and its weights (every
  shard an `*.index.json` lists, or at least one `*.safetensors`/`*.bin`); a GGUF must be a non-empty file
  starting with the `GGUF` magic. A load would cost minutes and GPU memory; a missing shard is what breaks.
- **Local forms** (`pkg://…`, a path) are verified where they are; only Hub ids are fetched.
- **Only what the loaders read** (`HUB_PATTERNS` minus `HUB_IGNORE`): openai/gpt-oss-20b also carries
  `original/` (the checkpoint in OpenAI's own format, ~13.8 GB) and `metal/` (Apple Metal), which neither
  vLLM nor transformers read; its top-level safetensors are what they load.
- **GPT-OSS's harmony encoding** (`o200k_base.tiktoken`, not in the model repository) is fetched and checked
  with the weights when vLLM serves a GPT-OSS environment here (pipeline/environment/harmony.py), reported as
  one more line under `environment.model`; without it vLLM cannot start offline.
- **The processes that load weights run offline, on local paths**: once a model's check passed here,
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
from typing import TYPE_CHECKING, Literal

from pipeline.errors import UserError
from pipeline.modelref import ModelRefError, as_resolved
from pipeline.placement import started_here

if TYPE_CHECKING:
    from pipeline.config import AgentConfig, EnvironmentConfig, EvaluateConfig

log = logging.getLogger(__name__)

State = Literal["present", "fetched", "missing", "invalid"]
HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken", "tokenizer*"]
"""Files fetched from a Hub repository: config, tokenizer, safetensors weights (no *.bin / *.pth copies)."""
HUB_IGNORE = ["original/*", "metal/*"]
"""Folders no loader reads: GPT-OSS's original-format checkpoint (~13.8 GB) and its Metal weights."""
HARMONY_KEY = "environment.model"
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


def required_models(agent: AgentConfig, environment: EnvironmentConfig, evaluate: EvaluateConfig) -> dict[str, str]:
    """Params key → model reference, for the models the active components load."""
    needed = {"agent.model": agent.model}
    if environment.backend in ("llamacpp", "vllm") and started_here(environment):
        needed["environment.model"] = environment.model
    needed["evaluate.ssim_model"] = evaluate.ssim_model
    return needed


@dataclass(frozen=True)
class RequiredWeights:
    """The models a run loads on this machine (module docstring: which), as the weights checks take them."""

    models: tuple[tuple[str, str], ...]
    """(params key, model reference) for each model, in `required_models`' order."""
    root: Path
    """The project root: relative references are resolved against it."""
    harmony: bool
    """Whether GPT-OSS's harmony encoding is needed too (vLLM serves a GPT-OSS environment here)."""

    @classmethod
    def needed_by(cls, agent: AgentConfig, environment: EnvironmentConfig, evaluate: EvaluateConfig,
           root: Path) -> RequiredWeights:
        from pipeline.environment.harmony import needs_harmony

        return cls(models=tuple(required_models(agent, environment, evaluate).items()), root=root,
                   harmony=needs_harmony(environment))


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


def harmony_status(*, fetch: bool) -> ModelStatus:
    """GPT-OSS's harmony encoding file(s) for vLLM: present, fetched, or missing (pipeline.environment.harmony)."""
    from pipeline.environment import harmony

    folder = harmony.encodings_dir()
    ref = "harmony encoding " + ", ".join(harmony.ENCODING_FILES)
    problem = harmony.verify_encodings(folder)
    if problem is None:
        return ModelStatus(HARMONY_KEY, ref, "present", str(folder))
    if not fetch:
        return ModelStatus(HARMONY_KEY, ref, "missing", f"{problem} (run `promptr1 weights`)")
    try:
        harmony.fetch_encodings(folder)
    except (OSError, ValueError) as exc:
        return ModelStatus(HARMONY_KEY, ref, "missing", f"download failed: {exc}")
    return ModelStatus(HARMONY_KEY, ref, "fetched", str(folder))


def ensure_weights(required: RequiredWeights, *, fetch: bool = True) -> list[ModelStatus]:
    """Every required model: present, fetched, missing or invalid (never raises for one model)."""
    statuses = [model_status(key, ref, required.root, fetch=fetch) for key, ref in required.models]
    if required.harmony:
        statuses.append(harmony_status(fetch=fetch))
    return statuses
