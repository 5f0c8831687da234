"""The plug-and-play matrix: the trained agent and the baselines with each environment, on the same rows.

The paper's claim: an agent trained against one environment works, unchanged, with another. The evaluate
stage runs the systems that use an environment (`prompt_r1`, `env_only`, `base_agent`, `gepa`; `agent_only`
answers alone and is the same whatever the environment) with the training environment and with every entry
of `evaluate.environments` (pipeline/config/matrix.py), and this module turns the answers into the matrix:
rows = the environment evaluated with, columns = the systems, cells = ID and OOD averages with CIs, and
prompt_r1's paired delta to each baseline *with the same environment* (the plug-and-play question is whether
the agent still adds something to the new environment, not whether the new environment is better).

Outputs:
- `metrics.json` key `matrix` (only when `evaluate.environments` lists any): the rows, each with its
  environment (backend, model, served name), averages, deltas and environment usage (an extra
  environment's row also its cost at its own prices); each extra environment's predictions are the evaluate
  run's table `eval/matrix/<name>/predictions.json`;
- summary.md's section "Plug-and-play matrix" (same condition): F1 per system and split, one row per
  environment;
- MLflow metrics `matrix/<environment>/<system>/<split>/<metric>` (+ `f1_low`/`f1_high`) and
  `matrix/<environment>/delta_vs_<baseline>/<split>/f1` (same condition);
- `matrix.csv`, a DVC plot, always (DVC needs the file): one row per environment × system × split, F1 with CI
  bounds, labelled `<evaluated with> | <system> | <split>`; with no extra environment it holds the training
  environment's rows alone. The other outputs of the default profile are unchanged.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from pipeline.config.matrix import TRAINING_ENVIRONMENT, EnvironmentVariant, resolve_variant
from pipeline.data.schema import write_text_atomic
from pipeline.evaluation.scores import SPLITS
from pipeline.evaluation.systems import BASELINES

if TYPE_CHECKING:
    from pipeline.config.environment import EnvironmentConfig
    from pipeline.config.sections import EvaluateConfig

MATRIX_FILE = "matrix.csv"
MATRIX_METRIC = "f1"
ENVIRONMENT_FREE = frozenset({"agent_only"})
"""Systems that never call the environment: one column of the main tables, not of the matrix."""


def matrix_baselines(baselines: list[str]) -> list[str]:
    """The configured baselines that use an environment, in report order."""
    return [b for b in BASELINES if b in baselines and b not in ENVIRONMENT_FREE]


def variant_environment(
    environment: EnvironmentConfig, evaluate: EvaluateConfig, variant: EnvironmentVariant
) -> EnvironmentConfig:
    """The entry's whole environment section (`variant` over the training `environment`), with the
    evaluation's sampling (`evaluate.env_temperature`, `evaluate.env_cache`)."""
    env = resolve_variant(environment, variant)
    env.temperature = evaluate.env_temperature
    env.cache = evaluate.env_cache
    return env


def _describe(cfg: EnvironmentConfig) -> dict[str, str]:
    return {"backend": cfg.backend, "model": cfg.model, "served_name": cfg.served_name}


def matrix_row(name: str, cfg: EnvironmentConfig, summary: dict[str, Any]) -> dict[str, Any]:
    """One row of the matrix from an aggregated summary (`pipeline.evaluation.scores.aggregate`) of the
    environment's answers: its environment-using systems' averages and prompt_r1's deltas."""
    systems = [s for s in summary["systems"] if s not in ENVIRONMENT_FREE]
    return {
        "name": name,
        "environment": _describe(cfg),
        "systems": systems,
        "averages": {s: summary["averages"][s] for s in systems},
        "deltas": {vs: d for vs, d in summary["deltas"].items() if vs.removeprefix("vs_") in systems},
        "env_usage": {s: u for s, u in summary.get("env_usage", {}).items() if s in systems},
    }


def build_matrix(
    training_env: EnvironmentConfig, summary: dict[str, Any], variant_rows: list[dict[str, Any]]
) -> dict[str, Any]:
    """metrics.json's `matrix`: the training environment's row (from the main summary) first, then each entry's."""
    training = matrix_row(TRAINING_ENVIRONMENT, training_env, summary)
    return {
        "trained_with": {"name": TRAINING_ENVIRONMENT, **_describe(training_env)},
        "metric": MATRIX_METRIC,
        "rows": [training, *variant_rows],
    }


def _matrix_or_training(summary: dict[str, Any], training_env: EnvironmentConfig) -> dict[str, Any]:
    return summary.get("matrix") or build_matrix(training_env, summary, [])


