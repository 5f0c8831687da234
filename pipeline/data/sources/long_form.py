"""Long-form generation sources: BookSum and WritingPrompts (train), XSum (out-of-distribution evaluation).

Each one's raw question becomes the task the authors' evaluation rows pose (a `task_format`):
- BookSum and WritingPrompts become "Please write a short article based on the given title: ..." with
  the summary / story as the answer. The authors gave BookSum LLM-written titles; the raw rows have
  none, so our BookSum title is the row's own `question`, "<book title> — <section name>" (rebuilt from
  the Hub's `book_id`, which the mirror already did). WritingPrompts loses its reddit tags (`[ WP ]`)
  and is quoted, exactly as in the authors' rows.
- XSum is reversed (the authors' "Please write an article: <summary>" → the BBC document). The Hub
  declares it that way round directly; the mirror stores it as summarisation, so its converter swaps.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from pipeline.data.sources.registry import BadRow, HubSource, RawRecord, register

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


def booksum_hub_title(rec: RawRecord, row: Mapping[str, Any]) -> RawRecord:
    """kmfoda/booksum `book_id` is `<title>.<section>`: rebuild the mirror's `<title> — <section>`."""
    book_id, section = row.get("book_id"), row.get("summary_id")
    if isinstance(book_id, str) and isinstance(section, str) and book_id.endswith("." + section):
        rec["question"] = f"{book_id[: -len(section) - 1]} — {section}"
    rec["id"] = f"booksum-chapter-{row.get('bid')}-{row.get('source')}-{section}"
    return rec


def xsum_mirror_reverse(rec: RawRecord, row: Mapping[str, Any]) -> RawRecord:
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


register("booksum", "long_form", trains=True,
         hub=HubSource("kmfoda/booksum", split="train", question="book_id", answers="summary_text", convert=booksum_hub_title),
         mirror="booksum/chapter_train.parquet", eval_file="BookSum.parquet", eval_tag="w-book-6600-256-test",
         task_format=title_task,
         note="title = '<book> — <section>' (the authors used LLM-written titles and shortened summaries)")
register("writingprompts", "long_form", trains=True,
         hub=HubSource("euclaise/writingprompts", split="train", question="prompt", answers="story"),
         mirror="writingprompts/train_subset.parquet", eval_file="WritingPrompts.parquet",
         eval_tag="wp-6600-256-test", task_format=writing_prompt_task,
         note="mirror: a 600-row subset of the train split")
register("xsum", "long_form", trains=False,
         hub=HubSource("EdinburghNLP/xsum", split="test", id="id", question="summary", answers="document"),
         mirror="xsum/test.parquet", mirror_convert=xsum_mirror_reverse, eval_file="Xsum_ood.parquet",
         eval_tag="xum-128-eval_ood", task_format=article_task,
         note="reversed, as in the authors' rows: summary → article")
