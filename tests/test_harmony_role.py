"""Where GPT-OSS reads our instruction: the request we send, rendered as the pinned vLLM renders it.

The client sends the instruction as a leading `system` chat message for every backend (pinned here on the
wire, through a real local HTTP server). vLLM 0.24.0 (constraints/gpu.txt) renders a GPT-OSS chat request in
`vllm/entrypoints/serve/render/serving.py` `_make_request_with_harmony`: `extract_instructions_from_messages`
peels a leading system/developer message, `build_harmony_preamble` puts it into the developer message (or,
with `VLLM_GPT_OSS_HARMONY_SYSTEM_INSTRUCTIONS=1`, into the system message's model identity),
`parse_chat_inputs_to_harmony_messages` converts the rest (assistant text to the `final` channel), and
`render_for_completion` renders with `openai_harmony`. `render_as_vllm_0_24` below follows those steps for
plain-text messages and renders with `openai_harmony` from the `oss-harmony` package (same import name and
Python API as the `openai-harmony` vLLM installs; it embeds the o200k vocabulary, so it renders offline). On
this conversation its token ids were compared once with openai-harmony 0.0.8's, given the same vocabulary
file: identical.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path

import pytest
from fault_server import FaultServer
from helpers import server_spec

from pipeline.config import load_params
from pipeline.environment.client import EnvironmentClient

REPO = Path(__file__).resolve().parents[1]
DATE = "2026-11-28"
"""vLLM writes the server's date into the system message (`VLLM_SYSTEM_START_DATE` pins it); fixed here."""


def sent_request(params, history: list[dict[str, str]], prompt: str) -> dict:
    """The chat request body the client sends for `params`' environment, as a real server received it."""
    with FaultServer(model=params.environment.served_name) as server:
        params.environment.base_url = server.url
        params.environment.cache = False
        client = EnvironmentClient(params.environment)

        async def ask() -> None:
            await client.reply(history, prompt)
            await client.aclose()

        asyncio.run(ask())
        (request,) = server.chat_requests
    return request.body


def render_as_vllm_0_24(
    messages: list[dict[str, str]], reasoning_effort: str, *, system_instructions: bool = False
) -> str:
    """The prompt vLLM 0.24.0 builds for a GPT-OSS chat request of plain-text messages (module docstring)."""
    from openai_harmony import (
        Conversation,
        DeveloperContent,
        HarmonyEncodingName,
        Message,
        ReasoningEffort,
        Role,
        SystemContent,
        load_harmony_encoding,
    )

    instructions = messages[0]["content"] if messages[0]["role"] in ("system", "developer") else None
    rest = messages[1:] if instructions is not None else messages
    system = SystemContent.new()
    if instructions is not None and system_instructions:
        system = system.with_model_identity(f"{system.model_identity}\n{instructions}")
    system = system.with_reasoning_effort(ReasoningEffort(reasoning_effort.capitalize()))
    harmony = [Message.from_role_and_content(Role.SYSTEM, system.with_conversation_start_date(DATE))]
    if instructions and not system_instructions:
        harmony.append(
            Message.from_role_and_content(
                Role.DEVELOPER, DeveloperContent.new().with_instructions(instructions)
            )
        )
    for message in rest:
        if message["role"] == "assistant":
            harmony.append(
                Message.from_role_and_content(Role.ASSISTANT, message["content"]).with_channel("final")
            )
        else:
            harmony.append(Message.from_role_and_content(Role(message["role"]), message["content"]))
    encoding = load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    tokens = encoding.render_conversation_for_completion(Conversation.from_messages(harmony), Role.ASSISTANT)
    return encoding.decode_utf8(tokens)


HISTORY = [{"role": "user", "content": "Who wrote Hamlet?"}, {"role": "assistant", "content": "Shakespeare."}]


