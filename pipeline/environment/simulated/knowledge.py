"""A knowledgeable environment: an OpenAI-compatible server that knows the gold answers of stored questions.

Why: the skill Prompt-R1 teaches is to ask the environment the right thing and then answer concisely from
its reply. With the CPU profile's 135M environment the replies are rarely right, so an agent can hardly
learn that skill from them. This server plays an environment that *knows* what the agent does not (the
`learn` profile): it is backed by question/gold-answer pairs (`environment.knowledge.sources`: the RL
training file and the held-out evaluation files), so whether the agent learns to use it can be measured.

Behaviour (deterministic: the same request always gets the same reply):
- **Matching rule.** The request is the *last user message* only (the current interaction prompt). Text
  is lower-cased and split into alphanumeric tokens; stop words (`STOP_WORDS`) are dropped, leaving
  content tokens. A stored question with content tokens Q matches a request with content tokens R when
  `coverage = |Q ∩ R| / |Q| >= min_overlap` (the request must contain that share of the question's
  distinct content words; extra words in the request do not hurt). The best match has the highest
  coverage, then the highest Jaccard `|Q ∩ R| / |Q ∪ R|` (a sub-question loses to the question that
  matches it whole), then the earliest stored row.
- **Reply.** Never the bare answer: the first gold answer is embedded in a longer sentence that also
  quotes the question, from one of `REPLY_TEMPLATES` (picked by a hash of the question, so the answer's
  position varies between questions but not between calls). The agent has to extract it.
- **Unknown request** (no question reaches `min_overlap`): a polite `UNKNOWN_REPLY` asking for the full
  question.
- Token counts in `usage` are whitespace word counts; `max_tokens` cuts the reply after that many words
  (`finish_reason: length`), as a model's reply is cut.

Sources: Parquet files in verl's RL schema (`extra_info.question`, `reward_model.ground_truth`, what the
build stage writes), Parquet or JSON-lines files with `question` and `answers` columns, or folders of such
Parquet files. `environment.knowledge.mode: terse` swaps in `pipeline.environment.simulated.terse`'s rules (a request
length limit the long questions exceed, replies with distractors); `hops` swaps in `pipeline.environment.simulated.hops`
(one subject per request, single-hop facts of a made-up world, so a 2-hop question needs two requests). Both
build on this module's `KnowledgeBase`, so the mode is chosen one level up, in
`pipeline.environment.simulated.knowledge_server`, which serves the chosen knowledge base with this module's
`make_server` and is started and stopped by `pipeline.environment.servers` (backend `knowledge`) like
llama.cpp.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

_STOP_WORDS_TEXT = (
    "a an the of in on at to for from by with and or is are was were be been being do does did what which who "
    "whom whose when where why how this that these those it its as into about please answer question me you "
    "your i my can could would should will tell give help"
)
STOP_WORDS = frozenset(_STOP_WORDS_TEXT.split())
"""Words that carry no content: dropped before matching (so "Please answer: X" matches X)."""

REPLY_TEMPLATES = (
    ("Good question. According to my notes on \"{question}\", the answer is {answer}. "
     "Let me know if you need more detail."),
    "I looked this up. {answer} is what my sources give for \"{question}\". I hope this helps.",
    "Here is what I found: the question \"{question}\" is answered by {answer}, as far as I can tell.",
    "Thanks for asking. For \"{question}\" my reference says: {answer}. Feel free to ask a follow-up.",
)
UNKNOWN_REPLY = ("I'm sorry, I don't know which question you mean. Please restate the full question you "
                 "want answered.")
_TOKEN = re.compile(r"[a-z0-9]+")


def content_tokens(text: str) -> frozenset[str]:
    """The distinct lower-cased alphanumeric tokens of `text` that are not stop words."""
    return frozenset(t for t in _TOKEN.findall(text.lower()) if t not in STOP_WORDS)


@dataclass(frozen=True)
class Fact:
    """One stored question and its gold answers."""

    question: str
    answers: tuple[str, ...]
    tokens: frozenset[str]


@dataclass(frozen=True)
class Match:
    """The stored question a request was matched to, and how well."""

    fact: Fact
    coverage: float
    jaccard: float


class KnowledgeBase:
    """Questions with gold answers, and the matching rule (module docstring) to find one from a request."""

    def __init__(self, facts: Iterable[tuple[str, Sequence[str]]], min_overlap: float = 0.6) -> None:
        if not 0 < min_overlap <= 1:
            raise ValueError(f"min_overlap={min_overlap}: must be in (0, 1]")
        self.min_overlap = min_overlap
        self.facts: list[Fact] = []
        self._index: dict[str, list[int]] = {}
        seen: set[str] = set()
        for question, answers in facts:
            question = " ".join(str(question).split())
            golds = tuple(str(a).strip() for a in answers if str(a).strip())
            tokens = content_tokens(question)
            if not tokens or not golds or question in seen:
                continue
            seen.add(question)
            for token in tokens:
                self._index.setdefault(token, []).append(len(self.facts))
            self.facts.append(Fact(question, golds, tokens))

    def __len__(self) -> int:
        return len(self.facts)

    def match(self, request: str) -> Match | None:
        """The best stored question for `request`, or None when none covers `min_overlap` (see module doc)."""
        words = content_tokens(request)
        shared: dict[int, int] = {}
        for token in words:
            for i in self._index.get(token, ()):
                shared[i] = shared.get(i, 0) + 1
        best: tuple[float, float, int] | None = None
        for i, n in shared.items():
            fact = self.facts[i]
            coverage = n / len(fact.tokens)
            if coverage < self.min_overlap:
                continue
            key = (coverage, n / len(fact.tokens | words), -i)
            if best is None or key > best:
                best = key
        if best is None:
            return None
        return Match(self.facts[-best[2]], best[0], best[1])

    def reply(self, request: str) -> str:
        """The environment's reply to one request: the answer embedded in a sentence, or UNKNOWN_REPLY."""
        found = self.match(request)
        if found is None:
            return UNKNOWN_REPLY
        question = found.fact.question
        pick = int(hashlib.md5(question.encode("utf-8")).hexdigest(), 16) % len(REPLY_TEMPLATES)
        return REPLY_TEMPLATES[pick].format(question=question, answer=found.fact.answers[0])


