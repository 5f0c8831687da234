"""Malformed source files: each stops the sample stage with one line naming the file and the column or
the counts, and nothing is written under the sampled or report folders.

Every case is a real file written where the registry expects GSM8K's training source in a temporary copy
of the mirror layout (the authors' real evaluation files linked in, as the leakage check reads them). One
case also runs the real CLI in a subprocess. The threshold's boundary is pinned from both sides, so the
check is known to fail and to pass.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from demo_project import tmp_mirror

from pipeline.config import Params
from pipeline.config.specs import source_paths
from pipeline.data.sources import REGISTRY, load_authors_eval
from pipeline.errors import DataError
from pipeline.stages.sample import run_sample

ROOT = Path(__file__).resolve().parents[2]
SOURCE = "raw/gsm8k/train.parquet"
COLUMNS = ("id", "question", "answers", "context", "source_split")

Writer = Callable[[Path, Params], None]
"""Writes one malformed source at the path given (params: for cases that read the real evaluation files)."""


def _rows(n: int, **fixed) -> dict[str, list]:
    base = {
        "id": [f"g{i}" for i in range(n)],
        "question": [f"How many apples does farmer {i} keep in the barn?" for i in range(n)],
        "answers": [[str(i)] for i in range(n)],
        "context": [""] * n,
        "source_split": ["train"] * n,
    }
    return {**base, **fixed}


def _parquet(columns: dict) -> Writer:
    return lambda path, _: pq.write_table(pa.table(columns), path)


def _bytes(make: Callable[[], bytes]) -> Writer:
    return lambda path, _: path.write_bytes(make())


def _valid_bytes(n: int = 3000) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(pa.table(_rows(n)), sink, compression="zstd")
    return sink.getvalue().to_pybytes()


def _corrupt_middle() -> bytes:
    """Footer intact (the schema reads), the first column's compressed pages scrambled."""
    data = bytearray(_valid_bytes())
    for i in range(64, len(data) // 3):
        data[i] ^= 0x5A
    return bytes(data)


def _not_utf8(path: Path, _: Params) -> None:
    text = pa.array([b"How many?", b"caf\xe9 \xff\xfe?", b"Why?"], pa.binary()).view(pa.string())
    pq.write_table(pa.table({**_rows(3), "question": text}), path)


def _wrong_extension(path: Path, _: Params) -> None:
    lines = [json.dumps({c: v[i] for c, v in _rows(5).items()}) for i in range(5)]
    path.with_suffix(".jsonl").write_text("\n".join(lines) + "\n")


def _duplicate_column(path: Path, _: Params) -> None:
    table = pa.table(_rows(4))
    pq.write_table(table.append_column("question", pa.array(["x?"] * 4)), path)


def _all_leaked(path: Path, params: Params) -> None:
    questions = [r.question for r in load_authors_eval(source_paths(params), REGISTRY["gsm8k"])[:20]]
    pq.write_table(pa.table(_rows(len(questions), question=questions)), path)

CASES: list[tuple[str, Writer, str]] = [
    ("missing column", _parquet({c: v for c, v in _rows(4).items() if c != "answers"}),
     r"missing column\(s\) 'answers'"),
    ("numeric question column", _parquet(_rows(4, question=[None, 7, 8, 9])),
     r"column 'question' holds int at row 1"),
    ("answers a struct (nested garbage)", _parquet(_rows(2, answers=[{"text": "1", "n": 1}, {"text": "2", "n": 2}])),
     r"column 'answers' holds dict at row 0"),
    ("answers nested lists", _parquet(_rows(2, answers=[[["1"]], [["2"]]])),
     r"column 'answers' holds a list holding list at row 0"),
    ("question bytes, not text", _parquet(_rows(2, question=[b"How?", b"Why?"])),
     r"column 'question' holds bytes at row 0"),
    ("all questions empty", _parquet(_rows(20, question=[" "] * 10 + [""] * 10)),
     r"only 0 of 20 rows usable .*'empty_question': 20"),
    ("every row the same", _parquet({c: [v[0]] * 20 for c, v in _rows(20).items()}),
     r"only 1 of 20 rows usable .* \(5\.0%\).*'duplicate_id': 19"),
    ("answers all null", _parquet(_rows(6, answers=pa.array([None] * 6, pa.list_(pa.string())))),
     r"only 0 of 6 rows usable.*'missing_answers': 6"),
    ("ids all null", _parquet(_rows(6, id=pa.array([None] * 6, pa.string()))),
     r"only 0 of 6 rows usable.*'missing_id': 6"),
    ("zero rows", _parquet({c: pa.array([], pa.list_(pa.string()) if c == "answers" else pa.string())
                            for c in COLUMNS}),
     r"only 0 of 0 rows usable"),
    ("huge rows", _parquet(_rows(3, question=["many apples " * 400_000] * 3)),
     r"only 0 of 3 rows usable.*'question_too_long': 3"),
    ("every row is an evaluation question", _all_leaked, r"only 0 of 20 rows usable.*leaked 20"),
    ("truncated Parquet", _bytes(lambda: _valid_bytes()[:1500]), r"cannot read as Parquet"),
    ("corrupt pages", _bytes(_corrupt_middle), r"column 'id' is unreadable"),
    ("CSV bytes under a .parquet name", _bytes(lambda: b"id,question,answers\n1,How?,2\n"),
     r"cannot read as Parquet"),
    ("text that is not UTF-8", _not_utf8, r"column 'question' is unreadable \(.*UTF8"),
    ("wrong file extension", _wrong_extension, r"source file not found \(found instead: train\.jsonl"),
    ("column named twice", _duplicate_column, r"column 'question' is unreadable"),
]



def _written(tmp_path: Path) -> list[Path]:
    return [p for folder in ("data", "reports") for p in (tmp_path / "out" / folder).rglob("*") if p.is_file()]


@pytest.mark.parametrize(("name", "write", "pattern"), CASES, ids=[c[0] for c in CASES])
def test_malformed_source_stops_naming_file_and_column(name, write, pattern, data_params, shared_datasets,
                                                       tmp_path):
    assert len(CASES) >= 10
    mirror = tmp_mirror(tmp_path, shared_datasets)
    params = data_params(mirror, paths={"sampled_dir": str(tmp_path / "out" / "data" / "sampled"),
                                        "reports_dir": str(tmp_path / "out" / "reports")})
    write(mirror / SOURCE, params)

    with pytest.raises(DataError) as info:
        run_sample(params, "gsm8k")

    message = str(info.value)
    assert "\n" not in message, message
    assert SOURCE in message, message
    assert re.search(pattern, message), message
    assert _written(tmp_path) == []


@pytest.mark.parametrize(("good", "empty", "passes"), [(10, 10, True), (9, 11, False)])
def test_threshold_boundary(good, empty, passes, data_params, shared_datasets, tmp_path):
    """Half the rows usable passes the default 0.5; one row fewer stops, writing nothing."""
    mirror = tmp_mirror(tmp_path, shared_datasets)
    pq.write_table(pa.table(_rows(good + empty, question=_rows(good)["question"] + [""] * empty)), mirror / SOURCE)
    params = data_params(mirror, paths={"sampled_dir": str(tmp_path / "out" / "data" / "sampled"),
                                        "reports_dir": str(tmp_path / "out" / "reports")})
    assert params.data.min_usable_fraction == 0.5
    if passes:
        assert run_sample(params, "gsm8k").rows_written == good
        assert len(_written(tmp_path)) == 2
    else:
        with pytest.raises(DataError, match=rf"only {good} of {good + empty} rows usable .* \(45\.0%\), below "
                                            r"data\.min_usable_fraction 0\.5"):
            run_sample(params, "gsm8k")
        assert _written(tmp_path) == []


def test_cli_prints_one_line_exits_1_and_writes_nothing(shared_datasets, tmp_path):
    mirror = tmp_mirror(tmp_path, shared_datasets)
    pq.write_table(pa.table(_rows(4, question=[None, 7, 8, 9])), mirror / SOURCE)
    out = tmp_path / "out"
    sets = [f"paths.mirror={mirror}", f"paths.sampled_dir={out / 'data' / 'sampled'}",
            f"paths.reports_dir={out / 'reports'}", f"paths.cache_dir={out / 'cache'}"]
    done = subprocess.run([sys.executable, "-m", "pipeline.cli", "sample", "gsm8k",
                           *[arg for s in sets for arg in ("-S", s)]],
                          cwd=ROOT, capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 1, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and SOURCE in errors[0] and "column 'question' holds int at row 1" in errors[0]
    assert "Traceback" not in done.stderr
    assert _written(tmp_path) == []
