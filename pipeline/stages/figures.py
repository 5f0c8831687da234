"""Each stage's key figure: one short line saying what it produced, read back from the files it wrote.

`promptr1 <stage>` ends with it (`<stage> done in <s> s: <figure>`) and the Prefect flow shows it per stage
task (log line, return value, artifact, the run summary's stage table). Design decisions:

- **The files are the contract.** A figure is read from the outputs dvc.yaml declares for the stage
  (`reports/sample/<ds>.json`, `reports/validate/summary.json`, …, `reports/promotion.json`), never from the
  stage's code or memory: the same line comes out of the process that ran the stage, of the flow that ran
  DVC, and of a later look at the workspace. So this module is a floor module (pipeline.config,
  pipeline.paths and the file names of pipeline.stage_files only) that imports no stage and costs a JSON read.
- **Given the folders, not the params.** The caller, which holds the params, resolves the folders the files
  lie in (`pipeline.config.specs.stage_folders`); this module only reads.
- **Never raises, never invents.** A missing file gives `no figure (<file> missing)`, a file of another
  shape `no figure (<file> unreadable: <why>)`: a reporting line must not fail the stage it reports on.
- **Stage names as DVC spells them.** `sample@<dataset>` is that dataset's sample; `sample` (the flow's one
  task for the foreach stage) adds its datasets up; a `dvc.yaml:` prefix is ignored.
- Scores are in points (as the stages write them); the evaluation figure is the primary metric, F1, of
  `prompt_r1` on the ID and OOD averages with their 95% intervals, beside the best other system's ID F1.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.config.specs import StageFolders
from pipeline.paths import display_path
from pipeline.stage_files import (
    BUILD_REPORTS_DIR,
    EVAL_REPORTS_DIR,
    GEPA_REPORTS_DIR,
    MERGE_REPORT_FILE,
    METRICS_FILE,
    PROMOTION_FILE,
    SAMPLE_REPORTS_DIR,
    SOURCES_DIR,
    SOURCES_EVAL_FILE,
    STEPS_CSV,
    SUMMARY_FILE,
    VALIDATE_REPORTS_DIR,
)
from pipeline.types import TRAINED

UNREACHABLE = "unreachable"
"""The Hub revision a fingerprint records for a source it could not reach (pipeline.stages.sources)."""
REWARD_COLUMN = "critic/score/mean"
"""The per-step mean reward in reports/train/steps.csv (the `Training reward` plot of dvc.yaml)."""
PRIMARY_METRIC = "f1"


class _NoFigure(Exception):
    """A figure cannot be given; the message says why (file missing or unreadable)."""


class _Files:
    """Reads a stage's output files, remembering the last one for an error message."""

    def __init__(self, folders: StageFolders) -> None:
        self.folders = folders
        self.last: Path | None = None

    def reports(self, *parts: str) -> Path:
        return self.folders.reports_dir.joinpath(*parts)

    def show(self, path: Path) -> str:
        return display_path(path, self.folders.root)

    def json(self, path: Path) -> Any:
        self.last = path
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise _NoFigure(f"{self.show(path)} missing") from None
        except OSError as exc:
            raise _NoFigure(f"{self.show(path)} unreadable: {exc.strerror or exc}") from None
        try:
            return json.loads(text)
        except ValueError as exc:
            raise _NoFigure(f"{self.show(path)} unreadable: not JSON ({exc})") from None

    def csv_rows(self, path: Path, columns: tuple[str, ...]) -> list[dict[str, str]]:
        """The rows of a CSV file whose header has every one of `columns`."""
        self.last = path
        try:
            with path.open(encoding="utf-8", newline="") as fh:
                reader = csv.DictReader(fh)
                rows = list(reader)
        except FileNotFoundError:
            raise _NoFigure(f"{self.show(path)} missing") from None
        except (OSError, csv.Error, UnicodeDecodeError) as exc:
            raise _NoFigure(f"{self.show(path)} unreadable: {exc}") from None
        absent = [c for c in columns if c not in (reader.fieldnames or [])]
        if absent:
            raise _NoFigure(f"{self.show(path)} unreadable: no column {', '.join(absent)}")
        return rows


