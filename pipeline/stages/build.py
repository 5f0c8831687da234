"""Stage `build`: the RL training file and the 12 evaluation files, in verl's RLHFDataset schema.

Outputs (under `paths.rl_dir`, default `data/rl/`):
- `train.parquet`: every validated sampled row, the Prompt-R1 user message rendered by
  `pipeline.agent.template.render_user_message` (DAPO gets its instruction there), shuffled with
  `seed` so verl's sequential batches mix datasets.
- `eval/<dataset>.parquet` for the 8 in-distribution and 4 out-of-distribution sets: the authors' own
  rows, kept as they are (their prompt text, their ground truths, their order); only `data_source`
  becomes our dataset name (their tags, e.g. `w-book-6600-256-test`, say nothing to a reader) and
  `extra_info` is added. `extra_info.id` is `<dataset>-eval-<row index>`: stable, because the files are.

Row schema (`RL_SCHEMA`): `data_source`, `prompt` (list of {role, content}; one user message), `ability`
(our task type), `reward_model` {ground_truth: list[str], style: "rule"}, `extra_info` {id, split,
question, answers, index}, `agent_name` ("prompt_r1", the agent loop verl dispatches to).

Nothing downstream runs on invalid data: the stage refuses to start unless
`reports/validate/summary.json` says validation succeeded for byte-identical copies (sha256) of the
sampled files it is about to read. The summary also records, per evaluation file, how many rows our
renderer reproduces exactly (all 1,536, counting the 58 DAPO rows that carry no DAPO instruction).
"""

from __future__ import annotations

import json
import logging
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.agent.template import render_user_message
from pipeline.config import Params
from pipeline.data.plan import BuildPlan, sampled_path, validate_summary_path
from pipeline.data.schema import write_json_atomic, write_parquet_atomic
from pipeline.data.sources import authors_eval_path, get_spec, load_authors_eval
from pipeline.errors import DataError
from pipeline.stage_files import BUILD_REPORTS_DIR, EVAL_SETS_DIR, SUMMARY_FILE, TRAIN_FILE
from pipeline.stages.validate import file_sha256

log = logging.getLogger(__name__)

AGENT_NAME = "prompt_r1"

RL_SCHEMA = pa.schema(
    [
        pa.field("data_source", pa.string()),
        pa.field(
            "prompt", pa.list_(pa.struct([pa.field("role", pa.string()), pa.field("content", pa.string())]))
        ),
        pa.field("ability", pa.string()),
        pa.field(
            "reward_model",
            pa.struct([pa.field("ground_truth", pa.list_(pa.string())), pa.field("style", pa.string())]),
        ),
        pa.field(
            "extra_info",
            pa.struct(
                [
                    pa.field("id", pa.string()),
                    pa.field("split", pa.string()),
                    pa.field("question", pa.string()),
                    pa.field("answers", pa.list_(pa.string())),
                    pa.field("index", pa.int64()),
                ]
            ),
        ),
        pa.field("agent_name", pa.string()),
    ]
)


def rl_row(
    *,
    dataset: str,
    content: str,
    task_type: str,
    answers: list[str],
    row_id: str,
    split: str,
    question: str,
    index: int,
) -> dict[str, Any]:
    """One row of verl's RLHFDataset schema."""
    return {
        "data_source": dataset,
        "prompt": [{"role": "user", "content": content}],
        "ability": task_type,
        "reward_model": {"ground_truth": list(answers), "style": "rule"},
        "extra_info": {
            "id": row_id,
            "split": split,
            "question": question,
            "answers": list(answers),
            "index": index,
        },
        "agent_name": AGENT_NAME,
    }


def _check_validated(plan: BuildPlan) -> dict[str, Any]:
    path = validate_summary_path(plan.reports_dir)
    shown = plan.shown(path)
    if not path.is_file():
        raise DataError(
            f"{shown}: not found; run `promptr1 validate` first (build only reads validated data)"
        )
    summary = json.loads(path.read_text(encoding="utf-8"))
    if not summary.get("success"):
        raise DataError(f"{shown}: the last validation failed; fix the data and rerun `promptr1 validate`")
    by_dataset = {
        f["dataset"]: (name, f) for name, f in summary.get("files", {}).items() if f.get("kind") == "train"
    }
    for ds in plan.train_datasets:
        sampled = sampled_path(plan.sampled_dir, ds)
        if ds not in by_dataset:
            raise DataError(f"{shown}: {ds} was not validated; rerun `promptr1 validate`")
        if not sampled.is_file() or file_sha256(sampled) != by_dataset[ds][1].get("sha256"):
            raise DataError(
                f"{plan.shown(sampled)} changed since it was validated; "
                "rerun `promptr1 validate`"
            )
    return summary


