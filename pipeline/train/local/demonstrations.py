"""Demonstrations of the format warm-up (`pipeline.train.local.warmup`): Prompt-R1 trajectories in the exact
protocol, built from the training rows against the live environment.

A demonstration (`build_demonstrations`) is a `Trajectory` built as the rollout builds one:
    ConversationBuilder.start(prompt messages)                                      prompt (ends with <think>)
    for each of `interaction_turns` turns:
        agent:  short reasoning</think>\\n<interaction_prompt>request</interaction_prompt>         mask 1
        env:    ConversationBuilder.env_turn_ids(LIVE environment reply)                          mask 0
    agent:      final reasoning</think>\\n<answer>{answer}</answer>                                mask 1
The first request is the question (with a short framing; `train.warmup.request: verbatim`: alone), later
ones ask the environment to verify/refine.
The answer (`train.warmup.answer`) is grounded in the replies (`reply`, the default with live replies): a gold
answer when a reply states it, else the short answer the last reply gives (`reply_answer`). `gold` puts the
row's gold answer there whatever the replies said. Why: on the default profile the replies rarely hold the
gold answer, so gold-answer demos taught the agent to answer unrelated to what it was told; grounded ones
raised the share of answers the replies state from 1 of 14 to 8 of 15 (GRPO samples) and 14 of 28 to 27 of 30
(evaluation), F1 unchanged (`benchmarks/bench_warmup_answers.py`, `benchmarks/results/warmup_answers_*.json`).
The think/request wording is drawn from a few templates with a seeded RNG, so the model learns the
structure rather than one string. The environment is the live one (`EnvironmentClient`, temperature forced
to 0 so replies are deterministic and cached), asked with its own history exactly as the rollout asks it.
Agent turns are encoded separately and appended (the builder is append-only, like the rollout), so training
sees the same token layout as sampling: no train/rollout drift.
Requests after the first (`train.warmup.followup`): `verify` asks the environment to check its answer;
`reask` builds the request from the previous live reply (its entity and the question's words it did not
restate: `pipeline.environment.simulated.knowledge_replies.reask_request`), the second request a 2-hop question of the
`hops` mode needs. `train.warmup.require_followup` keeps only demos whose gold answer the last reply states and no earlier
one does, so with `reask` the demos are 2-hop questions the re-ask answers (learn-hops: a few of them, so GRPO
still has the rest to learn).
With `train.warmup.replies: withheld` every environment turn is `WITHHELD_REPLY` instead (no call): the demos
then teach the protocol (tags, turn order, asking with the question, a short answer) but not how to use a
reply. The learn profile needs that: its environment's replies hold the answers, so live-reply demos would
teach the skill GRPO is measured on (the warm-up-only agent then scored held-out F1 98.6 on 24 questions).

Design decisions:
- **Which rows**: rows whose gold answer fits `max_answer_tokens`, whose every agent turn fits
  `agent.max_turn_tokens` (a demo turn the rollout would cut teaches a turn that earns nothing), whose prompt
  fits `agent.max_prompt_tokens` and whose whole response fits `agent.max_response_tokens`; drawn in a seeded
  order. `demonstrations` distinct demos are built and cycled through (each costs `interaction_turns`
  environment calls; 0 = one fresh demo per slot).
- **Which answer.** Withheld replies hold nothing to ground an answer in, so `auto` uses the gold answer there
  (the learn profile: GRPO is what must teach the use of replies). A `reply` demo whose replies yield no answer
  (empty reply) is dropped, like a demo whose environment call failed.
"""

from __future__ import annotations

import asyncio
import logging
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from pipeline.agent.protocol import (
    ANSWER_CLOSE,
    ANSWER_OPEN,
    PROMPT_CLOSE,
    PROMPT_OPEN,
    THINK_CLOSE,
    ConversationBuilder,
    parse_turn,
)
from pipeline.errors import DataError
from pipeline.metrics import normalize_answer
from pipeline.types import EnvironmentReply, PromptItem, Trajectory, Turn

if TYPE_CHECKING:
    from pipeline.config import AgentConfig, WarmupConfig
    from pipeline.train.plan import TrainPlan

log = logging.getLogger(__name__)

WITHHELD_REPLY = "(The reply is withheld in this demonstration.)"
"""The environment turn of a demonstration built with `train.warmup.replies: withheld`."""