def key_figure(folders: StageFolders, stage: str) -> str:
    """One line for `stage` (`sample@hotpotqa`, `train`, …) from the files it wrote; never raises."""
    group, _, item = stage.rsplit(":", 1)[-1].partition("@")
    figure = FIGURES.get(group)
    if figure is None:
        return f"no figure (unknown stage {stage!r})"
    files = _Files(folders)
    try:
        return figure(files, item or None)
    except _NoFigure as exc:
        return f"no figure ({exc})"
    except (KeyError, IndexError, TypeError, ValueError, AttributeError, ZeroDivisionError) as exc:
        where = files.show(files.last) if files.last is not None else stage
        return f"no figure ({where} unreadable: {type(exc).__name__} {exc})"


# ------------------------------------------------------------------------------------ one per stage


def _sources(files: _Files, _item: str | None) -> str:
    folder = files.folders.root / SOURCES_DIR
    evals = files.json(folder / SOURCES_EVAL_FILE)
    line = f"sources fingerprinted from the {evals['source']}, {len(evals['eval'])} evaluation files"
    fingerprints = unreachable = 0
    for path in sorted(folder.glob("*.json")):
        if path.name != SOURCES_EVAL_FILE:
            fingerprints += 1
            unreachable += (files.json(path).get("hub") or {}).get("revision") == UNREACHABLE
    return f"{fingerprints} {line}" + (f", {unreachable} unreachable" if unreachable else "")


def _sample(files: _Files, dataset: str | None) -> str:
    if dataset is not None:
        r = files.json(files.reports(SAMPLE_REPORTS_DIR, f"{dataset}.json"))
        if r["skipped"]:
            return f"{dataset}: skipped ({r['skip_reason']})"
        line = (f"{dataset}: {r['rows_written']} rows written of {r['rows_source']} "
                f"({r['leaked_removed']} leaked removed")
        return line + (f", short by {r['shortfall']})" if r["shortfall"] else ")")
    written = leaked = 0
    skipped: list[str] = []
    datasets = files.folders.train_datasets
    for ds in datasets:  # each file's fields taken as it is read: a bad one is named
        r = files.json(files.reports(SAMPLE_REPORTS_DIR, f"{ds}.json"))
        written, leaked = written + int(r["rows_written"]), leaked + int(r["leaked_removed"])
        skipped += [ds] if r["skipped"] else []
    line = f"{len(datasets)} datasets: {written} rows written ({leaked} leaked removed)"
    return line + (f", skipped: {', '.join(skipped)}" if skipped else "")


def _validate(files: _Files, _item: str | None) -> str:
    s = files.json(files.reports(VALIDATE_REPORTS_DIR, SUMMARY_FILE))
    checked = f"{s['expectations_evaluated']} expectations on {s['files_validated']} files"
    if s["success"]:
        return f"passed: {checked}"
    return (f"FAILED: {s['expectations_failed']} of {checked} failed "
            f"({s['files_failed']} files); see {s['data_docs']}")


def _build(files: _Files, _item: str | None) -> str:
    s = files.json(files.reports(BUILD_REPORTS_DIR, SUMMARY_FILE))
    train = s["train"]
    line = (f"{train['rows']} training rows from {len(train['rows_per_dataset'])} datasets, "
            f"{s['eval_rows_total']} evaluation rows in {len(s['eval'])} sets")
    return line + (f", skipped: {', '.join(map(str, s['skipped']))}" if s["skipped"] else "")


def _gepa(files: _Files, _item: str | None) -> str:
    return gepa_outcome(files.json(files.reports(GEPA_REPORTS_DIR, METRICS_FILE)))


def gepa_outcome(m: dict[str, Any]) -> str:
    """What GEPA did, from reports/gepa/metrics.json: the instruction it kept (the seed, or a proposal and why),
    the held-out F1 of both, and the metric calls against the budget. GEPA "accepts" a proposal that beats its
    parent on one minibatch (it is then scored on the val slice); the result is the best candidate on the val
    slice, which can still be the seed, so "accepted" alone misleads."""
    kept = bool(m.get("kept_seed", m["val_score_optimised"] <= m["val_score_seed"]))
    f1 = (f"held-out F1 {m['holdout_f1_seed']:.2f} → {m['holdout_f1_optimised']:.2f} "
          f"({m['holdout_f1_delta']:+.2f})")
    tried = (f"{int(m['proposals'])} proposals, {int(m['accepted'])} better than their parent on a minibatch "
             "and scored on the val slice")
    calls = f"{int(m['metric_calls'])} metric calls"
    if "max_metric_calls" in m:
        calls += f" of {int(m['max_metric_calls'])} allowed"
    if kept:
        return (f"kept the seed instruction (no proposal beat its val score {m['val_score_seed']:.3f}): {f1}; "
                f"{tried}; {calls}")
    return (f"chose a proposal (val score {m['val_score_optimised']:.3f}, the seed's {m['val_score_seed']:.3f}): "
            f"{f1}; {tried}; {calls}")


