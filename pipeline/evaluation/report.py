"""The evaluation report: metrics.json's content turned into files and MLflow records.

Outputs, all under `reports/eval/`:
- `metrics.json`: the content `scores.aggregate` builds plus environment usage and wall time (a DVC output);
- `headline.json`: the few figures two runs are compared on (`pipeline.tracking.headline`; the one DVC metric, one
  `dvc metrics show` row within 120 columns); `figures.json`: the wider set, `dvc metrics show
  reports/eval/figures.json` on demand;
- `plot_data.csv`: F1, the one metric every dataset reports, per dataset × system with its split and CI
  bounds (the DVC plot: one panel per split, a group of bars per dataset, `.dvc/plots/grouped_bars.json`);
- `plots/<dataset>.png`: bars with CI error bars for every metric the dataset reports;
- `predictions.parquet`: one row per question per system: inputs, prediction, per-metric scores in both
  modes, the trajectory as JSON, environment usage;
- `quality_cost.csv` and `plots/quality_vs_cost.png`: one point per system and split, F1 against the
  environment tokens per question (the DVC scatter plot and its labelled PNG);
- `matrix.csv` (pipeline/evaluation/matrix.py): the plug-and-play matrix's DVC plot; summary.md, metrics.json
  and MLflow get the matrix when `evaluate.environments` lists extra environments.
- `summary.md`: the verdict and the metrics' definitions first (`verdict`), then the averages, deltas,
  per-dataset means, cost beside quality (per question and one-off), environment usage, and the paper's
  numbers beside ours (`paper`), in tables.

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
- Plots are drawn with matplotlib's Agg backend (no display), imported only when plotting.
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
from pipeline.evaluation.matrix import MATRIX_FILE, matrix_markdown, matrix_metrics
from pipeline.evaluation.paper import paper_markdown
from pipeline.evaluation.scores import SPLITS, Scores, other_mode
from pipeline.evaluation.systems import SYSTEM_LABELS, Answer, system_colour
from pipeline.evaluation.traces import TraceIds, evaluation_table
from pipeline.evaluation.verdict import gepa_kept_seed, metric_label, system_label, verdict_markdown
from pipeline.stage_files import EVAL_SUMMARY_FILE, FIGURES_FILE, HEADLINE_FILE, METRICS_FILE
from pipeline.tracking.headline import (
    SPLIT_NAMES,
    best_other,
    figures,
    headline,
    last_step_reward,
    parent_metrics,
)
from pipeline.types import EvalRow

if TYPE_CHECKING:
    from pipeline.evaluation.plan import EvaluatePlan

PLOT_METRIC = "f1"
SUMMARY_METRICS = ("em", "f1", "ssim", "sm")
"""The columns of summary.md's averages and deltas tables."""


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


def plot_rows(summary: dict[str, Any]) -> pd.DataFrame:
    """plot_data.csv: F1 (the one metric every dataset reports) per dataset × system, with CI bounds."""
    split_of = {d: split for split, names in summary.get("datasets", {}).items() for d in names}
    rows = []
    for d, per_system in summary["per_dataset"].items():
        for system, entry in per_system.items():
            ci = entry[PLOT_METRIC]
            rows.append({"dataset_system": f"{d} | {system}", "dataset": d, "system": system,
                         "split": split_of.get(d, "").upper(), "metric": PLOT_METRIC, "score": ci["mean"],
                         "low": ci["low"], "high": ci["high"]})
    return pd.DataFrame(rows)