# -- sources ----------------------------------------------------------------------------------------------


def _facts_from_frame(frame: Any, path: Path) -> list[tuple[str, list[str]]]:
    if {"question", "answers"} <= set(frame.columns):
        return [(str(q), _as_list(a)) for q, a in zip(frame["question"], frame["answers"], strict=True)]
    if {"extra_info", "reward_model"} <= set(frame.columns):
        out = []
        for extra, reward in zip(frame["extra_info"], frame["reward_model"], strict=True):
            question = (extra or {}).get("question") or ""
            out.append((str(question), _as_list((reward or {}).get("ground_truth"))))
        return out
    raise ValueError(f"{path}: neither question/answers columns nor verl's extra_info/reward_model")


def _as_list(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    return [str(v) for v in list(value)]


def load_facts(sources: Sequence[str | Path]) -> list[tuple[str, list[str]]]:
    """Question/answers pairs from every source, in order (a folder: its *.parquet files, sorted)."""
    import pandas as pd

    facts: list[tuple[str, list[str]]] = []
    for source in sources:
        path = Path(source)
        files = sorted(path.glob("*.parquet")) if path.is_dir() else [path]
        if not files or not all(f.is_file() for f in files):
            raise FileNotFoundError(f"knowledge source {path} has no Parquet/JSONL file (run the build stage)")
        for file in files:
            if file.suffix in (".jsonl", ".json"):
                frame = pd.read_json(file, lines=True)
            else:
                frame = pd.read_parquet(file)
            facts.extend(_facts_from_frame(frame, file))
    return facts


# -- the HTTP server --------------------------------------------------------------------------------------


def completion_body(kb: KnowledgeBase, request: dict[str, Any], served_name: str) -> dict[str, Any]:
    """The chat-completion response to one OpenAI chat request body."""
    messages = request.get("messages") or []
    users = [m for m in messages if isinstance(m, dict) and m.get("role") == "user"]
    prompt_text = str(users[-1].get("content") or "") if users else ""
    words = kb.reply(prompt_text).split()
    limit = request.get("max_tokens")
    finish = "stop"
    if isinstance(limit, int) and 0 < limit < len(words):
        words, finish = words[:limit], "length"
    prompt_words = sum(len(str(m.get("content") or "").split()) for m in messages if isinstance(m, dict))
    return {
        "id": "chatcmpl-" + hashlib.md5(json.dumps(messages, sort_keys=True).encode()).hexdigest()[:16],
        "object": "chat.completion",
        "created": int(time.time()),
        "model": served_name,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": " ".join(words)},
                     "finish_reason": finish}],
        "usage": {"prompt_tokens": prompt_words, "completion_tokens": len(words),
                  "total_tokens": prompt_words + len(words)},
    }


def make_server(kb: KnowledgeBase, host: str, port: int, served_name: str) -> ThreadingHTTPServer:
    """A threaded HTTP server answering `/v1/models` and `/v1/chat/completions` from `kb`."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            logger.debug(format, *args)

        def _send(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode("utf-8")
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path.rstrip("/").endswith("/models"):
                self._send(200, {"object": "list", "data": [{"id": served_name, "object": "model",
                                                             "owned_by": "knowledge"}]})
            else:
                self._send(404, {"error": {"message": f"no route {self.path}"}})

        def do_POST(self) -> None:
            if not self.path.rstrip("/").endswith("/chat/completions"):
                self._send(404, {"error": {"message": f"no route {self.path}"}})
                return
            try:
                length = int(self.headers.get("Content-Length") or 0)
                request = json.loads(self.rfile.read(length) or b"{}")
            except (ValueError, UnicodeDecodeError) as exc:
                self._send(400, {"error": {"message": f"invalid JSON body: {exc}"}})
                return
            self._send(200, completion_body(kb, request, served_name))

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server