FIRST_THINK = [
    "I will explain the question briefly and give it to the large language model.",
    "The question asks for a specific fact. Let me ask the large language model.",
    "I should pass this question to the large model with a short explanation.",
    "First, I ask the large language model to answer the question.",
]
FIRST_PROMPT = [
    "{question}",
    "Please answer this question: {question}",
    "{question} Give a short, precise answer.",
    "Help me answer the question: {question}",
]
FOLLOW_THINK = [
    "The large model replied. I should check its answer before finishing.",
    "I got a response. Let me ask it to verify the answer.",
    "The reply may be right, but I want to confirm it.",
    "Let me refine the answer with one more request.",
]
FOLLOW_PROMPT = [
    "Please check your answer to \"{question}\" and give only the final answer.",
    "Verify the answer again and state it in a few words.",
    "Double-check the answer to: {question} Reply with the short final answer.",
    "Is that correct? Give the final answer to the question in a few words.",
]
FINAL_THINK = [
    "Based on the responses and the question, I can now give the final answer.",
    "I have checked the answer with the large language model.",
    "The interaction is complete, so I write the final answer.",
    "Now I know the final answer to the question.",
]


@dataclass
class DemoTexts:
    """The agent-side text of one demonstration (everything after each turn's `<think>` opener)."""

    interaction_turns: list[str]
    prompts: list[str]
    """The interaction prompts sent to the environment, one per interaction turn."""
    final_turn: str


def demo_texts(question: str, answer: str, turns: int, rng: random.Random, request: str = "framed") -> DemoTexts:
    """Pick wordings for one demonstration; the texts start after the `<think>\\n` opener. `request`
    (`WarmupConfig.request`): `framed` draws the first request from `FIRST_PROMPT`, `verbatim` sends the
    question alone (the same number of draws from `rng`, so the other wordings do not change)."""
    texts, prompts = [], []
    for t in range(turns):
        think = rng.choice(FIRST_THINK if t == 0 else FOLLOW_THINK)
        prompt = rng.choice(FIRST_PROMPT if t == 0 else FOLLOW_PROMPT).format(question=question)
        if t == 0 and request == "verbatim":
            prompt = question
        texts.append(f"{think}{THINK_CLOSE}\n{PROMPT_OPEN}{prompt}{PROMPT_CLOSE}")
        prompts.append(prompt)
    final = f"{rng.choice(FINAL_THINK)}{THINK_CLOSE}\n{ANSWER_OPEN}{answer}{ANSWER_CLOSE}"
    return DemoTexts(interaction_turns=texts, prompts=prompts, final_turn=final)


_ANSWER_PREFIX = re.compile(r"^\W*(?:so,?\s+)?(?:the\s+)?(?:final\s+|short\s+)?answer(?:\s+is)?\s*[:\-]?\s*",
                            re.IGNORECASE)


def stated_in(answer: str | None, texts: list[str]) -> bool:
    """`answer`, SQuAD-normalised, is a run of whole words of the normalised `texts` (a non-empty answer)."""
    norm = normalize_answer(answer)
    return bool(norm) and f" {norm} " in " " + " ".join(normalize_answer(t) for t in texts) + " "


def reply_answer(replies: list[str], golds: list[str], count_tokens: Callable[[str], int], max_tokens: int) -> str:
    """The answer a demonstration grounded in `replies` gives: the first gold answer that some reply states
    (SQuAD-normalised, on word boundaries) and that fits `max_tokens`; otherwise what the last reply answers:
    its last non-empty line, without an "The answer is:" style prefix and without quotes, markdown emphasis
    or a full stop around it, cut to at most `max_tokens` tokens on a word boundary. '' when the last reply is empty."""
    for gold in golds:
        if stated_in(gold, replies) and count_tokens(str(gold).strip()) <= max_tokens:
            return str(gold).strip()
    lines = [line.strip() for line in (replies[-1] if replies else "").splitlines() if line.strip()]
    if not lines:
        return ""
    text = _ANSWER_PREFIX.sub("", lines[-1]).strip().strip("\"'`*.").strip()
    text = text or lines[-1]
    words: list[str] = []
    for word in text.split():
        if count_tokens(" ".join([*words, word])) > max_tokens:
            break
        words.append(word)
    return " ".join(words)


def answer_source(warmup: Any) -> str:
    """`train.warmup.answer` resolved: `gold` with withheld replies (nothing to ground an answer in), else
    the setting, `auto` being `reply`."""
    if warmup.replies == "withheld":
        return "gold"
    return "reply" if warmup.answer == "auto" else warmup.answer


