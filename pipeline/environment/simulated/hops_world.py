"""The `hops` knowledge mode's synthetic world: made-up people, films, books, cities and countries, their
single-hop facts, and the 1-hop and 2-hop questions composed from them.

Why a made-up world: the mode must test whether the agent's *second* request names the right thing, so its
answers must be reachable only through the environment (no model knows "Who is the mother of the director of
Velvet Compass?") and a question must never name the entity that holds its answer. Everything is generated
from one seed (`WORLD_SEED`) with `random.Random`, so the world, its facts and its questions are the same on
every machine and in every process (the data source and the environment server each build it).

The world (`World.generate`):
- **Countries** (`hops_names.COUNTRIES`), each with 4 **cities** (`CITIES`) and a capital among them.
- **People** in three generations, each named by a first name and a surname drawn from short lists: 12
  couples (generation 0), 36 children (3 per couple), 12 couples of those, 36 grandchildren. A surname is
  drawn for each person, not inherited: 14 surnames over 96 people are shared by unrelated people, so a
  request that copies only a surname names nobody, and a bridge and its answer rarely share one (which
  would give a wrong answer partial F1). Everyone has a city of birth; generations 1 and 2 have a father
  and a mother.
- **Films** and **books** (two-word titles from their own word lists), each with a director / an author from
  generations 1 and 2.
- Name words are disjoint between kinds and from the relation words (`RELATION_WORDS`) and stop words.

Facts (`World.facts`): (subject, relation, object) with the relations `director`, `author`, `place of birth`,
`father`, `mother`, `country`, `capital`.

Questions (`World.questions`): every fact is a 1-hop question, and every pair of facts (s, r1, b), (b, r2, o)
whose answer o is not named in the question is a 2-hop question (the bridge b is never named). Each is
phrased in one of 3-4 wordings per relation (`ONE_HOP`, `TWO_HOP`, drawn by the seeded generator), and
shuffled; `split_questions` keeps one third 1-hop and two thirds 2-hop in both the held-out and the
training part.
"""

from __future__ import annotations

import random
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from functools import cache

from pipeline.environment.simulated.hops_names import (
    BOOK_WORDS,
    BOOKS,
    CITIES,
    COUNTRIES,
    FEMALE_NAMES,
    FILM_WORDS,
    FILMS,
    MALE_NAMES,
    SURNAMES,
)

WORLD_SEED = 0
"""The one seed of the world (the data source's version: changing it changes every question)."""
WORLD_VERSION = f"hops-world-v1-seed{WORLD_SEED}"

RELATIONS = ("director", "author", "place of birth", "father", "mother", "country", "capital")
"""Relation names, as the environment's replies and the informed request ("{relation} of {bridge}") say them."""
RELATION_WORDS: dict[str, frozenset[str]] = {
    "director": frozenset({"director", "directed", "directs", "filmmaker"}),
    "author": frozenset({"author", "wrote", "written", "writer"}),
    "place of birth": frozenset({"born", "birthplace", "birth"}),
    "father": frozenset({"father", "dad"}),
    "mother": frozenset({"mother", "mom"}),
    "country": frozenset({"country", "nation"}),
    "capital": frozenset({"capital"}),
}
"""The lower-cased words that name each relation in a request (the environment's lookup)."""

ONE_HOP: dict[str, tuple[str, ...]] = {
    "director": (
        "Who directed {s}?",
        "Who is the director of {s}?",
        "Name the director of the film {s}.",
        "{s} was directed by whom?",
    ),
    "author": (
        "Who wrote {s}?",
        "Who is the author of {s}?",
        "Name the author of the book {s}.",
        "{s} was written by whom?",
    ),
    "place of birth": (
        "Where was {s} born?",
        "What is the place of birth of {s}?",
        "In which city was {s} born?",
        "{s} was born in which city?",
    ),
    "father": ("Who is the father of {s}?", "Who was {s}'s father?", "Name the father of {s}."),
    "mother": ("Who is the mother of {s}?", "Who was {s}'s mother?", "Name the mother of {s}."),
    "country": ("In which country is {s}?", "What country is {s} located in?", "{s} lies in which country?"),
    "capital": (
        "What is the capital of {s}?",
        "Which city is the capital of {s}?",
        "Name the capital city of {s}.",
    ),
}
"""1-hop wordings per relation; `{s}` is the subject."""
INNER: dict[str, tuple[str, ...]] = {
    "director": ("the director of {s}", "the director of the film {s}"),
    "author": ("the author of {s}", "the author of the book {s}"),
    "father": ("the father of {s}", "{s}'s father"),
    "mother": ("the mother of {s}", "{s}'s mother"),
}
"""Noun phrases for the first hop of a generic 2-hop question."""
OUTER: dict[str, tuple[str, ...]] = {
    "place of birth": (
        "Where was {x} born?",
        "What is the place of birth of {x}?",
        "In which city was {x} born?",
    ),
    "father": ("Who is the father of {x}?", "Name the father of {x}.", "Who was {x}'s father?"),
    "mother": ("Who is the mother of {x}?", "Name the mother of {x}.", "Who was {x}'s mother?"),
}
"""Outer wordings of a generic 2-hop question; `{x}` is the first hop's noun phrase (`INNER`)."""
TWO_HOP: dict[tuple[str, str], tuple[str, ...]] = {
    ("place of birth", "country"): (
        "In which country was {s} born?",
        "{s} was born in which country?",
        "Which country is the birthplace of {s} in?",
    ),
    ("country", "capital"): (
        "What is the capital of the country where {s} lies?",
        "Which city is the capital of the country {s} is in?",
        "Name the capital of the country of {s}.",
    ),
}
"""Whole wordings of the 2-hop chains that no inner noun phrase covers; `{s}` is the subject."""


