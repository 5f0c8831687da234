"""The knowledgeable environment's `terse` mode (pipeline/environment/simulated/terse.py) and the trivial rules
(pipeline/evaluation/trivial_rules.py): the length limit, the key-word match, the distractor replies, worked
by hand on a small store; the real server process in that mode asked through the real EnvironmentClient."""

from __future__ import annotations

import asyncio
import json
import sys
from types import SimpleNamespace

import pytest
from demo_project import free_port
from helpers import server_spec

from pipeline.environment.client import EnvironmentClient
from pipeline.environment.servers import serve_environment, server_command
from pipeline.environment.simulated.knowledge import REPLY_TEMPLATES, UNKNOWN_REPLY, KnowledgeBase
from pipeline.environment.simulated.knowledge_replies import answered
from pipeline.environment.simulated.knowledge_server import knowledge_base
from pipeline.environment.simulated.terse import MAX_REQUEST_WORDS, TOO_LONG_REPLY, TerseKnowledgeBase
from pipeline.evaluation.trivial_rules import (
    INFORMED_RULES,
    RULES,
    evaluate_rules,
    read_first_sentence,
    read_label_match,
    read_template,
    request_content_words,
    terse_entries,
)

FACTS = [
    ("Who was the director of the film Zorblax Returns that premiered in Quintara?", ["Ada Vellum"]),
    ("Who was the director of the film Mirrowind?", ["Bo Tarn"]),
    ("Who was the producer of the film Mirrowind?", ["Cy Orr"]),
    ("What is the capital of Quintara?", ["Pell"]),
    ("Who composed the score of the film Zorblax?", ["Dee Ramm"]),
]
LONG = FACTS[0][0]


def test_key_words_are_the_rarest_content_words_in_question_order():
    kb = TerseKnowledgeBase(FACTS)
    # document frequencies: film 4, director 2, mirrowind 2, quintara 2, zorblax 2; returns/premiered 1
    assert kb.labels[0] == "director returns premiered"  # returns 1, premiered 1, then the first of the 2s
    assert kb.labels[4] == "composed score zorblax"
    assert kb.labels[1] == "director film mirrowind"  # its only three content words
    assert kb.labels[3] == "capital quintara"


def test_a_request_over_the_length_limit_is_refused_even_verbatim():
    kb = TerseKnowledgeBase(FACTS)
    assert len(LONG.split()) > MAX_REQUEST_WORDS
    reply = kb.reply(LONG)
    assert reply == TOO_LONG_REPLY.format(words=len(LONG.split()), limit=MAX_REQUEST_WORDS)
    assert not answered(reply)
    # the question mode answers the same request: the limit is the terse mode's
    assert "Ada Vellum" in KnowledgeBase(FACTS).reply(LONG)


@pytest.mark.parametrize(("request_text", "expected"), [
    ("Zorblax Returns director?", "Ada Vellum"),  # 2 of 3 key words, 3 words
    ("who directed Zorblax Returns, premiered where", "Ada Vellum"),  # 3 of 3
    ("director of Zorblax", None),  # 1 of 3 key words of fact 0 (director), 1 of 3 of fact 4 (zorblax)
    ("director Mirrowind", "Bo Tarn"),  # 2 of 3; the producer question has 1 of 3 (producer film mirrowind)
    ("capital Quintara", "Pell"),  # both key words of a two-key question
    ("Quintara", None),
    ("", None),
])
def test_matching_on_key_words_worked_cases(request_text, expected):
    kb = TerseKnowledgeBase(FACTS)
    found = kb.match(request_text)
    assert (found.fact.answers[0] if found else None) == expected
    reply = kb.reply(request_text)
    assert answered(reply) == (expected is not None)
    if expected is None:
        assert reply == UNKNOWN_REPLY


def test_reply_labels_the_answer_with_its_key_words_beside_distractors():
    kb = TerseKnowledgeBase(FACTS)
    reply = kb.reply("director Mirrowind")
    entries = terse_entries(reply)
    # related entries: the questions sharing the most content words with {director, mirrowind}: fact 0
    # (director) and fact 2 (mirrowind), one word each, stored order breaks the tie
    assert sorted(entries) == sorted([("director film mirrowind", "Bo Tarn"),
                                      ("director returns premiered", "Ada Vellum"),
                                      ("producer film mirrowind", "Cy Orr")])
    assert kb.reply("director Mirrowind") == reply  # deterministic
    assert read_label_match(reply, "director Mirrowind") == "Bo Tarn"


