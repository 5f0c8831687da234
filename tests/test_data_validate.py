"""Stage `validate`: real Great Expectations suites pass on the real data and fail, loudly, on bad data."""

from __future__ import annotations

import json
import shutil

import pyarrow.parquet as pq
import pytest

from pipeline.config.specs import source_paths
from pipeline.data.plan import ValidatePlan
from pipeline.data.schema import rows_to_table, write_parquet_atomic
from pipeline.data.sources import REGISTRY, load_authors_eval
from pipeline.errors import DataError
from pipeline.stages.validate import run_validate


def test_real_data_passes_every_suite(built_data):
    summary = json.loads(ValidatePlan.for_validate(built_data).summary_path.read_text())
    assert summary["success"] is True
    assert summary["files_validated"] == 20 and summary["files_failed"] == 0
    kinds = [f["kind"] for f in summary["files"].values()]
    assert kinds.count("train") == 8 and kinds.count("eval") == 12
    wp = next(
        f for f in summary["files"].values() if f["dataset"] == "writingprompts" and f["kind"] == "train"
    )
    assert wp["expected_rows"] == wp["rows"] < 5120 and wp["notes"]  # the recorded shortfall is honoured
    assert all(f["evaluated_expectations"] >= 14 for f in summary["files"].values())
    docs = built_data.path(built_data.paths.reports_dir) / "validate" / "data_docs"
    assert (docs / "index.html").is_file()
    assert "train__gsm8k" in (docs / "index.html").read_text()


def _copy_gsm8k_project(built_data, data_params):
    """A tmp project holding a copy of the real GSM8K sample (and its metrics), validating GSM8K only."""
    params = data_params(
        data={"train_datasets": ["gsm8k"], "id_eval_datasets": ["gsm8k"], "ood_eval_datasets": []}
    )
    for sub, name in (("sampled_dir", "gsm8k.parquet"), ("reports_dir", "sample/gsm8k.json")):
        src = built_data.path(getattr(built_data.paths, sub)) / name
        dst = params.path(getattr(params.paths, sub)) / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src, dst)
    return params


def test_small_copy_passes(built_data, data_params):
    params = _copy_gsm8k_project(built_data, data_params)
    assert run_validate(params)["success"]


def test_duplicate_ids_empty_answers_and_overlap_fail_with_a_clear_message(built_data, data_params):
    params = _copy_gsm8k_project(built_data, data_params)
    path = params.path(params.paths.sampled_dir) / "gsm8k.parquet"
    rows = pq.read_table(path).to_pylist()
    eval_question = load_authors_eval(source_paths(params), REGISTRY["hotpotqa"])[3].question
    rows[1]["id"] = rows[0]["id"]
    rows[2]["answers"] = []
    rows[3]["answers"] = ["ok", "  "]
    rows[4]["question"] = eval_question
    write_parquet_atomic(rows_to_table(rows), path)

    with pytest.raises(DataError) as err:
        run_validate(params)
    message = str(err.value)
    assert "validate/summary.json" in message and "data_docs/index.html" in message
    assert "gsm8k.parquet: expect_column_values_to_be_unique (column id) failed, 2 offending rows" in message
    assert rows[0]["id"] in message
    assert "expect_column_values_to_be_between (column n_answers)" in message
    assert "expect_column_values_to_be_between (column n_blank_answers)" in message
    assert (
        "expect_column_values_to_be_in_set (column in_eval_set)" in message and eval_question[:40] in message
    )

    summary = json.loads(ValidatePlan.for_validate(params).summary_path.read_text())  # written before the error
    assert summary["success"] is False and summary["files_failed"] == 1
    failed = next(iter(f for f in summary["files"].values() if not f["success"]))
    assert {f["expectation"] for f in failed["failed_expectations"]} == {
        "expect_column_values_to_be_unique",
        "expect_column_values_to_be_between",
        "expect_column_values_to_be_in_set",
    }


def test_row_count_must_match_the_recorded_sample(built_data, data_params):
    params = _copy_gsm8k_project(built_data, data_params)
    path = params.path(params.paths.sampled_dir) / "gsm8k.parquet"
    write_parquet_atomic(pq.read_table(path).slice(0, 100), path)
    with pytest.raises(DataError, match=r"expect_table_row_count_to_equal failed; e\.g\. \[100\]"):
        run_validate(params)


def test_wrong_schema_and_task_type_fail(built_data, data_params):
    params = _copy_gsm8k_project(built_data, data_params)
    path = params.path(params.paths.sampled_dir) / "gsm8k.parquet"
    table = pq.read_table(path)
    rows = table.to_pylist()
    rows[0]["task_type"] = "poetry"
    write_parquet_atomic(rows_to_table(rows).drop(["context"]), path)
    with pytest.raises(DataError) as err:
        run_validate(params)
    assert "expect_table_columns_to_match_set failed" in str(err.value)
    assert "expect_column_values_to_be_in_set (column task_type) failed, 1 offending rows" in str(err.value)


def test_bad_evaluation_file_fails(built_data, data_params, shared_datasets, tmp_path):
    mirror = tmp_path / "mirror"
    shutil.copytree(shared_datasets / "prompt-r1", mirror / "prompt-r1")
    eval_file = mirror / "prompt-r1" / "eval" / "gsm8k.parquet"
    table = pq.read_table(eval_file)
    rows = table.to_pylist()
    rows[7]["reward_model"]["ground_truth"] = []
    pq.write_table(table.from_pylist(rows, schema=table.schema), eval_file)
    params = _copy_gsm8k_project(built_data, data_params)
    params.paths.mirror = str(mirror)
    with pytest.raises(DataError) as err:
        run_validate(params)
    assert "prompt-r1/eval/gsm8k.parquet: expect_column_values_to_be_between (column n_answers)" in str(
        err.value
    )
    assert "gsm8k-eval-007" in str(err.value)


def test_missing_sampled_file_is_a_clear_error(data_params):
    params = data_params(data={"train_datasets": ["gsm8k"]})
    with pytest.raises(DataError, match=r"gsm8k\.parquet: not found; run `promptr1 sample gsm8k`"):
        run_validate(params)


def test_token_budget(built_data, data_params):
    params = _copy_gsm8k_project(built_data, data_params)
    params.data.max_question_tokens = 20
    with pytest.raises(DataError, match=r"column question_tokens_est"):
        run_validate(params)


def test_skipped_dataset_is_validated_as_empty_and_reported(data_params, shared_datasets, tmp_path):
    """A dataset listed in data.allow_skip whose source is missing flows through all three stages, visibly."""
    from pipeline.stages.build import run_build
    from pipeline.stages.sample import run_sample

    mirror = tmp_path / "mirror"
    (mirror / "raw").mkdir(parents=True)
    (mirror / "prompt-r1").symlink_to(shared_datasets / "prompt-r1")
    params = data_params(
        mirror,
        data={
            "train_datasets": ["gsm8k"],
            "id_eval_datasets": ["gsm8k"],
            "ood_eval_datasets": [],
            "allow_skip": ["gsm8k"],
        },
    )
    assert run_sample(params, "gsm8k").skipped
    summary = run_validate(params)
    train = next(f for f in summary["files"].values() if f["kind"] == "train")
    assert train["success"] and train["rows"] == train["expected_rows"] == 0
    assert "skipped by the sample stage" in train["notes"][0]
    built = run_build(params)
    assert built["train"]["rows"] == 0 and built["skipped"] == ["gsm8k"]
