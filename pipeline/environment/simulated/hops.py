"""The knowledgeable environment's `hops` mode: one subject per request, a store of single-hop facts.

Why: in the `question` and `terse` modes one good request gets the answer, so the only request skill on offer
is copying or truncating the question. Here the environment knows single-hop facts of a made-up world
(`pipeline.environment.simulated.hops_world`) and the questions are 1-hop or 2-hop compositions of them. The verbatim
2-hop question ("Where was the director of Velvet Compass born?") gets the first hop's answer (the
director, the *bridge*), and the answer is stored only under the bridge, which the question never names: the
score is decided by the second request (`{relation} of {bridge}`, or anything naming the bridge and the
relation).

Rules (deterministic: the same request always gets the same reply), on the last user message:
- **Subjects**: the world's entity names (people, films, books, cities, countries) that appear in the request
  as whole words, case-insensitively. A person is named only by first name and surname together (surnames
  are shared across families).
- Two or more subjects: `ONE_AT_A_TIME_REPLY` (no answer). None: `NO_SUBJECT_REPLY`.
- **Relation**: of the relation words (`hops_world.RELATION_WORDS`) in the request that name a relation the
  subject has, the one nearest the subject (in words; ties: the earlier). None: `RELATIONS_REPLY`, the list
  of relations the subject has (no answer).
- **Reply**: the fact, in one of 3 wordings per relation (`FACT_REPLIES`) that paraphrase the relation,
  picked by a hash of (subject, relation).

The store is the generated world; the knowledge sources (the RL files) are loaded as in the other modes, but
only their count is reported: every question of the `hops` data source is composed from this world.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pipeline.environment.simulated.hops_world import World, nearest_relation, tokens, world
from pipeline.environment.simulated.knowledge import KnowledgeBase

ONE_AT_A_TIME_REPLY = "I can look up one name at a time. Your request names {names}; ask about one of them."
NO_SUBJECT_REPLY = (
    "I found no person, film, book, city or country I know in your request. Ask about one of "
    "them by its full name."
)
RELATIONS_REPLY = "About {subject} I know: {relations}. Ask for one of them."
FACT_REPLIES: dict[str, tuple[str, ...]] = {
    "director": (
        "{s} was directed by {o}.",
        "{o} directed {s}.",
        "The film {s} is the work of the director {o}.",
    ),
    "author": ("{s} was written by {o}.", "{o} wrote {s}.", "The book {s} is by the writer {o}."),
    "place of birth": (
        "{s} was born in {o}.",
        "{o} is the birthplace of {s}.",
        "{s} came into the world in {o}.",
    ),
    "father": ("{s}'s father is {o}.", "{o} is the father of {s}.", "{s} is a child of {o}, the father."),
    "mother": ("{s}'s mother is {o}.", "{o} is the mother of {s}.", "{s} is a child of {o}, the mother."),
    "country": ("{s} lies in {o}.", "{s} is in the country {o}.", "{o} is the country where {s} lies."),
    "capital": ("{o} is the capital of {s}.", "The capital of {s} is {o}.", "{s} is governed from {o}."),
}
"""How a fact is stated, per relation; `{s}` the subject, `{o}` the object (the answer)."""


@dataclass(frozen=True)
class Lookup:
    """What the environment made of one request."""

    subjects: tuple[str, ...]
    relation: str | None = None
    answer: str | None = None


class HopsStore:
    """The `hops` rules (module docstring) over a world's facts."""

    def __init__(self, store: World) -> None:
        self.world = store
        self.names = {tuple(tokens(name)): name for name in store.kinds}
        self.longest = max(len(k) for k in self.names)

    def subjects(self, words: list[str]) -> list[tuple[str, int, int]]:
        """(name, first word index, last word index) of every entity named in `words`, in order."""
        found = []
        for start in range(len(words)):
            for length in range(self.longest, 0, -1):
                name = self.names.get(tuple(words[start : start + length]))
                if name is not None:
                    found.append((name, start, start + length - 1))
                    break
        return found

    def lookup(self, request: str) -> Lookup:
        words = tokens(request)
        found = self.subjects(words)
        names = tuple(dict.fromkeys(name for name, _, _ in found))
        if len(names) != 1:
            return Lookup(names)
        subject = names[0]
        known = self.world.relations_of(subject)
        relation = nearest_relation(words, [(a, b) for _, a, b in found], known)
        if relation is None:
            return Lookup(names)
        return Lookup(names, relation, known[relation])

    def reply(self, request: str) -> str:
        found = self.lookup(request)
        if not found.subjects:
            return NO_SUBJECT_REPLY
        if len(found.subjects) > 1:
            return ONE_AT_A_TIME_REPLY.format(names=" and ".join(found.subjects))
        subject = found.subjects[0]
        if found.relation is None:
            return RELATIONS_REPLY.format(
                subject=subject, relations=", ".join(self.world.relations_of(subject))
            )
        phrases = FACT_REPLIES[found.relation]
        pick = int(hashlib.md5(f"{subject}|{found.relation}".encode()).hexdigest(), 16) % len(phrases)
        return phrases[pick].format(s=subject, o=found.answer)


class HopsKnowledgeBase(KnowledgeBase):
    """`environment.knowledge.mode: hops`: `HopsStore` over the generated world. The question/answer facts of
    the knowledge sources are kept (as `KnowledgeBase` does) for the server's count only."""

    def __init__(
        self, facts: Iterable[tuple[str, Sequence[str]]], min_overlap: float = 0.6, store: World | None = None
    ) -> None:
        super().__init__(facts, min_overlap)
        self.store = HopsStore(store or world())

    def match(self, request: str) -> None:
        return None

    def reply(self, request: str) -> str:
        return self.store.reply(request)


def refused(reply: str) -> bool:
    """Whether a `hops` reply states no fact (one name at a time, no subject, the list of relations)."""
    text = reply.strip()
    return (
        text == NO_SUBJECT_REPLY
        or text.startswith(ONE_AT_A_TIME_REPLY.split("{")[0])
        or (text.startswith("About ") and text.endswith("Ask for one of them."))
    )
