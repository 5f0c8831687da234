"""Untrusted text made safe to record: what the environment wrote, before it reaches MLflow or a DVC output.

An environment reply is text from a model or a server the pipeline does not control. It reaches MLflow
(traces, the predictions table, the trajectory and GEPA artifacts) only through `sanitize_text` (or
`sanitize_value`, which applies it to every string of a JSON-like value). The DVC outputs that keep the
replies whole (`reports/eval/predictions.parquet`, `reports/train/trajectories.jsonl`) go through
`redact_secrets` / `redact_value` only: the same secret redaction, no escaping, no cap, since they are
the full data a later analysis rescores. Design decisions:

- **Secrets first.** Substrings that look like credentials are replaced by `[REDACTED]` before anything
  else, so a cut can never leave half a key behind: `Bearer …` tokens, OpenAI-style `sk-…` keys, GitHub,
  Hugging Face, AWS, Google and Slack tokens, JWTs, `api_key=…` / `password: …` / `token=…` assignments,
  credentials in URLs (`https://user:pass@host`), and the literal value of every key this process read
  (`register_secret`, called where the API key is read), whatever its shape.
- **Control characters escaped, terminal sequences removed.** ANSI/VT escape sequences (CSI, OSC and
  two-character escapes) are dropped whole; every other C0/C1 control character, NUL included, becomes
  a visible `\\xNN` (newline and tab stay); lone surrogates become U+FFFD. Nothing left can drive a
  terminal, end a C string early or break a JSON or SQLite consumer.
- **Length capped with a marker**: at most `MAX_RECORDED_CHARS` characters are kept, followed by
  `…[cut: N more characters]`, so a 4 MiB reply cannot fill the tracking store.
- Pure functions of text, stdlib only (it imports nothing of the pipeline): stages call it too.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

MAX_RECORDED_CHARS = 16_384
REDACTED = "[REDACTED]"
_MIN_SECRET_LEN = 8

_SECRET_PATTERNS = [
    re.compile(r"(?i)\b(bearer|basic)\s+[A-Za-z0-9._~+/=-]{8,}"),
    re.compile(r"\bsk-[A-Za-z0-9_-]{12,}"),
    re.compile(r"\b(?:gh[pousr]|github_pat)_[A-Za-z0-9_]{20,}"),
    re.compile(r"\bhf_[A-Za-z0-9]{20,}"),
    re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"),
    re.compile(r"\bAIza[0-9A-Za-z_-]{30,}"),
    re.compile(r"\bxox[abposr]-[A-Za-z0-9-]{10,}"),
    re.compile(r"\beyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}"),
    re.compile(r"(?i)(?<=://)[^/\s:@]+:[^/\s@]+(?=@)"),
]
_ASSIGNMENT = re.compile(
    r"(?i)\b((?:api[_-]?key|access[_-]?key|secret(?:[_-]?key)?|password|passwd|token|auth(?:orization)?)"
    r"[\"']?\s*[:=]\s*[\"']?)(?!(?i:bearer|basic)\s|\[REDACTED\])[^\s\"',;]{6,}")
_ANSI = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)?|[@-Z\\-_])|\x9b[0-?]*[ -/]*[@-~]")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_SURROGATE = re.compile(r"[\ud800-\udfff]")
_known_secrets: set[str] = set()


def register_secret(value: str) -> None:
    """Redact this exact value (a key this process read) from everything sanitised from now on."""
    if len(value) >= _MIN_SECRET_LEN:
        _known_secrets.add(value)


def redact_secrets(text: str) -> str:
    """`text` with every registered key and secret-looking substring replaced by `[REDACTED]`, nothing else."""
    for secret in sorted(_known_secrets, key=len, reverse=True):
        text = text.replace(secret, REDACTED)
    for pattern in _SECRET_PATTERNS:
        text = pattern.sub(lambda m: f"{m.group(1)} {REDACTED}" if m.lastindex else REDACTED, text)
    return _ASSIGNMENT.sub(lambda m: m.group(1) + REDACTED, text)


def redact_value(value: Any) -> Any:
    """`value` with `redact_secrets` applied to every string in it (dict keys included; other types kept)."""
    return _map_strings(value, redact_secrets)


def sanitize_text(text: str, max_chars: int = MAX_RECORDED_CHARS) -> str:
    """`text` with secrets redacted, terminal sequences removed, control characters escaped, length capped."""
    text = _ANSI.sub("", redact_secrets(text))
    text = _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)
    text = _SURROGATE.sub("\ufffd", text)
    if len(text) > max_chars:
        text = f"{text[:max_chars]}…[cut: {len(text) - max_chars} more characters]"
    return text


def sanitize_value(value: Any, max_chars: int = MAX_RECORDED_CHARS) -> Any:
    """`value` with `sanitize_text` applied to every string in it (dict keys included; other types kept)."""
    return _map_strings(value, lambda text: sanitize_text(text, max_chars))


def _map_strings(value: Any, fn: Callable[[str], str]) -> Any:
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, dict):
        return {_map_strings(k, fn): _map_strings(v, fn) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_map_strings(v, fn) for v in value)
    return value


def sanitized_json_copy(source: Path, dest_dir: Path) -> Path:
    """A sanitised copy of a JSON or JSON Lines file, same name, in `dest_dir` (for logging as an artifact)."""
    dest = dest_dir / source.name
    text = source.read_text(encoding="utf-8", errors="replace")
    if source.suffix == ".jsonl":
        lines = (json.dumps(sanitize_value(json.loads(line)), ensure_ascii=False)
                 for line in text.splitlines() if line.strip())
        dest.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
    else:
        dest.write_text(json.dumps(sanitize_value(json.loads(text)), ensure_ascii=False, indent=2), encoding="utf-8")
    return dest


__all__ = ["MAX_RECORDED_CHARS", "REDACTED", "redact_secrets", "redact_value", "register_secret", "sanitize_text",
           "sanitize_value", "sanitized_json_copy"]
