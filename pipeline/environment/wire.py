"""The OpenAI chat-completions wire format, read defensively: bodies, finish reasons, Retry-After.

`parse_completion` checks a 200 body field by field and raises `MalformedReply` for anything that is not a
chat completion (truncated JSON, an HTML page from a proxy, no choices, non-text content, a body over
`MAX_BODY_BYTES`), so the client can count and retry it instead of crashing mid-trajectory.
"""

from __future__ import annotations

import email.utils
import json
import time
from typing import Any

MAX_BODY_BYTES = 4 * 1024 * 1024
"""Largest chat-completion body accepted (4 MiB; a 2,048-token reply is ~10 KB)."""


class MalformedReply(Exception):
    """The endpoint answered 200 with a body that is not a chat completion."""


def parse_completion(body: bytes) -> tuple[str, int, int, str | None]:
    """(text, prompt tokens, completion tokens, finish_reason) of a chat completion; MalformedReply if not one."""
    if len(body) > MAX_BODY_BYTES:
        raise MalformedReply(f"body of {len(body):,} bytes exceeds the {MAX_BODY_BYTES:,}-byte limit")
    try:
        data = json.loads(body)
    except ValueError as exc:  # truncated JSON, HTML from a proxy, …
        raise MalformedReply(f"body is not JSON ({exc}): {shorten(body.decode('utf-8', 'replace'), 80)}") from None
    if not isinstance(data, dict):
        raise MalformedReply(f"body is JSON {type(data).__name__}, not an object")
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise MalformedReply("no choices in the completion")
    message = choices[0].get("message")
    content = message.get("content") if isinstance(message, dict) else None
    if content is not None and not isinstance(content, str):
        raise MalformedReply(f"message content is {type(content).__name__}, not text")
    usage = data.get("usage") if isinstance(data.get("usage"), dict) else {}
    try:
        prompt_tokens = int(usage.get("prompt_tokens") or 0)
        completion_tokens = int(usage.get("completion_tokens") or 0)
    except (TypeError, ValueError):
        prompt_tokens = completion_tokens = 0
    finish = choices[0].get("finish_reason")
    return content or "", prompt_tokens, completion_tokens, finish if isinstance(finish, str) else None


def retry_after_seconds(response: Any) -> float | None:
    """Seconds from a `Retry-After` (or `retry-after-ms`) header: delta-seconds or an HTTP date."""
    headers = getattr(response, "headers", None) or {}
    if ms := headers.get("retry-after-ms"):
        try:
            return max(0.0, float(ms) / 1000)
        except ValueError:
            pass
    value = headers.get("retry-after")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def shorten(text: str, limit: int = 160) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


