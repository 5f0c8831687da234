"""The Prompt-R1 user message: `Question: {question}` followed by the authors' agent instructions.

The text is the authors' own, copied byte for byte from `prompt[0]["content"]` of their 12 evaluation
files (`prompt-r1/eval/*.parquet`) into `prompt_r1_template.txt` beside this module, so it can be read,
diffed and swapped (`render_user_message(..., template=...)`) without touching code. The file holds
one `{question}` placeholder, filled by plain substitution rather than `str.format`, so braces in a
question (LaTeX in the math sets) are never interpreted. The file ends with one newline that editors
insist on; the authors' message does not, so exactly one trailing newline is dropped on load.

Dataset instructions, as the authors' rows show them (not as method.md summarises them):
- DAPO-Math carries DAPO-Math-17k's own wrapper, "Solve the following math problem step by step. ...
  \\n\\n{problem}\\n\\nRemember to put your answer on its own line after "Answer:".", placed *inside*
  the `Question:` line. Our normalised DAPO questions are the bare problems (the mirror stores them so;
  the Hub copy is unwrapped on load), and the wrapper is added here, at render time.
- GSM8K and MathQA rows carry no instruction at all: their text after `Question: ` is the bare problem,
  so their instruction is empty (method.md's "math sets prepend their own instruction" holds only for
  DAPO in the released files).
- 58 of the authors' 128 DAPO evaluation rows also lack the wrapper (they come from elsewhere: short,
  sometimes truncated statements). `dataset_instruction=False` renders those; `split_user_message`
  reports which case a row is.

`split_user_message` is the inverse of `render_user_message`: it recovers (question, instruction used)
from an authors' message; the data stages use it to read the authors' evaluation files.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path

TEMPLATE_FILE = Path(__file__).with_name("prompt_r1_template.txt")
QUESTION_SLOT = "{question}"


@dataclass(frozen=True)
class DatasetInstruction:
    """Text a dataset wraps around its question inside the `Question:` line."""

    prefix: str = ""
    suffix: str = ""

    def wrap(self, question: str) -> str:
        return f"{self.prefix}{question}{self.suffix}"

    def unwrap(self, text: str) -> str | None:
        """The question inside this wrapper, or None when `text` does not carry it."""
        if not (self.prefix or self.suffix):
            return None
        if (
            text.startswith(self.prefix)
            and text.endswith(self.suffix)
            and len(text) >= len(self.prefix) + len(self.suffix)
        ):
            return text[len(self.prefix) : len(text) - len(self.suffix)]
        return None


DAPO_INSTRUCTION = DatasetInstruction(
    prefix=(
        "Solve the following math problem step by step. The last line of your response should be of the "
        "form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
    ),
    suffix='\n\nRemember to put your answer on its own line after "Answer:".',
)

DATASET_INSTRUCTIONS: dict[str, DatasetInstruction] = {
    "dapo_math": DAPO_INSTRUCTION,
    "gsm8k": DatasetInstruction(),
    "mathqa": DatasetInstruction(),
}
"""Per-dataset instruction; datasets not listed have none."""


@cache
def _read_template(path: Path) -> str:
    text = path.read_text(encoding="utf-8").removesuffix("\n")
    if text.count(QUESTION_SLOT) != 1:
        raise ValueError(f"{path}: the template must contain {QUESTION_SLOT} exactly once")
    return text


def load_template(path: str | Path | None = None) -> str:
    """The Prompt-R1 template text (default: the packaged authors' text)."""
    return _read_template(Path(path) if path else TEMPLATE_FILE)


def instruction_for(dataset: str) -> DatasetInstruction:
    return DATASET_INSTRUCTIONS.get(dataset, DatasetInstruction())


def render_user_message(
    question: str,
    dataset: str,
    *,
    dataset_instruction: bool = True,
    template: str | None = None,
) -> str:
    """The single Prompt-R1 user message for `question` from `dataset`.

    `dataset_instruction=False` leaves out the dataset's own wrapper (the authors' unwrapped DAPO rows).
    A question that already carries its dataset's wrapper is not wrapped twice.
    """
    text = template if template is not None else load_template()
    instruction = instruction_for(dataset)
    if dataset_instruction and instruction.unwrap(question) is None:
        question = instruction.wrap(question)
    head, tail = text.split(QUESTION_SLOT, 1)
    return f"{head}{question}{tail}"


def split_user_message(content: str, dataset: str, *, template: str | None = None) -> tuple[str, bool]:
    """Inverse of `render_user_message`: (question, whether the dataset's wrapper was present).

    Raises ValueError when `content` does not follow the template.
    """
    text = template if template is not None else load_template()
    head, tail = text.split(QUESTION_SLOT, 1)
    if not (content.startswith(head) and content.endswith(tail) and len(content) >= len(head) + len(tail)):
        raise ValueError("message does not follow the Prompt-R1 template")
    inner = content[len(head) : len(content) - len(tail)]
    unwrapped = instruction_for(dataset).unwrap(inner)
    return (inner, False) if unwrapped is None else (unwrapped, True)
