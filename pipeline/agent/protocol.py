"""The Prompt-R1 protocol: the agent's tags, how one agent turn is parsed, and how a conversation is tokenised.

An agent turn is `<think>…</think>` followed by either `<interaction_prompt>…</interaction_prompt>` (sent to
the environment) or `<answer>…</answer>` (the end). The environment's reply comes back as a user turn
`<interaction_response>\\n{reply}\\n</interaction_response>` and the next assistant turn opens with `<think>`.

Design decisions:

- **Parsing never raises.** Model output is anything: missing, repeated, unclosed or misordered tags, text
  outside tags, empty parts. `parse_turn` scans the tag positions once and fills `ParsedTurn` with the first
  closed part of each kind (as the authors' regexes `re.search(r"<answer>(.*?)</answer>")` do), the reward
  flags, and human-readable `issues`.
- **Flags follow method.md, with the released code's anchoring.** M_t: exactly one of each of `<think>`,
  `</think>`, `<interaction_prompt>`, `</interaction_prompt>`, no answer tag, the turn is
  `<think>X</think>` + whitespace + `<interaction_prompt>Y</interaction_prompt>` with nothing else, X and Y
  non-empty. (The released code anchors the same regex but does not require non-empty parts; the method
  does.) A_p: a closed `<answer>…</answer>`. A_n: its content is non-empty after stripping. C_f: the turn is
  exactly `<think>…</think>` + whitespace + `<answer>…</answer>`, each of those four tags once, no interaction
  tags. Leading/trailing whitespace of the turn is ignored everywhere (a stop on `</interaction_prompt>` can
  end inside a token such as `>\\n`).
- **The turn text includes the `<think>` opener.** The template opens every assistant turn with
  `THINK_OPENER` (mask-0 context tokens); the rollout parses `THINK_OPENER + generated_text`, exactly the
  assistant block the authors' reward regexes see (`<|im_start|>assistant\\n<think>\\n…`).
- **Turn opening as in the authors' code.** Their environment wrapper (`NousToolEnv.format_tool_response`)
  appends `<|im_end|>\\n<|im_start|>user\\n<interaction_response>\\n{reply}\\n</interaction_response><|im_end|>\\n
  <|im_start|>assistant\\n<think>\\n` after an agent turn that stopped on `</interaction_prompt>`; replies are
  cut to `max_tool_response_length` characters with `...` appended. We produce the same text, but derive the
  role markers from the tokenizer's chat template instead of hard-coding ChatML, so any template works. Their
  *first* turn starts at the bare generation prompt; we open it with `<think>\\n` too (the contract says every
  assistant turn opens with `<think>`), so the agent never has to spend tokens on the opener.
- **Token drift.** `ConversationBuilder` is append-only: prompt ids, then each turn's *sampled* agent ids
  (mask 1), then the env ids (mask 0). Training consumes exactly the ids the sampler saw. For chat templates
  that render content verbatim (SmolLM2's ChatML, the Prompt-R1 authors' Qwen3 template) these ids equal the
  tokenisation of the whole conversation rendered at once (tested). Two known, documented differences:
  (1) Qwen3's *official* template drops `<think>…</think>` from assistant turns before the last user message,
  so a whole-conversation re-render is shorter than what the agent saw: we never re-render, and the verl
  agent loop appends tokens the same way; (2) a sampled token sequence need not be the tokenizer's canonical
  encoding of its text (e.g. `\\n\\n` as one or two tokens): we keep the sampled ids, never re-tokenise text.
- **One set of turn rules** (`TurnRules`): what ends a trajectory after each turn and how much of an
  environment reply fits. The local rollout and verl's agent loop both call it; neither writes a rule of
  its own (they once disagreed on a turn cut by the token budget: `token_budget` locally, `no_action` in
  verl).
- **Closing the agent turn.** Generation stops on a stop string (`STOP_STRINGS`), not on the end-of-turn
  token, so the env ids start with the template's assistant-closing text (`<|im_end|>\\n` for ChatML), minus
  the end-of-turn token when the agent did emit it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pipeline.types import ParsedTurn, StopReason

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
PROMPT_OPEN, PROMPT_CLOSE = "<interaction_prompt>", "</interaction_prompt>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<interaction_response>", "</interaction_response>"

THINK_OPENER = "<think>\n"
"""Text that opens every assistant turn (context, mask 0), as in the authors' `format_tool_response`."""

STOP_STRINGS = [PROMPT_CLOSE, ANSWER_CLOSE]
"""Generation of one agent turn stops right after either of these (they are kept in the output)."""

TRUNCATION_MARK = "..."
"""Appended to an environment reply cut to the maximum length (as the released code does)."""

