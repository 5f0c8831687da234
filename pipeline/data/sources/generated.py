"""Datasets made by code: their rows written once as files in the layouts every reader already reads.

A generated dataset (`registry.GeneratedSource`, the `hops` world) has no Hub id and no mirror file. So that
`sample`, `validate`, `build` and the leakage check treat it exactly like the others (the same readers, the
same checks, the sha256 that `build` compares), its rows are written to `<paths.cache_dir>/generated/<name>/`:
- `train.parquet`: the training rows in the mirror's columns (`registry.MIRROR_COLUMNS`);
- `eval.parquet`: the held-out rows in the authors' evaluation layout (`prompt` = the rendered Prompt-R1
  user message, `reward_model.ground_truth`), which `authors_eval.load_authors_eval` reads back.
The rows are deterministic and the files are rewritten only when their bytes differ, so an unchanged
generator leaves them (and everything downstream) untouched.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.agent.template import render_user_message
from pipeline.data.sources.registry import MIRROR_COLUMNS, DatasetSpec

TRAIN_SCHEMA = pa.schema(
    [
        pa.field("id", pa.string()),
        pa.field("question", pa.string()),
        pa.field("answers", pa.list_(pa.string())),
        pa.field("context", pa.string()),
        pa.field("source_split", pa.string()),
    ]
)
EVAL_SCHEMA = pa.schema(
    [
        pa.field(
            "prompt", pa.list_(pa.struct([pa.field("role", pa.string()), pa.field("content", pa.string())]))
        ),
        pa.field(
            "reward_model",
            pa.struct([pa.field("ground_truth", pa.list_(pa.string())), pa.field("style", pa.string())]),
        ),
    ]
)


def generated_dir(cache_dir: Path, spec: DatasetSpec) -> Path:
    """The folder of a generated dataset's files under `paths.cache_dir`."""
    return cache_dir / "generated" / spec.name


def _write_if_changed(table: pa.Table, path: Path) -> None:
    buffer = io.BytesIO()
    pq.write_table(table, buffer, compression="zstd")
    data = buffer.getvalue()
    if path.is_file() and path.read_bytes() == data:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.part")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def generated_files(cache_dir: Path, spec: DatasetSpec) -> tuple[Path, Path]:
    """(training file, held-out file) of a generated dataset under `cache_dir` (`paths.cache_dir`), written
    first when absent or changed."""
    if spec.generated is None:
        raise ValueError(f"{spec.name} is not a generated dataset")
    folder = generated_dir(cache_dir, spec)
    train, heldout = spec.generated.rows()
    _write_if_changed(
        pa.Table.from_pylist([{c: r.get(c) for c in MIRROR_COLUMNS} for r in train], schema=TRAIN_SCHEMA),
        folder / "train.parquet",
    )
    _write_if_changed(
        pa.Table.from_pylist(
            [
                {
                    "prompt": [{"role": "user", "content": render_user_message(question, spec.name)}],
                    "reward_model": {"ground_truth": list(answers), "style": "rule"},
                }
                for question, answers in heldout
            ],
            schema=EVAL_SCHEMA,
        ),
        folder / "eval.parquet",
    )
    return folder / "train.parquet", folder / "eval.parquet"