def question_of(item: PromptItem) -> str:
    """The bare question: `extra_info.question`, else the first line after `Question:` in the prompt."""
    if item.question.strip():
        return " ".join(item.question.split())
    content = item.messages[-1]["content"] if item.messages else ""
    first = content.split("Question:", 1)[-1].strip().splitlines()
    return first[0].strip() if first else ""


@dataclass
class _Plan:
    item: PromptItem
    texts: DemoTexts
    prompt_ids: list[int]
    turn_ids: list[list[int]]
    """Agent ids of every turn, the final one last (with the gold answer until `_ground_final` replaces it)."""
    final_think: str = ""


def _plan(builder: ConversationBuilder, item: PromptItem, w: WarmupConfig, a: AgentConfig,
          rng: random.Random) -> _Plan | None:
    """Texts and agent ids of one demo, or None when the row does not fit the budgets."""
    question = question_of(item)
    if not question or not item.gold_answers:
        return None
    answer = str(item.gold_answers[0]).strip()
    if not answer or len(builder.encode(answer)) > w.max_answer_tokens:
        return None
    texts = demo_texts(question, answer, w.interaction_turns, rng, w.request)
    turn_ids = [builder.encode(t) for t in [*texts.interaction_turns, texts.final_turn]]
    if any(len(ids) > a.max_turn_tokens for ids in turn_ids):
        return None
    prompt_ids = builder.start(item.messages)
    if len(prompt_ids) > a.max_prompt_tokens:
        return None
    final_think = texts.final_turn.split(THINK_CLOSE, 1)[0]
    return _Plan(item, texts, prompt_ids, turn_ids, final_think)


def _ground_final(builder: ConversationBuilder, plan: _Plan, replies: list[str], max_answer_tokens: int,
                  max_turn_tokens: int) -> str | None:
    """Rewrite `plan`'s final turn with the answer grounded in `replies` (`reply_answer`); returns the answer,
    or None when the replies give none or the turn no longer fits `max_turn_tokens`."""
    answer = reply_answer(replies, [str(g) for g in plan.item.gold_answers],
                          lambda text: len(builder.encode(text)), max_answer_tokens)
    if not answer:
        return None
    final = f"{plan.final_think}{THINK_CLOSE}\n{ANSWER_OPEN}{answer}{ANSWER_CLOSE}"
    ids = builder.encode(final)
    if len(ids) > max_turn_tokens:
        return None
    plan.texts.final_turn = final
    plan.turn_ids[-1] = ids
    return answer


def _reask_turn(builder: ConversationBuilder, plan: _Plan, t: int, reply: str, max_turn_tokens: int) -> bool:
    """Rewrite `plan`'s request `t` as the re-ask of `reply` (`knowledge_replies.reask_request`); False when
    the reply gives no entity to re-ask with or the turn no longer fits `max_turn_tokens`."""
    from pipeline.environment.simulated.knowledge_replies import reask_request

    request = reask_request(question_of(plan.item), reply)
    if not request:
        return False
    think = plan.texts.interaction_turns[t].split(THINK_CLOSE, 1)[0]
    text = f"{think}{THINK_CLOSE}\n{PROMPT_OPEN}{request}{PROMPT_CLOSE}"
    ids = builder.encode(text)
    if len(ids) > max_turn_tokens:
        return False
    plan.texts.interaction_turns[t], plan.texts.prompts[t], plan.turn_ids[t] = text, request, ids
    return True


def needed_followup(replies: list[str], golds: list[str]) -> bool:
    """The last reply states a gold answer and no earlier reply does (`train.warmup.require_followup`)."""
    return (len(replies) > 1 and any(stated_in(g, replies[-1:]) for g in golds)
            and not any(stated_in(g, replies[:-1]) for g in golds))


