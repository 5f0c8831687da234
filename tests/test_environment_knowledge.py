"""The knowledgeable environment: its matching rule on worked cases, its sources, and the real server process
started by the launcher registry and asked through the real EnvironmentClient."""

from __future__ import annotations

import asyncio
import json
import sys

import httpx
import pandas as pd
import pytest
from demo_project import free_port, pid_alive
from helpers import server_spec

from pipeline.environment.client import EnvironmentClient
from pipeline.environment.servers import serve_environment, server_command, started_server
from pipeline.environment.simulated.knowledge import (
    REPLY_TEMPLATES,
    UNKNOWN_REPLY,
    KnowledgeBase,
    completion_body,
    content_tokens,
    load_facts,
)

FACTS = [
    ("Who wrote the play Hamlet?", ["William Shakespeare", "Shakespeare"]),
    ("What is the capital city of France?", ["Paris"]),
    ("What is the capital city of France in 1800?", ["Paris (still)"]),
    ("How many legs does a spider have?", ["8"]),
]


def test_content_tokens_drop_stop_words_case_and_punctuation():
    assert content_tokens("Who wrote the play Hamlet?") == {"wrote", "play", "hamlet"}
    assert content_tokens("Please answer this question: WHO wrote Hamlet!") == {"wrote", "hamlet"}


@pytest.mark.parametrize(("request_text", "expected"), [
    ("Who wrote the play Hamlet?", "Who wrote the play Hamlet?"),                    # 3/3 words
    ("Please tell me: wrote play Hamlet, which author?", "Who wrote the play Hamlet?"),  # extra words are free
    ("who wrote hamlet", "Who wrote the play Hamlet?"),                              # 2/3 = 0.67 >= 0.6
    ("a famous play by Hamlet", "Who wrote the play Hamlet?"),                       # play, hamlet: 2/3
    ("Hamlet", None),                                                                # 1/3 < 0.6
    ("What is the capital city of France?", "What is the capital city of France?"),  # 3/3 beats the 3/4
    ("capital city France 1800", "What is the capital city of France in 1800?"),     # 4/4 beats 3/3 on Jaccard
    ("How many legs?", None),                                                        # many, legs: 2/4 = 0.5
    ("", None),
])
def test_matching_rule_worked_cases(request_text, expected):
    kb = KnowledgeBase(FACTS, min_overlap=0.6)
    found = kb.match(request_text)
    assert (found.fact.question if found else None) == expected


def test_match_scores_by_hand():
    # request {famous, play, hamlet} vs stored {wrote, play, hamlet}: shared {play, hamlet}
    found = KnowledgeBase(FACTS).match("a famous play by Hamlet")
    assert found.coverage == pytest.approx(2 / 3) and found.jaccard == pytest.approx(2 / 4)


def test_threshold_is_a_parameter():
    strict = KnowledgeBase(FACTS, min_overlap=1.0)
    assert strict.match("who wrote hamlet") is None
    assert strict.match("wrote play hamlet").fact.answers[0] == "William Shakespeare"
    with pytest.raises(ValueError):
        KnowledgeBase(FACTS, min_overlap=0.0)


def test_reply_embeds_the_answer_in_a_longer_deterministic_sentence():
    kb = KnowledgeBase(FACTS)
    for question, answers in FACTS:
        reply = kb.reply(question)
        assert answers[0] in reply and reply != answers[0]
        assert len(reply.split()) >= len(answers[0].split()) + 8
        assert question in reply
        assert reply == kb.reply(question) == KnowledgeBase(FACTS).reply(question)
    used = {[t.format(question=q, answer=a[0]) for t in REPLY_TEMPLATES].index(kb.reply(q)) for q, a in FACTS}
    assert len(used) >= 2  # where the answer sits depends on the question
    assert kb.reply("Which river flows through Rome?") == UNKNOWN_REPLY