_TAG_RE = re.compile(r"<(/?)(think|interaction_prompt|answer)>")


def _spans(text: str) -> tuple[dict[str, list[int]], list[tuple[str, bool, int, int]]]:
    """Every protocol tag in order: (name, is_close, start, end); plus counts per tag string."""
    tags = [(m.group(2), m.group(1) == "/", m.start(), m.end()) for m in _TAG_RE.finditer(text)]
    counts: dict[str, list[int]] = {}
    for name, closing, start, _ in tags:
        counts.setdefault(("</" if closing else "<") + name + ">", []).append(start)
    return counts, tags


def _first_closed(text: str, tags: list[tuple[str, bool, int, int]], name: str) -> tuple[str | None, bool]:
    """Content (stripped) of the first `<name>…</name>` and whether an opener was left unclosed."""
    for i, (tag, closing, _, end) in enumerate(tags):
        if tag == name and not closing:
            for tag2, closing2, start2, _ in tags[i + 1 :]:
                if tag2 == name and closing2:
                    return text[end:start2].strip(), False
            return None, True
    return None, False


def parse_turn(text: str) -> ParsedTurn:
    """Split one agent turn into think / interaction prompt / answer and set the format-reward flags.

    Never raises: anything that is not a string is treated as an empty turn.
    """
    if not isinstance(text, str):
        text = "" if text is None else str(text)
    counts, tags = _spans(text)
    parts = {name: _first_closed(text, tags, name) for name in ("think", "interaction_prompt", "answer")}
    think, prompt, answer = (parts[name][0] for name in ("think", "interaction_prompt", "answer"))
    issues = _structure_issues(text, counts, parts)
    valid_intermediate, complete_final, has_shape = _shape_flags(text.strip(), counts)
    if not has_shape:
        outside = _TAG_RE.sub("", _strip_tagged(text, tags)).strip()
        if outside:
            issues.append("text outside tags")

    return ParsedTurn(
        text=text,
        think=think,
        interaction_prompt=prompt,
        answer=answer,
        valid_intermediate=valid_intermediate,
        has_answer_tags=answer is not None,
        answer_nonempty=bool(answer),
        complete_final=complete_final,
        issues=issues,
    )


def _structure_issues(text: str, counts: dict[str, list[int]],
                      parts: dict[str, tuple[str | None, bool]]) -> list[str]:
    """What is wrong with the turn's tags and parts: empty, unclosed, repeated or unopened tags, missing or
    empty parts, both a prompt and an answer. `parts`: name -> (first closed content, left unclosed)."""
    think, think_unclosed = parts["think"]
    prompt, answer = parts["interaction_prompt"][0], parts["answer"][0]
    issues: list[str] = []
    if not text.strip():
        issues.append("empty turn")
    for name, (_, unclosed) in parts.items():
        if unclosed:
            issues.append(f"unclosed <{name}>")
    for tag, positions in counts.items():
        if len(positions) > 1:
            issues.append(f"{tag} appears {len(positions)} times")
    for name in ("think", "interaction_prompt", "answer"):
        if f"</{name}>" in counts and f"<{name}>" not in counts:
            issues.append(f"</{name}> without <{name}>")
    if think is None and not think_unclosed:
        issues.append("no <think>")
    elif think == "":
        issues.append("empty think")
    if prompt == "":
        issues.append("empty interaction prompt")
    if answer == "":
        issues.append("empty answer")
    if prompt is not None and answer is not None:
        issues.append("both an interaction prompt and an answer")
    return issues


def _shape_flags(body: str, counts: dict[str, list[int]]) -> tuple[bool, bool, bool]:
    """The format-reward flags of the stripped turn `body`: (valid intermediate turn, complete final turn,
    whether it has either shape at all, tag counts aside)."""

    def once(*tag_strings: str) -> bool:
        return all(len(counts.get(t, [])) == 1 for t in tag_strings)

    def absent(*tag_strings: str) -> bool:
        return all(t not in counts for t in tag_strings)

    intermediate = re.fullmatch(
        r"<think>(.*?)</think>\s*<interaction_prompt>(.*?)</interaction_prompt>", body, re.DOTALL
    )
    valid_intermediate = bool(
        intermediate
        and once(THINK_OPEN, THINK_CLOSE, PROMPT_OPEN, PROMPT_CLOSE)
        and absent(ANSWER_OPEN, ANSWER_CLOSE)
        and intermediate.group(1).strip()
        and intermediate.group(2).strip()
    )
    final = re.fullmatch(r"<think>(.*?)</think>\s*<answer>(.*?)</answer>", body, re.DOTALL)
    complete_final = bool(
        final and once(THINK_OPEN, THINK_CLOSE, ANSWER_OPEN, ANSWER_CLOSE) and absent(PROMPT_OPEN, PROMPT_CLOSE)
    )
    return valid_intermediate, complete_final, intermediate is not None or final is not None


