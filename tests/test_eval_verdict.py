"""summary.md says what it found: the verdict first (who wins, by how much, with the CI, and why when the setup
is not the paper's), each metric defined once, one spelling (SSim), and gepa's rows saying when GEPA kept the
seed instruction. On evaluation outputs real runs recorded (benchmarks/results)."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest

from pipeline.evaluation.paper import paper_comparison
from pipeline.evaluation.plan import EvaluatePlan
from pipeline.evaluation.summary import summary_markdown

ROOT = Path(__file__).resolve().parents[1]
RECORDED = ROOT / "benchmarks" / "results" / "pipeline_avx512_final_eval_metrics.json"
"""A default-profile run: env_only ID F1 5.64 against prompt_r1's 1.09, Δ −4.55 [−7.66, −2.01]."""
FIXTURES = ROOT / "tests" / "fixtures"


@pytest.fixture()
def recorded(params, tmp_path):
    params.paths.gepa_dir = str(FIXTURES / "gepa")  # a gepa record that kept the seed (candidate 0)
    params.paths.reports_dir = str(tmp_path / "reports")
    return json.loads(RECORDED.read_text()), params


def _section(md: str, title: str) -> str:
    return md.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def _outcomes(summary: dict) -> dict:
    """How a run's answers ended, as `scores.answer_outcomes` counts them: base_agent never acted (every row
    `no_action`, hence its zeros), prompt_r1 ran out of turns on 12 rows of 48."""
    datasets = [d for split in ("id", "ood") for d in summary["datasets"][split]]
    n = summary["rows_per_dataset"]
    reasons = {"prompt_r1": {"answer": 32, "max_turns": 12, "no_action": 4}, "base_agent": {"no_action": 48}}
    empties = {"prompt_r1": 16, "base_agent": 48}
    out = {}
    for system in summary["systems"]:
        stops = reasons.get(system, {"answer": n * len(datasets)})
        empty = empties.get(system, 0)
        per_dataset = {d: {"rows": n, "empty": min(n, max(0, empty - n * i))} for i, d in enumerate(datasets)}
        out[system] = {"rows": n * len(datasets), "empty": empty, "stop_reasons": stops, "per_dataset": per_dataset}
    return out


def _sentences(text: str) -> list[str]:
    """Sentences end with '.', '!' or '?' before a space or the end (decimals like 5.64 do not end one)."""
    return [s for s in re.split(r"(?<=[.!?])\s+", text.strip()) if s]


def test_verdict_opens_the_summary_with_the_winner_the_difference_and_why(recorded):
    summary, params = recorded
    summary["outcomes"] = _outcomes(summary)
    md = summary_markdown(summary, EvaluatePlan.for_evaluate(params))
    assert md.startswith("# Evaluation summary\n\n## Verdict\n\n")
    verdict = _section(md, "Verdict")
    paragraph = verdict.split("\n\n", 1)[0]
    assert len(_sentences(paragraph)) <= 3, _sentences(paragraph)
    assert ("ID: `env_only` wins with F1 5.64 [3.31, 8.86]; `prompt_r1` has 1.09 [0.30, 2.06]: Δ -4.55 "
            "[-7.66, -2.01] points (`prompt_r1` − `env_only`, paired bootstrap); the CI excludes 0") in paragraph
    assert "OOD: `env_only` wins" in paragraph
    # why this run is not the paper's: what differs, and what it does to the ordering, in one sentence
    assert "Not the paper's setup, so its ordering need not hold:" in paragraph
    assert "a 135M-parameter environment instead of GPT-4o-mini" in paragraph
    assert "4 rows per set instead of 128" in paragraph
    assert "GEPA kept the seed instruction" not in paragraph


