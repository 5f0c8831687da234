"""What the agent can be asked: a question is text with something in it.

`promptr1 ask` and the served pyfunc both refuse anything else before the environment is called: an empty
question got an invented answer after three paid turns (the template still asks the agent to answer), and a
number or a null from a JSON request was turned into the text "42" or "None" and answered the same way.
"""

from __future__ import annotations


def question_problem(question: object) -> str | None:
    """Why `question` cannot be asked (empty, blank, or not text), or None when it can."""
    if not isinstance(question, str):
        return f"a question must be text, got {type(question).__name__} {question!r}"
    if not question.strip():
        return f"the question is empty ({question!r}): ask something"
    return None
