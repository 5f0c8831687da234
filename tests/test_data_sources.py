"""The dataset registry: every dataset declared once, its sources present, its quirks handled."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from pipeline.config.specs import source_paths
from pipeline.data.sources import REGISTRY, DatasetSpec, get_spec, load_authors_eval, register
from pipeline.data.sources.long_form import (
    article_task,
    booksum_hub_title,
    title_task,
    writing_prompt_task,
    xsum_mirror_reverse,
)
from pipeline.data.sources.math_problems import dapo_unwrap, gsm8k_final_answer, mathqa_option_value
from pipeline.data.sources.registry import flashrag
from pipeline.errors import DataError
from pipeline.stages.sample import run_sample

TRAIN = ["2wikimultihopqa", "hotpotqa", "gsm8k", "dapo_math", "musique", "popqa", "booksum", "writingprompts"]
OOD = ["mathqa", "squad_v2", "triviaqa", "xsum"]
GENERATED = ["hops"]


def test_registry_declares_the_twelve_datasets_once():
    assert list(REGISTRY) == TRAIN + OOD + GENERATED
    assert [s.name for s in REGISTRY.values() if s.trains] == TRAIN + GENERATED
    assert len({s.eval_file for s in REGISTRY.values()}) == 13
    for spec in REGISTRY.values():
        assert isinstance(spec, DatasetSpec)
        assert (spec.generated is not None) == (spec.name in GENERATED) == (spec.hub is None)
        if spec.hub is not None:
            assert spec.hub.path and spec.hub.split and spec.hub.question and spec.hub.answers
        assert spec.mirror.files
        assert (spec.metric_family == "generation") == (spec.task_type == "long_form")
    assert {get_spec(d).metric_family for d in ("booksum", "writingprompts", "xsum")} == {"generation"}
    assert {get_spec(d).task_type for d in ("gsm8k", "dapo_math", "mathqa")} == {"math"}


def test_a_new_dataset_is_one_register_call_and_keeps_the_paper_order():
    """The families are imported alphabetically (long_form first); the registry still reads in the paper's order,
    and a dataset beyond the paper's twelve follows them."""
    before = dict(REGISTRY)
    try:
        spec = register(
            "a_new_qa",
            "open_qa",
            trains=False,
            hub=flashrag("nq", "test"),
            mirror="nq/test.parquet",
            eval_file="nq.parquet",
            eval_tag="nq-128-eval_ood",
        )
        assert list(REGISTRY) == TRAIN + OOD + GENERATED + ["a_new_qa"] and get_spec("a_new_qa") is spec
        assert spec.metric_family == "qa" and spec.mirror.files == ("nq/test.parquet",)
        assert spec.hub.describe() == "hub:RUC-NLPIR/FlashRAG_datasets[nq]:test"
        assert spec.task_format("  as is ") == "  as is "
    finally:
        REGISTRY.clear()
        REGISTRY.update(before)


def test_a_dataset_is_registered_once():
    gsm8k = get_spec("gsm8k")
    with pytest.raises(ValueError, match="'gsm8k' is registered twice"):
        register(
            "gsm8k",
            "math",
            trains=True,
            hub=gsm8k.hub,
            mirror="gsm8k/other.parquet",
            eval_file=gsm8k.eval_file,
            eval_tag=gsm8k.eval_tag,
        )
    assert REGISTRY["gsm8k"] is gsm8k and list(REGISTRY) == TRAIN + OOD + GENERATED


def test_params_lists_match_the_registry(params):
    assert params.data.train_datasets == TRAIN
    assert params.eval_datasets == TRAIN + OOD


def test_unknown_dataset_is_a_clear_error():
    with pytest.raises(DataError, match="unknown dataset 'nope'"):
        get_spec("nope")


def test_every_source_file_is_in_the_shared_mirror(shared_datasets):
    for spec in REGISTRY.values():
        if spec.generated is not None:  # made by code, written under paths.cache_dir
            continue
        for rel in spec.mirror.files:
            assert (shared_datasets / "raw" / rel).is_file(), rel
        assert (shared_datasets / "prompt-r1" / "eval" / spec.eval_file).is_file()


def test_authors_eval_rows_read_back(params):
    for spec in REGISTRY.values():
        rows = load_authors_eval(source_paths(params), spec)
        assert len(rows) == 128
        assert len({r.id for r in rows}) == 128 and rows[5].id == f"{spec.name}-eval-005"
        assert all(r.question and r.answers for r in rows)
        if spec.generated is not None:
            continue
        tags = set(
            pq.read_table(params.mirror / "prompt-r1" / "eval" / spec.eval_file)
            .column("data_source")
            .to_pylist()
        )
        assert tags == {spec.eval_tag}


