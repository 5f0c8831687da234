"""One conversation protocol for both training loops: the same scripted conversations through the local
rollout (`pipeline.agent.rollout`: CPU training, evaluation, `promptr1 ask`) and through verl's own
`AgentLoopWorker` running our `prompt_r1` loop (GPU training), compared label by label, token by token.

The agent is a script (`ScriptedAgent`), not a model: each conversation is a list of turn texts chosen to
hit one turn rule each. The local side gets it as a `Policy` (finish reason `length` when the limit cut a
turn, as every real policy reports); verl's side as its LLM client (`TokenOutput`, vLLM's contract:
sampled ids, stop string included). The environment is a real OpenAI-compatible server on 127.0.0.1
(tests/fault_server.py), answering by content. verl's side goes through the trainer's own batch path and
its reward loop with our reward function (tests/verl_cpu.py), so `rm_scores` is the reward verl trains on.

Two budgets, because one conversation needs room and another needs to run out of it:
- roomy: an answer after a call, a turn-limit ending, a malformed turn (`no_action`), an over-long
  reply cut to `env_reply_max_chars` with `...`;
- tight: a turn cut by the token budget (`token_budget`), a reply that overflows the budget.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from fault_server import FaultServer
from verl.workers.rollout.replica import TokenOutput
from verl_cpu import compose_verl, verl_worker_rollout

from pipeline.agent.policy import Generation
from pipeline.agent.protocol import STOP_STRINGS, ConversationBuilder
from pipeline.agent.rollout import RolloutSettings, rollout
from pipeline.config import load_params
from pipeline.environment.client import EnvironmentClient
from pipeline.reward import reward_for_trajectory
from pipeline.stages.build import RL_SCHEMA, rl_row
from pipeline.train.local.questions import prompt_item_from_row
from pipeline.train.plan import TrainPlan
from pipeline.train.verl.overrides import build_overrides

REPO_ROOT = Path(__file__).resolve().parents[1]
GROUP_SIZE = 2
MAX_TURNS = 3
MAX_TURN_TOKENS = 48
MAX_PROMPT_TOKENS = 96
REPLY_MAX_CHARS = 120

ASK = "Thinking.</think>\n<interaction_prompt>{ask}</interaction_prompt>"
RAMBLE = "I keep thinking about this " + "and about that " * 40  # no tags, far longer than any limit
SCRIPTS: dict[str, list[str]] = {  # marker -> the agent's turns, in order
    "QA": [ASK.format(ask="What is the capital of France?"), "The reply says Paris.</think>\n<answer>Paris</answer>"],
    "QC": [ASK.format(ask="Tell me more."), ASK.format(ask="And more."), ASK.format(ask="Still more.")],
    "QD": ["I think the answer is Paris."],
    "QL": [ASK.format(ask="Please write long."), "It was long.</think>\n<answer>Paris</answer>"],
    "QB": [ASK.format(ask="Short please."), RAMBLE],
    "QE": [ASK.format(ask="Please write long.")],
}
EXPECTED = {  # marker -> (stop reason, agent turns, environment calls)
    "QA": ("answer", 2, 1),
    "QC": ("max_turns", 3, 2),  # the last allowed turn never calls the environment
    "QD": ("no_action", 1, 0),
    "QL": ("answer", 2, 1),
    "QB": ("token_budget", 2, 1),  # the second turn is cut by what is left of the budget, not by max_turn_tokens
    "QE": ("token_budget", 1, 1),  # the reply does not fit: cut at the budget
}
ROOMY, TIGHT = ["QA", "QC", "QD", "QL"], ["QB", "QE"]

pytestmark = pytest.mark.slow  # verl's worker, dataset and reward loop on CPU (~1-2 min on a busy 2-core CPU)


def environment_reply(messages: list[dict[str, Any]]) -> str:
    """The environment: a long reply when asked for one (400 words), else a short one."""
    asked = messages[-1]["content"]
    if "long" in asked:
        return " ".join(f"word{i}" for i in range(400))
    return f"reply to: {asked}"


class ScriptedAgent:
    """Plays SCRIPTS: the conversation's marker from the context, the turn from the replies seen so far."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def turn(self, context: list[int], limit: int) -> tuple[list[int], list[float], bool]:
        """(sampled ids, their log-probs, whether the limit cut the turn) for the next turn of `context`."""
        text = self.tokenizer.decode(context)
        marker = re.search(r"Question: (Q[A-Z])\b", text).group(1)
        script = SCRIPTS[marker]
        ids = self.tokenizer.encode(script[min(text.count("<interaction_response>"), len(script) - 1)],
                                    add_special_tokens=False)
        cut = len(ids) > limit
        ids = ids[:limit]
        return ids, [-0.01 * (1 + i % 7) for i in range(len(ids))], cut


