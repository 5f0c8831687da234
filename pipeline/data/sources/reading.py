"""Reading a dataset's raw records, from a local mirror or the Hugging Face Hub: one reader for every dataset.

- `mirror`: Parquet file(s) under `<paths.mirror>/raw/`, already column-normalised (id, question,
  answers, context, source_split, meta; see ../shared/datasets/README.md). Used when `paths.mirror` is
  set (the default profile, tests, CI).
- `hub`: the spec's Hub id, config, split and field mapping, read with `datasets.load_dataset`. That is
  the normal path (`paths.mirror` empty, e.g. the paper profile). The Hub is unreachable on the machines
  this project is tested on, so this path is exercised only as far as its failure: it raises a
  `DataError` naming the Hub id and telling the user about `paths.mirror` and `data.allow_skip`.

Both paths end in the same raw record (id, question, answers, context, source_split), then the side's
`convert` (a registered source quirk) fixes it. A converter's `BadRow` is not raised here: it marks the
record (`_bad`) so that the sample stage counts it under that drop reason with every other bad row.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.config import Params
from pipeline.data.schema import display_path
from pipeline.data.sources.registry import BadRow, Converter, DatasetSpec, RawRecord
from pipeline.errors import DataError

MIRROR_COLUMNS = ("id", "question", "answers", "context", "source_split")


@dataclass
class RawSource:
    """Raw records of one dataset and where they came from (for the stage's metrics)."""

    records: list[RawRecord]
    origin: list[str]
    rows_read: int = 0


def _dig(row: Mapping[str, Any], dotted: str) -> Any:
    value: Any = row
    for part in dotted.split("."):
        if isinstance(value, Mapping):
            value = value.get(part)
        elif isinstance(value, list | tuple) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            return None
    return value


def _apply(convert: Converter | None, rec: RawRecord, row: Mapping[str, Any]) -> RawRecord:
    if convert is None:
        return rec
    try:
        return convert(rec, row)
    except BadRow as bad:
        rec["_bad"] = bad.reason
        return rec


def read_mirror_file(
    path: Path, root: Path, columns: tuple[str, ...] = MIRROR_COLUMNS
) -> list[dict[str, Any]]:
    """Rows of one mirror Parquet file; DataError naming the file (and column) when unusable."""
    shown = display_path(path, root)
    if not path.is_file():
        raise DataError(f"{shown}: source file not found")
    try:
        schema = pq.read_schema(path)
    except (OSError, pa.ArrowException) as exc:
        raise DataError(f"{shown}: cannot read as Parquet ({exc})") from None
    missing = [c for c in columns if c not in schema.names]
    if missing:
        raise DataError(
            f"{shown}: missing column(s) {', '.join(repr(c) for c in missing)} "
            f"(has: {', '.join(schema.names)}; expected: {', '.join(columns)})"
        )
    try:
        return pq.read_table(path, columns=list(columns)).to_pylist()
    except (OSError, pa.ArrowException) as exc:
        raise DataError(f"{shown}: cannot read columns {list(columns)} ({exc})") from None


def _load_mirror(spec: DatasetSpec, mirror: Path, root: Path) -> RawSource:
    out = RawSource(records=[], origin=[])
    for rel in spec.mirror.files:
        path = mirror / "raw" / rel
        rows = read_mirror_file(path, root)
        out.origin.append(f"mirror:raw/{rel}")
        out.rows_read += len(rows)
        for row in rows:
            rec = {c: row[c] for c in MIRROR_COLUMNS}
            out.records.append(_apply(spec.mirror.convert, rec, row))
    return out


def _load_hub(spec: DatasetSpec, cache_dir: Path) -> RawSource:
    hub = spec.hub
    try:
        import datasets

        ds = datasets.load_dataset(hub.path, hub.config, split=hub.split, cache_dir=str(cache_dir / "hf"))
    except Exception as exc:  # noqa: BLE001 — any failure of the Hub path is reported the same way
        raise DataError(
            f"{spec.name}: cannot load {hub.describe()} from the Hugging Face Hub "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); set paths.mirror to a "
            f"local mirror, or list {spec.name!r} in data.allow_skip to skip it explicitly"
        ) from None
    for dotted in filter(None, (hub.question, hub.answers, hub.id, hub.context)):
        if dotted.split(".")[0] not in ds.column_names:
            raise DataError(
                f"{hub.describe()}: missing column {dotted.split('.')[0]!r} "
                f"(has: {', '.join(ds.column_names)})"
            )
    out = RawSource(records=[], origin=[hub.describe()], rows_read=len(ds))
    for i, row in enumerate(ds):
        answers = _dig(row, hub.answers)
        rec: RawRecord = {
            "id": str(_dig(row, hub.id)) if hub.id else f"{spec.name}-{hub.split}-{i}",
            "question": _dig(row, hub.question),
            # Scalar answer fields (a story, a summary, a letter) are declared as such: one gold answer.
            "answers": [answers] if isinstance(answers, str) else answers,
            "context": _dig(row, hub.context) if hub.context else "",
            "source_split": hub.split,
        }
        out.records.append(_apply(hub.convert, rec, row))
    return out


def load_raw(spec: DatasetSpec, params: Params) -> RawSource:
    """The raw records of `spec` from the mirror (if `paths.mirror` is set) or the Hub."""
    mirror = params.mirror
    if mirror is not None:
        return _load_mirror(spec, mirror, params.root)
    return _load_hub(spec, params.path(params.paths.cache_dir))