def test_task_formats_match_the_authors_rows():
    assert title_task("A Tale of Two Cities — Book 2 Chapters 15-16") == (
        "Please write a short article based on the given title: A Tale of Two Cities — Book 2 Chapters 15-16."
    )
    assert title_task("The Golden Rule in Action.").endswith("title: The Golden Rule in Action.")
    assert writing_prompt_task("[ WP ] [ IP ] You summon the devil .") == (
        "Please write a short article based on the given title: 'You summon the devil .'"
    )
    assert (
        writing_prompt_task("No tag here")
        == "Please write a short article based on the given title: 'No tag here'"
    )
    assert article_task("A man was shot.") == "Please write an article: A man was shot."


def test_source_converters():
    rec = gsm8k_final_answer({"answers": ["He pays 3*4=12.\n#### 1,200"]}, {})
    assert rec["answers"] == ["1200"]
    with pytest.raises(Exception, match="answer_unparseable"):
        gsm8k_final_answer({"answers": ["no marker"]}, {})

    wrapped = (
        "Solve the following math problem step by step. The last line of your response should be of the form "
        "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\nWhat is 2+2?\n\n"
        'Remember to put your answer on its own line after "Answer:".'
    )
    assert dapo_unwrap({"question": wrapped}, {})["question"] == "What is 2+2?"
    assert dapo_unwrap({"question": "bare"}, {})["question"] == "bare"

    row = {"correct": "b", "options": "a ) 5.4 , b ) 5.6 , c ) 6"}
    assert mathqa_option_value({"answers": ["b"]}, row)["answers"] == ["5.6"]

    book = booksum_hub_title(
        {"question": "x"},
        {"book_id": "Emma.chapter 3", "summary_id": "chapter 3", "bid": 158, "source": "sparknotes"},
    )
    assert book["question"] == "Emma — chapter 3" and book["id"] == "booksum-chapter-158-sparknotes-chapter 3"

    rev = xsum_mirror_reverse(
        {
            "question": "Summarize the following BBC article in one sentence.\n\nDoc text.",
            "answers": ["One line."],
        },
        {},
    )
    assert rev["question"] == "One line." and rev["answers"] == ["Doc text."]


def test_hub_unreachable_is_a_clear_error(data_params, tmp_path, monkeypatch):
    """paths.mirror empty = the Hub; offline here, so the real datasets.load_dataset call fails cleanly."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    params = data_params(paths={"mirror": ""})
    with pytest.raises(
        DataError, match=r"gsm8k: cannot load hub:openai/gsm8k\[main\]:train .*data.allow_skip"
    ):
        run_sample(params, "gsm8k")
    assert not (tmp_path / "data" / "sampled" / "gsm8k.parquet").exists()


def test_hub_unreachable_and_allowed_to_skip_is_reported(data_params, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    params = data_params(paths={"mirror": ""}, data={"allow_skip": ["gsm8k"]})
    report = run_sample(params, "gsm8k")
    assert report.skipped and "cannot load hub:openai/gsm8k" in report.skip_reason
    table = pq.read_table(tmp_path / "data" / "sampled" / "gsm8k.parquet")
    assert table.num_rows == 0 and table.column_names[:3] == ["id", "question", "answers"]
    metrics = json.loads((tmp_path / "reports" / "sample" / "gsm8k.json").read_text())
    assert metrics["skipped"] is True and metrics["rows_written"] == 0 and metrics["shortfall"] == 5120
    assert metrics["warnings"] and "skipped" in metrics["warnings"][0]


def test_eval_only_dataset_is_not_sampled(params):
    with pytest.raises(DataError, match="evaluation-only"):
        run_sample(params, "xsum")


def test_the_generated_hops_source_is_sampled_validated_and_built(data_params):
    """The generated dataset goes through the same stages and Great Expectations suites as the others."""
    from pipeline.stages.build import run_build
    from pipeline.stages.sample import run_sample
    from pipeline.stages.validate import run_validate

    params = data_params(data={"train_datasets": ["hops"], "id_eval_datasets": ["hops"], "ood_eval_datasets": [],
                               "sample_size": 512})
    report = run_sample(params, "hops")
    assert (report.rows_source, report.rows_written, report.leaked_removed) == (798, 512, 0)
    assert report.source == [f"generated:{get_spec('hops').generated.version}"]
    summary = run_validate(params)
    assert summary["success"] and {f["kind"] for f in summary["files"].values()} == {"train", "eval"}
    built = run_build(params)
    assert built["train"]["rows"] == 512 and built["eval"]["hops"]["rows"] == 128
    assert built["eval"]["hops"]["template_reproduced"] == 128
    rows = load_authors_eval(source_paths(params), get_spec("hops"))
    assert rows[0].id == "hops-eval-000" and rows[0].question and rows[0].answers
