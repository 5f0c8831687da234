"""The plug-and-play matrix: `evaluate.environments`, its report, and a real two-environment run.

The fast tests check the config entries (merge over the training environment, refusals naming the entry) and
the matrix's outputs on hand-made aggregates; the slow one runs evaluate with the llama.cpp environment (the
training one) and the knowledgeable server (pipeline/environment/simulated/knowledge.py) as the second environment,
and reads the matrix back from summary.md, matrix.csv and MLflow.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

from pipeline.config import ConfigError, load_params
from pipeline.config.matrix import TRAINING_ENVIRONMENT
from pipeline.evaluation.matrix import (
    build_matrix,
    matrix_baselines,
    matrix_markdown,
    matrix_metrics,
    matrix_plot_rows,
    matrix_row,
    variant_environment,
)

ROOT = Path(__file__).resolve().parents[1]


def _load(evaluate: dict, environment: dict | None = None, profile: str | None = None):
    overrides: dict = {"evaluate": evaluate}
    if environment:
        overrides["environment"] = environment
    if profile:
        overrides["profile"] = profile
    return load_params(ROOT / "params.yaml", overrides)


# --- the config --------------------------------------------------------------------------------------------


def test_default_is_the_training_environment_only():
    params = load_params(ROOT / "params.yaml")
    assert params.evaluate.environments == []


def test_an_entry_changes_only_its_keys_and_a_moved_endpoint_drops_the_inherited_url():
    params = _load(
        {
            "environments": [
                {
                    "name": "kb",
                    "backend": "knowledge",
                    "model": "kb",
                    "served_name": "kb",
                    "port": 8799,
                    "knowledge": {"min_overlap": 0.5},
                },
                {"name": "other-model", "served_name": "other", "max_tokens": 64},
            ],
            "env_temperature": 0.0,
            "env_cache": False,
        },
        environment={"base_url": "http://127.0.0.1:9999/v1", "temperature": 0.7},
    )
    first, second = params.evaluate.environments
    kb = variant_environment(params.environment, params.evaluate, first)
    assert (kb.backend, kb.served_name, kb.port, kb.url) == (
        "knowledge",
        "kb",
        8799,
        "http://127.0.0.1:8799/v1",
    )
    assert kb.knowledge.min_overlap == 0.5 and kb.knowledge.sources == params.environment.knowledge.sources
    assert kb.system_prompt == params.environment.system_prompt  # inherited
    assert (kb.temperature, kb.cache) == (0.0, False)  # the evaluation's sampling, not the training's 0.7
    same_endpoint = variant_environment(params.environment, params.evaluate, second)
    assert same_endpoint.url == "http://127.0.0.1:9999/v1" and same_endpoint.max_tokens == 64
    assert params.environment.served_name != "other"  # the training section itself is untouched


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        ([{"name": "a", "temperature": 0.5}], "env_temperature"),
        ([{"name": "a", "modle": "x"}], "modle"),
        ([{"name": "a"}], "changes nothing"),
        ([{"name": TRAINING_ENVIRONMENT, "served_name": "x"}], "training environment's row"),
        ([{"name": "a b", "served_name": "x"}], "name"),
        ([{"name": "a", "served_name": "x"}, {"name": "a", "served_name": "y"}], r"environments\[1\].*twice"),
        ([{"name": "a", "max_tokens": 0}], r"environments\[0\] \('a'\)\.max_tokens"),
        ([{"name": "a", "backend": "api"}], r"environments\[0\].*base_url"),
        ([{"name": "a", "backend": "api", "base_url": "https://u:secret@example.com/v1"}], "credentials"),
        ([{"name": "a", "backend": "knowledge", "port": 8766}], "agent server's port"),
        ([{"name": "a", "model": "other.gguf"}], "cannot be told apart"),
    ],
)
def test_a_bad_entry_fails_at_load_naming_it(entries, message):
    with pytest.raises(ConfigError, match=message):
        _load({"environments": entries})


def test_api_profile_lists_gpt_oss_20b_beside_gpt_4o_mini():
    params = load_params(ROOT / "params.yaml", {"profile": "api"})
    assert params.environment.served_name == "gpt-4o-mini"
    [entry] = params.evaluate.environments
    env = variant_environment(params.environment, params.evaluate, entry)
    assert (entry.name, env.served_name, env.model) == ("gpt-oss-20b", "gpt-oss-20b", "openai/gpt-oss-20b")
    assert env.base_url == "" and env.url == "http://127.0.0.1:8000/v1"  # not the OpenAI URL it would inherit


def test_matrix_baselines_are_those_that_use_an_environment():
    assert matrix_baselines(["gepa", "agent_only", "env_only", "base_agent"]) == [
        "env_only",
        "base_agent",
        "gepa",
    ]


# --- the report, on hand-made aggregates ---------------------------------------------------------------------


def _matrix_table(md: str) -> list[str]:
    """The matrix table's body rows in summary.md: the lines after its header up to the first blank line."""
    lines = md.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| trained with | evaluated with |"))
    body = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        body.append(line)
    return body


