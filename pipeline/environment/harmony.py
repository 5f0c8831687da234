"""GPT-OSS on vLLM: the harmony encoding file, fetched with the weights so the server starts on an offline
node, and where harmony puts our instruction.

vLLM renders and parses GPT-OSS conversations with `openai_harmony`, whose `load_harmony_encoding(
HARMONY_GPT_OSS)` needs tiktoken's `o200k_base.tiktoken` vocabulary. That file is not in the model's Hub
repository and `HF_HUB_OFFLINE` does not cover it: harmony (Rust) downloads it from
openaipublic.blob.core.windows.net when the server starts and fails without network ("error downloading or
loading vocab file", vLLM issue 22525). Read from openai/harmony's `src/tiktoken_ext/public_encodings.rs`:
- with `TIKTOKEN_ENCODINGS_BASE` set, harmony loads `<that folder>/o200k_base.tiktoken` and checks its
  sha256 (below), never the network; without it, it downloads into `TIKTOKEN_RS_CACHE_DIR` (default: a
  folder under the system temp dir) under a hash of the URL;
- the GPT-OSS encoding (`O200kHarmony`, `src/registry.rs`) reads `o200k_base.tiktoken` only; `cl100k_base`
  is another encoding, not fetched.

So `promptr1 weights` fetches the file (when vLLM serves a GPT-OSS environment on this machine), verifies its sha256, and the
server is started with `TIKTOKEN_ENCODINGS_BASE` pointing at it (pipeline/environment/servers.py). Where:
`$TIKTOKEN_ENCODINGS_BASE` if the operator set it (a shared or pre-filled folder), else
`<HF_HOME>/tiktoken-encodings`, beside the Hub cache that holds the weights, so a copied or shared cache
brings it along.

**Our instruction is GPT-OSS's developer message.** GPT-OSS reads instructions from harmony's developer
message; its system message carries the model identity, reasoning effort, date and channels. The client
sends the method's instruction as the first chat message with role `system` (`EnvironmentClient.messages`,
the same request for every backend). Read from vLLM 0.24.0's source (the version constraints/gpu.txt pins):
its chat-completions path for GPT-OSS (`vllm/entrypoints/serve/render/serving.py`
`_make_request_with_harmony`) peels a leading `system` or `developer` message off
(`vllm/entrypoints/openai/parser/harmony_utils.py` `extract_instructions_from_messages`, vLLM PR 44330) and
`build_harmony_preamble` renders it as the developer message's `# Instructions`, after a system message with
harmony's default identity, the reasoning effort, the date and the channels. A `system` and a `developer` first message render identically,
so the role stays `system` (before that PR, by its description, the message was rendered separately after
the harmony preamble). The one switch that moves the instruction into the system message's model identity is
`VLLM_GPT_OSS_HARMONY_SYSTEM_INSTRUCTIONS=1` (`vllm/envs.py`, default off): the server the pipeline starts gets
it set to 0 (`harmony_server_env`), whatever the operator's shell holds.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.environment.budget import is_gpt_oss
from pipeline.placement import started_here

if TYPE_CHECKING:
    from pipeline.config import EnvironmentConfig

log = logging.getLogger(__name__)

ENCODINGS_VARIABLE = "TIKTOKEN_ENCODINGS_BASE"
"""The variable harmony reads the folder of local encoding files from."""
ENCODINGS_URL = "https://openaipublic.blob.core.windows.net/encodings/"
"""Where harmony itself downloads them from (public_encodings.rs: DEFAULT_TIKTOKEN_BASE_URL)."""
ENCODING_FILES = {"o200k_base.tiktoken": "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"}
"""File → sha256, as harmony checks it (public_encodings.rs: Encoding::expected_hash)."""
DOWNLOAD_TIMEOUT_S = 120.0
SYSTEM_INSTRUCTIONS_VARIABLE = "VLLM_GPT_OSS_HARMONY_SYSTEM_INSTRUCTIONS"
"""vLLM's switch that renders a leading system/developer instruction into harmony's system message (off: the
developer message, where GPT-OSS reads instructions)."""


def needs_harmony(env: EnvironmentConfig) -> bool:
    """Whether the server the pipeline starts loads the harmony encoding: vLLM serving a GPT-OSS model on this
    machine. An environment at a `base_url` elsewhere (the paper's second node) loads it there, not here."""
    return env.backend == "vllm" and is_gpt_oss(env) and started_here(env)


def encodings_dir() -> Path:
    """The folder holding the encoding files (see module docstring)."""
    configured = os.environ.get(ENCODINGS_VARIABLE)
    if configured:
        return Path(configured)
    from huggingface_hub import constants

    return Path(constants.HF_HOME) / "tiktoken-encodings"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def verify_encodings(folder: Path) -> str | None:
    """None when every encoding file is in `folder` with harmony's sha256, else what is missing or wrong."""
    problems = []
    for name, expected in ENCODING_FILES.items():
        path = folder / name
        if not path.is_file():
            problems.append(f"{path} is missing")
        elif _sha256(path) != expected:
            problems.append(f"{path} does not have harmony's sha256 {expected[:12]}…")
    return "; ".join(problems) or None


def fetch_encodings(folder: Path) -> None:
    """Download every missing or wrong encoding file into `folder` (atomically: a temp file, checked, renamed).

    Raises OSError (network, disk) or ValueError (the download has another sha256).
    """
    import httpx

    folder.mkdir(parents=True, exist_ok=True)
    for name, expected in ENCODING_FILES.items():
        target = folder / name
        if target.is_file() and _sha256(target) == expected:
            continue
        partial = folder / f".{name}.partial-{os.getpid()}"
        url = ENCODINGS_URL + name
        log.info("fetching %s (GPT-OSS harmony encoding) into %s", url, folder)
        try:
            with httpx.stream("GET", url, timeout=DOWNLOAD_TIMEOUT_S, follow_redirects=True) as response:
                response.raise_for_status()
                with open(partial, "wb") as handle:
                    handle.writelines(response.iter_bytes())
        except httpx.HTTPError as exc:
            partial.unlink(missing_ok=True)
            raise OSError(f"{url}: {type(exc).__name__}: {exc}") from exc
        got = _sha256(partial)
        if got != expected:
            partial.unlink(missing_ok=True)
            raise ValueError(f"{url} has sha256 {got}, not harmony's {expected}")
        os.replace(partial, target)


def harmony_server_env() -> dict[str, str]:
    """The vLLM server environment for GPT-OSS: harmony reads the local encoding files instead of the network,
    and our instruction renders as the developer message (module docstring)."""
    return {ENCODINGS_VARIABLE: str(encodings_dir().resolve()), SYSTEM_INSTRUCTIONS_VARIABLE: "0"}
