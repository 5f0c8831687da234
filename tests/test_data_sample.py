"""Stage `sample`: normalisation with malformed inputs, leakage removal, determinism, the real mirror."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from demo_project import tmp_mirror

from pipeline.config.specs import source_paths
from pipeline.data.schema import SAMPLED_SCHEMA, question_key
from pipeline.data.sources import REGISTRY, load_authors_eval
from pipeline.errors import DataError
from pipeline.stages.sample import run_sample


def _write_raw(mirror: Path, columns: dict[str, pa.Array | list]) -> Path:
    path = mirror / "raw" / "gsm8k" / "train.parquet"
    pq.write_table(pa.table(columns), path)
    return path


def _good(n: int) -> list[dict]:
    return [
        {
            "id": f"g{i}",
            "question": f"How many apples does farmer {i} have?",
            "answers": [str(i)],
            "context": "",
            "source_split": "train",
        }
        for i in range(n)
    ]


def _columns(rows: list[dict]) -> dict[str, list]:
    return {c: [r[c] for r in rows] for c in ("id", "question", "answers", "context", "source_split")}


def test_bad_rows_are_dropped_and_counted_per_reason(data_params, shared_datasets, tmp_path):
    mirror = tmp_mirror(tmp_path, shared_datasets)
    leaked_q = load_authors_eval(source_paths(data_params()), REGISTRY["gsm8k"])[0].question
    rows = _good(10) + [
        {"id": "b1", "question": None, "answers": ["1"], "context": "", "source_split": "train"},
        {"id": "b2", "question": "   ", "answers": ["1"], "context": "", "source_split": "train"},
        {
            "id": "b3",
            "question": "Where is the answer?",
            "answers": None,
            "context": "",
            "source_split": "train",
        },
        {"id": "b4", "question": "Why is it empty?", "answers": [], "context": "", "source_split": "train"},
        {
            "id": "b5",
            "question": "Why all blank?",
            "answers": [" ", ""],
            "context": "",
            "source_split": "train",
        },
        {
            "id": "g0",
            "question": "A different question with a reused id?",
            "answers": ["x"],
            "context": "",
            "source_split": "train",
        },
        {
            "id": "d1",
            "question": "how MANY apples does farmer 3 have",
            "answers": ["3"],
            "context": "",
            "source_split": "train",
        },
        {
            "id": "l1",
            "question": "  " + leaked_q.upper() + " ",
            "answers": ["30"],
            "context": "",
            "source_split": "train",
        },
        {"id": "t1", "question": "word " * 400, "answers": ["1"], "context": "", "source_split": "train"},
        {"id": None, "question": "Who has no id?", "answers": ["1"], "context": "", "source_split": "train"},
        {
            "id": "k1",
            "question": "Which answers keep?",
            "answers": ["  yes ", "", "y"],
            "context": None,
            "source_split": None,
        },
    ]
    _write_raw(mirror, _columns(rows))
    params = data_params(mirror, data={"sample_size": 100, "max_question_tokens": 200})

    report = run_sample(params, "gsm8k")

    dropped = {k: v for k, v in report.dropped_by_reason.items() if v}
    assert dropped == {
        "missing_question": 1,
        "empty_question": 1,
        "missing_answers": 1,
        "empty_answers": 2,
        "duplicate_id": 1,
        "duplicate_question": 1,
        "question_too_long": 1,
        "missing_id": 1,
    }
    assert report.leaked_removed == 1 and report.leaked_by_eval_file == {"gsm8k.parquet": 1}
    assert report.rows_source == len(rows) and report.rows_written == 11 and report.shortfall == 89
    assert any("only 11 usable rows" in w for w in report.warnings)

    table = pq.read_table(params.path(params.paths.sampled_dir) / "gsm8k.parquet")
    assert table.schema == SAMPLED_SCHEMA
    out = {r["id"]: r for r in table.to_pylist()}
    assert (
        out["k1"]["answers"] == ["yes", "y"]
        and out["k1"]["context"] == ""
        and out["k1"]["source_split"] == ""
    )
    assert {r["task_type"] for r in out.values()} == {"math"} and {r["dataset"] for r in out.values()} == {
        "gsm8k"
    }
    metrics = json.loads((params.path(params.paths.reports_dir) / "sample" / "gsm8k.json").read_text())
    for key in (
        "rows_source",
        "dropped_by_reason",
        "leaked_removed",
        "rows_written",
        "shortfall",
        "warnings",
    ):
        assert key in metrics
    assert metrics["dropped_by_reason"]["empty_answers"] == 2 and metrics["rows_written"] == 11


def test_wrong_value_types_stop_naming_file_column_and_row(data_params, shared_datasets, tmp_path):
    """A wrong type is a broken column: the stage stops naming it, it does not drop the column row by row."""
    mirror = tmp_mirror(tmp_path, shared_datasets)
    base = _columns(_good(4))
    for column, values, message in (
        ("question", [None, None, 3, 4], r"column 'question' holds int at row 2 .*expected text"),
        ("answers", [[None], [2], [3], [4]], r"column 'answers' holds a list holding int at row 1"),
        ("id", [None, 1.5, 2.5, 3.5], r"column 'id' holds float at row 1"),
    ):
        _write_raw(mirror, {**base, column: values})
        with pytest.raises(DataError, match=r"raw/gsm8k/train\.parquet: " + message):
            run_sample(data_params(mirror), "gsm8k")
    assert not (tmp_path / "data" / "sampled").exists()


def test_text_answers_are_one_gold_answer(data_params, shared_datasets, tmp_path):
    mirror = tmp_mirror(tmp_path, shared_datasets)
    _write_raw(mirror, {**_columns(_good(2)), "answers": [" 1 ", "2"]})
    params = data_params(mirror)
    report = run_sample(params, "gsm8k")
    assert report.rows_written == 2 and not any(report.dropped_by_reason.values())
    table = pq.read_table(params.path(params.paths.sampled_dir) / "gsm8k.parquet")
    assert table.column("answers").to_pylist() == [["1"], ["2"]]


def test_wrong_columns_name_the_file_and_column(data_params, shared_datasets, tmp_path):
    mirror = tmp_mirror(tmp_path, shared_datasets)
    cols = _columns(_good(3))
    cols["query"] = cols.pop("question")
    _write_raw(mirror, cols)
    with pytest.raises(DataError, match=r"raw/gsm8k/train\.parquet: missing column\(s\) 'question'"):
        run_sample(data_params(mirror), "gsm8k")


def test_unreadable_or_missing_source_names_the_file(data_params, shared_datasets, tmp_path):
    mirror = tmp_mirror(tmp_path, shared_datasets)
    with pytest.raises(DataError, match=r"raw/gsm8k/train\.parquet: source file not found"):
        run_sample(data_params(mirror), "gsm8k")
    (mirror / "raw" / "gsm8k" / "train.parquet").write_text("id,question\n1,what?\n")
    with pytest.raises(DataError, match=r"raw/gsm8k/train\.parquet: cannot read as Parquet"):
        run_sample(data_params(mirror), "gsm8k")


def test_unreadable_source_may_be_skipped_only_when_allowed(data_params, shared_datasets, tmp_path):
    mirror = tmp_mirror(tmp_path, shared_datasets)
    report = run_sample(data_params(mirror, data={"allow_skip": ["gsm8k"]}), "gsm8k")
    assert report.skipped and "source file not found" in report.skip_reason


def test_same_seed_gives_byte_identical_output(data_params, tmp_path):
    outs = []
    for name, seed in (("a", 42), ("b", 42), ("c", 7)):
        folders = {
            "sampled_dir": str(tmp_path / name / "sampled"),
            "reports_dir": str(tmp_path / name / "reports"),
        }
        params = data_params(seed=seed, paths=folders, data={"sample_size": 500})
        run_sample(params, "gsm8k")
        outs.append((params.path(params.paths.sampled_dir) / "gsm8k.parquet").read_bytes())
    assert outs[0] == outs[1]
    assert outs[0] != outs[2]


def test_real_mirror_samples_all_training_sets(built_data):
    params = built_data
    eval_keys = {
        question_key(r.question) for spec in REGISTRY.values() for r in load_authors_eval(source_paths(params), spec)
    }
    for dataset in params.data.train_datasets:
        report = json.loads(
            (params.path(params.paths.reports_dir) / "sample" / f"{dataset}.json").read_text()
        )
        table = pq.read_table(params.path(params.paths.sampled_dir) / f"{dataset}.parquet")
        assert table.num_rows == report["rows_written"]
        if dataset == "writingprompts":  # a 600-row subset: all usable rows, shortfall recorded
            assert report["rows_written"] < 600 and report["shortfall"] == 5120 - report["rows_written"]
            assert report["warnings"]
        else:
            assert report["rows_written"] == 5120 and report["shortfall"] == 0
        questions = table.column("question").to_pylist()
        assert not {question_key(q) for q in questions} & eval_keys
        assert len(set(table.column("id").to_pylist())) == table.num_rows
    gsm8k = json.loads((params.path(params.paths.reports_dir) / "sample" / "gsm8k.json").read_text())
    assert gsm8k["leaked_removed"] > 100  # the authors' GSM8K eval rows come from the train split
    booksum = pq.read_table(params.path(params.paths.sampled_dir) / "booksum.parquet").to_pylist()[0]
    assert booksum["question"].startswith("Please write a short article based on the given title: ")
    assert " — " in booksum["question"]