def _ci(mean: float) -> dict[str, float]:
    return {"mean": mean, "low": mean - 5, "high": mean + 5}


def _aggregate(f1: dict[str, float]) -> dict:
    systems = list(f1)
    return {
        "systems": systems,
        "averages": {
            s: {"id": {"f1": _ci(v), "em": _ci(v / 2)}, "ood": {"f1": _ci(v + 1)}} for s, v in f1.items()
        },
        "deltas": {
            f"vs_{s}": {
                "id": {"f1": {"delta": f1["prompt_r1"] - v, "low": -1.0, "high": 1.0}},
                "ood": {"f1": {"delta": 0.0, "low": -1.0, "high": 1.0}},
            }
            for s, v in f1.items()
            if s != "prompt_r1"
        },
        "env_usage": {s: {"calls": 1} for s in systems},
    }


def test_matrix_outputs_one_row_per_environment(params):
    main = _aggregate({"prompt_r1": 30.0, "env_only": 20.0, "agent_only": 10.0})
    with_kb = _load({"environments": [{"name": "kb", "served_name": "kb"}]})
    other = variant_environment(with_kb.environment, with_kb.evaluate, with_kb.evaluate.environments[0])
    rows = [matrix_row("kb", other, _aggregate({"prompt_r1": 60.0, "env_only": 50.0}))]
    main["matrix"] = build_matrix(params.environment, main, rows)

    md = "\n".join(matrix_markdown(main))
    table = _matrix_table(md)
    assert [line.split(" | ")[1] for line in table] == [TRAINING_ENVIRONMENT, "kb"]
    assert "| prompt_r1 ID | prompt_r1 OOD | env_only ID | env_only OOD |" in md
    assert "agent_only ID" not in md  # it uses no environment: not a column of the matrix
    assert "60.00 [55.00, 65.00]" in table[1] and "30.00 [25.00, 35.00]" in table[0]
    assert "| kb | env_only | id | +10.00 [-1.00, +1.00] |" in md

    metrics = matrix_metrics(main)
    assert metrics["matrix/kb/prompt_r1/id/f1"] == 60.0 and metrics["matrix/training/prompt_r1/id/f1"] == 30.0
    assert metrics["matrix/kb/prompt_r1/id/f1_low"] == 55.0 and metrics["matrix/kb/env_only/ood/f1"] == 51.0
    assert metrics["matrix/kb/delta_vs_env_only/id/f1"] == 10.0
    assert not any(k.startswith("matrix/training/agent_only") for k in metrics)

    plot = matrix_plot_rows(main["matrix"])
    assert list(dict.fromkeys(plot.evaluated_with)) == [TRAINING_ENVIRONMENT, "kb"]
    assert len(plot) == 2 * 2 * 2  # environments × matrix systems × splits
    assert set(plot.trained_with) == {TRAINING_ENVIRONMENT}
    assert plot.set_index("label").loc["kb | prompt_r1 | id", "score"] == 60.0


def test_without_extra_environments_the_report_is_unchanged_but_the_plot_has_the_training_row(
    tmp_path, params
):
    from pipeline.evaluation.matrix import write_matrix

    summary = _aggregate({"prompt_r1": 30.0, "env_only": 20.0})
    assert matrix_markdown(summary) == [] and matrix_metrics(summary) == {}
    plot = pd.read_csv(write_matrix(summary, params.environment, tmp_path))
    assert set(plot.evaluated_with) == {TRAINING_ENVIRONMENT} and len(plot) == 4


# --- a real two-environment run (slow) -------------------------------------------------------------------------