def _train_rows(plan: BuildPlan) -> tuple[list[dict[str, Any]], dict[str, int]]:
    rows: list[dict[str, Any]] = []
    per_dataset: dict[str, int] = {}
    for ds in plan.train_datasets:
        table = pq.read_table(sampled_path(plan.sampled_dir, ds))
        per_dataset[ds] = table.num_rows
        for r in table.to_pylist():
            rows.append(
                rl_row(
                    dataset=ds,
                    content=render_user_message(r["question"], ds),
                    task_type=r["task_type"],
                    answers=r["answers"],
                    row_id=r["id"],
                    split="train",
                    question=r["question"],
                    index=0,
                )
            )
    order = np.random.default_rng(plan.seed).permutation(len(rows))
    shuffled = [rows[i] for i in order]
    for i, row in enumerate(shuffled):
        row["extra_info"]["index"] = i
    return shuffled, per_dataset


def _write_eval_set(plan: BuildPlan, ds: str) -> dict[str, Any] | None:
    """Write `eval/<ds>.parquet` from the authors' rows; returns its summary (rows, source, how many prompts
    our renderer reproduces), or None when the file is missing and `ds` may be skipped."""
    spec = get_spec(ds)
    try:
        eval_rows = load_authors_eval(plan.sources, spec)
    except DataError:
        if ds not in plan.allow_skip:
            raise
        return None
    out = [
        rl_row(
            dataset=ds,
            content=r.prompt_content,
            task_type=spec.task_type,
            answers=r.answers,
            row_id=r.id,
            split="test",
            question=r.question,
            index=r.index,
        )
        for r in eval_rows
    ]
    reproduced = sum(
        render_user_message(r.question, ds, dataset_instruction=r.has_instruction) == r.prompt_content
        for r in eval_rows
    )
    target = plan.rl_dir / EVAL_SETS_DIR / f"{ds}.parquet"
    write_parquet_atomic(pa.Table.from_pylist(out, schema=RL_SCHEMA), target)
    return {
        "rows": len(out),
        "source": plan.shown(authors_eval_path(plan.sources, spec)),
        "authors_tag": spec.eval_tag,
        "template_reproduced": reproduced,
        "rows_with_dataset_instruction": sum(r.has_instruction for r in eval_rows),
    }


def run_build(params: Params) -> dict[str, Any]:
    """Write data/rl/train.parquet and data/rl/eval/<dataset>.parquet; summary in reports/build/."""
    plan = BuildPlan.for_build(params)
    _check_validated(plan)
    rl_dir = plan.rl_dir
    summary: dict[str, Any] = {"train": {}, "eval": {}, "skipped": []}

    rows, per_dataset = _train_rows(plan)
    write_parquet_atomic(pa.Table.from_pylist(rows, schema=RL_SCHEMA), rl_dir / TRAIN_FILE)
    summary["train"] = {
        "rows": len(rows),
        "rows_per_dataset": per_dataset,
        "file": plan.shown(rl_dir / TRAIN_FILE),
    }
    for ds in [d for d, n in per_dataset.items() if n == 0]:
        summary["skipped"].append(ds)

    for ds in plan.eval_datasets:
        written = _write_eval_set(plan, ds)
        if written is None:
            summary["skipped"].append(f"eval:{ds}")
        else:
            summary["eval"][ds] = written
    summary["eval_rows_total"] = sum(e["rows"] for e in summary["eval"].values())
    write_json_atomic(summary, plan.reports_dir / BUILD_REPORTS_DIR / SUMMARY_FILE)
    log.debug(
        "built %s (%d rows) and %d evaluation files (%d rows)",
        summary["train"]["file"],
        len(rows),
        len(summary["eval"]),
        summary["eval_rows_total"],
    )
    return summary
