"""What a dataset is, and `register`, the one way a source family declares one.

A `DatasetSpec` says what a dataset *is* (task type, whether it trains) and where its rows come from, two
ways: `hub` (a Hugging Face Hub split and its field mapping) and `mirror` (normalised Parquet file(s) under
`<paths.mirror>/raw/`). Reading either is `reading.py`'s job; a source quirk is a `Converter` attached to
the side that has it, so the reader stays one loop for every dataset. A third kind, `generated`, is made by
code from a fixed seed (the `hops` world, `synthetic.py`): `generated.py` writes its training and held-out
rows as files in the mirror's and the authors' layouts, and every reader then reads those files.

Design decisions:
- Declaring a dataset is one `register(...)` call in its family's module (multi_hop_qa, open_qa,
  math_problems, long_form), which the package's `__init__` imports. It is in `REGISTRY` at once, placed
  in the paper's order (`PAPER_ORDER`) whatever order the families are imported in.
- Everything a spec repeats across datasets has one default here instead: the metric family follows from
  the task type, the mirror is one file, the task format is the bare question, and FlashRAG's collection
  (five of the twelve datasets) is `flashrag(config, split)`.
- Specs are frozen dataclasses and only `register` writes `REGISTRY`: the data stages only read them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pipeline.errors import DataError

TaskType = Literal["multi_hop_qa", "open_qa", "math", "long_form"]
MetricFamily = Literal["qa", "math", "generation"]
"""qa and math: EM and F1 (SM too); generation: F1 and SSim (method.md, Metrics)."""

METRIC_FAMILY: dict[str, MetricFamily] = {
    "multi_hop_qa": "qa",
    "open_qa": "qa",
    "math": "math",
    "long_form": "generation",
}

RawRecord = dict[str, Any]
"""id, question, answers, context, source_split: values as read, not yet checked."""
MIRROR_COLUMNS = ("id", "question", "answers", "context", "source_split")
"""A raw record's columns: those of the mirror's Parquet files, which `generated.py` writes too."""


class BadRow(ValueError):
    """A converter found a row it cannot turn into a task; `reason` is the drop-count key."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


Converter = Callable[[RawRecord, Mapping[str, Any]], RawRecord]
"""(mapped record, original source row) → fixed record; may raise BadRow."""

TaskFormat = Callable[[str], str]
"""Raw question → the task the authors' evaluation rows pose."""


@dataclass(frozen=True)
class HubSource:
    """A Hugging Face Hub dataset split and how its fields map to the raw record (dotted paths)."""

    path: str
    split: str
    question: str
    answers: str
    config: str | None = None
    id: str | None = None
    """Field holding a stable id; None = `<dataset>-<split>-<row index>` (the mirror's convention)."""
    context: str | None = None
    convert: Converter | None = None

    def describe(self) -> str:
        return f"hub:{self.path}{f'[{self.config}]' if self.config else ''}:{self.split}"


GeneratedRows = Callable[[], tuple[list[RawRecord], list[tuple[str, list[str]]]]]
"""() → (training records in the mirror's columns, held-out (question, gold answers) pairs)."""


@dataclass(frozen=True)
class GeneratedSource:
    """A dataset made by code (no Hub, no mirror file): deterministic rows and the version that names them."""

    version: str
    """Changes whenever the rows change; recorded in the `sources` stage's fingerprint."""
    rows: GeneratedRows


@dataclass(frozen=True)
class MirrorSource:
    """Normalised Parquet file(s) under `<mirror>/raw/`."""

    files: tuple[str, ...]
    convert: Converter | None = None


def bare_question(question: str) -> str:
    """The default task format: the raw question is already the task."""
    return question


@dataclass(frozen=True)
class DatasetSpec:
    """One dataset: what it is, where its rows come from, and the authors' evaluation file for it."""

    name: str
    task_type: TaskType
    trains: bool
    """True for the training datasets; False for the 4 out-of-distribution evaluation sets."""
    hub: HubSource | None
    """None only for a generated dataset."""
    mirror: MirrorSource
    eval_file: str
    """The authors' evaluation file name in `prompt-r1/eval/`."""
    eval_tag: str
    """The authors' `data_source` tag in that file (we replace it with `name`)."""
    task_format: TaskFormat = bare_question
    note: str = ""
    generated: GeneratedSource | None = None
    """Set for a dataset made by code: its rows come from here, never from the Hub or the mirror."""

    @property
    def metric_family(self) -> MetricFamily:
        return METRIC_FAMILY[self.task_type]


_FLASHRAG = "RUC-NLPIR/FlashRAG_datasets"


def flashrag(config: str, split: str) -> HubSource:
    """A split of FlashRAG's QA collection: every config has `id`, `question` and `golden_answers`."""
    return HubSource(
        _FLASHRAG, config=config, split=split, id="id", question="question", answers="golden_answers"
    )


PAPER_ORDER = (
    "2wikimultihopqa",
    "hotpotqa",
    "gsm8k",
    "dapo_math",
    "musique",
    "popqa",
    "booksum",
    "writingprompts",
    "mathqa",
    "squad_v2",
    "triviaqa",
    "xsum",
)
"""The paper's tables: 8 training datasets, then the 4 out-of-distribution sets. params.yaml's lists follow it;
datasets beyond the paper's (the generated `hops`) follow them."""

REGISTRY: dict[str, DatasetSpec] = {}
"""Every registered dataset, in `PAPER_ORDER`; any other dataset follows them, in registration order."""


def _paper_position(name: str) -> int:
    return PAPER_ORDER.index(name) if name in PAPER_ORDER else len(PAPER_ORDER)


def register(
    name: str,
    task_type: TaskType,
    *,
    trains: bool,
    hub: HubSource | None,
    mirror: str,
    eval_file: str,
    eval_tag: str,
    mirror_convert: Converter | None = None,
    task_format: TaskFormat = bare_question,
    note: str = "",
    generated: GeneratedSource | None = None,
) -> DatasetSpec:
    """Declare dataset `name` (its mirror file is relative to `<mirror>/raw/`; for a `generated` one, the file
    it is written to under `<paths.cache_dir>/generated/`); a second `name` is an error, and so is a dataset
    with neither a Hub source nor a generator."""
    if name in REGISTRY:
        raise ValueError(f"dataset {name!r} is registered twice")
    if hub is None and generated is None:
        raise ValueError(f"dataset {name!r} has neither a Hub source nor a generator")
    spec = DatasetSpec(
        name=name,
        task_type=task_type,
        trains=trains,
        hub=hub,
        mirror=MirrorSource((mirror,), convert=mirror_convert),
        eval_file=eval_file,
        eval_tag=eval_tag,
        task_format=task_format,
        note=note,
        generated=generated,
    )
    # Families register in import order; the registry's order is the paper's, whatever that order was.
    ordered = sorted([*REGISTRY.values(), spec], key=lambda s: _paper_position(s.name))
    REGISTRY.clear()
    REGISTRY.update((s.name, s) for s in ordered)
    return spec


def get_spec(name: str) -> DatasetSpec:
    try:
        return REGISTRY[name]
    except KeyError:
        raise DataError(f"unknown dataset {name!r}; known: {', '.join(REGISTRY)}") from None