@pytest.mark.slow
def test_two_environment_micro_run_shows_the_matrix_everywhere(
    tmp_path, repo_root, shared_datasets, llama_server, tiny_llama_dir
):
    """Trained with llama.cpp (SmolLM2), evaluated with it and with the knowledgeable server: the matrix is in
    summary.md, matrix.csv and the evaluate run's MLflow metrics (read through MlflowClient), one row each."""
    import mlflow
    from conftest import free_port
    from helpers import FIXTURES, make_project

    from pipeline.stages import evaluate as E

    project = make_project(tmp_path, repo_root, shared_datasets, {"hotpotqa": "id", "triviaqa": "ood"})
    shutil.copytree(FIXTURES / "gepa", project / "data" / "gepa")
    params = load_params(
        project / "params.yaml",
        {
            "paths": {"model_dir": str(tiny_llama_dir)},
            "data": {"id_eval_datasets": ["hotpotqa"], "ood_eval_datasets": ["triviaqa"]},
            "agent": {"max_turns": 2, "max_prompt_tokens": 1536},
            "environment": {"base_url": llama_server, "max_tokens": 24},
            "evaluate": {
                "agent_engine": "transformers",
                "rows_per_dataset": 2,
                "agent_max_turn_tokens": 24,
                "bootstrap_samples": 100,
                "baselines": ["env_only", "agent_only", "gepa"],
                "environments": [
                    {
                        "name": "knowledgeable",
                        "backend": "knowledge",
                        "model": "knowledge-base",
                        "served_name": "knowledge-base",
                        "port": free_port(),
                        "knowledge": {"sources": ["data/rl/eval"]},
                    }
                ],
            },
            "mlflow": {"trace_evaluation": False},
        },
    )
    summary = E.run_evaluate(params)
    out = project / "reports" / "eval"

    names = [TRAINING_ENVIRONMENT, "knowledgeable"]
    matrix = json.loads((out / "metrics.json").read_text())["matrix"]
    assert [r["name"] for r in matrix["rows"]] == names
    assert matrix["rows"][1]["environment"]["backend"] == "knowledge"
    assert matrix["rows"][1]["systems"] == ["prompt_r1", "env_only", "gepa"]
    # the knowledgeable server knows every gold answer: env_only scores with it, and it was really asked
    assert (
        matrix["rows"][1]["env_usage"]["env_only"]["calls"]
        + matrix["rows"][1]["env_usage"]["env_only"]["cache_hits"]
        == 4
    )
    assert summary["matrix"]["rows"][1]["averages"]["env_only"]["id"]["f1"]["mean"] > 0

    md = (out / "summary.md").read_text()
    assert "## Plug-and-play matrix" in md
    table = _matrix_table(md)
    assert [line.split(" | ")[1] for line in table] == names
    assert "`knowledge-base`" in table[1] and f"`{params.environment.served_name}`" in table[0]

    plot = pd.read_csv(out / "matrix.csv")
    assert list(dict.fromkeys(plot.evaluated_with)) == names
    assert set(plot.system) == {"prompt_r1", "env_only", "gepa"} and len(plot) == 2 * 3 * 2

    client = mlflow.MlflowClient(tracking_uri=mlflow.get_tracking_uri())
    assert mlflow.get_tracking_uri().startswith("sqlite:") and str(project) in mlflow.get_tracking_uri()
    exp = client.get_experiment_by_name(params.mlflow.experiment)
    [run] = client.search_runs([exp.experiment_id], filter_string="tags.stage = 'evaluate'")
    logged = {k for k in run.data.metrics if k.startswith("matrix/")}
    assert {k.split("/")[1] for k in logged} == set(names)
    for name in names:
        for system in ("prompt_r1", "env_only", "gepa"):
            assert f"matrix/{name}/{system}/id/f1" in logged and f"matrix/{name}/{system}/ood/f1" in logged
    kb_f1 = run.data.metrics["matrix/knowledgeable/env_only/id/f1"]
    assert kb_f1 == summary["matrix"]["rows"][1]["averages"]["env_only"]["id"]["f1"]["mean"]
    assert "eval/matrix.csv" in {a.path for a in client.list_artifacts(run.info.run_id, "eval")}
    kb_table = mlflow.load_table("eval/matrix/knowledgeable/predictions.json", run_ids=[run.info.run_id])
    assert len(kb_table) == 3 * 2 * 2 and set(kb_table.system) == {"prompt_r1", "env_only", "gepa"}
    assert matrix["rows"][1]["cost"]["env_only"]["questions"] == 4
    print("\n".join(line for line in md.split("## Plug-and-play matrix")[1].split("\n## ")[0].splitlines()))