def _strip_tagged(text: str, tags: list[tuple[str, bool, int, int]]) -> str:
    """The text with every closed tag pair's span removed (to spot text outside tags)."""
    out: list[str] = []
    cursor, open_name, open_start = 0, None, 0
    for name, closing, start, end in tags:
        if open_name is None and not closing:
            out.append(text[cursor:start])
            open_name, open_start = name, start
        elif open_name == name and closing:
            cursor, open_name = end, None
    out.append(text[open_start if open_name is not None else cursor:])
    return "".join(out)


def environment_prompt_for(turn: ParsedTurn) -> str | None:
    """The interaction prompt to send to the environment, or None when this turn ends the trajectory.

    None when the turn gave an answer (closed `<answer>` tags), or has no closed, non-empty interaction prompt
    (the authors' environment likewise only answers a parseable `<interaction_prompt>`).
    """
    if turn.answer is not None:
        return None
    if turn.interaction_prompt:
        return turn.interaction_prompt
    return None


@dataclass(frozen=True)
class TurnDecision:
    """What follows one agent turn: the trajectory stops (`stop` set) or `prompt` goes to the environment."""

    stop: StopReason | None
    """Why the trajectory ends after this turn; None while it goes on."""
    prompt: str | None = None
    """The interaction prompt to send to the environment (set exactly when `stop` is None)."""


@dataclass(frozen=True)
class TurnRules:
    """The per-turn rules of a Prompt-R1 conversation, shared by every loop that rolls one out.

    The local rollout (`pipeline.agent.rollout`: training on CPU, evaluation, `promptr1 ask`) and verl's
    agent loop (`pipeline.train.verl.agent_loop`: GPU training) both ask these three questions and nothing
    else decides a trajectory's shape, so the two backends cannot drift apart (tests/test_protocol_parity.py
    drives the same scripted conversations through both):

    - `token_limit`: how many tokens the next agent turn may generate: `max_turn_tokens`, clipped to what
      is left of `max_response_tokens` (which counts agent and environment tokens alike, as verl's
      `data.max_response_length`).
    - `after_agent_turn`: the decision, in this order: `answer` (closed answer tags); `token_budget` (the
      response is full, or a turn with no usable interaction prompt was cut by the budget rather than by
      the per-turn limit); `no_action` (neither an answer nor a non-empty closed interaction prompt);
      `max_turns` (the last allowed turn never calls the environment: its reply could not be used);
      otherwise the interaction prompt goes to the environment.
    - `fit_reply`: the environment's ids are cut to the room left; a reply that fills it ends the
      trajectory with `token_budget` (the released code likewise truncates at the maximum length).
    """

    max_turns: int
    max_turn_tokens: int
    max_response_tokens: int

    def token_limit(self, response_tokens: int) -> int:
        """Generation limit of the next agent turn when `response_tokens` are already in the response."""
        return max(0, min(self.max_turn_tokens, self.max_response_tokens - response_tokens))

    def after_agent_turn(self, turn: ParsedTurn, *, turn_number: int, hit_limit: bool, limit: int,
                         response_tokens: int) -> TurnDecision:
        """Decide what follows agent turn `turn_number` (1-based), generated under `limit` (`token_limit`'s
        value for it); `hit_limit`: the generator stopped because of that limit (the local policies report
        it as finish reason `length`; verl's `TokenOutput` folds vLLM's `length` into `completed`, so its
        adapter reads it off the sampled ids: as many as the limit). `response_tokens` counts the response
        including this turn."""
        if turn.answer is not None:
            return TurnDecision("answer")
        prompt = environment_prompt_for(turn)
        cut_by_budget = hit_limit and limit < self.max_turn_tokens
        if response_tokens >= self.max_response_tokens or (prompt is None and cut_by_budget):
            return TurnDecision("token_budget")
        if prompt is None:
            return TurnDecision("no_action")
        if turn_number >= self.max_turns:
            return TurnDecision("max_turns")
        return TurnDecision(None, prompt)

    def fit_reply(self, env_ids: Sequence[int], response_tokens: int) -> tuple[list[int], StopReason | None]:
        """The environment ids that fit after `response_tokens`, and `token_budget` when they fill the room."""
        room = max(0, self.max_response_tokens - response_tokens)
        return list(env_ids[:room]), ("token_budget" if len(env_ids) >= room else None)


