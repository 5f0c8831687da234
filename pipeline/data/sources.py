"""Dataset registry: every dataset the pipeline knows is declared once, here.

A `DatasetSpec` says what a dataset *is* (task type, metric family, whether it trains) and where its rows
come from, two ways:
- `hub`: the Hugging Face Hub id, config, split and field mapping, read with `datasets.load_dataset`.
  That is the normal path (`paths.mirror` empty, e.g. the paper profile). The Hub is unreachable on the
  machines this project is tested on, so this path is exercised only as far as its failure: it raises a
  `DataError` naming the Hub id and telling the user about `paths.mirror` and `data.allow_skip`.
- `mirror`: Parquet file(s) under `<paths.mirror>/raw/`, already column-normalised (id, question,
  answers, context, source_split, meta; see ../shared/datasets/README.md). Used when `paths.mirror` is
  set (the default profile, tests, CI).

Both paths end in the same raw record (id, question, answers, context, source_split); a per-source
`convert` fixes source quirks (GSM8K's `#### 42`, DAPO's embedded instruction, XSum's reversed
direction in the mirror) and then the spec's `task_format` turns the raw question into the task the
authors' evaluation rows pose:
- BookSum and WritingPrompts become "Please write a short article based on the given title: ..." with
  the summary / story as the answer. The authors gave BookSum LLM-written titles; the raw rows have
  none, so our BookSum title is the row's own `question`, "<book title> — <section name>". WritingPrompts
  loses its reddit tags (`[ WP ]`) and is quoted, exactly as in the authors' rows.
- XSum is reversed (the authors' "Please write an article: <summary>" → the BBC document).
- Math datasets keep the bare problem; DAPO's instruction is added at render time
  (`pipeline.agent.template`).

Where training rows come from when the source has one split only (2WikiMultihopQA and HotpotQA dev,
PopQA test): that split; the leakage filter in the sample stage removes the authors' evaluation rows.

`spec.eval_file` names the authors' 128-row evaluation file in `<mirror>/prompt-r1/eval/`; in Hub mode
the same files are fetched once from the authors' GitHub repository into `paths.cache_dir`.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.agent.template import DAPO_INSTRUCTION, split_user_message
from pipeline.config import Params
from pipeline.data.schema import display_path
from pipeline.errors import DataError
from pipeline.types import EvalRow

log = logging.getLogger(__name__)

TaskType = Literal["multi_hop_qa", "open_qa", "math", "long_form"]
MetricFamily = Literal["qa", "math", "generation"]
"""qa and math: EM and F1 (SM too); generation: F1 and SSim (method.md, Metrics)."""

MIRROR_COLUMNS = ("id", "question", "answers", "context", "source_split")
EVAL_COLUMNS = ("prompt", "reward_model")
AUTHORS_EVAL_URL = "https://raw.githubusercontent.com/QwenQKing/Prompt-R1/main/dataset/eval_data/{file}"

RawRecord = dict[str, Any]
"""id, question, answers, context, source_split: values as read, not yet checked."""


class BadRow(ValueError):
    """A converter found a row it cannot turn into a task; `reason` is the drop-count key."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


Converter = Callable[[RawRecord, Mapping[str, Any]], RawRecord]
"""(mapped record, original source row) → fixed record; may raise BadRow."""


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


@dataclass(frozen=True)
class MirrorSource:
    """Normalised Parquet file(s) under `<mirror>/raw/`."""

    files: tuple[str, ...]
    convert: Converter | None = None


@dataclass(frozen=True)
class DatasetSpec:
    """One dataset: what it is, where its rows come from, and the authors' evaluation file for it."""

    name: str
    task_type: TaskType
    metric_family: MetricFamily
    trains: bool
    """True for the 8 training datasets; False for the 4 out-of-distribution evaluation sets."""
    hub: HubSource
    mirror: MirrorSource
    eval_file: str
    """The authors' evaluation file name in `prompt-r1/eval/`."""
    eval_tag: str
    """The authors' `data_source` tag in that file (we replace it with `name`)."""
    task_format: Callable[[str], str] = field(default=lambda q: q)
    note: str = ""


# --- source quirks ---------------------------------------------------------------------------------