def test_the_verdict_is_followed_by_the_stop_reasons_of_each_system(recorded):
    """Why answers failed, right after the verdict: zeros everywhere read as "never acted", not "answered wrong"."""
    summary, params = recorded
    summary["outcomes"] = _outcomes(summary)
    md = summary_markdown(summary, EvaluatePlan.for_evaluate(params))
    assert md.index("## Verdict") < md.index("## How the answers ended") < md.index("## Metrics")
    table = _section(md, "How the answers ended")
    assert "| system | rows | answer | no_action | max_turns | empty answers |" in table
    assert "| base_agent | 48 | 0 | 48 | 0 | 48 |" in table
    assert "| prompt_r1 | 48 | 32 | 4 | 12 | 16 |" in table
    assert "| gepa (kept the seed) | 48 | 48 | 0 | 0 | 0 |" in table
    assert "`max_turns`: the turn limit, no answer" in table
    assert "GEPA kept the seed instruction" in table


def test_each_metric_is_defined_once_and_spelled_one_way(recorded):
    summary, params = recorded
    md = summary_markdown(summary, EvaluatePlan.for_evaluate(params))
    for name in ("EM", "SM", "F1", "SSim"):
        assert md.count(f"- **{name}**:") == 1, name
    assert "SSIM" not in md and "| SSim |" in md
    assert "| booksum | SSim |" in md  # the per-dataset table
    assert "| prompt_r1 | writingprompts | SSim |" in md  # the paper's table


def test_gepa_rows_say_when_gepa_kept_the_seed(recorded, tmp_path):
    summary, params = recorded
    md = summary_markdown(summary, EvaluatePlan.for_evaluate(params))
    averages = _section(md, "Averages")
    assert "| gepa (kept the seed) | id |" in averages and "| gepa | id |" not in averages
    assert "| gepa (kept the seed) | id |" in _section(md, "Deltas of prompt_r1 (paired bootstrap)")
    # a record whose optimised instruction is a proposal: plain `gepa`, and no such sentence
    record = json.loads((FIXTURES / "gepa" / "prompt.json").read_text())
    record["optimised"] = {**record["optimised"], "candidate": 2, "instruction": "Reply with the answer only."}
    (tmp_path / "gepa").mkdir()
    (tmp_path / "gepa" / "prompt.json").write_text(json.dumps(record))
    params.paths.gepa_dir = str(tmp_path / "gepa")
    md = summary_markdown(summary, EvaluatePlan.for_evaluate(params))
    assert "| gepa | id |" in _section(md, "Averages") and "kept the seed" not in md


def test_verdict_when_prompt_r1_wins_on_the_papers_setup(recorded):
    summary, params = copy.deepcopy(recorded[0]), recorded[1]
    summary["averages"]["prompt_r1"]["id"]["f1"] = {"mean": 42.45, "low": 40.0, "high": 45.0}
    summary["deltas"]["vs_env_only"]["id"]["f1"] = {"delta": 1.2, "low": -0.5, "high": 2.9}
    params.agent.model = "Qwen/Qwen3-4B"
    params.environment.model = params.environment.served_name = "gpt-4o-mini"
    summary["rows_per_dataset"] = 128
    summary["paper"] = paper_comparison(summary, params.agent.model, params.environment)
    verdict = _section(summary_markdown(summary, EvaluatePlan.for_evaluate(params)), "Verdict")
    assert ("ID: `prompt_r1` wins with F1 42.45 [40.00, 45.00], ahead of `env_only` (5.64 [3.31, 8.86]): "
            "Δ +1.20 [-0.50, +2.90] points (`prompt_r1` − `env_only`, paired bootstrap); the CI includes 0: "
            "within noise") in verdict
    assert "not the paper's setup" not in verdict.lower()


