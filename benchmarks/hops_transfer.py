"""2-hop chains composed from PopQA's facts: the `hops` experiment's real-data transfer check.

PopQA asks one relation of one entity in a fixed wording per relation ("Who was the director of X?", "In what
city was X born?"); the data mirror keeps the question and the answers only, so the facts are read back from
those wordings (`PATTERNS`, the relations the `hops` world also has). A chain joins (s, r1, b) and (b, r2, o)
when one of the first question's answers is the subject b of a second question. Kept only when:
- the bridge b is **unambiguous**: at least two words, the subject of exactly one question of relation r2,
  and not the subject of questions with different answers (PopQA has same-name entities);
- the first fact is unambiguous too (one question of (s, r1));
- at most `PER_BRIDGE` chains share a bridge, no answer is named in the question, and the verbatim question
  gets the bridge from the store (as every question of the `hops` world does).
The chains are worded with the `hops` world's own 2-hop wordings (`hops_world._compose`'s rule: the first
hop's relation word nearest the subject) and served by the same rules (`hops.HopsStore`) over a world made of
the chains' facts, so the agent meets real names in the environment it was trained against.
"""

from __future__ import annotations

import random
import re
from collections import defaultdict
from pathlib import Path

from pipeline.environment.simulated.hops import HopsStore
from pipeline.environment.simulated.hops_world import (
    Fact,
    Question,
    World,
    name_spans,
    nearest_relation,
    tokens,
    two_hop_wordings,
)

PATTERNS = {
    "director": re.compile(r"^Who was the director of (.+)\?$"),
    "author": re.compile(r"^Who is the author of (.+)\?$"),
    "place of birth": re.compile(r"^In what city was (.+) born\?$"),
    "father": re.compile(r"^Who is the father of (.+)\?$"),
    "mother": re.compile(r"^Who is the mother of (.+)\?$"),
    "country": re.compile(r"^In what country is (.+)\?$"),
    "capital": re.compile(r"^What is the capital of (.+)\?$"),
}
"""PopQA's wording of each relation the `hops` world has; group 1 is the subject."""
PER_BRIDGE = 2
CHAINS = 32
"""Chains kept (a fixed seeded draw), so one evaluation costs what a held-out one does."""


def popqa_facts(rows: list[tuple[str, list[str]]]) -> dict[tuple[str, str], list[list[str]]]:
    """(subject, relation) -> the answer lists of every PopQA question asking it."""
    facts: dict[tuple[str, str], list[list[str]]] = defaultdict(list)
    for question, answers in rows:
        for relation, pattern in PATTERNS.items():
            found = pattern.match(question.strip())
            if found and answers:
                facts[found.group(1).strip(), relation].append([str(a) for a in answers])
    return facts


def popqa_chains(
    rows: list[tuple[str, list[str]]], seed: int = 0, limit: int = CHAINS
) -> tuple[World, dict[str, list[str]]]:
    """A world holding the chains' facts, its 2-hop questions (`World.questions`), and each question's gold
    answers (all of PopQA's aliases of the second answer)."""
    facts = popqa_facts(rows)
    by_subject: dict[str, dict[str, list[list[str]]]] = defaultdict(dict)
    for (subject, relation), answer_lists in facts.items():
        by_subject[subject][relation] = answer_lists
    rng = random.Random(seed)
    chains: list[tuple[Fact, Fact, list[str]]] = []
    per_bridge: dict[str, int] = defaultdict(int)
    for (subject, r1), firsts in sorted(facts.items()):
        if len(firsts) != 1:
            continue
        for bridge in firsts[0]:
            second = by_subject.get(bridge)
            if not second or len(bridge.split()) < 2 or bridge == subject:
                continue
            for r2, answer_lists in sorted(second.items()):
                if len(answer_lists) != 1 or per_bridge[bridge] >= PER_BRIDGE:
                    continue
                golds = answer_lists[0]
                if subject in golds:
                    continue
                chains.append((Fact(subject, r1, bridge), Fact(bridge, r2, golds[0]), golds))
                per_bridge[bridge] += 1
    rng.shuffle(chains)
    store = World()
    questions: list[Question] = []
    answers: dict[str, list[str]] = {}
    for first, second, golds in chains:
        if len(questions) >= limit:
            break
        known = by_subject[
            first.subject
        ]  # every relation PopQA asks of the subject: the store may hold them all
        fits = []
        for text in two_hop_wordings(first, second.relation):
            words = tokens(text)
            if (
                not any(g in text for g in golds)
                and nearest_relation(words, name_spans(words, first.subject), known) == first.relation
            ):
                fits.append(text[0].upper() + text[1:])
        if not fits:
            continue
        text = rng.choice(fits)
        questions.append(Question(text, second.object, (first, second)))
        answers[text] = golds
        for fact in (first, second):
            if fact not in store.facts:
                store.facts.append(fact)
            store.kinds.setdefault(fact.subject, "entity")
            store.kinds.setdefault(fact.object, "entity")
    store.index()
    lookup = HopsStore(store)  # a name of one chain inside another's question would make it ask two subjects
    store.questions = [q for q in questions if lookup.lookup(q.text).answer == q.bridge]
    return store.index(), {q.text: answers[q.text] for q in store.questions}


def read_popqa(mirror: Path) -> list[tuple[str, list[str]]]:
    """(question, answers) of PopQA's only split in the data mirror (`raw/popqa/test.parquet`)."""
    import pyarrow.parquet as pq

    table = pq.read_table(mirror / "raw" / "popqa" / "test.parquet", columns=["question", "answers"])
    return [
        (q, list(a or []))
        for q, a in zip(
            table.column("question").to_pylist(), table.column("answers").to_pylist(), strict=True
        )
    ]