def test_duplicates_and_empty_rows_are_dropped_first_one_kept():
    kb = KnowledgeBase([("Q one thing", ["A"]), ("Q one thing", ["B"]), ("", ["C"]), ("the of", ["D"]),
                        ("no answer here", [])])
    assert len(kb) == 1 and kb.match("one thing").fact.answers == ("A",)


def test_completion_body_is_openai_shaped_and_cut_at_max_tokens():
    kb = KnowledgeBase(FACTS)
    body = completion_body(kb, {"messages": [{"role": "system", "content": "be kind"},
                                             {"role": "user", "content": "old question about Paris"},
                                             {"role": "assistant", "content": "whatever"},
                                             {"role": "user", "content": "How many legs does a spider have?"}]},
                           "kb")
    text = body["choices"][0]["message"]["content"]
    assert "8" in text.split() or "8." in text or " 8," in text or " 8 " in text
    assert body["choices"][0]["finish_reason"] == "stop" and body["model"] == "kb"
    assert body["usage"]["completion_tokens"] == len(text.split())
    cut = completion_body(kb, {"messages": [{"role": "user", "content": "spider legs many"}], "max_tokens": 3}, "kb")
    assert len(cut["choices"][0]["message"]["content"].split()) == 3
    assert cut["choices"][0]["finish_reason"] == "length"


def test_load_facts_from_rl_parquet_folder_and_jsonl(tmp_path):
    rl = pd.DataFrame({
        "data_source": ["hotpotqa"],
        "prompt": [[{"role": "user", "content": "Question: Who wrote the play Hamlet?"}]],
        "reward_model": [{"ground_truth": ["William Shakespeare"], "style": "rule"}],
        "extra_info": [{"id": "x", "question": "Who wrote the play Hamlet?"}],
    })
    folder = tmp_path / "eval"
    folder.mkdir()
    rl.to_parquet(folder / "a.parquet")
    jsonl = tmp_path / "facts.jsonl"
    jsonl.write_text(json.dumps({"question": "What is 2 + 3?", "answers": ["5"]}) + "\n", encoding="utf-8")
    facts = load_facts([folder, jsonl])
    assert facts == [("Who wrote the play Hamlet?", ["William Shakespeare"]), ("What is 2 + 3?", ["5"])]
    with pytest.raises(FileNotFoundError):
        load_facts([tmp_path / "missing.parquet"])


def test_real_server_through_the_launcher_and_the_environment_client(params, tmp_path):
    source = tmp_path / "facts.jsonl"
    source.write_text("".join(json.dumps({"question": q, "answers": a}) + "\n" for q, a in FACTS),
                      encoding="utf-8")
    params.paths.cache_dir = str(tmp_path / "cache")
    env = params.environment
    env.backend, env.served_name, env.port, env.cache = "knowledge", "knowledge-base", free_port(), False
    env.knowledge.sources = [str(source)]
    env.server.startup_timeout_s = 30
    command = server_command(server_spec(params))
    assert command[:3] == [sys.executable, "-m", "pipeline.environment.simulated.knowledge_server"]
    with serve_environment(server_spec(params)) as url:
        server = started_server(url)
        assert server is not None and pid_alive(server.pid)
        models = httpx.get(f"{url}/models", timeout=5).json()
        assert [m["id"] for m in models["data"]] == ["knowledge-base"]
        client = EnvironmentClient(env)

        async def ask():
            try:
                return await asyncio.gather(
                    client.reply([], "Please answer this question: Who wrote the play Hamlet?"),
                    client.reply([], "What's the weather like today?"))
            finally:
                await client.aclose()

        known, unknown = asyncio.run(ask())
        assert known.error is None and "William Shakespeare" in known.text and known.text != "William Shakespeare"
        assert unknown.error is None and unknown.text == UNKNOWN_REPLY
        assert client.usage.calls == 2 and client.usage.completion_tokens == len(known.text.split()) + len(
            UNKNOWN_REPLY.split())
    assert not pid_alive(server.pid)