class ScriptedPolicy:
    """The local rollout's `Policy` over a ScriptedAgent."""

    def __init__(self, agent: ScriptedAgent) -> None:
        self.agent, self.tokenizer = agent, agent.tokenizer

    def generate(self, prompts, max_new_tokens, temperature, top_p, stop, return_logprobs):
        assert stop == STOP_STRINGS
        out = []
        for prompt, limit in zip(prompts, max_new_tokens, strict=True):
            ids, logprobs, cut = self.agent.turn(prompt, limit)
            out.append(Generation(ids, logprobs if return_logprobs else None,
                                  self.tokenizer.decode(ids, skip_special_tokens=True), "length" if cut else "stop"))
        return out


class ScriptedServerManager:
    """verl's LLM client contract (`generate(...) -> TokenOutput`) over a ScriptedAgent."""

    def __init__(self, agent: ScriptedAgent) -> None:
        self.agent = agent
        self.calls = 0

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any],
                       **kwargs: Any) -> TokenOutput:
        self.calls += 1
        assert sampling_params["stop"] == STOP_STRINGS and sampling_params["include_stop_str_in_output"]
        ids, logprobs, _ = self.agent.turn(list(prompt_ids), int(sampling_params["max_tokens"]))
        return TokenOutput(token_ids=ids, log_probs=logprobs, stop_reason="completed", num_preempted=0)


def user_content(marker: str) -> str:
    return f"Question: {marker}\nAnswer with Prompt-R1 tags."


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_llama_dir))


@pytest.fixture(scope="module")
def env_server():
    with FaultServer(responder=environment_reply) as server:
        yield server


def tight_budget(tokenizer) -> int:
    """QB's first turn and reply, then 20 tokens: its second turn's limit (20) is below max_turn_tokens."""
    builder = ConversationBuilder(tokenizer, REPLY_MAX_CHARS)
    a1 = tokenizer.encode(SCRIPTS["QB"][0], add_special_tokens=False)
    return len(a1) + len(builder.env_turn_ids("reply to: Short please.", a1)) + 20


def make_params(markers: list[str], max_response_tokens: int, rl_dir: Path, model_dir: Path, server: FaultServer):
    rows = [rl_row(dataset="hotpotqa", content=user_content(m), task_type="multi-hop", answers=["Paris"],
                   row_id=m, split="train", question=m, index=i) for i, m in enumerate(markers)]
    pq.write_table(pa.Table.from_pylist(rows, schema=RL_SCHEMA), rl_dir / "train.parquet")
    return load_params(REPO_ROOT / "params.yaml", {
        "profile": "paper",
        "paths": {"rl_dir": str(rl_dir), "cache_dir": str(rl_dir / "cache")},
        "environment": {"base_url": server.url, "served_name": "fault-model", "cache": False, "max_retries": 0,
                        "timeout_s": 10},
        "agent": {"model": str(model_dir), "max_turns": MAX_TURNS, "max_turn_tokens": MAX_TURN_TOKENS,
                  "max_response_tokens": max_response_tokens, "max_prompt_tokens": MAX_PROMPT_TOKENS,
                  "env_reply_max_chars": REPLY_MAX_CHARS},
        "train": {"group_size": GROUP_SIZE},
    })


def local_side(params, agent: ScriptedAgent):
    frame = pq.read_table(params.path(params.paths.rl_dir) / "train.parquet").to_pylist()
    items = [prompt_item_from_row(row, i) for i, row in enumerate(frame)]
    settings = replace(RolloutSettings.sampled(params.agent), temperature=1.0, top_p=1.0)

    async def go():
        env = EnvironmentClient(params.environment)
        try:
            return await rollout(
                ScriptedPolicy(agent), env, items, settings, group_size=GROUP_SIZE, return_logprobs=True,
                reward_fn=partial(reward_for_trajectory, cfg=params.reward))
        finally:
            await env.aclose()

    return asyncio.run(go())


