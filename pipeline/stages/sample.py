"""Stage `sample` (one per training dataset): raw source → normalised, clean, de-leaked sample.

Steps, in order (`run_sample`):
1. Read the raw records (`sources.load_raw`: local mirror or Hugging Face Hub). An unreadable source,
   one with wrong columns, or a column holding a value of the wrong type (a numeric question, numeric
   answers, nested structs) fails with a `DataError` naming the file, the column and the first bad row:
   a wrong type is a broken column, not a bad row to drop and count. An unreachable source
   is skipped only when `data.allow_skip` lists the dataset: the stage then writes an empty, valid
   Parquet file and a metrics file with `skipped: true` and the reason, and logs a warning.
2. Normalise each row to the one schema (`schema.SAMPLED_SCHEMA`) and turn it into the task the authors
   pose (`spec.task_format`). Bad rows are dropped and counted per reason (`DROP_REASONS`): missing
   id/question/answers, empty question, no non-empty answer (one text answer is one gold),
   a question over `data.max_question_tokens` (estimated), duplicate ids, and duplicate questions. A
   question that appears twice (PopQA's same-name entities, BookSum's several summaries of one section,
   DAPO's repeats) keeps its first row only: two training rows with one question and different golds
   teach nothing but noise. Answers are stripped of surrounding whitespace and blank aliases.
3. Leakage: drop every row whose normalised question (`schema.question_key`) appears in ANY of the
   authors' 12 evaluation files (not only the dataset's own: XSum summaries or SQuAD questions could
   surface anywhere). Counted per evaluation file.
   Fail closed: when fewer than `data.min_usable_fraction` of the source's rows survive steps 2 and 3
   (the real mirror's worst is BookSum at 72%, its repeated sections), or the source has no rows, the
   stage stops with a `DataError` naming the file(s), the counts and the drop reasons, and writes
   nothing: a source gone bad must not become a small or empty training set with only a warning.
4. Draw `data.sample_size` rows without replacement, with a generator seeded by (`seed`, dataset name),
   so datasets get independent draws and one seed reproduces all of them. Rows keep source order, so a
   diff between two samples reads naturally. Fewer rows than asked: all of them, a warning recorded.
5. Write `data/sampled/<dataset>.parquet` and `reports/sample/<dataset>.json` atomically. Same seed and
   inputs → byte-identical Parquet (explicit Arrow schema, no pandas metadata, fixed compression).
"""

from __future__ import annotations

import logging
import zlib
from collections import Counter
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.config import Params
from pipeline.data.plan import SamplePlan
from pipeline.data.schema import (
    empty_table,
    estimate_tokens,
    question_key,
    rows_to_table,
    write_json_atomic,
    write_parquet_atomic,
)
from pipeline.data.sources import (
    REGISTRY,
    DatasetSpec,
    RawRecord,
    SourcePaths,
    get_spec,
    load_authors_eval,
    load_raw,
)
from pipeline.errors import DataError

log = logging.getLogger(__name__)

DROP_REASONS = (
    "missing_id",
    "missing_question",
    "empty_question",
    "missing_answers",
    "empty_answers",
    "question_too_long",
    "duplicate_id",
    "duplicate_question",
    "answer_unparseable",
    "source_layout",
)


@dataclass
class SampleReport:
    """What the stage did to one dataset: written as `reports/sample/<dataset>.json` (DVC metrics)."""

    dataset: str
    source: list[str] = field(default_factory=list)
    rows_source: int = 0
    dropped_by_reason: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DROP_REASONS, 0))
    rows_clean: int = 0
    leaked_removed: int = 0
    leaked_by_eval_file: dict[str, int] = field(default_factory=dict)
    rows_available: int = 0
    sample_size: int = 0
    rows_written: int = 0
    shortfall: int = 0
    seed: int = 0
    skipped: bool = False
    skip_reason: str = ""
    warnings: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items()}


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def normalise_record(rec: RawRecord, spec: DatasetSpec, max_tokens: int) -> tuple[dict[str, Any] | None, str]:
    """One raw record (column types already checked by the reader) → a normalised row, or (None, reason)."""
    if rec.get("_bad"):
        return None, rec["_bad"]
    rid, question, answers = rec.get("id"), rec.get("question"), rec.get("answers")
    if rid is None or (isinstance(rid, str) and not rid.strip()):
        return None, "missing_id"
    if question is None:
        return None, "missing_question"
    if not question.strip():
        return None, "empty_question"
    if answers is None:
        return None, "missing_answers"
    golds = [a.strip() for a in ([answers] if isinstance(answers, str) else answers) if a and a.strip()]
    if not golds:
        return None, "empty_answers"
    task = spec.task_format(question.strip())
    if estimate_tokens(task) > max_tokens:
        return None, "question_too_long"
    return {
        "id": str(rid),
        "question": task,
        "answers": golds,
        "context": _text(rec.get("context")) or "",
        "task_type": spec.task_type,
        "source_split": _text(rec.get("source_split")) or "",
        "dataset": spec.name,
    }, ""


def evaluation_keys(
    sources: SourcePaths, allow_skip: Collection[str], report: SampleReport | None = None
) -> dict[str, str]:
    """question_key → the authors' evaluation file it appears in, over all 12 evaluation files."""
    keys: dict[str, str] = {}
    for spec in REGISTRY.values():
        try:
            rows = load_authors_eval(sources, spec)
        except DataError as exc:
            if spec.name not in allow_skip:
                raise
            if report is not None:
                report.warnings.append(f"leakage check without {spec.eval_file}: {exc}")
            continue
        for row in rows:
            keys.setdefault(question_key(row.question), spec.eval_file)
    return keys


