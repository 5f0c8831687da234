"""Rules written in a few lines, asked the knowledgeable environment on the held-out rows: what no training buys.

Why: a learning result means something only beside what a fixed rule gets from the same environment. In the
knowledgeable environment's `question` mode, sending the question verbatim and reading the answer out of the
reply template scores F1 100, so GRPO's gain there is answer extraction measured against a warm-up taught to
ignore the reply. Each rule here is a request (what to send) and a reading (what to answer from the reply); it
is asked exactly as the server answers (`knowledge.completion_body`: the same reply and the same `max_tokens`
cut), without an agent and without training, so it costs milliseconds per question.

Requests:
- `question`: the question verbatim (what the warm-up's request templates contain);
- `content_words`: the question's first `terse.MAX_REQUEST_WORDS` content words (stop words dropped): the
  shortest fix for a length limit that a person would write first.
Readings:
- `template_read`: the `{answer}` slot of the `question` mode's reply templates (`knowledge.REPLY_TEMPLATES`);
  a reply no template matches is answered whole;
- `full_reply`: the whole reply;
- `first_sentence`: the reply up to its first sentence end;
- `first_entry` / `random_entry`: the answer of the first / a hash-picked entry of a `terse` reply (the
  obvious readings of a reply that lists candidates; the right entry's position varies, so they score about
  one in three where the request is answered).
`INFORMED_RULES` holds one more rule that is not trivial (`read_label_match`: it reads `terse`'s entries and
picks the one labelled with the request's words), to show what a reading of that mode's replies can reach.
Every combination is a rule (`RULES`); `evaluate_rules` scores each on F1/EM and on how often the request was
answered (`knowledge_replies.answered`), per question, so the CIs can be recomputed.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Sequence
from typing import Any

from pipeline.environment.simulated.knowledge import (
    REPLY_TEMPLATES,
    KnowledgeBase,
    completion_body,
    content_tokens,
)
from pipeline.environment.simulated.knowledge_replies import answered
from pipeline.environment.simulated.terse import MAX_REQUEST_WORDS, PHRASES
from pipeline.metrics import exact_match, token_f1

_TOKEN = re.compile(r"[A-Za-z0-9]+")


def _template_pattern(template: str) -> re.Pattern[str]:
    parts = re.split(r"(\{question\}|\{answer\})", template)
    slots = {"{question}": "(?:.*?)", "{answer}": "(?P<answer>.+?)"}
    return re.compile("".join(slots.get(p, re.escape(p)) for p in parts), re.DOTALL)


_TEMPLATES = [_template_pattern(t) for t in REPLY_TEMPLATES]


def request_question(question: str) -> str:
    return question


def request_content_words(question: str) -> str:
    """The question's first MAX_REQUEST_WORDS content words, in the question's order and spelling."""
    keep = content_tokens(question)
    words = [w for w in _TOKEN.findall(question) if w.lower() in keep]
    return " ".join(words[:MAX_REQUEST_WORDS])


def read_template(reply: str, request: str = "") -> str:
    """The `{answer}` slot of the `question` mode's reply templates; the whole reply when none matches."""
    for pattern in _TEMPLATES:
        found = pattern.fullmatch(reply.strip())
        if found:
            return found.group("answer").strip()
    return reply.strip()


def read_full_reply(reply: str, request: str = "") -> str:
    return reply.strip()


def read_first_sentence(reply: str, request: str = "") -> str:
    """The reply up to the first '.', '!' or '?' followed by a space (the end mark dropped)."""
    return re.split(r"(?<=[.!?])\s+", reply.strip(), maxsplit=1)[0].rstrip(".!?")


def _phrase_pattern(phrase: str) -> re.Pattern[str]:
    parts = re.split(r"(\{label\}|\{answer\})", phrase)
    slots = {"{label}": "(?P<label>[a-z0-9]+(?: [a-z0-9]+)*)", "{answer}": "(?P<answer>.+?)"}
    return re.compile("".join(slots.get(p, re.escape(p)) for p in parts), re.DOTALL)


_PHRASES = [_phrase_pattern(p) for p in PHRASES]


