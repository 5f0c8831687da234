"""Fixed strategies asked the `hops` environment, reported per hop: the controls and references of that mode.

Why: the `hops` mode (pipeline/environment/simulated/hops.py) is a test of the agent's *second* request only if no
fixed rule gets the 2-hop answers. Each strategy here is a few lines, asked exactly as the server answers
(`trivial_rules.ask`: the same reply and `max_tokens` cut), with no agent and no training, at most two
requests (the learn-hops profile's `agent.max_turns: 3`: two requests, then the answer). The answer is read
with `knowledge_replies.reply_entity` from the last reply that states a fact (else from an earlier one).

Trivial rules (`TRIVIAL`), what a person would try first:
- `prior_per_relation`: no request; the most common answer of the question's relation among the training
  questions (a prior, the floor);
- `question`: the question verbatim; `content_words`: its first 8 content words;
- `split_of_the`: the question split at "of"/"the", the last piece asked first, then the one before it;
- `question_twice`: the verbatim question, asked again;
- `ask_then_entity`: the question, then the first reply's entity alone;
- `ask_then_question_entity`: the question, then the question followed by the first reply's entity;
- `ask_then_entity_3words`: the question, then the first reply's entity and the question's first 3
  content words.
References (`REFERENCES`), not trivial:
- `informed`: the question, then "{relation} of {bridge}", the relation taken from the question's chain
  (what the world's designer knows): the ceiling of a two-request strategy;
- `reask`: the question, then `knowledge_replies.reask_request` (the first reply's entity followed by the
  question's content words the reply did not restate): a generic re-ask that needs no knowledge of the world, and the
  second request of the learn-hops warm-up's demonstrations (`train.warmup.followup: reask`).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pipeline.environment.simulated.hops_world import World
from pipeline.environment.simulated.knowledge import KnowledgeBase
from pipeline.environment.simulated.knowledge_replies import (
    answered,
    content_words,
    reask_request,
    reply_entity,
)
from pipeline.evaluation.trivial_rules import ask
from pipeline.metrics import exact_match, token_f1

HOP_GROUPS = ("1-hop", "2-hop")


def hop_group(world: World, question: str) -> str | None:
    """ "1-hop" or "2-hop" for a question of the world, None for any other question."""
    found = world.question(question)
    return None if found is None else f"{found.hops}-hop"


@dataclass
class Conversation:
    """The requests a strategy sent and the replies it got."""

    requests: list[str]
    replies: list[str]

    def answer(self) -> str:
        """`reply_entity` of the last reply that states one."""
        for request, reply in zip(reversed(self.requests), reversed(self.replies), strict=True):
            entity = reply_entity(reply, request)
            if entity:
                return entity
        return ""


Asker = Callable[[str], str]
Strategy = Callable[[str, Asker, World, dict[str, str]], Conversation]
"""(question, ask, world, prior answer per relation) -> the conversation it had."""


def _talk(ask_env: Asker, *requests: str) -> Conversation:
    return Conversation(list(requests), [ask_env(r) for r in requests])


def _then(ask_env: Asker, question: str, second: Callable[[str, str], str]) -> Conversation:
    """Ask `question`, then `second(question, first reply's entity)` when the first reply states one."""
    first = ask_env(question)
    entity = reply_entity(first, question)
    if not entity:
        return Conversation([question], [first])
    follow = second(question, entity)
    return Conversation([question, follow], [first, ask_env(follow)])


def _prior(question: str, ask_env: Asker, world: World, prior: dict[str, str]) -> Conversation:
    found = world.question(question)
    return Conversation([], [prior.get(found.relation, "") if found else ""])


def _split_of_the(question: str) -> list[str]:
    pieces = [p.strip(" ?.") for p in re.split(r"\b(?:of|the)\b", question, flags=re.IGNORECASE)]
    return [p for p in pieces if p][::-1][:2]


def _first_words(question: str, n: int) -> str:
    return " ".join(content_words(question, n))


def _informed(question: str, ask_env: Asker, world: World, prior: dict[str, str]) -> Conversation:
    found = world.question(question)
    if found is None or found.hops == 1:
        return _talk(ask_env, question)
    return _then(ask_env, question, lambda q, e: f"{found.relation} of {e}")


def _reask(question: str, ask_env: Asker, world: World, prior: dict[str, str]) -> Conversation:
    first = ask_env(question)
    follow = reask_request(question, first)
    if not follow:
        return Conversation([question], [first])
    return Conversation([question, follow], [first, ask_env(follow)])


TRIVIAL: dict[str, Strategy] = {
    "prior_per_relation": _prior,
    "question": lambda q, a, w, p: _talk(a, q),
    "content_words": lambda q, a, w, p: _talk(a, " ".join(content_words(q))),
    "split_of_the": lambda q, a, w, p: _talk(a, *_split_of_the(q)),
    "question_twice": lambda q, a, w, p: _talk(a, q, q),
    "ask_then_entity": lambda q, a, w, p: _then(a, q, lambda q2, e: e),
    "ask_then_question_entity": lambda q, a, w, p: _then(a, q, lambda q2, e: f"{q2} {e}"),
    "ask_then_entity_3words": lambda q, a, w, p: _then(a, q, lambda q2, e: f"{e} {_first_words(q2, 3)}"),
}
"""The trivial rules (module docstring), by name."""
REFERENCES: dict[str, Strategy] = {"informed": _informed, "reask": _reask}
"""The two non-trivial references (module docstring), by name."""


def prior_answers(world: World, questions: Sequence[str]) -> dict[str, str]:
    """Relation -> the most common answer among `questions` (the training questions) of that relation."""
    counts: dict[str, Counter[str]] = {}
    for text in questions:
        found = world.question(text)
        if found is not None:
            counts.setdefault(found.relation, Counter())[found.answer] += 1
    return {relation: c.most_common(1)[0][0] for relation, c in counts.items()}


def evaluate_hops_rules(
    kb: KnowledgeBase,
    world: World,
    rows: Sequence[Any],
    training_questions: Sequence[str],
    max_tokens: int | None,
    strategies: dict[str, Strategy] | None = None,
) -> dict[str, dict[str, Any]]:
    """Each strategy on every row (`row.question`, `row.answers`), grouped per hop ("1-hop", "2-hop"): the
    lists `f1`, `em`, `answered` (a reply stated a fact), `predictions`, `requests`, plus `f1_mean` etc.
    over all rows. Rows that are not questions of `world` are refused with a ValueError naming the first."""
    groups: dict[str, list[Any]] = {g: [] for g in HOP_GROUPS}
    for row in rows:
        group = hop_group(world, row.question)
        if group is None:
            raise ValueError(f"question {row.question!r} is not a question of the hops world")
        groups[group].append(row)
    prior = prior_answers(world, training_questions)

    def ask_env(request: str) -> str:
        return ask(kb, request, max_tokens)

    out: dict[str, dict[str, Any]] = {}
    for name, strategy in (strategies or {**TRIVIAL, **REFERENCES}).items():
        result: dict[str, Any] = {k: {} for k in ("f1", "em", "answered", "predictions", "requests")}
        for group, members in groups.items():
            talks = [strategy(r.question, ask_env, world, prior) for r in members]
            preds = [t.answer() if t.requests else t.replies[0] for t in talks]
            result["f1"][group] = [token_f1(p, r.answers) for p, r in zip(preds, members, strict=True)]
            result["em"][group] = [exact_match(p, r.answers) for p, r in zip(preds, members, strict=True)]
            result["answered"][group] = [
                float(any(answered(x) for x in t.replies) and bool(t.requests)) for t in talks
            ]
            result["predictions"][group], result["requests"][group] = preds, [t.requests for t in talks]
        for key in ("f1", "em", "answered"):
            values = [v for vs in result[key].values() for v in vs]
            result[f"{key}_mean"] = sum(values) / len(values) if values else float("nan")
        out[name] = result
    return out
