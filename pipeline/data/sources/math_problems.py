"""Math sources: GSM8K and DAPO-Math (train), MathQA (out-of-distribution evaluation only).

Every math dataset keeps the bare problem as its question. The Hub rows need a converter each, because
their answer or question fields are not yet what the authors' rows hold (the mirror's are):
- GSM8K's `answer` is a worked solution ending in `#### 42`: the number is the gold.
- DAPO's Hub prompt embeds DAPO's own instruction: it is taken off here and added back when the template
  is rendered (`pipeline.agent.template`), so the question the leakage filter sees is the bare problem.
- MathQA stores the correct option's letter; the authors' rows hold the option's numeric value.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from pipeline.agent.template import DAPO_INSTRUCTION
from pipeline.data.sources.registry import BadRow, HubSource, RawRecord, register


def gsm8k_final_answer(rec: RawRecord, row: Mapping[str, Any]) -> RawRecord:
    """openai/gsm8k `answer` is a worked solution ending in `#### 42`: keep the number."""
    answers = rec["answers"]
    solution = answers[0] if isinstance(answers, list) and answers else None
    if not isinstance(solution, str) or "####" not in solution:
        raise BadRow("answer_unparseable")
    rec["answers"] = [solution.rsplit("####", 1)[1].strip().replace(",", "")]
    return rec


def dapo_unwrap(rec: RawRecord, row: Mapping[str, Any]) -> RawRecord:
    """The Hub DAPO prompt embeds DAPO's instruction; keep the bare problem (added back at render)."""
    q = rec["question"]
    if isinstance(q, str):
        inner = DAPO_INSTRUCTION.unwrap(q)
        rec["question"] = inner if inner is not None else q
    return rec


def mathqa_option_value(rec: RawRecord, row: Mapping[str, Any]) -> RawRecord:
    """allenai/math_qa stores a letter; the authors' rows use the option's numeric value."""
    letter, options = row.get("correct"), row.get("options")
    if not isinstance(letter, str) or not isinstance(options, str):
        raise BadRow("answer_unparseable")
    match = re.search(rf"(?:^|,)\s*{re.escape(letter.strip())}\s*\)\s*([^,]+)", options)
    if not match:
        raise BadRow("answer_unparseable")
    rec["answers"] = [match.group(1).strip()]
    return rec


register("gsm8k", "math", trains=True,
         hub=HubSource("openai/gsm8k", config="main", split="train", question="question", answers="answer", convert=gsm8k_final_answer),
         mirror="gsm8k/train.parquet", eval_file="gsm8k.parquet", eval_tag="gsm8k-256-test")
register("dapo_math", "math", trains=True,
         hub=HubSource("open-r1/DAPO-Math-17k-Processed", config="all", split="train", id="extra_info.index", question="prompt", answers="solution", convert=dapo_unwrap),
         mirror="dapo_math_17k/train.parquet", eval_file="DAPO-Math.parquet", eval_tag="dapo-math-256-test")
register("mathqa", "math", trains=False,
         hub=HubSource("allenai/math_qa", split="test", question="Problem", answers="correct", convert=mathqa_option_value),
         mirror="mathqa/test.parquet", eval_file="MathQA_ood.parquet", eval_tag="MathQA-128-eval_ood",
         note="mirror: the MathQA-Gain subset (numeric answers, as in the authors' rows)")