def _train(files: _Files, _item: str | None) -> str:
    rows = files.csv_rows(files.reports(STEPS_CSV), ("step", REWARD_COLUMN))
    if not rows:
        return "no training step recorded"
    first, last = float(rows[0][REWARD_COLUMN]), float(rows[-1][REWARD_COLUMN])
    return f"{len(rows)} steps (last step {rows[-1]['step']}), mean reward {first:.3f} → {last:.3f}"


def _merge(files: _Files, _item: str | None) -> str:
    model_dir = files.folders.model_dir
    r = files.json(model_dir / MERGE_REPORT_FILE)
    return (f"step {r['step']} ({r['source']}) merged into {files.show(model_dir)}, "
            f"max logit difference {float(r['max_abs_logit_diff']):.3g}")


def _evaluate(files: _Files, _item: str | None) -> str:
    m = files.json(files.reports(EVAL_REPORTS_DIR, METRICS_FILE))
    averages = m["averages"]

    def score(system: str, split: str) -> str:
        s = averages[system][split][PRIMARY_METRIC]
        return f"{s['mean']:.2f} [{s['low']:.2f}, {s['high']:.2f}]"

    line = (f"{TRAINED} F1 ID {score(TRAINED, 'id')}, OOD {score(TRAINED, 'ood')} "
            f"({m['rows_per_dataset']} rows per set)")
    others = [s for s in averages if s != TRAINED]
    if not others:
        return line
    best = max(others, key=lambda s: averages[s]["id"][PRIMARY_METRIC]["mean"])
    return f"{line}; best other system {best} ID {averages[best]['id'][PRIMARY_METRIC]['mean']:.2f}"


def _register(files: _Files, _item: str | None) -> str:
    promotion = files.json(files.reports(PROMOTION_FILE))
    if not isinstance(promotion, dict):
        raise TypeError("not a JSON object")
    return promotion_line(promotion)


def promotion_line(promotion: dict[str, Any] | None) -> str:
    """One line: promoted or not, and why (keys written by register; unknown shapes shown as JSON)."""
    if promotion is None:
        return "no promotion decision (reports/promotion.json missing)"
    if promotion.get("new_version") is False:  # a run that registered nothing (tracking.lineage.champion_status)
        alias = promotion.get("alias", "champion")
        if "champion_version" not in promotion:
            return f"no new version; {promotion.get('note') or f'no @{alias} found'}"
        return (f"no new version; {alias} is v{promotion['champion_version']}, promoted by run "
                f"{promotion.get('promoted_by_run') or 'unknown'} on {promotion.get('promoted_on') or 'an unknown date'}")
    promoted = promotion.get("promoted", promotion.get("promote"))
    reason = promotion.get("reason") or promotion.get("reasons") or promotion.get("message")
    if isinstance(reason, list):
        reason = "; ".join(str(r) for r in reason)
    if promoted is None:
        return json.dumps(promotion, sort_keys=True)[:300]
    alias = promotion.get("alias", "champion")
    version = promotion.get("version") or promotion.get("model_version")
    head = f"promoted to @{alias}" if promoted else f"not promoted to @{alias}"
    if version is not None:
        head += f" (model version {version})"
    return f"{head}: {reason}" if reason else head


FIGURES: dict[str, Callable[[_Files, str | None], str]] = {
    "sources": _sources,
    "sample": _sample,
    "validate": _validate,
    "build": _build,
    "gepa": _gepa,
    "train": _train,
    "merge": _merge,
    "evaluate": _evaluate,
    "register": _register,
}
"""Stage (dvc.yaml name, without `@item`) → how its figure is read."""
