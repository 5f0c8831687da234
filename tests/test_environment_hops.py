"""The knowledgeable environment's `hops` mode: a generated world of single-hop facts, its 1-hop and 2-hop
questions, the one-subject look-up rules, and the rule table that makes it a test of the second request.

Why: the mode is only a test of the agent's second request if (a) the verbatim 2-hop question gets the bridge,
never the answer, (b) the answer is reachable by naming the bridge and the relation, and (c) no trivial rule
gets it. The table below is what pipeline/evaluation/hops_rules.py measures on the 48 held-out questions the
learn-hops profile evaluates (16 1-hop, 32 2-hop); it runs in well under a second.
"""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest

from pipeline.environment.simulated.hops import NO_SUBJECT_REPLY, HopsKnowledgeBase, HopsStore, refused
from pipeline.environment.simulated.hops_world import RELATION_WORDS, World, split_questions, world
from pipeline.environment.simulated.knowledge_replies import answered, reask_request, reply_entity
from pipeline.environment.simulated.knowledge_server import knowledge_base
from pipeline.evaluation.hops_rules import REFERENCES, TRIVIAL, evaluate_hops_rules


@pytest.fixture(scope="module")
def store() -> World:
    return world()


@pytest.fixture(scope="module")
def split(store):
    return split_questions(store.questions, 128)


def test_the_world_is_deterministic_and_two_thirds_two_hop(store, split):
    again = World.generate()
    assert [q.text for q in again.questions] == [q.text for q in store.questions]
    train, heldout = split
    assert len(heldout) == 128 and not {q.text for q in train} & {q.text for q in heldout}
    assert [q.hops for q in heldout[:6]] == [1, 2, 2, 1, 2, 2]
    assert Counter(q.hops for q in heldout[:48]) == {1: 16, 2: 32}
    counts = Counter(q.hops for q in train)
    assert counts[2] == 2 * counts[1] and len(train) >= 512
    surnames = Counter(name.split()[-1] for name, kind in store.kinds.items() if kind == "person")
    assert max(surnames.values()) >= 5  # shared surnames: a surname alone names nobody


def test_a_two_hop_question_never_names_its_bridge_or_answer_and_resolves_to_the_bridge(store):
    lookup = HopsStore(store)
    two_hop = [q for q in store.questions if q.hops == 2]
    assert len(two_hop) > 500
    for q in two_hop:
        assert q.bridge not in q.text and q.answer not in q.text
        assert lookup.lookup(q.text).answer == q.bridge, q.text
        assert lookup.lookup(f"{q.relation} of {q.bridge}").answer == q.answer


def test_lookup_rules_worked_cases(store):
    lookup = HopsStore(store)
    film = next(f for f in store.facts if f.relation == "director")
    director = film.object
    birthplace = store.relations_of(director)["place of birth"]
    # two subjects: one name at a time
    assert lookup.reply(f"{director} {film.subject}").startswith("I can look up one name at a time.")
    # a surname alone, a first name alone: nobody
    assert lookup.reply(f"Where was {director.split()[-1]} born?") == NO_SUBJECT_REPLY
    assert lookup.reply(director.split()[0]) == NO_SUBJECT_REPLY
    # a subject without a relation word: the list of what it knows, no answer
    listed = lookup.reply(director)
    assert listed.startswith(f"About {director} I know: place of birth") and birthplace not in listed
    assert refused(listed) and not answered(listed)
    # the relation word nearest the subject wins; a relation the subject lacks is ignored
    assert lookup.lookup(f"Where was the director of {film.subject} born?").answer == director
    assert lookup.lookup(f"{director.upper()} born").answer == birthplace  # case-insensitive
    reply = lookup.reply(f"place of birth of {director}")
    assert birthplace in reply and answered(reply) and reply == lookup.reply(f"place of birth of {director}")


def test_replies_paraphrase_the_relation(store):
    lookup = HopsStore(store)
    facts = [f for f in store.facts if f.relation == "director"]
    wordings = {
        lookup.reply(f"director of {f.subject}").replace(f.subject, "S").replace(f.object, "O") for f in facts
    }
    assert len(wordings) == 3 and all("O" in w for w in wordings)


def test_reply_entity_and_the_generic_reask():
    assert (
        reply_entity("Velvet Compass was directed by Alda Corran.", "Who directed Velvet Compass?")
        == "Alda Corran"
    )
    assert reply_entity(
        "The film Velvet Compass is the work of the director Alda Corran.", "Velvet Compass"
    ) == ("Alda Corran")
    assert (
        reply_entity(
            "Eleanor of Scotland is a child of James I of Scotland, the father.",
            "Who is the father of Eleanor of Scotland?",
        )
        == "James I of Scotland"
    )
    assert reply_entity(NO_SUBJECT_REPLY, "x") == ""
    question = "Where was the director of Velvet Compass born?"
    assert (
        reask_request(question, "Velvet Compass was directed by Alda Corran.") == "Alda Corran director born"
    )
    assert reask_request(question, "Alda Corran directed Velvet Compass.") == "Alda Corran director born"
    assert reask_request(question, NO_SUBJECT_REPLY) == ""


HELDOUT_48 = {  # mean F1 in points on the learn-hops held-out questions: 16 1-hop, 32 2-hop
    "prior_per_relation": (0.0, 9.4),
    "question": (100.0, 0.0),
    "content_words": (100.0, 0.0),
    "split_of_the": (37.5, 0.0),
    "question_twice": (100.0, 0.0),
    "ask_then_entity": (100.0, 0.0),
    "ask_then_question_entity": (100.0, 0.0),
    "ask_then_entity_3words": (93.8, 50.0),
    "informed": (100.0, 100.0),
    "reask": (100.0, 84.4),
}


def test_rule_table_per_hop_on_the_held_out_questions(split):
    train, heldout = split
    rows = [SimpleNamespace(question=q.text, answers=[q.answer]) for q in heldout[:48]]
    kb = knowledge_base([], 0.6, "hops")
    assert isinstance(kb, HopsKnowledgeBase)
    results = evaluate_hops_rules(kb, world(), rows, [q.text for q in train[:512]], 96)
    assert set(results) == set(TRIVIAL) | set(REFERENCES)
    table = {
        name: tuple(round(100 * sum(r["f1"][g]) / len(r["f1"][g]), 1) for g in ("1-hop", "2-hop"))
        for name, r in results.items()
    }
    assert table == HELDOUT_48
    # what makes the mode a test of the second request: the verbatim question never gets a 2-hop answer,
    # naming the bridge and the relation always does, and the best trivial rule is far below that
    assert sum(results["question"]["em"]["2-hop"]) == 0
    assert all(asks[1].startswith(tuple(RELATION_WORDS)) for asks in results["informed"]["requests"]["2-hop"])
    assert max(table[n][1] for n in TRIVIAL) <= 50.0


def test_rows_that_are_not_questions_of_the_world_are_refused():
    with pytest.raises(ValueError, match="not a question of the hops world"):
        evaluate_hops_rules(
            knowledge_base([], 0.6, "hops"),
            world(),
            [SimpleNamespace(question="Who wrote Hamlet?", answers=["Shakespeare"])],
            [],
            96,
        )
