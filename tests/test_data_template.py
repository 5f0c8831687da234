"""The Prompt-R1 user message: our rendering must equal the authors' text for every one of their rows."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from pipeline.agent.template import (
    DAPO_INSTRUCTION,
    load_template,
    render_user_message,
    split_user_message,
)
from pipeline.data.sources import REGISTRY

MARKER = "\nFirst, provide a simple explanation of the question"


def _authors_rows(shared_datasets):
    for spec in REGISTRY.values():
        if spec.generated is not None:  # no authors' file: its rows are rendered by our template
            continue
        table = pq.read_table(shared_datasets / "prompt-r1" / "eval" / spec.eval_file, columns=["prompt"])
        for prompt in table.column("prompt").to_pylist():
            yield spec.name, prompt


def test_renders_all_1536_authors_rows_exactly(shared_datasets):
    checked, with_instruction = 0, 0
    for dataset, prompt in _authors_rows(shared_datasets):
        assert len(prompt) == 1 and prompt[0]["role"] == "user"
        content = prompt[0]["content"]
        # The question is the part after "Question: " up to the instructions ...
        assert content.startswith("Question: ") and content.count(MARKER) == 1
        question = content[len("Question: ") : content.index(MARKER)]
        # ... and for DAPO rows that carry DAPO's own instruction, the instruction is separated from it.
        inner = DAPO_INSTRUCTION.unwrap(question) if dataset == "dapo_math" else None
        if inner is not None:
            with_instruction += 1
            assert render_user_message(inner, dataset) == content
        else:
            assert render_user_message(question, dataset, dataset_instruction=False) == content
            if dataset != "dapo_math":  # datasets without an instruction render the same either way
                assert render_user_message(question, dataset) == content
        checked += 1
    assert checked == 1536
    assert with_instruction == 70  # the other 58 DAPO rows carry no DAPO instruction in the authors' file


def test_split_is_the_inverse_of_render(shared_datasets):
    for dataset, prompt in _authors_rows(shared_datasets):
        content = prompt[0]["content"]
        question, has_instruction = split_user_message(content, dataset)
        assert render_user_message(question, dataset, dataset_instruction=has_instruction) == content


def test_template_file_holds_one_slot_and_no_trailing_newline():
    text = load_template()
    assert text.startswith("Question: {question}\nFirst, provide a simple explanation")
    assert text.endswith("<answer>(final answer for the question)</answer>")
    assert "outline → add details → refine → check). \n4." in text  # the authors' trailing space is kept


def test_math_instructions_follow_the_authors_rows():
    rendered = render_user_message("What is 1+1?", "dapo_math")
    assert rendered.startswith("Question: Solve the following math problem step by step.")
    assert 'What is 1+1?\n\nRemember to put your answer on its own line after "Answer:".\nFirst,' in rendered
    # Already wrapped: not wrapped twice.
    assert render_user_message(DAPO_INSTRUCTION.wrap("What is 1+1?"), "dapo_math") == rendered
    # GSM8K and MathQA rows carry no instruction in the authors' files.
    assert render_user_message("What is 1+1?", "gsm8k").startswith("Question: What is 1+1?\nFirst,")
    assert render_user_message("What is 1+1?", "mathqa").startswith("Question: What is 1+1?\nFirst,")


def test_braces_in_questions_are_not_format_fields():
    rendered = render_user_message(r"Find $\frac{a}{b}$ when {x} = 2", "dapo_math", dataset_instruction=False)
    assert rendered.startswith(r"Question: Find $\frac{a}{b}$ when {x} = 2" + "\n")


def test_custom_template_and_bad_message():
    assert render_user_message("Q?", "hotpotqa", template="<<{question}>>") == "<<Q?>>"
    with pytest.raises(ValueError, match="template"):
        split_user_message("Question: no instructions here", "hotpotqa")