def terse_entries(reply: str) -> list[tuple[str, str]] | None:
    """The (label, answer) entries of a `terse` reply, in order; None when the reply is not made of them."""
    text = reply.strip()
    if not text:
        return []
    for end in (m.end() for m in re.finditer(r"\.(?= |$)", text)):
        for pattern in _PHRASES:
            found = pattern.fullmatch(text[:end])
            rest = terse_entries(text[end:]) if found else None
            if found and rest is not None:
                return [(found.group("label"), found.group("answer").strip()), *rest]
    return None


def read_first_entry(reply: str, request: str = "") -> str:
    """The answer of a `terse` reply's first entry (the whole reply when it has no entries)."""
    entries = terse_entries(reply)
    return entries[0][1] if entries else reply.strip()


def read_random_entry(reply: str, request: str = "") -> str:
    """The answer of one of a `terse` reply's entries, picked by a hash of the reply (deterministic, and
    unrelated to which entry is right); the whole reply when it has no entries."""
    entries = terse_entries(reply)
    if not entries:
        return reply.strip()
    return entries[int(hashlib.md5(reply.encode("utf-8")).hexdigest(), 16) % len(entries)][1]


def read_label_match(reply: str, request: str = "") -> str:
    """Not a trivial rule: written from `terse`'s documented reply format, it answers with the entry whose
    label shares the most words with the request (the whole reply when the reply has no entries). It shows
    that the mode's replies can be read; it is a ceiling for a reading, not a baseline."""
    entries = terse_entries(reply)
    if not entries:
        return reply.strip()
    words = content_tokens(request)
    return max(entries, key=lambda e: len(words & set(e[0].split())))[1]


REQUESTS: dict[str, Callable[[str], str]] = {
    "question": request_question,
    "content_words": request_content_words,
}
READINGS: dict[str, Callable[[str], str]] = {
    "template_read": read_template,
    "full_reply": read_full_reply,
    "first_sentence": read_first_sentence,
    "first_entry": read_first_entry,
    "random_entry": read_random_entry,
}
RULES = {f"{req}+{read}": (REQUESTS[req], READINGS[read]) for req in REQUESTS for read in READINGS}
"""The trivial rules. Rule name (`request+reading`) -> (request function, reading function(reply, request))."""
INFORMED_RULES = {"content_words+label_match": (request_content_words, read_label_match)}
"""Rules written from the `terse` mode's documented format: what a reading of its replies can reach."""


def ask(kb: KnowledgeBase, request: str, max_tokens: int | None) -> str:
    """The reply the knowledge server sends to `request` as the last user message (its `max_tokens` cut too)."""
    body = {"messages": [{"role": "user", "content": request}], "max_tokens": max_tokens}
    return completion_body(kb, body, "rules")["choices"][0]["message"]["content"]


def evaluate_rules(
    kb: KnowledgeBase,
    rows_by_ds: dict[str, Sequence[Any]],
    max_tokens: int | None,
    rules: dict[str, tuple[Callable[[str], str], Callable[[str], str]]] | None = None,
) -> dict[str, dict[str, Any]]:
    """Each rule on every row (`row.question`, `row.answers`): per dataset the lists `f1`, `em`, `answered`
    (1.0 / 0.0) and `predictions`, plus the means `f1_mean`, `em_mean`, `answered_mean`."""
    out: dict[str, dict[str, Any]] = {}
    for name, (make_request, read) in (rules or RULES).items():
        result: dict[str, Any] = {"f1": {}, "em": {}, "answered": {}, "predictions": {}}
        for dataset, rows in rows_by_ds.items():
            f1s, ems, hits, preds = [], [], [], []
            for row in rows:
                request = make_request(row.question)
                reply = ask(kb, request, max_tokens)
                prediction = read(reply, request)
                f1s.append(token_f1(prediction, row.answers))
                ems.append(exact_match(prediction, row.answers))
                hits.append(float(answered(reply)))
                preds.append(prediction)
            result["f1"][dataset], result["em"][dataset] = f1s, ems
            result["answered"][dataset], result["predictions"][dataset] = hits, preds
        for key in ("f1", "em", "answered"):
            values = [v for vs in result[key].values() for v in vs]
            result[f"{key}_mean"] = sum(values) / len(values) if values else float("nan")
        out[name] = result
    return out