def _gsm8k_final_answer(rec: RawRecord, row: Mapping[str, Any]) -> RawRecord:
    """openai/gsm8k `answer` is a worked solution ending in `#### 42`: keep the number."""
    answers = rec["answers"]
    solution = answers[0] if isinstance(answers, list) and answers else None
    if not isinstance(solution, str) or "####" not in solution:
        raise BadRow("answer_unparseable")
    rec["answers"] = [solution.rsplit("####", 1)[1].strip().replace(",", "")]
    return rec


def _dapo_unwrap(rec: RawRecord, row: Mapping[str, Any]) -> RawRecord:
    """The Hub DAPO prompt embeds DAPO's instruction; keep the bare problem (added back at render)."""
    q = rec["question"]
    if isinstance(q, str):
        inner = DAPO_INSTRUCTION.unwrap(q)
        rec["question"] = inner if inner is not None else q
    return rec


def _booksum_hub_title(rec: RawRecord, row: Mapping[str, Any]) -> RawRecord:
    """kmfoda/booksum `book_id` is `<title>.<section>`: rebuild the mirror's `<title> — <section>`."""
    book_id, section = row.get("book_id"), row.get("summary_id")
    if isinstance(book_id, str) and isinstance(section, str) and book_id.endswith("." + section):
        rec["question"] = f"{book_id[: -len(section) - 1]} — {section}"
    rec["id"] = f"booksum-chapter-{row.get('bid')}-{row.get('source')}-{section}"
    return rec


def _mathqa_option_value(rec: RawRecord, row: Mapping[str, Any]) -> RawRecord:
    """allenai/math_qa stores a letter; the authors' rows use the option's numeric value."""
    letter, options = row.get("correct"), row.get("options")
    if not isinstance(letter, str) or not isinstance(options, str):
        raise BadRow("answer_unparseable")
    match = re.search(rf"(?:^|,)\s*{re.escape(letter.strip())}\s*\)\s*([^,]+)", options)
    if not match:
        raise BadRow("answer_unparseable")
    rec["answers"] = [match.group(1).strip()]
    return rec


def _xsum_mirror_reverse(rec: RawRecord, row: Mapping[str, Any]) -> RawRecord:
    """The mirror stores XSum as summarisation ('Summarize ...\\n\\n<document>' → summary); reverse it."""
    question, answers = rec["question"], rec["answers"]
    if (
        not isinstance(question, str)
        or "\n\n" not in question
        or not isinstance(answers, list)
        or not answers
    ):
        raise BadRow("source_layout")
    rec["question"], rec["answers"] = answers[0], [question.split("\n\n", 1)[1]]
    return rec


# --- task formats (the authors' evaluation rows) ----------------------------------------------------

_REDDIT_TAGS = re.compile(r"^\s*(?:\[\s*[A-Za-z]{1,4}\s*\]\s*)+")


def title_task(title: str) -> str:
    """BookSum: the authors' rows read `...given title: <title>.`"""
    title = title.strip()
    return (
        f"Please write a short article based on the given title: {title}{'' if title.endswith('.') else '.'}"
    )


def writing_prompt_task(prompt: str) -> str:
    """WritingPrompts: reddit tags dropped, prompt quoted, as in the authors' rows."""
    return f"Please write a short article based on the given title: '{_REDDIT_TAGS.sub('', prompt).strip()}'"


def article_task(summary: str) -> str:
    """XSum, reversed: write the article from its one-sentence summary."""
    return f"Please write an article: {summary.strip()}"


_FLASHRAG = "RUC-NLPIR/FlashRAG_datasets"