def write_plots(summary: dict[str, Any], out_dir: Path) -> list[Path]:
    """One PNG per dataset: grouped bars (metric × system) with CI error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    systems = summary["systems"]
    width = 0.8 / max(1, len(systems))
    for d, per_system in summary["per_dataset"].items():
        metrics_ = M.reported_metrics(d)
        fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(metrics_), 3.2))
        x = np.arange(len(metrics_))
        for k, system in enumerate(systems):
            cis = [per_system[system][m] for m in metrics_]
            means = np.array([c["mean"] for c in cis])
            err = np.array([[c["mean"] - c["low"] for c in cis], [c["high"] - c["mean"] for c in cis]])
            ax.bar(x + (k - (len(systems) - 1) / 2) * width, means, width, yerr=err, capsize=3, label=system,
                   color=system_colour(system))
        ax.set_xticks(x, [metric_label(m) for m in metrics_])
        ax.set_ylim(0, 105)
        ax.set_ylabel("score (points)")
        ax.set_title(f"{d} ({summary['mode']} mode, {int(summary['confidence'] * 100)}% bootstrap CI)", fontsize=9)
        ax.legend(fontsize=7, loc="upper right")
        fig.tight_layout()
        path = out_dir / f"{d}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


def write_quality_cost_plot(points: pd.DataFrame, path: Path) -> Path:
    """F1 against environment tokens per question: one labelled marker per system and split."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 4))
    for split, marker in (("id", "o"), ("ood", "s")):  # the split as the marker, the system as its colour
        sel = points[points["split"] == split]
        ax.scatter(sel["env_tokens_per_question"], sel[PLOT_METRIC], marker=marker, label=split.upper(),
                   c=[system_colour(s) for s in sel["system"]])
        for _, r in sel.iterrows():
            ax.annotate(r["system"], (r["env_tokens_per_question"], r[PLOT_METRIC]), fontsize=7,
                        xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("environment tokens per question")
    ax.set_ylabel(f"{metric_label(PLOT_METRIC)} (points)")
    ax.set_title("Quality against cost (one point per system and split)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def cost_markdown(summary: dict[str, Any], kept_seed: bool = False) -> list[str]:
    """summary.md's cost section: per-question cost beside the average F1, then the one-off costs."""
    prices = summary["cost"]["prices"]
    lines = ["## Cost beside quality", "",
             (f"Environment cost of answering, counted over every reply a system used (cached or not), at "
              f"{prices['usd_per_million_prompt']} / {prices['usd_per_million_completion']} USD per million "
              "prompt / completion tokens. One-off: what it cost to make the system (GRPO training, GEPA search)."),
             "", ("| system | ID F1 | OOD F1 | env requests / q | env tokens / q | USD / q | USD (this eval) |"
                  " one-off | one-off env requests | one-off env tokens | one-off USD | one-off hours |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in summary["systems"]:
        inf = summary["cost"]["inference"][s]
        av = summary["averages"][s]
        f1 = [format_ci(av[split].get(PLOT_METRIC)) for split in SPLITS]
        once = summary["cost"]["one_off"].get(s)
        if once is None:
            once_cells = ["none" if s in ("env_only", "agent_only", "base_agent") else "not recorded", "–", "–",
                          "–", "–"]
        else:
            once_cells = [once["what"], str(once["env_requests"]),
                          str(once["prompt_tokens"] + once["completion_tokens"]), f"{once['usd']:.4f}",
                          f"{once['hours']:.4f}"]
        lines.append(f"| {system_label(s, kept_seed)} | {f1[0]} | {f1[1]} | {inf['env_requests_per_question']:.2f} | "
                     f"{inf['env_tokens_per_question']:.1f} | {inf['usd_per_question']:.6f} | {inf['usd']:.4f} | "
                     + " | ".join(once_cells) + " |")
    return lines


def format_ci(ci: dict[str, float] | None) -> str:
    """`mean [low, high]` in points, or a dash when the metric is not reported."""
    return "–" if ci is None else f"{ci['mean']:.2f} [{ci['low']:.2f}, {ci['high']:.2f}]"


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


def _gepa_record(summary: dict[str, Any], path: Path) -> dict[str, Any] | None:
    """data/gepa/prompt.json (`path`) when gepa was evaluated and the file is there (its seed/optimised
    instructions)."""
    if "gepa" not in summary["systems"] or not path.is_file():
        return None
    return json.loads(path.read_text(encoding="utf-8"))


HEADLINE_WHAT = {"f1_id": "prompt_r1's F1, in-distribution sets", "f1_ood": "prompt_r1's F1, out-of-distribution sets",
                 "env_tokens": "prompt_r1's environment tokens per question"}
QUALITY_COST_PNG = "plots/quality_vs_cost.png"
"""The picture summary.md embeds, relative to reports/eval/ (a Markdown viewer shows it beside the file)."""
DEFAULT_UI = "http://127.0.0.1:5000"
"""Where `mlflow ui` serves a local store."""


def headline_markdown(summary: dict[str, Any]) -> list[str]:
    """summary.md's headline: what `dvc metrics show` prints, each figure said in words, the gains with the
    system they are measured against and their paired-bootstrap CI; the quality-against-cost picture."""
    values = headline(summary)
    lines = ["## Headline (`dvc metrics show`)", "", "| figure | value | what |", "|---|---|---|"]
    for key, value in values.items():
        what = HEADLINE_WHAT.get(key)
        if what is None:  # a gain: prompt_r1 minus the best other system on that split
            split = next(s for s, name in SPLIT_NAMES.items() if key == f"f1_gain_{name}")
            rival = best_other(summary, split)
            ci = summary["deltas"][f"vs_{rival}"][split]["f1"]
            what = (f"prompt_r1's F1 minus {rival}'s (the best other system), {split.upper()}; "
                    f"95% CI [{ci['low']:+.2f}, {ci['high']:+.2f}]")
        lines.append(f"| `{key}` | {value:g} | {what} |")
    if "cost" in summary:
        lines += ["", f"![F1 against environment tokens per question, per system and split]({QUALITY_COST_PNG})"]
    return lines


def mlflow_links_markdown() -> list[str]:
    """Links to the active MLflow run (evaluate) and its parent, and to the registered model's page: the
    tracking server's pages, or `mlflow ui`'s local address for a SQLite store; [] without an active run."""
    import mlflow

    run = mlflow.active_run()
    if run is None:
        return []
    uri = mlflow.get_tracking_uri()
    ui = uri.rstrip("/") if uri.startswith(("http://", "https://")) else DEFAULT_UI
    experiment = run.info.experiment_id
    parent = mlflow.MlflowClient().get_run(run.info.run_id).data.tags.get("mlflow.parentRunId")
    lines = ["## MLflow", ""]
    if not uri.startswith(("http://", "https://")):
        lines += [("Local store: open it with `MLFLOW_DISABLE_TELEMETRY=true mlflow ui --backend-store-uri "
                  f"{_store_shown(uri)}`, then:"), ""]
    if parent:
        lines.append(f"- [pipeline run]({ui}/#/experiments/{experiment}/runs/{parent}) (`{parent}`)")
    lines.append(f"- [evaluate run]({ui}/#/experiments/{experiment}/runs/{run.info.run_id}): traces, predictions "
                 "table, these files")
    lines.append(f"- [registered models]({ui}/#/models): the version this evaluation became is in "
                 "reports/promotion.json once `register` ran")
    return lines


def _store_shown(uri: str) -> str:
    """A SQLite store's URI with the project's own folder left out when it lives there."""
    prefix = "sqlite:///"
    if uri.startswith(prefix):
        path = Path(uri[len(prefix):])
        try:
            return prefix + str(path.resolve().relative_to(Path.cwd().resolve()))
        except ValueError:
            return uri
    return uri


def summary_markdown(summary: dict[str, Any], plan: EvaluatePlan) -> str:
    """A short human-readable report of metrics.json: the verdict first (`verdict`), then the tables."""
    mode = summary["mode"]
    systems = summary["systems"]
    gepa_record = _gepa_record(summary, plan.gepa_prompt)
    kept = gepa_kept_seed(gepa_record)
    lines = [
        "# Evaluation summary",
        "",
        *verdict_markdown(summary, plan, gepa_record),
        "",
        *headline_markdown(summary),
        "",
        "## Setup",
        "",
        (f"{summary['rows_per_dataset']} rows per dataset; metrics mode `{mode}` "
        f"(the `{other_mode(mode)}` numbers are in metrics.json)."),
        "",
        "Systems: " + "; ".join(f"`{s}` = {SYSTEM_LABELS.get(s, s)}" for s in systems) + ".",
        f"env_only prompt: the question, a blank line, then: \"{plan.evaluate.env_only_instruction}\"",
        "",
        "## Averages",
        "",
        "| system | split | EM | F1 | SSim | SM |",
        "|---|---|---|---|---|---|",
    ]
    for s in systems:
        for split in SPLITS:
            av = summary["averages"][s][split]
            lines.append(f"| {system_label(s, kept)} | {split} | "
                         + " | ".join(format_ci(av.get(m)) for m in SUMMARY_METRICS) + " |")
    if summary["deltas"]:
        lines += ["", "## Deltas of prompt_r1 (paired bootstrap)", "", "| vs | split | EM | F1 | SSim | SM |",
                  "|---|---|---|---|---|---|"]
        for vs, per_split in summary["deltas"].items():
            for split in SPLITS:
                cells = []
                for m in SUMMARY_METRICS:
                    c = per_split[split].get(m)
                    cells.append("–" if c is None else f"{c['delta']:+.2f} [{c['low']:+.2f}, {c['high']:+.2f}]")
                lines.append(f"| {system_label(vs.removeprefix('vs_'), kept)} | {split} | " + " | ".join(cells) + " |")
    if "matrix" in summary:
        lines += ["", *matrix_markdown(summary)]
    lines += ["", "## Per dataset (mean)", "", "| dataset | metric | " + " | ".join(systems) + " |",
              "|---|---|" + "---|" * len(systems)]
    for d, per_system in summary["per_dataset"].items():
        for m in M.reported_metrics(d):
            lines.append(f"| {d} | {metric_label(m)} | " + " | ".join(f"{per_system[s][m]['mean']:.2f}" for s in systems)
                         + " |")
    if "cost" in summary:
        lines += ["", *cost_markdown(summary, kept)]
    lines += ["", "## Environment usage (calls this run sent)", "", ("| system | calls | cache hits | prompt tok | completion tok | errors |"
              " cost USD |"), "|---|---|---|---|---|---|---|"]
    for s, u in summary["env_usage"].items():
        lines.append(f"| {system_label(s, kept)} | {u['calls']} | {u['cache_hits']} | {u['prompt_tokens']} | {u['completion_tokens']} |"
                     f" {u['errors']} | {u['cost_usd']:.4f} |")
    if "paper" in summary:
        lines += ["", *paper_markdown(summary["paper"])]
    links = mlflow_links_markdown()
    if links:
        lines += ["", *links]
    return "\n".join(lines) + "\n"


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

    record = _gepa_record(summary, prompt_file)
    if record is None:
        return None
    uri = version_uri(sanitize_text(record["optimised"]["instruction"]))
    if uri is not None:
        mlflow.set_tag(PROMPT_URI_TAG, uri)
        mlflow.MlflowClient().link_prompt_version_to_run(mlflow.active_run().info.run_id, uri)
    return uri
