"""The evaluation report: metrics.json's content turned into files and MLflow records.

Outputs, all under `reports/eval/`:
- `metrics.json`: the content `scores.aggregate` builds plus environment usage and wall time (a DVC output);
- `headline.json`: the few figures two runs are compared on (`pipeline.tracking.headline`; the one DVC metric, one
  `dvc metrics show` row within 120 columns); `figures.json`: the wider set, `dvc metrics show
  reports/eval/figures.json` on demand;
- `plot_data.csv` (the DVC plot) and `plots/<dataset>.png`: pipeline/evaluation/plots.py;
- `predictions.parquet`: one row per question per system: inputs, prediction, per-metric scores in both
  modes, the trajectory as JSON, environment usage;
- `quality_cost.csv` and `plots/quality_vs_cost.png`: one point per system and split, F1 against the
  environment tokens per question (the DVC scatter plot, and its labelled PNG drawn by plots.py);
- `matrix.csv` (pipeline/evaluation/matrix.py): the plug-and-play matrix's DVC plot; summary.md, metrics.json
  and MLflow get the matrix when `evaluate.environments` lists extra environments.
- `summary.md`: the verdict first, then the tables (pipeline/evaluation/summary.py).

Design decisions:
- **Atomic writes** (temporary file + rename): a killed stage never leaves a half-written output.
- **No secrets in `predictions.parquet`**: its strings keep the environment's replies whole but pass the
  secret redaction of `pipeline.environment.sanitize` (`redact_value`), so an endpoint echoing the API key
  leaves it in no DVC output.
- **MLflow** gets one sentence for the run's description (`describe_evaluation`: systems, rows, F1 per
  system and split), the same numbers under flat keys (`flat_metrics`), the evaluation rows as dataset inputs,
  the predictions as a table (`evaluation.traces.evaluation_table`, each row naming its trace), and the
  files above as artifacts of the evaluate run; the parent run gets the headline figures
  (`headline.parent_metrics`), so two pipeline runs compare on their parents alone. The table's text (predictions and turns that may quote the
  environment's replies) is sanitised first (`pipeline.environment.sanitize`): secrets redacted, control
  characters escaped, each string capped (`evaluation_table`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import pyarrow as pa

from pipeline import metrics as M
from pipeline.data.schema import write_json_atomic, write_parquet_atomic, write_text_atomic
from pipeline.environment.sanitize import redact_value
from pipeline.evaluation.costs import quality_cost_rows
from pipeline.evaluation.matrix import MATRIX_FILE, matrix_metrics
from pipeline.evaluation.plots import PLOT_METRIC, plot_rows, write_plots, write_quality_cost_plot
from pipeline.evaluation.scores import SPLITS, Scores, other_mode
from pipeline.evaluation.summary import gepa_record, summary_markdown
from pipeline.evaluation.systems import Answer
from pipeline.evaluation.traces import TraceIds, evaluation_table
from pipeline.stage_files import EVAL_SUMMARY_FILE, FIGURES_FILE, HEADLINE_FILE, METRICS_FILE
from pipeline.tracking.headline import figures, headline, last_step_reward, parent_metrics
from pipeline.types import EvalRow

if TYPE_CHECKING:
    from pipeline.evaluation.plan import EvaluatePlan


def predictions_frame(all_answers: dict[str, dict[str, list[Answer]]], all_scores: dict[str, Scores],
                      rows_by_ds: dict[str, list[EvalRow]]) -> pd.DataFrame:
    """One row per (system, question): inputs, prediction, per-metric scores (both modes), trajectory, usage."""
    records = []
    for system, answers in all_answers.items():
        for name, rows in rows_by_ds.items():
            for i, (row, ans) in enumerate(zip(rows, answers[name], strict=True)):
                rec: dict[str, Any] = {
                    "system": system, "dataset": name, "split": row.split, "row": row.index, "uid": row.id,
                    "question": row.question, "gold": list(row.answers), "prediction": ans.prediction,
                }
                for metric in M.ALL_METRICS:
                    rec[metric] = all_scores[system]["ours"][name].get(metric, [np.nan] * len(rows))[i]
                    rec[f"ref_{metric}"] = all_scores[system]["reference"][name].get(metric, [np.nan] * len(rows))[i]
                rec.update({
                    "turns": ans.turns, "stop_reason": ans.stop_reason,
                    "trajectory": json.dumps(ans.trajectory, ensure_ascii=False, default=str),
                    "env_calls": ans.usage.calls, "env_cache_hits": ans.usage.cache_hits,
                    "env_prompt_tokens": ans.usage.prompt_tokens,
                    "env_completion_tokens": ans.usage.completion_tokens,
                    "env_errors": ans.usage.errors, "env_cost_usd": ans.usage.cost_usd, "seconds": ans.seconds,
                })
                records.append(rec)
    return pd.DataFrame.from_records(records)


def describe_evaluation(summary: dict[str, Any]) -> str:
    """One sentence for the run's description: what was evaluated and each system's average F1 (ID / OOD)."""
    scores = []
    for s in summary["systems"]:
        av = summary["averages"][s]
        cells = [f"{av[split][PLOT_METRIC]['mean']:.1f}" if av[split].get(PLOT_METRIC) else "–" for split in SPLITS]
        scores.append(f"{s} {cells[0]} / {cells[1]}")
    return (f"Evaluated {len(summary['systems'])} systems on {len(summary['per_dataset'])} datasets × "
            f"{summary['rows_per_dataset']} rows in {summary.get('wall_s', 0):.0f} s ({summary['mode']} metrics); "
            f"{PLOT_METRIC.upper()} ID / OOD in points: " + "; ".join(scores) + ".")


def flat_metrics(summary: dict[str, Any]) -> dict[str, float]:
    """MLflow metric keys: `<system>/<dataset>/<metric>`, `<system>/<split>/<metric>[_low|_high]`, deltas."""
    out: dict[str, float] = {}
    for d, per_system in summary["per_dataset"].items():
        for s, entry in per_system.items():
            for m, ci in entry.items():
                out[f"{s}/{d}/{m}"] = ci["mean"]
    for s, per_split in summary["averages"].items():
        for split, entry in per_split.items():
            for m, ci in entry.items():
                out[f"{s}/{split}/{m}"] = ci["mean"]
                out[f"{s}/{split}/{m}_low"] = ci["low"]
                out[f"{s}/{split}/{m}_high"] = ci["high"]
    for vs, per_split in summary["deltas"].items():
        for split, entry in per_split.items():
            for m, c in entry.items():
                out[f"delta_{vs}/{split}/{m}"] = c["delta"]
    other = other_mode(summary["mode"])
    for s, per_split in summary[other]["averages"].items():
        for split, entry in per_split.items():
            for m, ci in entry.items():
                out[f"{other}/{s}/{split}/{m}"] = ci["mean"]
    for s, u in summary["env_usage"].items():
        for k, v in u.items():
            out[f"env/{s}/{k}"] = float(v)
    for s, c in summary.get("cost", {}).get("inference", {}).items():
        for k, v in c.items():
            out[f"cost/{s}/{k}"] = float(v)
    for s, c in summary.get("cost", {}).get("one_off", {}).items():
        for k, v in (c or {}).items():
            if k != "what":
                out[f"one_off/{s}/{k}"] = float(v)
    for r in summary.get("paper", {}).get("rows", []):
        if r["delta"] is not None:
            out[f"vs_paper/{r['system']}/{r['scope']}/{r['metric']}"] = r["delta"]
    out.update(matrix_metrics(summary))
    return out


def write_reports(summary: dict[str, Any], predictions: pd.DataFrame, plan: EvaluatePlan) -> list[Path]:
    """Every file of the report under `plan.out_dir`, each written atomically; returns the plots' paths.

    The predictions keep the environment's replies whole but with secrets redacted (`redact_value`): a
    server echoing the API key must not put it in a DVC output."""
    out_dir = plan.out_dir
    redacted = predictions.copy()
    for column in redacted.columns:
        if pd.api.types.is_object_dtype(redacted[column]) or pd.api.types.is_string_dtype(redacted[column]):
            redacted[column] = redacted[column].map(redact_value, na_action="ignore")
    write_parquet_atomic(pa.Table.from_pandas(redacted, preserve_index=False), out_dir / "predictions.parquet")
    write_json_atomic(summary, out_dir / METRICS_FILE)
    write_json_atomic(headline(summary), out_dir / HEADLINE_FILE)
    write_json_atomic(figures(summary, last_step_reward(plan.steps_csv)), out_dir / FIGURES_FILE)
    write_text_atomic(plot_rows(summary).to_csv(index=False), out_dir / "plot_data.csv")
    plots = write_plots(summary, out_dir / "plots")
    if "cost" in summary:
        points = quality_cost_rows(summary, PLOT_METRIC)
        write_text_atomic(points.to_csv(index=False), out_dir / "quality_cost.csv")
        plots.append(write_quality_cost_plot(points, out_dir / "plots" / "quality_vs_cost.png"))
    write_text_atomic(summary_markdown(summary, plan), out_dir / EVAL_SUMMARY_FILE)
    return plots


def _input_frame(rows: list[EvalRow]) -> pd.DataFrame:
    return pd.DataFrame({
        "uid": [r.id for r in rows],
        "question": [r.question for r in rows],
        "gold_answers": [json.dumps(r.answers, ensure_ascii=False) for r in rows],
    })


def log_mlflow(summary: dict[str, Any], predictions: pd.DataFrame, rows_by_ds: dict[str, list[EvalRow]],
               plan: EvaluatePlan, plots: list[Path], trace_ids: TraceIds | None = None) -> None:
    """Params, flat metrics, dataset inputs, the predictions table (each row with its trace id, when traced)
    and the report files (in `plan.out_dir`), to the active run. The engine logged is the one that ran
    (`plan.engine`)."""
    import mlflow

    from pipeline.tracking.runs import log_dataset_inputs, log_parent_metrics

    out_dir = plan.out_dir
    mlflow.log_params({"evaluate.rows_per_dataset": plan.evaluate.rows_per_dataset,
                       "evaluate.systems": ",".join(summary["systems"]),
                       "evaluate.metrics_mode": plan.evaluate.metrics_mode,
                       "evaluate.agent_engine": plan.engine})
    mlflow.log_metrics(flat_metrics(summary))
    log_parent_metrics(parent_metrics(summary))
    log_dataset_inputs({f"eval/{d}": (_input_frame(rows), plan.rows_dir / f"{d}.parquet")
                        for d, rows in rows_by_ds.items()}, context="evaluation")
    mlflow.log_table(evaluation_table(predictions, trace_ids or {}), artifact_file="eval/predictions.json")
    for name in (METRICS_FILE, HEADLINE_FILE, FIGURES_FILE, EVAL_SUMMARY_FILE, "plot_data.csv", "quality_cost.csv", MATRIX_FILE):
        if (out_dir / name).is_file():
            mlflow.log_artifact(str(out_dir / name), artifact_path="eval")
    for path in plots:
        mlflow.log_artifact(str(path), artifact_path="eval/plots")
    mlflow.set_tags({"eval.mode": summary["mode"], "eval.systems": ",".join(summary["systems"])})
    link_gepa_prompt(summary, plan.gepa_prompt)


def link_gepa_prompt(summary: dict[str, Any], prompt_file: Path) -> str | None:
    """Name, on the active run, the Prompt Registry version of the instruction `gepa` was evaluated with (the
    one in `prompt_file`, evaluate's DVC dependency): tag `gepa.prompt_uri` and the run's prompt link. None
    when gepa was not evaluated or no registry version holds that text."""
    import mlflow

    from pipeline.environment.sanitize import sanitize_text
    from pipeline.tracking.prompts import PROMPT_URI_TAG, version_uri

    record = gepa_record(summary, prompt_file)
    if record is None:
        return None
    uri = version_uri(sanitize_text(record["optimised"]["instruction"]))
    if uri is not None:
        mlflow.set_tag(PROMPT_URI_TAG, uri)
        mlflow.MlflowClient().link_prompt_version_to_run(mlflow.active_run().info.run_id, uri)
    return uri