_SPECS: tuple[DatasetSpec, ...] = (
    DatasetSpec(
        name="2wikimultihopqa",
        task_type="multi_hop_qa",
        metric_family="qa",
        trains=True,
        hub=HubSource(
            _FLASHRAG,
            config="2wikimultihopqa",
            split="train",
            id="id",
            question="question",
            answers="golden_answers",
        ),
        mirror=MirrorSource(("2wikimultihopqa/dev.parquet",)),
        eval_file="2WikiMultihopQA.parquet",
        eval_tag="2WikiMultihopQA-256-test",
        note="mirror: dev split only (no train); the authors' eval rows are removed by the leakage filter",
    ),
    DatasetSpec(
        name="hotpotqa",
        task_type="multi_hop_qa",
        metric_family="qa",
        trains=True,
        hub=HubSource(
            _FLASHRAG,
            config="hotpotqa",
            split="train",
            id="id",
            question="question",
            answers="golden_answers",
        ),
        mirror=MirrorSource(("hotpotqa/dev.parquet",)),
        eval_file="hotpot.parquet",
        eval_tag="hotpot-256-test",
        note="mirror: distractor dev split only (no train)",
    ),
    DatasetSpec(
        name="gsm8k",
        task_type="math",
        metric_family="math",
        trains=True,
        hub=HubSource(
            "openai/gsm8k",
            config="main",
            split="train",
            question="question",
            answers="answer",
            convert=_gsm8k_final_answer,
        ),
        mirror=MirrorSource(("gsm8k/train.parquet",)),
        eval_file="gsm8k.parquet",
        eval_tag="gsm8k-256-test",
    ),
    DatasetSpec(
        name="dapo_math",
        task_type="math",
        metric_family="math",
        trains=True,
        hub=HubSource(
            "open-r1/DAPO-Math-17k-Processed",
            config="all",
            split="train",
            id="extra_info.index",
            question="prompt",
            answers="solution",
            convert=_dapo_unwrap,
        ),
        mirror=MirrorSource(("dapo_math_17k/train.parquet",)),
        eval_file="DAPO-Math.parquet",
        eval_tag="dapo-math-256-test",
    ),
    DatasetSpec(
        name="musique",
        task_type="multi_hop_qa",
        metric_family="qa",
        trains=True,
        hub=HubSource(
            _FLASHRAG, config="musique", split="train", id="id", question="question", answers="golden_answers"
        ),
        mirror=MirrorSource(("musique/train.parquet",)),
        eval_file="MusiQue.parquet",
        eval_tag="MusiQue-256-test",
    ),
    DatasetSpec(
        name="popqa",
        task_type="open_qa",
        metric_family="qa",
        trains=True,
        hub=HubSource(
            _FLASHRAG, config="popqa", split="test", id="id", question="question", answers="golden_answers"
        ),
        mirror=MirrorSource(("popqa/test.parquet",)),
        eval_file="PopQA.parquet",
        eval_tag="PopQA-256-test",
        note="one split only; the authors' eval rows are removed by the leakage filter",
    ),
    DatasetSpec(
        name="booksum",
        task_type="long_form",
        metric_family="generation",
        trains=True,
        hub=HubSource(
            "kmfoda/booksum",
            split="train",
            question="book_id",
            answers="summary_text",
            convert=_booksum_hub_title,
        ),
        mirror=MirrorSource(("booksum/chapter_train.parquet",)),
        eval_file="BookSum.parquet",
        eval_tag="w-book-6600-256-test",
        task_format=title_task,
        note="title = '<book> — <section>' (the authors used LLM-written titles and shortened summaries)",
    ),
    DatasetSpec(
        name="writingprompts",
        task_type="long_form",
        metric_family="generation",
        trains=True,
        hub=HubSource("euclaise/writingprompts", split="train", question="prompt", answers="story"),
        mirror=MirrorSource(("writingprompts/train_subset.parquet",)),
        eval_file="WritingPrompts.parquet",
        eval_tag="wp-6600-256-test",
        task_format=writing_prompt_task,
        note="mirror: a 600-row subset of the train split",
    ),
    DatasetSpec(
        name="mathqa",
        task_type="math",
        metric_family="math",
        trains=False,
        hub=HubSource(
            "allenai/math_qa",
            split="test",
            question="Problem",
            answers="correct",
            convert=_mathqa_option_value,
        ),
        mirror=MirrorSource(("mathqa/test.parquet",)),
        eval_file="MathQA_ood.parquet",
        eval_tag="MathQA-128-eval_ood",
        note="mirror: the MathQA-Gain subset (numeric answers, as in the authors' rows)",
    ),
    DatasetSpec(
        name="squad_v2",
        task_type="open_qa",
        metric_family="qa",
        trains=False,
        hub=HubSource(
            "rajpurkar/squad_v2",
            split="validation",
            id="id",
            question="question",
            answers="answers.text",
            context="context",
        ),
        mirror=MirrorSource(("squad_v2/dev.parquet",)),
        eval_file="squad_v2_ood.parquet",
        eval_tag="squad_v2-128-eval_ood",
    ),
    DatasetSpec(
        name="triviaqa",
        task_type="open_qa",
        metric_family="qa",
        trains=False,
        hub=HubSource(
            _FLASHRAG, config="triviaqa", split="test", id="id", question="question", answers="golden_answers"
        ),
        mirror=MirrorSource(("triviaqa/test_subsample1000.parquet",)),
        eval_file="triviaqa_ood.parquet",
        eval_tag="triviaqa_train-128-eval_ood",
    ),
    DatasetSpec(
        name="xsum",
        task_type="long_form",
        metric_family="generation",
        trains=False,
        hub=HubSource("EdinburghNLP/xsum", split="test", id="id", question="summary", answers="document"),
        mirror=MirrorSource(("xsum/test.parquet",), convert=_xsum_mirror_reverse),
        eval_file="Xsum_ood.parquet",
        eval_tag="xum-128-eval_ood",
        task_format=article_task,
        note="reversed, as in the authors' rows: summary → article",
    ),
)