def test_the_answer_position_and_wording_vary_between_questions():
    facts = [(f"Who founded the company Brand{n} in Town{n}?", [f"Founder {n}"]) for n in range(24)]
    kb = TerseKnowledgeBase(facts)
    positions, first_words = set(), set()
    for n in range(24):
        reply = kb.reply(f"Brand{n} Town{n} founded")
        entries = terse_entries(reply)
        assert len(entries) == 3 and (f"brand{n} town{n}".split()[0] in entries[[a for _, a in entries].index(
            f"Founder {n}")][0])
        positions.add([a for _, a in entries].index(f"Founder {n}"))
        first_words.add(reply.split()[0])
    assert positions == {0, 1, 2} and len(first_words) >= 3


@pytest.mark.parametrize("template", REPLY_TEMPLATES)
def test_template_read_recovers_the_answer_of_each_question_mode_template(template):
    reply = template.format(question="Who wrote the play Hamlet?", answer="William Shakespeare")
    assert read_template(reply) == "William Shakespeare"
    assert read_template("something else entirely") == "something else entirely"


def test_first_sentence_and_content_word_requests():
    assert read_first_sentence("Under x y I find J. Cole. On a b my notes give Z.") == "Under x y I find J"
    request = request_content_words(LONG)
    assert request == "director film Zorblax Returns premiered Quintara"
    assert len(request_content_words(" ".join(["Alpha", "Bravo", "Charlie"] * 5)).split()) == MAX_REQUEST_WORDS


def test_trivial_rules_by_mode_on_the_small_store():
    rows = {"set": [SimpleNamespace(question=q, answers=a) for q, a in FACTS]}
    question_mode = evaluate_rules(knowledge_base(FACTS, 0.6, "question"), rows, 96)
    assert question_mode["question+template_read"]["f1_mean"] == 1.0  # the two-line rule
    terse = evaluate_rules(knowledge_base(FACTS, 0.6, "terse"), rows, 96, {**RULES, **INFORMED_RULES})
    assert terse["question+template_read"]["answered"]["set"] == [0.0, 1.0, 1.0, 1.0, 1.0]  # the long one refused
    assert terse["question+template_read"]["f1"]["set"][0] == 0.0
    assert all(r["f1_mean"] < 0.5 for name, r in terse.items() if name in RULES and not name.endswith("_entry"))
    # reading an entry of the reply (the first, or any) picks the answer out of the distractors now and then
    assert terse["content_words+first_entry"]["f1_mean"] > terse["content_words+template_read"]["f1_mean"]
    assert terse["content_words+first_entry"]["f1"]["set"].count(1.0) >= 1
    assert terse["content_words+label_match"]["em_mean"] == 1.0  # the replies can be read


def test_mode_is_passed_to_the_server_and_unknown_modes_fail(params):
    params.environment.backend = "knowledge"
    params.environment.knowledge.mode = "terse"
    command = server_command(params)
    assert command[command.index("--mode") + 1] == "terse"
    with pytest.raises(ValueError, match="mode"):
        knowledge_base(FACTS, 0.6, "paraphrase")


def test_real_terse_server_through_the_environment_client(params, tmp_path):
    source = tmp_path / "facts.jsonl"
    source.write_text("".join(json.dumps({"question": q, "answers": a}) + "\n" for q, a in FACTS), encoding="utf-8")
    params.paths.cache_dir = str(tmp_path / "cache")
    env = params.environment
    env.backend, env.served_name, env.port, env.cache = "knowledge", "knowledge-base", free_port(), False
    env.knowledge.sources, env.knowledge.mode = [str(source)], "terse"
    env.server.startup_timeout_s = 30
    assert server_command(server_spec(params))[:3] == [sys.executable, "-m", "pipeline.environment.simulated.knowledge_server"]
    with serve_environment(server_spec(params)):
        client = EnvironmentClient(env)

        async def ask():
            try:
                return await asyncio.gather(client.reply([], LONG), client.reply([], "Zorblax Returns director?"))
            finally:
                await client.aclose()

        refused, known = asyncio.run(ask())
    assert refused.error is None and not answered(refused.text) and "at most 8 words" in refused.text
    assert known.error is None and answered(known.text) and read_label_match(known.text, "Zorblax Returns") == (
        "Ada Vellum")