def test_the_summary_says_the_headline_in_words_embeds_the_picture_and_links_its_runs(recorded, tmp_path):
    """summary.md's headline: each `dvc metrics show` figure with what it is, the gains against the system
    they are measured on with their CI; the quality-against-cost PNG by a link relative to reports/eval/; and,
    written inside the evaluate run, links to that run and its parent in the MLflow UI."""
    import mlflow

    summary, params = recorded
    md = summary_markdown(summary, EvaluatePlan.for_evaluate(params))
    head = _section(md, "Headline (`dvc metrics show`)")
    assert "| `f1_id` | 1.1 | prompt_r1's F1, in-distribution sets |" in head
    assert "| `f1_gain_id` | -4.5 | prompt_r1's F1 minus env_only's (the best other system), ID; " \
           "95% CI [-7.66, -2.01] |" in head
    assert "| `env_tokens` | 453 |" in head
    assert "![F1 against environment tokens per question, per system and split](plots/quality_vs_cost.png)" in head
    assert "## MLflow" not in md  # no active run: nothing to link
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = mlflow.set_experiment("summary-links").experiment_id
    with mlflow.start_run() as parent, mlflow.start_run(nested=True) as child:
        linked = summary_markdown(summary, EvaluatePlan.for_evaluate(params))
    links = _section(linked, "MLflow")
    assert f"[pipeline run](http://127.0.0.1:5000/#/experiments/{experiment}/runs/{parent.info.run_id})" in links
    assert f"[evaluate run](http://127.0.0.1:5000/#/experiments/{experiment}/runs/{child.info.run_id})" in links
    assert "mlflow ui --backend-store-uri sqlite:///" in links


def test_gepa_s_cost_row_does_not_call_a_kept_seed_a_success():
    """The cost table's GEPA row: when GEPA kept the seed, its proposals are said to have not beaten it (they
    may still have been accepted into the search's pool); otherwise how many were accepted."""
    from pipeline.evaluation.costs import gepa_one_off

    record = json.loads((FIXTURES / "gepa" / "prompt.json").read_text())
    assert record["optimised"]["candidate"] == 0
    kept = gepa_one_off(record)["what"]
    assert "none beat the seed on the val slice" in kept and f"({record['cost']['accepted']} accepted)" not in kept
    record["optimised"]["candidate"] = 1
    assert gepa_one_off(record)["what"].endswith(f"proposals ({record['cost']['accepted']} accepted)")


def test_one_colour_per_system_in_the_vega_template_and_every_png(recorded, tmp_path):
    """`SYSTEM_COLOURS` is the one mapping: the DVC Vega template's colour scale lists it, and the report's PNGs
    (per-set bars, quality against cost) draw each system in its colour (its exact RGB is in the image)."""
    import matplotlib.image as mpimg
    import numpy as np

    from pipeline.evaluation.costs import quality_cost_rows
    from pipeline.evaluation.plots import PLOT_METRIC, write_plots, write_quality_cost_plot
    from pipeline.evaluation.systems import SYSTEM_COLOURS

    template = json.loads((ROOT / ".dvc" / "plots" / "grouped_bars.json").read_text())
    scale = template["spec"]["encoding"]["color"]["scale"]
    assert dict(zip(scale["domain"], scale["range"], strict=True)) == SYSTEM_COLOURS
    summary, _ = recorded

    def has(path, colour: str) -> bool:
        rgb = np.round(mpimg.imread(path)[..., :3] * 255).astype(int)
        want = [int(colour[i:i + 2], 16) for i in (1, 3, 5)]
        return bool((np.abs(rgb - want).sum(-1) <= 3).any())

    bars = write_plots(summary, tmp_path / "plots")[0]
    points = quality_cost_rows(summary, PLOT_METRIC)
    cost = write_quality_cost_plot(points, tmp_path / "cost.png")
    assert all(has(bars, SYSTEM_COLOURS[s]) for s in summary["systems"])
    # in the scatter a system drawn later on exactly the same points hides one (gepa kept the seed: env_only's)
    at = {s: sorted(map(tuple, points[points["system"] == s][["env_tokens_per_question", PLOT_METRIC]].values))
          for s in summary["systems"]}
    shown = [s for i, s in enumerate(summary["systems"]) if all(at[s] != at[t] for t in summary["systems"][i + 1:])]
    assert "env_only" not in shown and len(shown) == 4
    assert all(has(cost, SYSTEM_COLOURS[s]) for s in shown)
    assert not has(bars, "#8c564b")  # the check can fail: a colour no system has is not found