REGISTRY: dict[str, DatasetSpec] = {spec.name: spec for spec in _SPECS}
TASK_TYPES: frozenset[str] = frozenset(spec.task_type for spec in _SPECS)


def get_spec(name: str) -> DatasetSpec:
    try:
        return REGISTRY[name]
    except KeyError:
        raise DataError(f"unknown dataset {name!r}; known: {', '.join(REGISTRY)}") from None


# --- reading raw sources ---------------------------------------------------------------------------


@dataclass
class RawSource:
    """Raw records of one dataset and where they came from (for the stage's metrics)."""

    records: list[RawRecord]
    origin: list[str]
    rows_read: int = 0


def _dig(row: Mapping[str, Any], dotted: str) -> Any:
    value: Any = row
    for part in dotted.split("."):
        if isinstance(value, Mapping):
            value = value.get(part)
        elif isinstance(value, list | tuple) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            return None
    return value


def _apply(convert: Converter | None, rec: RawRecord, row: Mapping[str, Any]) -> RawRecord:
    if convert is None:
        return rec
    try:
        return convert(rec, row)
    except BadRow as bad:
        rec["_bad"] = bad.reason
        return rec


def read_mirror_file(
    path: Path, root: Path, columns: tuple[str, ...] = MIRROR_COLUMNS
) -> list[dict[str, Any]]:
    """Rows of one mirror Parquet file; DataError naming the file (and column) when unusable."""
    shown = display_path(path, root)
    if not path.is_file():
        raise DataError(f"{shown}: source file not found")
    try:
        schema = pq.read_schema(path)
    except (OSError, pa.ArrowException) as exc:
        raise DataError(f"{shown}: cannot read as Parquet ({exc})") from None
    missing = [c for c in columns if c not in schema.names]
    if missing:
        raise DataError(
            f"{shown}: missing column(s) {', '.join(repr(c) for c in missing)} "
            f"(has: {', '.join(schema.names)}; expected: {', '.join(columns)})"
        )
    try:
        return pq.read_table(path, columns=list(columns)).to_pylist()
    except (OSError, pa.ArrowException) as exc:
        raise DataError(f"{shown}: cannot read columns {list(columns)} ({exc})") from None


def _load_mirror(spec: DatasetSpec, mirror: Path, root: Path) -> RawSource:
    out = RawSource(records=[], origin=[])
    for rel in spec.mirror.files:
        path = mirror / "raw" / rel
        rows = read_mirror_file(path, root)
        out.origin.append(f"mirror:raw/{rel}")
        out.rows_read += len(rows)
        for row in rows:
            rec = {c: row[c] for c in MIRROR_COLUMNS}
            out.records.append(_apply(spec.mirror.convert, rec, row))
    return out


