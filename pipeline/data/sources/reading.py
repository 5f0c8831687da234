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

Column types are checked here, once, for both paths (`check_record_types`, after the converter): a value
of the wrong type (a numeric question, answers that are a number or a list of numbers, a nested struct)
is not a bad row but a bad column, so the read stops with a `DataError` naming the source, the column,
the first bad row and its value, instead of the sample stage dropping the column row by row. Missing
values (None) are left to the sample stage's drop counts. Answers may be a list of text or one text (one
gold answer, as the Hub's scalar answer fields are). Every mirror column is also validated by Arrow in
full before it is converted, so invalid UTF-8 or corrupt pages stop the read naming the column instead
of escaping as a decoding traceback.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.config.specs import SourcePaths
from pipeline.data.sources.generated import generated_files
from pipeline.data.sources.registry import MIRROR_COLUMNS, BadRow, Converter, DatasetSpec, RawRecord
from pipeline.errors import DataError
from pipeline.paths import display_path

COLUMN_TYPES: dict[str, tuple[tuple[type, ...], str]] = {
    "id": ((str, int), "text or an integer"),
    "question": ((str,), "text"),
    "answers": ((list, tuple, str), "a list of text, or text"),
    "context": ((str,), "text"),
    "source_split": ((str,), "text"),
}
"""Raw record column → (accepted Python types, what the error says is expected). None is always accepted."""


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


def _kind(value: Any) -> str:
    if isinstance(value, list | tuple):
        inner = sorted({type(v).__name__ for v in value if not isinstance(v, str)})
        return f"a list holding {'/'.join(inner)}"
    return type(value).__name__


def _wrong_type(column: str, value: Any) -> bool:
    types, _ = COLUMN_TYPES[column]
    if isinstance(value, bool) or not isinstance(value, types):
        return True
    return column == "answers" and not isinstance(value, str) and any(
        a is not None and not isinstance(a, str) for a in value
    )


def check_record_types(rec: RawRecord, row: int, source: str) -> RawRecord:
    """`rec` unchanged, or a DataError naming `source`, the column, `row` and the value of the wrong type."""
    if rec.get("_bad"):
        return rec
    for column, (_, expected) in COLUMN_TYPES.items():
        value = rec.get(column)
        if value is not None and _wrong_type(column, value):
            raise DataError(
                f"{source}: column {column!r} holds {_kind(value)} at row {row} (first bad row, counting "
                f"from 0; expected {expected}): {value!r:.80}"
            )
    return rec


def _apply(convert: Converter | None, rec: RawRecord, row: Mapping[str, Any]) -> RawRecord:
    if convert is None:
        return rec
    try:
        return convert(rec, row)
    except BadRow as bad:
        rec["_bad"] = bad.reason
        return rec


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def read_mirror_file(
    path: Path, root: Path, columns: tuple[str, ...] = MIRROR_COLUMNS
) -> list[dict[str, Any]]:
    """Rows of one mirror Parquet file; DataError naming the file (and column) when unusable."""
    shown = display_path(path, root)
    if not path.is_file():
        others = sorted(p.name for p in path.parent.glob(f"{path.stem}.*") if p != path)
        hint = f" (found instead: {', '.join(others)}; the mirror's files are Parquet, named as registered)"
        raise DataError(f"{shown}: source file not found{hint if others else ''}")
    try:
        schema = pq.read_schema(path)
    except (OSError, pa.ArrowException) as exc:
        raise DataError(f"{shown}: cannot read as Parquet ({_one_line(exc)})") from None
    missing = [c for c in columns if c not in schema.names]
    if missing:
        raise DataError(
            f"{shown}: missing column(s) {', '.join(repr(c) for c in missing)} "
            f"(has: {', '.join(schema.names)}; expected: {', '.join(columns)})"
        )
    values = []
    for name in columns:  # one column at a time, so a corrupt page or bad text names its column
        try:
            column = pq.read_table(path, columns=[name]).column(name)
            column.validate(full=True)
            values.append(column.to_pylist())
        except (OSError, pa.ArrowException, ValueError) as exc:  # ValueError: text that is not UTF-8
            raise DataError(f"{shown}: column {name!r} is unreadable ({_one_line(exc)})") from None
    return [dict(zip(columns, row, strict=True)) for row in zip(*values, strict=True)]


def _load_mirror(spec: DatasetSpec, mirror: Path, root: Path) -> RawSource:
    out = RawSource(records=[], origin=[])
    for rel in spec.mirror.files:
        path = mirror / "raw" / rel
        rows = read_mirror_file(path, root)
        out.origin.append(f"mirror:raw/{rel}")
        out.rows_read += len(rows)
        shown = display_path(path, root)
        for i, row in enumerate(rows):
            rec = {c: row[c] for c in MIRROR_COLUMNS}
            out.records.append(check_record_types(_apply(spec.mirror.convert, rec, row), i, shown))
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
        out.records.append(check_record_types(_apply(hub.convert, rec, row), i, hub.describe()))
    return out


def _load_generated(spec: DatasetSpec, where: SourcePaths) -> RawSource:
    path, _ = generated_files(where.cache_dir, spec)
    rows = read_mirror_file(path, where.root)
    shown = display_path(path, where.root)
    records = [check_record_types({c: row[c] for c in MIRROR_COLUMNS}, i, shown) for i, row in enumerate(rows)]
    return RawSource(records=records, origin=[f"generated:{spec.generated.version}"], rows_read=len(rows))


def load_raw(spec: DatasetSpec, where: SourcePaths) -> RawSource:
    """The raw records of `spec`: generated (a `generated` dataset, whatever the paths say), else from the
    mirror (if `paths.mirror` is set) or the Hub."""
    if spec.generated is not None:
        return _load_generated(spec, where)
    if where.mirror is not None:
        return _load_mirror(spec, where.mirror, where.root)
    return _load_hub(spec, where.cache_dir)
