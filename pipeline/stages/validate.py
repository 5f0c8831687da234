"""Stage `validate`: Great Expectations suites over every sampled file and every evaluation file.

Design decisions:
- Suites are defined here, in code (`build_suite`), one per file, from the dataset's registry entry; no
  GX project folder is kept in the repo. An ephemeral context holds them; the only thing written is the
  Data Docs site (`reports/validate/data_docs/index.html`, rebuilt from scratch each run) and the JSON
  summary (`reports/validate/summary.json`, DVC metrics).
- GX validates a pandas frame of the file's own columns plus a few derived columns (`DERIVED`) for the
  checks GX has no expectation for over list-valued cells: answers are a list of non-empty strings,
  the estimated question length, the normalised question key, membership in an evaluation set. The
  schema expectation names the exact column set, so a missing or extra column in a file still fails.
- Question length uses `schema.estimate_tokens` (UTF-8 bytes / 3, an over-estimate for English), not
  the agent tokenizer: the check stays free of a model load and errs on the side of flagging.
- Row counts: a training file must hold `data.sample_size` rows, unless `reports/sample/<ds>.json`
  records a shortfall (then exactly the rows it says it wrote) or a skip (then 0 rows). An evaluation
  file must hold `data.eval_rows` rows.
- Evaluation files are the authors' (`<mirror>/prompt-r1/eval/*.parquet`), read back into the
  normalised schema (`sources.load_authors_eval`), so both kinds of file face the same suite.
- Overlap: every training question's key is checked against the keys of all 12 evaluation files.
- Any failure: the summary (with the failed expectations and example rows) and the Data Docs are
  written first, then a `DataError` names the file, the expectation and example offending rows, and
  the CLI exits non-zero. The build stage refuses to run unless this summary says success for the very
  files it reads (sha256 recorded here).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow.parquet as pq

from pipeline.config import Params
from pipeline.data.plan import ValidatePlan, sample_metrics_path, sampled_path
from pipeline.data.schema import (
    COLUMNS,
    estimate_tokens,
    question_key,
    write_json_atomic,
)
from pipeline.data.sources import (
    REGISTRY,
    DatasetSpec,
    authors_eval_path,
    get_spec,
    load_authors_eval,
    normalised_eval_row,
)
from pipeline.errors import DataError

log = logging.getLogger(__name__)

DERIVED = [
    "question_is_text",
    "question_chars",
    "question_tokens_est",
    "answers_are_text",
    "n_answers",
    "n_blank_answers",
    "question_key",
    "in_eval_set",
]
TOKEN_ESTIMATE = "ceil(utf8_bytes / 3)"
EXAMPLES = 5


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass
class Target:
    """One file to validate, already read into rows of the normalised schema."""

    name: str
    """Display path (relative to the project root)."""
    dataset: str
    kind: str
    """'train' (a sampled file) or 'eval' (an authors' evaluation file)."""
    rows: list[dict[str, Any]]
    columns: list[str]
    expected_rows: int
    sha256: str = ""
    notes: list[str] = field(default_factory=list)


def _derive(rows: list[dict[str, Any]], columns: list[str], eval_keys: set[str]) -> pd.DataFrame:
    """The file's columns plus the derived check columns, as one pandas frame for GX."""
    data: dict[str, list[Any]] = {c: [r.get(c) for r in rows] for c in columns}
    questions = [r.get("question") for r in rows]
    answers = [r.get("answers") for r in rows]
    is_text = [isinstance(q, str) for q in questions]
    texts = [q if ok else "" for q, ok in zip(questions, is_text, strict=True)]
    keys = [question_key(q) for q in texts]
    data["question_is_text"] = is_text
    data["question_chars"] = [len(q.strip()) for q in texts]
    data["question_tokens_est"] = [estimate_tokens(q) for q in texts]
    data["answers_are_text"] = [isinstance(a, list) and all(isinstance(x, str) for x in a) for a in answers]
    data["n_answers"] = [
        sum(1 for x in a if isinstance(x, str) and x.strip()) if isinstance(a, list) else 0 for a in answers
    ]
    data["n_blank_answers"] = [
        sum(1 for x in a if not (isinstance(x, str) and x.strip())) if isinstance(a, list) else 0
        for a in answers
    ]
    data["question_key"] = keys
    data["in_eval_set"] = [k in eval_keys for k in keys]
    return pd.DataFrame(data)


def build_suite(target: Target, max_question_tokens: int) -> list[Any]:
    """The expectations for one file (GX 1.x expectation objects)."""
    import great_expectations.expectations as gxe

    spec = get_spec(target.dataset)
    suite: list[Any] = [
        gxe.ExpectTableColumnsToMatchSet(column_set=[*COLUMNS, *DERIVED], exact_match=True),
        gxe.ExpectTableRowCountToEqual(value=target.expected_rows),
        gxe.ExpectColumnValuesToNotBeNull(column="id"),
        gxe.ExpectColumnValuesToBeUnique(column="id"),
        gxe.ExpectColumnValuesToNotBeNull(column="question"),
        gxe.ExpectColumnValuesToBeInSet(column="question_is_text", value_set=[True]),
        gxe.ExpectColumnValuesToBeBetween(column="question_chars", min_value=1),
        gxe.ExpectColumnValuesToNotBeNull(column="answers"),
        gxe.ExpectColumnValuesToBeInSet(column="answers_are_text", value_set=[True]),
        gxe.ExpectColumnValuesToBeBetween(column="n_answers", min_value=1),
        gxe.ExpectColumnValuesToBeBetween(column="n_blank_answers", max_value=0),
        gxe.ExpectColumnValuesToBeInSet(column="task_type", value_set=[spec.task_type]),
        gxe.ExpectColumnValuesToBeInSet(column="dataset", value_set=[spec.name]),
        gxe.ExpectColumnValuesToBeBetween(
            column="question_tokens_est", max_value=max_question_tokens
        ),
    ]
    if target.kind == "train":
        suite.append(gxe.ExpectColumnValuesToBeInSet(column="in_eval_set", value_set=[False]))
    return suite


# --- collecting the files ----------------------------------------------------------------------------


def _read_sampled(plan: ValidatePlan, dataset: str) -> Target:
    path = sampled_path(plan.sampled_dir, dataset)
    shown = plan.shown(path)
    if not path.is_file():
        raise DataError(f"{shown}: not found; run `promptr1 sample {dataset}` (or `dvc repro sample`) first")
    try:
        table = pq.read_table(path)
    except Exception as exc:  # noqa: BLE001 — any unreadable file is the same user-facing problem
        raise DataError(f"{shown}: cannot read as Parquet ({exc})") from None
    expected, notes = plan.sample_size, []
    report_file = sample_metrics_path(plan.reports_dir, dataset)
    if report_file.is_file():
        report = json.loads(report_file.read_text(encoding="utf-8"))
        if report.get("skipped"):
            expected = 0
            notes.append(f"skipped by the sample stage: {report.get('skip_reason', '')}")
        elif report.get("shortfall", 0) > 0:
            expected = int(report.get("rows_written", 0))
            notes.append(
                f"source smaller than sample_size; {expected} rows recorded in "
                f"{plan.shown(report_file)}"
            )
    return Target(
        name=shown,
        dataset=dataset,
        kind="train",
        rows=table.to_pylist(),
        columns=table.column_names,
        expected_rows=expected,
        sha256=file_sha256(path),
        notes=notes,
    )


def _read_eval(plan: ValidatePlan, spec: DatasetSpec) -> Target | None:
    try:
        rows = load_authors_eval(plan.sources, spec)
    except DataError as exc:
        if spec.name in plan.allow_skip:
            log.warning("%s: evaluation file skipped: %s", spec.name, exc)
            return None
        raise
    path = authors_eval_path(plan.sources, spec)
    return Target(
        name=plan.shown(path),
        dataset=spec.name,
        kind="eval",
        rows=[normalised_eval_row(r, spec) for r in rows],
        columns=list(COLUMNS),
        expected_rows=plan.eval_rows,
        sha256=file_sha256(path),
    )


def _all_eval_keys(plan: ValidatePlan) -> set[str]:
    keys: set[str] = set()
    for spec in REGISTRY.values():
        try:
            keys.update(question_key(r.question) for r in load_authors_eval(plan.sources, spec))
        except DataError:
            if spec.name not in plan.allow_skip:
                raise
    return keys


# --- running GX -------------------------------------------------------------------------------------


def _context(docs_dir: Path) -> Any:
    import great_expectations as gx
    from great_expectations.data_context.types.base import ProgressBarsConfig

    context = gx.get_context(mode="ephemeral")
    context.variables.progress_bars = ProgressBarsConfig(globally=False, metric_calculations=False)
    context.add_data_docs_site(
        site_name="validate",
        site_config={
            "class_name": "SiteBuilder",
            "site_index_builder": {"class_name": "DefaultSiteIndexBuilder"},
            "store_backend": {"class_name": "TupleFilesystemStoreBackend", "base_directory": str(docs_dir)},
        },
    )
    return context


def _examples(frame: pd.DataFrame, result: dict[str, Any]) -> list[Any]:
    """Up to EXAMPLES offending rows (id + question) or the observed value of a table expectation."""
    indices = result.get("partial_unexpected_index_list") or result.get("unexpected_index_list") or []
    if indices:
        out = []
        for idx in list(indices)[:EXAMPLES]:
            i = (
                idx
                if isinstance(idx, int)
                else next(iter(idx.values()), None)
                if isinstance(idx, dict)
                else None
            )
            if isinstance(i, int) and 0 <= i < len(frame):
                q = frame.iloc[i].get("question")
                out.append({"row": i, "id": frame.iloc[i].get("id"), "question": str(q)[:120]})
        if out:
            return out
    if result.get("partial_unexpected_list"):
        return [str(v)[:120] for v in result["partial_unexpected_list"][:EXAMPLES]]
    if "observed_value" in result:
        return [result["observed_value"]]
    return []


def _validate(context: Any, target: Target, frame: pd.DataFrame, max_question_tokens: int, n: int) -> dict[str, Any]:
    import great_expectations as gx

    asset_name = f"{target.kind}__{target.dataset}"
    asset = context.data_sources.add_pandas(f"src_{n}").add_dataframe_asset(asset_name)
    batch = asset.add_batch_definition_whole_dataframe("whole")
    suite = context.suites.add(gx.ExpectationSuite(name=asset_name))
    for expectation in build_suite(target, max_question_tokens):
        suite.add_expectation(expectation)
    definition = context.validation_definitions.add(
        gx.ValidationDefinition(name=asset_name, data=batch, suite=suite)
    )
    checkpoint = context.checkpoints.add(
        gx.Checkpoint(
            name=f"cp_{asset_name}",
            validation_definitions=[definition],
            actions=[],
            result_format={"result_format": "SUMMARY", "partial_unexpected_count": EXAMPLES},
        )
    )
    run = checkpoint.run(batch_parameters={"dataframe": frame})
    failed = []
    evaluated = 0
    for validation in run.run_results.values():
        for er in validation.results:
            evaluated += 1
            if er.success:
                continue
            cfg = er.expectation_config
            failure = {
                "expectation": cfg.type,
                "column": cfg.kwargs.get("column"),
                "unexpected_count": (er.result or {}).get("unexpected_count"),
                "examples": _examples(frame, er.result or {}),
            }
            if er.exception_info and er.exception_info.get("raised_exception"):
                failure["error"] = str(er.exception_info.get("exception_message"))[:300]
            failed.append(failure)
    return {
        "dataset": target.dataset,
        "kind": target.kind,
        "rows": len(frame),
        "expected_rows": target.expected_rows,
        "success": not failed,
        "evaluated_expectations": evaluated,
        "failed_expectations": failed,
        "sha256": target.sha256,
        "notes": target.notes,
    }


def _failure_message(summary: dict[str, Any], plan: ValidatePlan) -> str:
    docs = plan.shown(plan.validate_dir / "data_docs" / "index.html")
    lines = [f"data validation failed: see {plan.shown(plan.summary_path)} and {docs}"]
    for name, result in summary["files"].items():
        for f in result["failed_expectations"]:
            col = f" (column {f['column']})" if f.get("column") else ""
            count = f", {f['unexpected_count']} offending rows" if f.get("unexpected_count") else ""
            lines.append(
                f"  {name}: {f['expectation']}{col} failed{count}; "
                f"e.g. {json.dumps(f['examples'][:3], default=str)}"
            )
    return "\n".join(lines)


def run_validate(params: Params, datasets: Iterable[str] | None = None) -> dict[str, Any]:
    """Validate every sampled file and every evaluation file; write the summary and Data Docs."""
    started = time.perf_counter()
    plan = ValidatePlan.for_validate(params)
    train = list(datasets) if datasets is not None else list(plan.train_datasets)
    targets = [_read_sampled(plan, ds) for ds in train]
    targets += [t for t in (_read_eval(plan, get_spec(ds)) for ds in plan.eval_datasets) if t is not None]
    eval_keys = _all_eval_keys(plan)

    docs_dir = plan.validate_dir / "data_docs"
    if docs_dir.exists():
        shutil.rmtree(docs_dir)
    docs_dir.mkdir(parents=True)
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
    if not log.isEnabledFor(logging.DEBUG):  # `-v` keeps GX's own INFO lines
        import great_expectations.data_context.types.base  # noqa: F401  (sets its logger to INFO on import)

        for name in ("great_expectations", "great_expectations.data_context.types.base"):
            logging.getLogger(name).setLevel(logging.WARNING)
    context = _context(docs_dir)

    files: dict[str, Any] = {}
    for n, target in enumerate(targets):
        frame = _derive(target.rows, target.columns, eval_keys)
        files[target.name] = _validate(context, target, frame, plan.max_question_tokens, n)
        if files[target.name]["success"]:
            log.debug("%s: ok", target.name)
        else:
            log.warning("%s: FAILED", target.name)

    context.build_data_docs(site_names=["validate"])
    summary = {
        "success": all(f["success"] for f in files.values()),
        "files_validated": len(files),
        "files_failed": sum(not f["success"] for f in files.values()),
        "expectations_evaluated": sum(f["evaluated_expectations"] for f in files.values()),
        "expectations_failed": sum(len(f["failed_expectations"]) for f in files.values()),
        "skipped_eval_datasets": [
            ds
            for ds in plan.eval_datasets
            if ds in plan.allow_skip
            and not any(f["dataset"] == ds and f["kind"] == "eval" for f in files.values())
        ],
        "question_token_estimate": TOKEN_ESTIMATE,
        "max_question_tokens": plan.max_question_tokens,
        "data_docs": plan.shown(docs_dir / "index.html"),
        "files": files,
    }
    write_json_atomic(summary, plan.summary_path)
    if not summary["success"]:
        raise DataError(_failure_message(summary, plan))
    log.debug("validated %d files, all expectations met (%.1f s)", len(files), time.perf_counter() - started)
    return summary