_TOKEN = re.compile(r"[a-z0-9]+")


def tokens(text: str) -> list[str]:
    """Lower-cased alphanumeric words, in order."""
    return _TOKEN.findall(text.lower())


def nearest_relation(
    words: Sequence[str], spans: Sequence[tuple[int, int]], known: Collection[str]
) -> str | None:
    """The relation (of `known`) whose word in `words` is nearest a subject span (first, last word index);
    ties: the earlier word. None when no word of `words` names a relation in `known`. The environment's rule
    (pipeline/environment/simulated/hops.py); the question wordings are checked against it, so each resolves to its
    first hop."""
    best: tuple[int, int, str] | None = None
    for i, word in enumerate(words):
        for relation in known:
            if word in RELATION_WORDS[relation]:
                distance = min(a - i if i < a else i - b for a, b in spans)
                if distance > 0 and (best is None or (distance, i) < best[:2]):
                    best = (distance, i, relation)
    return None if best is None else best[2]


def name_spans(words: list[str], name: str) -> list[tuple[int, int]]:
    """(first, last) word index of every occurrence of `name` in `words`."""
    key = tokens(name)
    return [(i, i + len(key) - 1) for i in range(len(words)) if words[i : i + len(key)] == key]


@dataclass(frozen=True)
class Fact:
    """One single-hop fact: `object` is the `relation` of `subject`."""

    subject: str
    relation: str
    object: str


@dataclass(frozen=True)
class Question:
    """A 1-hop or 2-hop question, its answer and the chain of facts that leads to it."""

    text: str
    answer: str
    chain: tuple[Fact, ...]
    """The facts in order: the first names the question's subject; the last holds the answer."""

    @property
    def hops(self) -> int:
        return len(self.chain)

    @property
    def bridge(self) -> str | None:
        """The entity hop 1 returns and hop 2 starts from (None for a 1-hop question)."""
        return self.chain[0].object if len(self.chain) > 1 else None

    @property
    def relation(self) -> str:
        """The relation of the last hop (what the answer is)."""
        return self.chain[-1].relation


