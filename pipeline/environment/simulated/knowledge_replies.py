"""Reading the knowledgeable environment's replies, whatever its mode: did it answer, and what did it name.

`answered` knows the refusals of all three modes (`question`'s unknown request, `terse`'s request length
limit, `hops`' replies that state no fact), so it sits above the three mode modules rather than in one of
them. `reply_entity` and `reask_request` read any reply for the entity it states and build the second
request of a 2-hop question from it: they need no knowledge of the `hops` world, only the reply, so they are
a reference for what a re-asking agent can do (the evaluation's `hops` rules and the format warm-up use them).
"""

from __future__ import annotations

import re

from pipeline.environment.simulated.hops import refused
from pipeline.environment.simulated.hops_world import tokens
from pipeline.environment.simulated.knowledge import STOP_WORDS, UNKNOWN_REPLY, content_tokens
from pipeline.environment.simulated.terse import TOO_LONG_REPLY


def answered(reply: str) -> bool:
    """Whether an environment reply (any mode) answers the request: not a refusal, not 'unknown', not a `hops`
    reply that states no fact."""
    text = reply.strip()
    return (
        bool(text)
        and text != UNKNOWN_REPLY
        and not text.startswith(TOO_LONG_REPLY.split("{")[0])
        and not refused(text)
    )


_ENTITY = re.compile(r"[A-Z][\w'-]*(?:(?: (?:of|the|de|da|del|von|van|la|le))* [A-Z][\w'-]*)*")
_LEADING = frozenset({"the", "a", "an", "about", "i", "in", "ask", "your"})
_WORD = re.compile(r"[A-Za-z0-9]+")


def reply_entity(reply: str, request: str = "") -> str:
    """The entity a reply states beyond the request: the last run of capitalised words (joined by "of", "the",
    "de" and the like; a leading article or sentence opener dropped) that the request does not contain
    (case-insensitive); '' for a reply that states no fact (any mode's refusal: `answered`). Written for any
    reply, not from the world."""
    if not answered(reply):
        return ""
    said = f" {' '.join(tokens(request))} "
    found = []
    for run in _ENTITY.findall(reply):
        words = run.split()
        while words and words[0].lower() in _LEADING:
            words = words[1:]
        if words and f" {' '.join(tokens(' '.join(words)))} " not in said:
            found.append(" ".join(words))
    return found[-1] if found else ""


def content_words(question: str, limit: int = 8) -> list[str]:
    """The question's first `limit` words that are not stop words, in its order and spelling."""
    return [w for w in _WORD.findall(question) if w.lower() not in STOP_WORDS][:limit]


def reask_request(question: str, reply: str) -> str:
    """A second request from the first reply: its entity (`reply_entity`) followed by the question's content
    words the reply did not restate ('' when the reply states no entity). Generic: it needs no knowledge of
    the world, only the reply, so it is a reference for what a re-asking agent can do."""
    entity = reply_entity(reply, question)
    if not entity:
        return ""
    said = content_tokens(reply)
    return " ".join([entity, *(w for w in content_words(question) if w.lower() not in said)])
