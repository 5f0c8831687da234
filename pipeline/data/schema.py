"""The normalised row schema every data stage speaks, plus the helpers they share.

- One schema for every dataset (`SAMPLED_SCHEMA`): id, question, answers (list of strings), context,
  task_type, source_split, dataset. Written with an explicit Arrow schema, no pandas metadata and fixed
  compression, so the same rows give the same bytes (the sample stage's determinism test relies on it).
- `question_key` is the one normalisation used for leakage and overlap checks: Unicode NFKC, case-fold,
  every run of non-word characters (punctuation, whitespace) collapsed to one space. It is stricter
  than exact text (catches "Sitting Bull'S" vs "Sitting Bull's", extra spaces) but never merges two
  questions that differ in a word.
- `estimate_tokens` is the cheap token count used for the question-length budget: UTF-8 bytes / 3,
  rounded up. English BPE tokenizers average about 4 characters per token, so this over-counts
  English (errs towards flagging) and is about one token per character for CJK text; it needs no
  tokenizer load (the agent tokenizer would cost seconds per stage for a check that is nowhere near
  its limit: the longest question here is ~3,300 bytes against a 4,096-token budget).
- Writes are atomic: a temporary file in the same folder, then `os.replace`, so a killed stage never
  leaves a half-written output that DVC or the next stage could mistake for a result.
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
import unicodedata
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

COLUMNS = ["id", "question", "answers", "context", "task_type", "source_split", "dataset"]

SAMPLED_SCHEMA = pa.schema(
    [
        pa.field("id", pa.string(), nullable=False),
        pa.field("question", pa.string(), nullable=False),
        pa.field("answers", pa.list_(pa.string()), nullable=False),
        pa.field("context", pa.string(), nullable=False),
        pa.field("task_type", pa.string(), nullable=False),
        pa.field("source_split", pa.string(), nullable=False),
        pa.field("dataset", pa.string(), nullable=False),
    ]
)

_FILE_MODE = 0o644  # mkstemp creates 0600; outputs are ordinary shared files

_NON_WORD = re.compile(r"[\W_]+", re.UNICODE)


def question_key(text: str) -> str:
    """Normalised form of a question for leakage/overlap comparison."""
    folded = unicodedata.normalize("NFKC", text).casefold()
    return " ".join(_NON_WORD.sub(" ", folded).split())


def estimate_tokens(text: str) -> int:
    """Cheap upper-leaning token estimate: ceil(UTF-8 bytes / 3)."""
    return math.ceil(len(text.encode("utf-8")) / 3)


def _atomic_target(path: Path) -> tuple[int, Path]:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    return fd, Path(tmp)


def write_parquet_atomic(table: pa.Table, path: Path) -> None:
    """Write `table` to `path` (zstd, no pandas metadata) via a temporary file and a rename."""
    fd, tmp = _atomic_target(path)
    os.close(fd)
    try:
        pq.write_table(table.replace_schema_metadata(None), tmp, compression="zstd")
        os.chmod(tmp, _FILE_MODE)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_json_atomic(data: Mapping[str, Any], path: Path) -> None:
    """Write pretty, key-sorted JSON via a temporary file and a rename."""
    fd, tmp = _atomic_target(path)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(data, fh, indent=2, sort_keys=True, ensure_ascii=False)
            fh.write("\n")
        os.chmod(tmp, _FILE_MODE)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text_atomic(text: str, path: Path) -> None:
    """Write UTF-8 `text` (CSV, Markdown, ...) via a temporary file and a rename."""
    fd, tmp = _atomic_target(path)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.chmod(tmp, _FILE_MODE)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def rows_to_table(rows: Iterable[Mapping[str, Any]]) -> pa.Table:
    """Normalised rows → an Arrow table with exactly `SAMPLED_SCHEMA`."""
    return pa.Table.from_pylist([{c: row[c] for c in COLUMNS} for row in rows], schema=SAMPLED_SCHEMA)


def empty_table() -> pa.Table:
    return SAMPLED_SCHEMA.empty_table()