@pytest.fixture(scope="module", params=["roomy", "tight"])
def both_sides(request, tokenizer, tiny_llama_dir, env_server, tmp_path_factory):
    markers = ROOMY if request.param == "roomy" else TIGHT
    budget = 1024 if request.param == "roomy" else tight_budget(tokenizer)
    params = make_params(markers, budget, tmp_path_factory.mktemp("rl"), tiny_llama_dir, env_server)
    agent = ScriptedAgent(tokenizer)
    calls_before = len(env_server.chat_requests)
    local = local_side(params, agent)
    local_calls = len(env_server.chat_requests) - calls_before
    config = compose_verl(build_overrides(TrainPlan.from_params(params)))
    verl_out = verl_worker_rollout(config, tokenizer, ScriptedServerManager(agent), rows=len(markers))
    verl_calls = len(env_server.chat_requests) - calls_before - local_calls
    return markers, budget, local, verl_out, (local_calls, verl_calls)


def response_part(batch, key: str, i: int) -> list:
    attention = batch["attention_mask"][i, MAX_PROMPT_TOKENS:].bool()
    return batch[key][i][attention].tolist()


def test_each_conversation_ends_as_the_rules_say(both_sides):
    markers, _, local, _, (local_calls, verl_calls) = both_sides
    assert [t.item.uid for t in local] == [m for m in markers for _ in range(GROUP_SIZE)]
    for traj in local:
        reason, turns, _ = EXPECTED[traj.item.uid]
        assert (traj.stop_reason, traj.num_turns) == (reason, turns), traj.item.uid
    expected_calls = GROUP_SIZE * sum(EXPECTED[m][2] for m in markers)
    assert local_calls == verl_calls == expected_calls


def test_both_loops_give_the_same_labels_masks_and_rewards(both_sides):
    markers, budget, local, verl_out, _ = both_sides
    batch, extra = verl_out.batch, verl_out.non_tensor_batch
    assert len(batch) == len(local) == len(markers) * GROUP_SIZE
    for i, traj in enumerate(local):
        uid = traj.item.uid
        assert extra["prompt_r1_stop_reason"][i] == traj.stop_reason, uid
        assert int(extra["__num_turns__"][i]) == traj.num_turns, uid
        assert list(extra["prompt_r1_turns"][i]) == [t.parsed.text for t in traj.turns], uid
        assert response_part(batch, "responses", i) == traj.response_ids, uid
        assert response_part(batch, "response_mask", i) == traj.response_mask, uid
        assert response_part(batch, "rollout_log_probs", i) == pytest.approx(traj.response_logprobs), uid
        assert len(traj.response_ids) <= budget
        # the reward verl trains on: one value, on the last response token
        last = int(batch["attention_mask"][i, MAX_PROMPT_TOKENS:].sum()) - 1
        assert float(batch["rm_scores"][i, last]) == pytest.approx(traj.reward.total), uid
        assert float(batch["rm_scores"][i].abs().sum()) == pytest.approx(abs(traj.reward.total)), uid


def test_the_reward_is_computed_once_on_the_verl_path(both_sides):
    """The loop leaves the reward to verl's reward loop: no reward parts of its own in the batch."""
    _, _, local, verl_out, _ = both_sides
    assert not [k for k in verl_out.non_tensor_batch if k.startswith("prompt_r1_reward")]
    assert "score" in verl_out.meta_info["reward_extra_keys"]
    scores = [float(s) for s in verl_out.non_tensor_batch["score"]]
    assert scores == pytest.approx([t.reward.total for t in local])


@pytest.mark.parametrize("both_sides", ["roomy"], indirect=True)  # the over-long reply is in the roomy set
def test_over_long_reply_is_cut_to_max_chars_in_both(both_sides, tokenizer):
    _, _, local, verl_out, _ = both_sides
    i = next(i for i, t in enumerate(local) if t.item.uid == "QL")
    env_text = tokenizer.decode([t for t, m in zip(local[i].response_ids, local[i].response_mask, strict=True)
                                 if not m])
    cut = environment_reply([{"content": "Please write long."}])[:REPLY_MAX_CHARS] + "..."
    assert f"<interaction_response>\n{cut}\n</interaction_response>" in env_text
    assert torch.equal(torch.tensor(response_part(verl_out.batch, "responses", i)), torch.tensor(local[i].response_ids))