def draw_indices(n: int, k: int, seed: int, dataset: str) -> np.ndarray:
    """k of n row positions, sorted, from a generator seeded by (seed, dataset)."""
    rng = np.random.default_rng([seed, zlib.crc32(dataset.encode("utf-8"))])
    return np.sort(rng.choice(n, size=k, replace=False))


def _require_usable(floor: float, report: SampleReport) -> None:
    """DataError unless at least `data.min_usable_fraction` (`floor`) of the source rows (and at least one)
    are usable."""
    usable, total = report.rows_available, report.rows_source
    if total and usable and usable >= floor * total:
        return
    dropped = {k: v for k, v in report.dropped_by_reason.items() if v}
    raise DataError(
        f"{', '.join(report.source)}: only {usable} of {total} rows usable after cleaning and leakage removal"
        f"{f' ({usable / total:.1%})' if total else ''}, below data.min_usable_fraction {floor}; dropped "
        f"{dropped or 'none'}, leaked {report.leaked_removed}; nothing written"
    )


def _write(plan: SamplePlan, report: SampleReport, rows: list[dict[str, Any]] | None) -> None:
    table = rows_to_table(rows) if rows else empty_table()
    write_parquet_atomic(table, plan.sampled_file)
    write_json_atomic(report.as_dict(), plan.metrics_file)


def run_sample(params: Params, dataset: str) -> SampleReport:
    """Normalise, clean, de-leak and sample one training dataset (see the module docstring)."""
    spec = get_spec(dataset)
    if not spec.trains:
        raise DataError(f"{dataset} is an evaluation-only dataset; the sample stage draws training rows")
    plan = SamplePlan.for_sample(params, dataset)
    report = SampleReport(dataset=dataset, sample_size=plan.sample_size, seed=plan.seed)

    try:
        raw = load_raw(spec, plan.sources)
    except DataError as exc:
        if dataset not in plan.allow_skip:
            raise
        _write_skipped(plan, report, exc)
        return report
    report.source, report.rows_source = raw.origin, raw.rows_read

    clean, drops = _clean_rows(raw.records, spec, plan.max_question_tokens, report)
    kept = _remove_leaked(clean, evaluation_keys(plan.sources, plan.allow_skip, report), report)
    _require_usable(plan.min_usable_fraction, report)
    chosen = _draw_sample(kept, plan, report, generated=spec.generated is not None)
    _write(plan, report, chosen)
    log.debug(
        "%s: %d source rows, %d dropped %s, %d leaked, %d written",
        dataset,
        report.rows_source,
        sum(drops.values()),
        dict(drops),
        report.leaked_removed,
        report.rows_written,
    )
    return report


def _write_skipped(plan: SamplePlan, report: SampleReport, exc: DataError) -> None:
    """An unreachable source `data.allow_skip` lists: an empty sample and a report saying why."""
    report.skipped, report.skip_reason = True, str(exc)
    report.shortfall = plan.sample_size
    report.warnings.append(f"skipped (listed in data.allow_skip): {exc}")
    log.warning("%s: skipped: %s", report.dataset, exc)
    _write(plan, report, None)


def _clean_rows(records: Iterable[RawRecord], spec: DatasetSpec, max_tokens: int,
                report: SampleReport) -> tuple[list[dict[str, Any]], Counter[str]]:
    """The normalised rows, first of each id and of each question (its `question_key` kept as `_key`), and
    the drops by reason (also counted in `report`)."""
    clean: list[dict[str, Any]] = []
    drops: Counter[str] = Counter()
    seen_ids: set[str] = set()
    seen_questions: set[str] = set()
    for rec in records:
        row, reason = normalise_record(rec, spec, max_tokens)
        if row is None:
            drops[reason] += 1
            continue
        key = question_key(row["question"])
        if row["id"] in seen_ids:
            drops["duplicate_id"] += 1
            continue
        if key in seen_questions:
            drops["duplicate_question"] += 1
            continue
        seen_ids.add(row["id"])
        seen_questions.add(key)
        row["_key"] = key
        clean.append(row)
    report.dropped_by_reason.update(drops)
    report.rows_clean = len(clean)
    return clean, drops


def _remove_leaked(clean: list[dict[str, Any]], eval_keys: dict[str, str],
                   report: SampleReport) -> list[dict[str, Any]]:
    """The rows whose question is in no evaluation file (`_key` removed); the leaked ones counted in `report`
    per evaluation file."""
    kept: list[dict[str, Any]] = []
    leaked: Counter[str] = Counter()
    for row in clean:
        hit = eval_keys.get(row.pop("_key"))
        if hit:
            leaked[hit] += 1
        else:
            kept.append(row)
    report.leaked_removed = sum(leaked.values())
    report.leaked_by_eval_file = dict(sorted(leaked.items()))
    report.rows_available = len(kept)
    return kept


def _draw_sample(kept: list[dict[str, Any]], plan: SamplePlan, report: SampleReport, *,
                 generated: bool) -> list[dict[str, Any]]:
    """`data.sample_size` of the usable rows (all of them when fewer, a warning recorded), in source order."""
    k = min(plan.sample_size, len(kept))
    report.rows_written = k
    report.shortfall = plan.sample_size - k
    if report.shortfall:
        report.warnings.append(
            f"only {len(kept)} usable rows after cleaning and leakage removal; "
            f"wrote all of them ({report.shortfall} short of sample_size {plan.sample_size})"
        )
        # a generated world holds a fixed number of questions: sampling all of them is its design, not a loss
        (log.info if generated else log.warning)("%s: %s", report.dataset, report.warnings[-1])
    return [kept[i] for i in draw_indices(len(kept), k, plan.seed, report.dataset)]