def test_gpt_oss_gets_our_instruction_as_harmony_developer_message():
    params = load_params(REPO / "params.yaml", {"profile": "paper"})
    body = sent_request(params, HISTORY, "When was it written?")
    instruction = params.environment.system_prompt
    assert body["messages"] == [
        {"role": "system", "content": instruction},
        *HISTORY,
        {"role": "user", "content": "When was it written?"},
    ]
    assert body["reasoning_effort"] == "low"

    prompt = render_as_vllm_0_24(body["messages"], body["reasoning_effort"])
    assert prompt == (
        "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
        f"Knowledge cutoff: 2024-06\nCurrent date: {DATE}\n\nReasoning: low\n\n"
        "# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>"
        f"<|start|>developer<|message|># Instructions\n\n{instruction}<|end|>"
        "<|start|>user<|message|>Who wrote Hamlet?<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Shakespeare.<|end|>"
        "<|start|>user<|message|>When was it written?<|end|><|start|>assistant"
    )
    # a `developer` first message renders the same: the role we send does not matter to vLLM 0.24.0 ...
    as_developer = [{"role": "developer", "content": instruction}, *body["messages"][1:]]
    assert render_as_vllm_0_24(as_developer, "low") == prompt
    # ... but vLLM's VLLM_GPT_OSS_HARMONY_SYSTEM_INSTRUCTIONS=1 would move it out of the developer message
    moved = render_as_vllm_0_24(body["messages"], "low", system_instructions=True)
    assert "<|start|>developer" not in moved and moved.index(instruction) < moved.index("<|end|>")


def test_other_backends_send_the_same_request_as_before(monkeypatch):
    """The default (llama.cpp) and paid-API environments: the body, key order included, is unchanged."""
    for overrides in ({}, {"profile": "api"}):
        params = load_params(REPO / "params.yaml", overrides or None)
        env = params.environment
        if env.backend == "api":  # a loopback test server stands in for the paid endpoint
            monkeypatch.setenv(env.api_key_env, "sk-test-key")
        body = sent_request(params, HISTORY, "When was it written?")
        expected = {
            "model": env.served_name,
            "messages": [
                {"role": "system", "content": env.system_prompt},
                *HISTORY,
                {"role": "user", "content": "When was it written?"},
            ],
            "temperature": env.temperature,
            "max_tokens": env.max_tokens,
            **({"reasoning_effort": env.reasoning_effort} if env.reasoning_effort else {}),
        }
        assert json.dumps(body) == json.dumps(expected), overrides


def test_gpt_oss_server_keeps_the_instruction_in_the_developer_message(tmp_path, monkeypatch):
    """The vLLM server the pipeline starts for GPT-OSS runs with VLLM_GPT_OSS_HARMONY_SYSTEM_INSTRUCTIONS=0,
    whatever the operator's shell holds; other vLLM models are left alone."""
    from pipeline.environment import harmony
    from pipeline.environment.servers import server_env

    model = tmp_path / "gpt-oss-20b"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"x")
    vocab = b"IQ== 0\n"
    monkeypatch.setattr(harmony, "ENCODING_FILES", {"o200k_base.tiktoken": hashlib.sha256(vocab).hexdigest()})
    (tmp_path / "encodings").mkdir()
    (tmp_path / "encodings" / "o200k_base.tiktoken").write_bytes(vocab)
    monkeypatch.setenv("TIKTOKEN_ENCODINGS_BASE", str(tmp_path / "encodings"))
    monkeypatch.setenv("VLLM_GPT_OSS_HARMONY_SYSTEM_INSTRUCTIONS", "1")
    params = load_params(REPO / "params.yaml", {"profile": "paper", "environment": {"model": str(model)}})
    assert server_env(server_spec(params))["VLLM_GPT_OSS_HARMONY_SYSTEM_INSTRUCTIONS"] == "0"
    monkeypatch.delenv("VLLM_GPT_OSS_HARMONY_SYSTEM_INSTRUCTIONS")
    params.environment.served_name, params.environment.model = "qwen", str(model.rename(tmp_path / "qwen"))
    assert "VLLM_GPT_OSS_HARMONY_SYSTEM_INSTRUCTIONS" not in server_env(server_spec(params))


def test_docs_say_which_role_and_why_for_the_pinned_vllm():
    pinned = (REPO / "constraints" / "gpu.txt").read_text()
    assert "vllm==0.24.0" in pinned.splitlines()  # another vLLM: read its harmony rendering again
    text = (REPO / "docs" / "gpu.md").read_text()
    paragraph = text[text.index("**Where GPT-OSS reads our instruction**") :]
    paragraph = paragraph[: paragraph.index("\n- **")]
    for needed in (
        "developer",
        "role `system`",
        "vLLM 0.24.0",
        "extract_instructions_from_messages",
        "VLLM_GPT_OSS_HARMONY_SYSTEM_INSTRUCTIONS=0",
        "tests/test_harmony_role.py",
    ):
        assert needed in paragraph, needed


@pytest.mark.parametrize("effort", ["low", "medium", "high"])
def test_reasoning_effort_goes_to_the_harmony_system_message(effort):
    prompt = render_as_vllm_0_24(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], effort
    )
    system = prompt[: prompt.index("<|end|>")]
    assert f"Reasoning: {effort}" in system and "Be brief." not in system