def matrix_plot_rows(matrix: dict[str, Any]) -> pd.DataFrame:
    """matrix.csv: F1 per evaluated-with environment × system × split, with CI bounds (the DVC plot)."""
    out = []
    for row in matrix["rows"]:
        for s in row["systems"]:
            for split in SPLITS:
                ci = row["averages"][s][split].get(MATRIX_METRIC)
                if ci is None:
                    continue
                out.append(
                    {
                        "label": f"{row['name']} | {s} | {split}",
                        "trained_with": matrix["trained_with"]["name"],
                        "evaluated_with": row["name"],
                        "served_name": row["environment"]["served_name"],
                        "system": s,
                        "split": split,
                        "metric": MATRIX_METRIC,
                        "score": ci["mean"],
                        "low": ci["low"],
                        "high": ci["high"],
                    }
                )
    return pd.DataFrame(
        out,
        columns=[
            "label",
            "trained_with",
            "evaluated_with",
            "served_name",
            "system",
            "split",
            "metric",
            "score",
            "low",
            "high",
        ],
    )


def write_matrix(summary: dict[str, Any], training_env: EnvironmentConfig, out_dir: Path) -> Path:
    """Write matrix.csv (always: DVC declares it as a plot) and return its path; without plug-and-play
    environments it holds the training environment's row (`training_env`) alone."""
    path = out_dir / MATRIX_FILE
    write_text_atomic(matrix_plot_rows(_matrix_or_training(summary, training_env)).to_csv(index=False), path)
    return path


def _cell(ci: dict[str, float] | None) -> str:
    return "–" if ci is None else f"{ci['mean']:.2f} [{ci['low']:.2f}, {ci['high']:.2f}]"


def matrix_markdown(summary: dict[str, Any]) -> list[str]:
    """summary.md's matrix section (empty without extra environments): one row per environment."""
    matrix = summary.get("matrix")
    if not matrix:
        return []
    trained = matrix["trained_with"]
    systems = list(dict.fromkeys(s for row in matrix["rows"] for s in row["systems"]))
    header = " | ".join(f"{s} {split.upper()}" for s in systems for split in SPLITS)
    lines = [
        "## Plug-and-play matrix (trained with × evaluated with)",
        "",
        (
            f"The agent trained with `{trained['name']}` ({trained['backend']}, `{trained['served_name']}`), "
            "evaluated unchanged with each environment on the same rows; the baselines with the same environment. "
            f"{MATRIX_METRIC.upper()} (mean [CI]); `agent_only` uses no environment (see Averages)."
        ),
        "",
        f"| trained with | evaluated with | served model | {header} |",
        "|---|---|---|" + "---|" * (len(systems) * len(SPLITS)),
    ]
    for row in matrix["rows"]:
        cells = [
            _cell(row["averages"][s][split].get(MATRIX_METRIC)) if s in row["averages"] else "–"
            for s in systems
            for split in SPLITS
        ]
        lines.append(
            f"| {trained['name']} | {row['name']} | `{row['environment']['served_name']}` | "
            + " | ".join(cells)
            + " |"
        )
    deltas = [
        (row["name"], vs, split, row["deltas"][vs][split].get(MATRIX_METRIC))
        for row in matrix["rows"]
        for vs in row["deltas"]
        for split in SPLITS
    ]
    if deltas:
        lines += [
            "",
            f"prompt_r1 − baseline with the same environment, {MATRIX_METRIC.upper()} (paired bootstrap):",
            "",
            "| evaluated with | vs | split | Δ [CI] |",
            "|---|---|---|---|",
        ]
        for name, vs, split, c in deltas:
            cell = "–" if c is None else f"{c['delta']:+.2f} [{c['low']:+.2f}, {c['high']:+.2f}]"
            lines.append(f"| {name} | {vs.removeprefix('vs_')} | {split} | {cell} |")
    return lines


def log_matrix_predictions(name: str, predictions: pd.DataFrame) -> None:
    """One extra environment's predictions, as the main run's (`evaluation_table`), to the active MLflow run:
    what each system answered with that environment. No DVC output: the default profile's files stay as
    they are, and predictions.parquet keeps one environment."""
    import mlflow

    from pipeline.evaluation.traces import evaluation_table

    mlflow.log_table(evaluation_table(predictions, {}), artifact_file=f"eval/matrix/{name}/predictions.json")


def matrix_metrics(summary: dict[str, Any]) -> dict[str, float]:
    """MLflow metrics of the matrix (none without extra environments)."""
    out: dict[str, float] = {}
    for row in (summary.get("matrix") or {}).get("rows", []):
        prefix = f"matrix/{row['name']}"
        for s, per_split in row["averages"].items():
            for split, entry in per_split.items():
                for m, ci in entry.items():
                    out[f"{prefix}/{s}/{split}/{m}"] = ci["mean"]
                    if m == MATRIX_METRIC:
                        out[f"{prefix}/{s}/{split}/{m}_low"] = ci["low"]
                        out[f"{prefix}/{s}/{split}/{m}_high"] = ci["high"]
        for vs, per_split in row["deltas"].items():
            for split, entry in per_split.items():
                if MATRIX_METRIC in entry:
                    out[f"{prefix}/delta_{vs}/{split}/{MATRIX_METRIC}"] = entry[MATRIX_METRIC]["delta"]
    return out