def _load_hub(spec: DatasetSpec, cache_dir: Path) -> RawSource:
    hub = spec.hub
    try:
        import datasets

        ds = datasets.load_dataset(hub.path, hub.config, split=hub.split, cache_dir=str(cache_dir / "hf"))
    except Exception as exc:  # noqa: BLE001 — any failure of the Hub path is reported the same way
        raise DataError(
            f"{spec.name}: cannot load {hub.describe()} from the Hugging Face Hub "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); set paths.mirror to a "
            f"local mirror, or list {spec.name!r} in data.allow_skip to skip it explicitly"
        ) from None
    for dotted in filter(None, (hub.question, hub.answers, hub.id, hub.context)):
        if dotted.split(".")[0] not in ds.column_names:
            raise DataError(
                f"{hub.describe()}: missing column {dotted.split('.')[0]!r} "
                f"(has: {', '.join(ds.column_names)})"
            )
    out = RawSource(records=[], origin=[hub.describe()], rows_read=len(ds))
    for i, row in enumerate(ds):
        answers = _dig(row, hub.answers)
        rec: RawRecord = {
            "id": str(_dig(row, hub.id)) if hub.id else f"{spec.name}-{hub.split}-{i}",
            "question": _dig(row, hub.question),
            # Scalar answer fields (a story, a summary, a letter) are declared as such: one gold answer.
            "answers": [answers] if isinstance(answers, str) else answers,
            "context": _dig(row, hub.context) if hub.context else "",
            "source_split": hub.split,
        }
        out.records.append(_apply(hub.convert, rec, row))
    return out


def load_raw(spec: DatasetSpec, params: Params) -> RawSource:
    """The raw records of `spec` from the mirror (if `paths.mirror` is set) or the Hub."""
    mirror = params.mirror
    if mirror is not None:
        return _load_mirror(spec, mirror, params.root)
    return _load_hub(spec, params.path(params.paths.cache_dir))


# --- the authors' evaluation files -----------------------------------------------------------------


def authors_eval_path(params: Params, spec: DatasetSpec) -> Path:
    """Local path of the authors' evaluation file (fetched into the cache once in Hub mode)."""
    mirror = params.mirror
    if mirror is not None:
        return mirror / "prompt-r1" / "eval" / spec.eval_file
    target = params.path(params.paths.cache_dir) / "prompt-r1" / "eval" / spec.eval_file
    if not target.is_file():
        url = AUTHORS_EVAL_URL.format(file=spec.eval_file)
        try:
            import httpx

            response = httpx.get(url, timeout=60.0, follow_redirects=True)
            response.raise_for_status()
        except Exception as exc:  # noqa: BLE001
            raise DataError(
                f"{spec.name}: cannot fetch the authors' evaluation file {url} ({type(exc).__name__}); "
                "set paths.mirror to a folder holding prompt-r1/eval/"
            ) from None
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(".part")
        tmp.write_bytes(response.content)
        tmp.replace(target)
    return target


def normalised_eval_row(row: EvalRow, spec: DatasetSpec) -> dict[str, Any]:
    """An evaluation row in the normalised schema of the sampled files (what `validate` checks)."""
    return {
        "id": row.id,
        "question": row.question,
        "answers": row.answers,
        "context": "",
        "task_type": spec.task_type,
        "source_split": "eval",
        "dataset": spec.name,
    }


def load_authors_eval(params: Params, spec: DatasetSpec) -> list[EvalRow]:
    """The authors' evaluation rows of `spec`; ids are `<dataset>-eval-<row index>` (files are fixed)."""
    path = authors_eval_path(params, spec)
    shown = display_path(path, params.root)
    rows = read_mirror_file(path, params.root, EVAL_COLUMNS)
    out: list[EvalRow] = []
    for i, row in enumerate(rows):
        prompt, reward = row["prompt"], row["reward_model"]
        try:
            content = prompt[0]["content"]
            question, has_instruction = split_user_message(content, spec.name)
        except (TypeError, KeyError, IndexError, ValueError) as exc:
            raise DataError(
                f"{shown}: row {i}, column 'prompt': not a Prompt-R1 user message ({exc})"
            ) from None
        truth = reward.get("ground_truth") if isinstance(reward, Mapping) else None
        if not isinstance(truth, list):
            raise DataError(f"{shown}: row {i}, column 'reward_model': no ground_truth list")
        out.append(
            EvalRow(
                dataset=spec.name,
                split="id" if spec.trains else "ood",
                index=i,
                id=f"{spec.name}-eval-{i:03d}",
                question=question,
                answers=list(truth),
                messages=[{"role": "user", "content": content}],  # split_user_message parsed it as one
                has_instruction=has_instruction,
            )
        )
    return out