@dataclass
class World:
    """Entities by kind, the fact store and the questions (module docstring)."""

    kinds: dict[str, str] = field(default_factory=dict)
    """Entity name -> kind (person, film, book, city, country)."""
    facts: list[Fact] = field(default_factory=list)
    questions: list[Question] = field(default_factory=list)

    def relations_of(self, subject: str) -> dict[str, str]:
        """Relation -> object of every fact about `subject`."""
        return self._by_subject.get(subject, {})

    def question(self, text: str) -> Question | None:
        """The generated question with this exact text (whitespace-normalised), or None."""
        return self._by_text.get(" ".join(text.split()))

    def index(self) -> World:
        self._by_subject: dict[str, dict[str, str]] = {}
        for fact in self.facts:
            self._by_subject.setdefault(fact.subject, {})[fact.relation] = fact.object
        self._by_text = {q.text: q for q in self.questions}
        return self

    @classmethod
    def generate(cls, seed: int = WORLD_SEED) -> World:
        rng = random.Random(seed)
        world = cls()
        cities = list(CITIES)
        rng.shuffle(cities)
        for k, country in enumerate(COUNTRIES):
            own = cities[4 * k : 4 * k + 4]
            world.kinds[country] = "country"
            world.facts.append(Fact(country, "capital", rng.choice(own)))
            for city in own:
                world.kinds[city] = "city"
                world.facts.append(Fact(city, "country", country))
        used: set[str] = set()

        def person(male: bool) -> str:
            while True:
                name = f"{rng.choice(MALE_NAMES if male else FEMALE_NAMES)} {rng.choice(SURNAMES)}"
                if name not in used:
                    used.add(name)
                    world.kinds[name] = "person"
                    world.facts.append(Fact(name, "place of birth", rng.choice(cities)))
                    return name

        def children(couples: list[tuple[str, str]]) -> list[tuple[str, bool]]:
            out = []
            for father, mother in couples:
                for _ in range(3):
                    male = rng.random() < 0.5
                    child = person(male)
                    world.facts += [Fact(child, "father", father), Fact(child, "mother", mother)]
                    out.append((child, male))
            return out

        elders = [(person(True), person(False)) for _ in range(12)]
        middle = children(elders)
        men = [p for p, male in middle if male]
        women = [p for p, male in middle if not male]
        rng.shuffle(men)
        rng.shuffle(women)
        pairs = list(zip(men, women, strict=False))[:12]
        young = children(pairs)
        makers = [p for p, _ in middle + young]
        for kind, words, count, relation in (
            ("film", FILM_WORDS, FILMS, "director"),
            ("book", BOOK_WORDS, BOOKS, "author"),
        ):
            titles = [f"{a} {b}" for a in words[0] for b in words[1]]
            for title in rng.sample(titles, count):
                world.kinds[title] = kind
                world.facts.append(Fact(title, relation, rng.choice(makers)))
        world.index()
        world.questions = _compose(world, rng)
        return world.index()


def two_hop_wordings(first: Fact, relation: str) -> list[str]:
    """Every wording of the 2-hop chain `first` then `relation` (none when the chain has no wording)."""
    if (first.relation, relation) in TWO_HOP:
        return [t.format(s=first.subject) for t in TWO_HOP[first.relation, relation]]
    if first.relation in INNER and relation in OUTER:
        return [o.format(x=i.format(s=first.subject)) for i in INNER[first.relation] for o in OUTER[relation]]
    return []


def _compose(world: World, rng: random.Random) -> list[Question]:
    """Every 1-hop and 2-hop question of `world` (one wording each, drawn by `rng` among those whose
    nearest relation word is the first hop's, so the verbatim question returns the bridge), shuffled."""
    out: list[Question] = []
    for fact in world.facts:
        text = rng.choice(ONE_HOP[fact.relation]).format(s=fact.subject)
        out.append(Question(text, fact.object, (fact,)))
    for first in world.facts:
        known = world.relations_of(first.subject)
        for relation, obj in world.relations_of(first.object).items():
            if obj == first.subject:
                continue
            fits = []
            for text in two_hop_wordings(first, relation):
                words = tokens(text)
                if (
                    obj not in text
                    and nearest_relation(words, name_spans(words, first.subject), known) == first.relation
                ):
                    fits.append(text[0].upper() + text[1:])
            if fits:
                out.append(Question(rng.choice(fits), obj, (first, Fact(first.object, relation, obj))))
    rng.shuffle(out)
    return out


@cache
def world() -> World:
    """The world of `WORLD_SEED` (built once per process)."""
    return World.generate(WORLD_SEED)


def split_questions(questions: list[Question], heldout: int) -> tuple[list[Question], list[Question]]:
    """(training, held-out) questions: the held-out part has `heldout` questions in the repeating order
    1-hop, 2-hop, 2-hop (so any first N of them keep the one-third/two-thirds mix); the training part is the
    rest, cut so that one third of it is 1-hop. Deterministic (the questions' own shuffled order)."""
    one = [q for q in questions if q.hops == 1]
    two = [q for q in questions if q.hops == 2]
    n_one = heldout // 3 + (heldout % 3 > 0)
    n_two = heldout - n_one
    if n_one > len(one) or n_two > len(two):
        raise ValueError(
            f"{heldout} held-out questions need {n_one} 1-hop and {n_two} 2-hop; the world has "
            f"{len(one)} and {len(two)}"
        )
    held = []
    ones, twos = iter(one[:n_one]), iter(two[:n_two])
    for k in range(heldout):
        held.append(next(ones) if k % 3 == 0 else next(twos))
    rest_one, rest_two = one[n_one:], two[n_two:]
    keep_one = min(len(rest_one), len(rest_two) // 2)
    kept = set(rest_one[:keep_one]) | set(rest_two[: 2 * keep_one])
    return [q for q in questions if q in kept], held