async def _assemble(builder: ConversationBuilder, env: Any, plans: list[_Plan], withheld: bool = False,
                    grounding: tuple[int, int] | None = None,
                    reask_tokens: int | None = None) -> list[Trajectory | None]:
    """Ask the environment turn by turn (all demos of a round concurrently) and append ids as the rollout.
    `withheld`: every reply is `WITHHELD_REPLY` and the environment is not asked. `grounding`
    (max answer tokens, max turn tokens): the final answer comes from the replies (`_ground_final`); a demo
    whose replies give none is None in the result. `reask_tokens` (max turn tokens; `followup: reask`): every
    request after the first is rewritten from the previous reply (`_reask_turn`); a demo it fails for is None."""
    trajs = [Trajectory(item=p.item, prompt_ids=list(p.prompt_ids)) for p in plans]
    histories: list[list[dict[str, str]]] = [[] for _ in plans]
    dropped: set[int] = set()
    rounds = len(plans[0].texts.prompts) if plans else 0
    for t in range(rounds):
        if t > 0 and reask_tokens is not None and not withheld:
            for k, (p, hist) in enumerate(zip(plans, histories, strict=True)):
                if k not in dropped and not _reask_turn(builder, p, t, hist[-1]["content"], reask_tokens):
                    dropped.add(k)
        if withheld:
            replies = [EnvironmentReply(text=WITHHELD_REPLY) for _ in plans]
        else:
            replies = await asyncio.gather(*(env.reply(list(h), p.texts.prompts[t])
                                             for p, h in zip(plans, histories, strict=True)))
        for p, traj, hist, reply in zip(plans, trajs, histories, replies, strict=True):
            agent_ids = p.turn_ids[t]
            env_ids = builder.env_turn_ids(reply.text, agent_ids)
            traj.turns.append(Turn(parsed=parse_turn(builder.think_opener + p.texts.interaction_turns[t]),
                                   agent_token_ids=list(agent_ids), env_reply=reply, env_token_ids=env_ids))
            traj.response_ids += [*agent_ids, *env_ids]
            traj.response_mask += [1] * len(agent_ids) + [0] * len(env_ids)
            if not withheld:
                traj.usage.add(reply)
            hist += [{"role": "user", "content": p.texts.prompts[t]}, {"role": "assistant", "content": reply.text}]
    out: list[Trajectory | None] = []
    for k, (p, traj) in enumerate(zip(plans, trajs, strict=True)):
        if k in dropped:
            out.append(None)
            continue
        if grounding is not None:
            replies = [t.env_reply.text for t in traj.turns if t.env_reply is not None]
            if _ground_final(builder, p, replies, *grounding) is None:
                out.append(None)
                continue
        final = p.turn_ids[-1]
        traj.turns.append(Turn(parsed=parse_turn(builder.think_opener + p.texts.final_turn),
                               agent_token_ids=list(final)))
        traj.response_ids += final
        traj.response_mask += [1] * len(final)
        traj.stop_reason = "answer"
        out.append(traj)
    return out


def build_demonstrations(plan: TrainPlan, frame: pd.DataFrame, tokenizer: Any, env: Any, count: int,
                         item_from_row: Callable[[dict[str, Any], int], PromptItem]) -> list[Trajectory]:
    """`count` demonstration trajectories from the training rows (see module docstring).

    `env` is an EnvironmentClient (or anything with its `async reply(history, prompt)`); failed environment
    calls (reply with `error`) drop that demo. Raises DataError when no row fits the budgets.
    """
    w, a = plan.train.warmup, plan.agent
    builder = ConversationBuilder(tokenizer, a.env_reply_max_chars)
    withheld = w.replies == "withheld"
    grounding = (w.max_answer_tokens, a.max_turn_tokens) if answer_source(w) == "reply" else None
    reask = a.max_turn_tokens if w.followup == "reask" else None
    rng = random.Random(plan.seed)
    order = np.random.default_rng([plan.seed, 0x5F7]).permutation(len(frame))
    demos: list[Trajectory] = []
    cursor = 0
    while len(demos) < count and cursor < len(order):
        plans: list[_Plan] = []
        while len(plans) < count - len(demos) and cursor < len(order):
            index = int(order[cursor])
            cursor += 1
            demo = _plan(builder, item_from_row(frame.iloc[index].to_dict(), index), w, a, rng)
            if demo is not None:
                plans.append(demo)
        if not plans:
            break
        for traj in asyncio.run(_assemble(builder, env, plans, withheld, grounding, reask)):
            if traj is None:
                continue
            failed = any(t.env_reply is not None and t.env_reply.error for t in traj.turns)
            if failed or len(traj.response_ids) > a.max_response_tokens:
                continue
            replies = [t.env_reply.text for t in traj.turns if t.env_reply is not None]
            if w.require_followup and not needed_followup(replies, [str(g) for g in traj.item.gold_answers]):
                continue
            demos.append(traj)
            if len(demos) == count:
                break
    if not demos:
        raise DataError("format warm-up: no training row fits the budgets (train.warmup.max_answer_tokens, "
                        "agent.max_turn_tokens/max_prompt_tokens/max_response_tokens) or the environment failed")
    if len(demos) < count:
        log.warning("format warm-up: only %d of %d demonstrations could be built; cycling them", len(demos), count)
    return demos
