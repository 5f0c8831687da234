"""Stage `build`: verl RLHFDataset files for training and the 12 evaluation sets."""

from __future__ import annotations

import json
from collections import Counter

import pyarrow.parquet as pq
import pytest

from pipeline.agent.template import render_user_message
from pipeline.data.plan import ValidatePlan
from pipeline.data.sources import REGISTRY
from pipeline.errors import DataError
from pipeline.stages.build import AGENT_NAME, RL_SCHEMA, run_build


def test_train_file_schema_and_content(built_data):
    rl_dir = built_data.path(built_data.paths.rl_dir)
    table = pq.read_table(rl_dir / "train.parquet")
    assert table.schema.remove_metadata() == RL_SCHEMA
    rows = table.to_pylist()
    counts = Counter(r["data_source"] for r in rows)
    sampled = {
        ds: pq.read_metadata(built_data.path(built_data.paths.sampled_dir) / f"{ds}.parquet").num_rows
        for ds in built_data.data.train_datasets
    }
    assert counts == sampled
    assert len({r["data_source"] for r in rows[:50]}) > 3  # shuffled, not grouped by dataset
    assert [r["extra_info"]["index"] for r in rows] == list(range(len(rows)))
    assert len({r["extra_info"]["id"] for r in rows}) == len(rows)
    for r in rows[:500]:
        assert r["agent_name"] == AGENT_NAME and r["extra_info"]["split"] == "train"
        assert (
            r["reward_model"]["style"] == "rule"
            and r["reward_model"]["ground_truth"] == r["extra_info"]["answers"]
        )
        assert len(r["prompt"]) == 1 and r["prompt"][0]["role"] == "user"
        assert r["prompt"][0]["content"] == render_user_message(r["extra_info"]["question"], r["data_source"])
        assert r["ability"] == REGISTRY[r["data_source"]].task_type
    dapo = next(r for r in rows if r["data_source"] == "dapo_math")
    assert dapo["prompt"][0]["content"].startswith("Question: Solve the following math problem step by step.")


def test_eval_files_keep_the_authors_rows(built_data, shared_datasets):
    rl_dir = built_data.path(built_data.paths.rl_dir)
    files = sorted(p.stem for p in (rl_dir / "eval").glob("*.parquet"))
    assert files == sorted(built_data.eval_datasets)  # the paper's twelve (the generated `hops` is not listed)
    for spec in (REGISTRY[name] for name in built_data.eval_datasets):
        ours = pq.read_table(rl_dir / "eval" / f"{spec.name}.parquet")
        assert ours.schema.remove_metadata() == RL_SCHEMA
        theirs = pq.read_table(shared_datasets / "prompt-r1" / "eval" / spec.eval_file).to_pylist()
        ours_rows = ours.to_pylist()
        assert len(ours_rows) == len(theirs) == 128
        for i, (a, b) in enumerate(zip(ours_rows, theirs, strict=True)):
            assert a["prompt"][0]["content"] == b["prompt"][0]["content"]
            assert a["reward_model"]["ground_truth"] == list(b["reward_model"]["ground_truth"])
            assert a["data_source"] == spec.name and a["extra_info"]["id"] == f"{spec.name}-eval-{i:03d}"
            assert a["extra_info"]["split"] == "test" and a["extra_info"]["index"] == i
    summary = json.loads(
        (built_data.path(built_data.paths.reports_dir) / "build" / "summary.json").read_text()
    )
    assert summary["eval_rows_total"] == 1536
    assert all(e["template_reproduced"] == 128 for e in summary["eval"].values())
    assert summary["eval"]["dapo_math"]["rows_with_dataset_instruction"] == 70


def test_build_is_deterministic(built_data, tmp_path):
    first = (built_data.path(built_data.paths.rl_dir) / "train.parquet").read_bytes()
    params = built_data.model_copy(deep=True)
    params.paths.rl_dir = str(tmp_path / "rl")
    params.paths.reports_dir = str(tmp_path / "reports")
    (tmp_path / "reports" / "validate").mkdir(parents=True)
    (tmp_path / "reports" / "validate" / "summary.json").write_bytes(ValidatePlan.for_validate(built_data).summary_path.read_bytes())
    run_build(params)
    assert (tmp_path / "rl" / "train.parquet").read_bytes() == first


def test_build_refuses_unvalidated_data(built_data, tmp_path):
    params = built_data.model_copy(deep=True)
    params.paths.rl_dir = str(tmp_path / "rl")
    params.paths.reports_dir = str(tmp_path / "reports")
    with pytest.raises(DataError, match="run `promptr1 validate` first"):
        run_build(params)

    summary = json.loads(ValidatePlan.for_validate(built_data).summary_path.read_text())
    target = tmp_path / "reports" / "validate" / "summary.json"
    target.parent.mkdir(parents=True)
    target.write_text(json.dumps({**summary, "success": False}))
    with pytest.raises(DataError, match="the last validation failed"):
        run_build(params)

    first = next(name for name, f in summary["files"].items() if f.get("kind") == "train")
    summary["files"][first]["sha256"] = "0" * 64
    target.write_text(json.dumps(summary))
    with pytest.raises(DataError, match="changed since it was validated"):
        run_build(params)
    assert not (tmp_path / "rl" / "train.parquet").exists()
