"""The knowledgeable environment's `terse` mode: a request length limit and free-form replies with distractors.

Why: in the `question` mode (`pipeline.environment.simulated.knowledge`) the verbatim question is the best possible
request and every reply quotes it in one of four fixed templates, so a two-line rule (send the question, read
the answer out of the template) scores F1 100 and an agent that "learns" there learns answer extraction only.
This mode keeps the same knowledge (the same sources, the same gold answers) but changes two properties that
real environment LLMs and search tools have, so that what the agent must improve is its *request*:

- **Request length limit** (`MAX_REQUEST_WORDS`): a request (the last user message) of more than 8
  whitespace-separated words is refused with `TOO_LONG_REPLY` - as a search box, a tool's argument limit or an
  API's input limit refuses it. Of the learn profile's held-out questions, the popqa ones (4-8 words) fit and
  nearly every hotpotqa/2wikimultihopqa question (8-61 words) does not: the agent has to restate long
  questions in few words.
- **Matching on distinctive words**: each stored question's key words are its `KEY_WORDS` rarest content
  words (fewest stored questions contain them: names, titles, years; ties: earlier in the question). A
  request matches a question when it contains at least `MIN_KEY_HITS` of them (all of them when the question
  has fewer); the best match has the most key words hit (as a share), then the highest Jaccard overlap of all
  content words (`knowledge.content_tokens`), then the earliest stored row. A search engine ranks the same
  way (rare terms weigh most), and a short request that keeps the names finds the question.
- **Free-form reply with distractors**: the answer comes with up to `DISTRACTORS` related entries (the stored
  questions sharing the most content words with the request, as a search engine's other hits; stored order
  breaks ties; an entry whose answer equals the gold answer is skipped), each as "<its key words> -> <its
  answer>" in one of `PHRASES`, in an order and wording picked by a hash of the matched question. No
  position and no fixed phrase gives the answer: it is the candidate labelled with the request's own key
  words. Reading the whole reply or its first sentence scores low.
- A request that is short enough but matches nothing gets `UNKNOWN_REPLY` (as the `question` mode).

Everything is deterministic (same request, same reply). These rules are fixed before any training run; the
numbers above are measured on the learn profile's data (`benchmarks/bench_learning.py --mode terse`).
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from collections.abc import Iterable, Sequence

from pipeline.environment.simulated.knowledge import UNKNOWN_REPLY, Fact, KnowledgeBase, Match, content_tokens

MAX_REQUEST_WORDS = 8
"""A longer request (whitespace words of the last user message) is refused."""
KEY_WORDS = 3
"""How many of a stored question's rarest content words are its key words."""
MIN_KEY_HITS = 2
"""Key words a request must contain to match (all of them when a question has fewer key words)."""
DISTRACTORS = 2
"""Related entries quoted beside the answer."""
_TOKEN = re.compile(r"[a-z0-9]+")
TOO_LONG_REPLY = (
    "Your request has {words} words; I only read requests of at most {limit} words. "
    "Ask again in at most {limit} words."
)
PHRASES = (
    "On {label} my notes give {answer}.",
    "{answer} is listed under {label}.",
    "For {label}, the entry says {answer}.",
    "Under {label} I find {answer}.",
)


def _digest(text: str) -> int:
    return int(hashlib.md5(text.encode("utf-8")).hexdigest(), 16)


def key_words(fact: Fact, document_frequency: Counter[str]) -> tuple[str, ...]:
    """The `KEY_WORDS` rarest content words of `fact`'s question, in the order they appear in it."""
    order = {}
    for token in content_tokens_in_order(fact.question):
        order.setdefault(token, len(order))
    ranked = sorted(fact.tokens, key=lambda t: (document_frequency[t], order.get(t, 0)))[:KEY_WORDS]
    return tuple(sorted(ranked, key=lambda t: order.get(t, 0)))


def content_tokens_in_order(text: str) -> list[str]:
    """`content_tokens` as a list in text order (duplicates kept)."""
    keep = content_tokens(text)
    return [t for t in _TOKEN.findall(text.lower()) if t in keep]


class TerseKnowledgeBase(KnowledgeBase):
    """The `terse` mode's rules (module docstring) over the same facts as `KnowledgeBase`."""

    def __init__(self, facts: Iterable[tuple[str, Sequence[str]]], min_overlap: float = 0.6) -> None:
        super().__init__(facts, min_overlap)
        frequency: Counter[str] = Counter()
        for fact in self.facts:
            frequency.update(fact.tokens)
        self.keys = [frozenset(key_words(f, frequency)) for f in self.facts]
        self.labels = [" ".join(key_words(f, frequency)) for f in self.facts]

    def _ranked(self, words: frozenset[str]) -> tuple[list[tuple[float, float, int]], dict[int, int]]:
        shared: dict[int, int] = {}
        for token in words:
            for i in self._index.get(token, ()):
                shared[i] = shared.get(i, 0) + 1
        matches = []
        for i in shared:
            keys = self.keys[i]
            hits = len(keys & words)
            if hits < min(MIN_KEY_HITS, len(keys)):
                continue
            fact = self.facts[i]
            matches.append((hits / len(keys), len(fact.tokens & words) / len(fact.tokens | words), -i))
        return sorted(matches, reverse=True), shared

    def match(self, request: str) -> Match | None:
        """The stored question `request` names by its key words, or None (length is checked by `reply`)."""
        ranked, _ = self._ranked(content_tokens(request))
        if not ranked:
            return None
        coverage, jaccard, i = ranked[0]
        return Match(self.facts[-i], coverage, jaccard)

    def reply(self, request: str) -> str:
        words = len(request.split())
        if words > MAX_REQUEST_WORDS:
            return TOO_LONG_REPLY.format(words=words, limit=MAX_REQUEST_WORDS)
        tokens = content_tokens(request)
        ranked, shared = self._ranked(tokens)
        if not ranked:
            return UNKNOWN_REPLY
        best = -ranked[0][2]
        gold = self.facts[best].answers[0]
        seed = _digest(self.facts[best].question)
        others = sorted((i for i in shared if i != best), key=lambda i: (-shared[i], i))
        if len(others) < DISTRACTORS:  # too few related entries: fill from a hash-picked stretch of the store
            start = seed % len(self.facts)
            others += [(start + k) % len(self.facts) for k in range(len(self.facts))]
        entries, seen = [(self.labels[best], gold)], {gold.lower()}
        for i in others:
            if len(entries) > DISTRACTORS:
                break
            answer = self.facts[i].answers[0]
            if i == best or answer.lower() in seen:
                continue
            seen.add(answer.lower())
            entries.append((self.labels[i], answer))
        rotate = seed % len(entries)
        entries = entries[rotate:] + entries[:rotate]
        return " ".join(
            PHRASES[(seed // 7 + k) % len(PHRASES)].format(label=label, answer=answer)
            for k, (label, answer) in enumerate(entries)
        )