def format_env_reply(reply: str, max_chars: int) -> str:
    """`<interaction_response>\\n{reply}\\n</interaction_response>`, the reply cut to `max_chars` (+ `...`)."""
    reply = reply or ""
    if max_chars >= 0 and len(reply) > max_chars:
        reply = reply[:max_chars] + TRUNCATION_MARK
    return f"{RESPONSE_OPEN}\n{reply}\n{RESPONSE_CLOSE}"


_USER, _AGENT, _ENV = "PROMPTR1USERPLACEHOLDER", "PROMPTR1AGENTPLACEHOLDER", "PROMPTR1ENVPLACEHOLDER"


class ConversationBuilder:
    """Token ids of a Prompt-R1 conversation, built append-only turn by turn.

    `start(messages)` gives the prompt ids (chat template with the generation prompt, then `THINK_OPENER`).
    `env_turn_ids(reply_text, agent_ids)` gives the mask-0 ids that follow an agent turn: the end of the
    assistant turn, the user turn holding the formatted environment reply, and the next assistant header with
    `THINK_OPENER`. The role markers come from the tokenizer's chat template (see module docstring).
    """

    def __init__(self, tokenizer: Any, env_reply_max_chars: int = 2048, think_opener: str = THINK_OPENER):
        self.tokenizer = tokenizer
        self.env_reply_max_chars = env_reply_max_chars
        self.think_opener = think_opener
        self.assistant_close, self.user_prefix, self.user_suffix_and_header = self._template_pieces()
        close_ids = self.encode(self.assistant_close)
        special = set(getattr(tokenizer, "all_special_ids", []) or []) | set(
            getattr(tokenizer, "added_tokens_decoder", {}) or {})
        self.end_of_turn_id: int | None = close_ids[0] if close_ids and close_ids[0] in special else None
        """The token that ends an assistant turn in this template (`<|im_end|>` for ChatML)."""

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def _template_pieces(self) -> tuple[str, str, str]:
        """(assistant-closing text, text between it and the reply, text after the reply up to the next turn).

        Read off one render of [user, assistant, user] with the generation prompt, so templates that render
        the latest assistant turn differently from earlier ones (Qwen3's official template adds an empty
        think block to it) still give the pieces as they appear mid-conversation.
        """
        msgs = [{"role": "user", "content": _USER}, {"role": "assistant", "content": _AGENT},
                {"role": "user", "content": _ENV}]
        full = self.render(msgs, add_generation_prompt=True)
        if _AGENT not in full or _ENV not in full or full.index(_AGENT) > full.index(_ENV):
            raise ValueError("chat template does not render user/assistant turns in order; cannot build turns")
        between = full[full.index(_AGENT) + len(_AGENT): full.index(_ENV)]
        after = full[full.index(_ENV) + len(_ENV):]
        closed = self.render(msgs[:2])
        close = closed[closed.rindex(_AGENT) + len(_AGENT):] if _AGENT in closed else ""
        if not between.startswith(close):
            close = ""
        return close, between[len(close):], after

    def start(self, messages: list[dict[str, str]]) -> list[int]:
        """Prompt ids: the chat template with the generation prompt, then the `<think>` opener."""
        return self.encode(self.render(messages, add_generation_prompt=True) + self.think_opener)

    def env_text(self, reply_text: str, agent_closed: bool = False) -> str:
        """The mask-0 text after an agent turn (see `env_turn_ids`)."""
        close = self.assistant_close
        if agent_closed and self.end_of_turn_id is not None:
            eot_text = self.tokenizer.decode([self.end_of_turn_id])
            close = close.removeprefix(eot_text)
        return (
            close + self.user_prefix + format_env_reply(reply_text, self.env_reply_max_chars)
            + self.user_suffix_and_header + self.think_opener
        )

    def env_turn_ids(self, reply_text: str, agent_ids: Sequence[int] = ()) -> list[int]:
        """Mask-0 ids after an agent turn: close it (unless `agent_ids` ended with the end-of-turn token),
        the user turn `<interaction_response>\\n{reply}\\n</interaction_response>` (reply = the environment's
        raw text, cut to `env_reply_max_chars`), then the next assistant header and `<think>` opener."""
        closed = bool(agent_ids) and self.end_of_turn_id is not None and agent_ids[-1] == self.end_of_turn_id
        return self.encode(self.env_text(reply_text, agent_closed=closed))

    def stop_token_ids(self, extra: Sequence[int] | int | None = ()) -> list[int]:
        """Token ids that end generation: the template's end-of-turn token plus `extra` (the model's eos)."""
        ids: list[int] = []
        if self.end_of_turn_id is not None:
            ids.append(self.end_of_turn_id)
        if isinstance(extra, int):
            extra = [extra]
        for i in extra or ():
            if i is not None and i not in ids:
                ids.append(int(i))
        return ids
