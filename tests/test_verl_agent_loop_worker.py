"""Our agent loop inside verl's own `AgentLoopWorker`, with a real model generating, against a live environment.

The path is the one verl's trainer takes for one rollout step (ray_trainer.fit), minus Ray and the GPU:

    train.parquet (our build stage's rows) → verl's RLHFDataset + collate_fn → DataProto, uid,
    RayPPOTrainer._get_gen_batch, repeat(n, interleave) → AgentLoopWorker.generate_sequences
        → our `prompt_r1` loop (registered by agent_loop.yaml) → TransformersServerManager (tests/verl_cpu.py:
          a tiny Llama on CPU, greedy) and tests/fault_server.py (the environment, over HTTP)
        → verl's RewardLoopWorker with our custom reward function → rm_scores
    → the DataProto the trainer consumes.

The same rows then go through our local backend (`pipeline.agent.rollout` with `TransformersPolicy` on the
same weights, greedy, the same environment) and the two are compared token for token.

The model: the session's tiny random Llama (real SmolLM2 tokenizer), first taught one Prompt-R1 conversation
(two interaction prompts, then an answer) by a few hundred optimizer steps, so greedy decoding really calls
the environment twice. The second question was never taught: whatever the model writes there is compared too.
Only the worker class runs here, not its Ray actor: `AgentLoopManager` only splits the batch over such
actors (`DataProto.chunk`) and concatenates their outputs.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from fault_server import FaultServer
from verl_cpu import TransformersServerManager, compose_verl, verl_worker_rollout

from pipeline.agent.protocol import ConversationBuilder
from pipeline.config import load_params
from pipeline.stages.build import RL_SCHEMA, rl_row
from pipeline.train.plan import TrainPlan
from pipeline.train.verl.overrides import build_overrides

REPO_ROOT = Path(__file__).resolve().parents[1]
GROUP_SIZE = 2
MAX_TURN_TOKENS = 64
MAX_RESPONSE_TOKENS = 384
MAX_PROMPT_TOKENS = 128

QUESTIONS = [  # (question, gold answers); only the first conversation is taught to the model
    ("What is the capital of France?", ["Paris"]),
    ("Which river flows through Vienna?", ["Danube"]),
]
TAUGHT_TURNS = [
    "The question asks for a capital.</think>\n<interaction_prompt>What is the capital of France?</interaction_prompt>",
    "The reply names a city.</think>\n<interaction_prompt>Is Paris really the capital?</interaction_prompt>",
    "Both replies agree.</think>\n<answer>Paris</answer>",
]

pytestmark = pytest.mark.slow  # teaches a tiny model, runs verl's worker and our rollout (~2 min on a busy 2-core CPU)


def user_message(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Question: {question}\nAnswer with Prompt-R1 tags."}]


@pytest.fixture(scope="module")
def env_server():
    with FaultServer() as server:  # replies "echo: <last user message>"
        yield server


@pytest.fixture(scope="module")
def protocol_model_dir(tiny_llama_dir, tmp_path_factory) -> Path:
    """The tiny Llama after learning TAUGHT_TURNS (with the environment's echo replies) for QUESTIONS[0]."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32)
    builder = ConversationBuilder(tokenizer, env_reply_max_chars=2048)
    ids, agent_positions = builder.start(user_message(QUESTIONS[0][0])), []
    for text in TAUGHT_TURNS:
        agent = tokenizer.encode(text, add_special_tokens=False)
        agent_positions += range(len(ids), len(ids) + len(agent))
        ids += agent
        if "<interaction_prompt>" in text:
            prompt = text.split("<interaction_prompt>")[1].split("</interaction_prompt>")[0]
            ids += builder.env_turn_ids(f"echo: {prompt}", agent)
    sequence, targets = torch.tensor([ids]), torch.tensor(agent_positions)
    torch.manual_seed(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(300):  # ~130 steps; the loss is on the agent's tokens only (the head is the costly part)
        hidden = model.model(input_ids=sequence).last_hidden_state[0, targets - 1]
        nll = torch.nn.functional.cross_entropy(model.lm_head(hidden), sequence[0, targets], reduction="none")
        if nll.max().item() < 0.5:  # every taught token has p > 0.6: greedy reproduces it with a margin
            break
        optimizer.zero_grad()
        nll.mean().backward()
        optimizer.step()
    assert nll.max().item() < 0.5, "the tiny model did not learn the conversation"
    folder = tmp_path_factory.mktemp("protocol_llama")
    model.save_pretrained(str(folder), safe_serialization=True)
    tokenizer.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def params(protocol_model_dir, env_server, tmp_path_factory):
    """The paper profile (backend verl) on the tiny model, greedy, G = 2, pointed at the live environment."""
    rl_dir = tmp_path_factory.mktemp("rl")
    rows = [rl_row(dataset="hotpotqa", content=user_message(q)[0]["content"], task_type="multi-hop",
                   answers=gold, row_id=f"q{i}", split="train", question=q, index=i)
            for i, (q, gold) in enumerate(QUESTIONS)]
    pq.write_table(pa.Table.from_pylist(rows, schema=RL_SCHEMA), rl_dir / "train.parquet")
    return load_params(REPO_ROOT / "params.yaml", {
        "profile": "paper",
        "paths": {"rl_dir": str(rl_dir), "cache_dir": str(rl_dir / "cache")},
        "environment": {"base_url": env_server.url, "served_name": "fault-model", "cache": False,
                        "max_retries": 0, "timeout_s": 10},
        "agent": {"model": str(protocol_model_dir), "temperature": 0.0, "max_turn_tokens": MAX_TURN_TOKENS,
                  "max_response_tokens": MAX_RESPONSE_TOKENS, "max_prompt_tokens": MAX_PROMPT_TOKENS},
        "train": {"group_size": GROUP_SIZE},
    })


@pytest.fixture(scope="module")
def verl_rollout(params, protocol_model_dir):
    """verl's trainer-side batch for one step, from our parquet, through AgentLoopWorker.generate_sequences."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = compose_verl(build_overrides(TrainPlan.from_params(params)))
    tokenizer = AutoTokenizer.from_pretrained(str(protocol_model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(protocol_model_dir), dtype=torch.float32)
    server = TransformersServerManager(model, tokenizer)
    return verl_worker_rollout(config, tokenizer, server, rows=len(QUESTIONS)), server


@pytest.fixture(scope="module")
def local_rollout(params, protocol_model_dir, env_server):
    """Our local backend on the same rows, weights and environment: what `promptr1 train` (local) rolls out."""
    from functools import partial

    from pipeline.agent.policy import TransformersPolicy
    from pipeline.agent.rollout import RolloutSettings, run_rollout
    from pipeline.environment.client import EnvironmentClient
    from pipeline.reward import reward_for_trajectory
    from pipeline.train.local.questions import prompt_item_from_row

    frame = pq.read_table(params.path(params.paths.rl_dir) / "train.parquet").to_pylist()
    items = [prompt_item_from_row(row, i) for i, row in enumerate(frame)]
    policy = TransformersPolicy.from_ref(str(protocol_model_dir), device="cpu")
    return run_rollout(
        policy, EnvironmentClient(params.environment), items, RolloutSettings.greedy(params.agent),
        group_size=GROUP_SIZE, return_logprobs=True, reward_fn=partial(reward_for_trajectory, cfg=params.reward),
    )


def valid(row: torch.Tensor, mask: torch.Tensor) -> list[int]:
    return row[mask.bool()].tolist()


def test_batch_has_the_layout_the_trainer_consumes(verl_rollout):
    out, _ = verl_rollout
    b, p, r = len(QUESTIONS) * GROUP_SIZE, MAX_PROMPT_TOKENS, MAX_RESPONSE_TOKENS
    batch = out.batch
    assert batch["prompts"].shape == (b, p) and batch["responses"].shape == (b, r)
    assert batch["input_ids"].shape == batch["attention_mask"].shape == batch["position_ids"].shape == (b, p + r)
    assert batch["response_mask"].shape == batch["rm_scores"].shape == batch["rollout_log_probs"].shape == (b, r)
    assert torch.equal(batch["input_ids"], torch.cat([batch["prompts"], batch["responses"]], dim=1))
    attention = batch["attention_mask"]
    assert torch.equal(batch["position_ids"], (attention.cumsum(-1) - 1).clamp(min=0))
    for i in range(b):
        prompt_len = int(attention[i, :p].sum())
        response_len = int(attention[i, p:].sum())
        assert attention[i, :p].tolist() == [0] * (p - prompt_len) + [1] * prompt_len  # left-padded prompt
        assert attention[i, p:].tolist() == [1] * response_len + [0] * (r - response_len)  # right-padded response
        assert batch["response_mask"][i, response_len:].sum() == 0  # padding is never trained on
    # item-major groups of n, as GRPO groups them; our extra fields ride along for the reward and dumps
    prompts = [str(list(p)) for p in out.non_tensor_batch["raw_prompt"]]
    assert prompts[0] == prompts[1] != prompts[2] == prompts[3]
    assert out.non_tensor_batch["__num_turns__"].tolist()[:2] == [3, 3]
    assert out.non_tensor_batch["prompt_r1_stop_reason"][0] == "answer"
    assert "score" in out.meta_info["reward_extra_keys"]


def test_multi_turn_trajectory_masks_environment_tokens(verl_rollout, params, env_server):
    out, server = verl_rollout
    tokenizer = server.tokenizer
    attention = out.batch["attention_mask"][0, MAX_PROMPT_TOKENS:]
    response = valid(out.batch["responses"][0], attention)
    mask = valid(out.batch["response_mask"][0], attention)
    builder = ConversationBuilder(tokenizer, params.agent.env_reply_max_chars)
    a1, a2, a3 = (tokenizer.encode(t, add_special_tokens=False) for t in TAUGHT_TURNS)
    e1 = builder.env_turn_ids("echo: What is the capital of France?", a1)
    e2 = builder.env_turn_ids("echo: Is Paris really the capital?", a2)
    assert response == a1 + e1 + a2 + e2 + a3  # the model generated what it learned; the server replied live
    assert mask == [1] * len(a1) + [0] * len(e1) + [1] * len(a2) + [0] * len(e2) + [1] * len(a3)
    assert "<interaction_response>\necho: What is the capital of France?" in tokenizer.decode(e1)
    # mask-0 log-probs are 0.0; agent tokens carry the server's (greedy: close to 0 after learning, but < 0)
    logprobs = valid(out.batch["rollout_log_probs"][0], attention)
    assert all(lp == 0.0 for lp, m in zip(logprobs, mask, strict=True) if not m)
    assert all(lp < 0.0 for lp, m in zip(logprobs, mask, strict=True) if m)
    # the environment was really called: 2 calls per taught trajectory, the second with its history
    bodies = [req.body["messages"] for req in env_server.chat_requests]
    assert any([m["role"] for m in b] == ["system", "user", "assistant", "user"]
               and b[-1]["content"] == "Is Paris really the capital?" for b in bodies)
    assert len({c["request_id"] for c in server.calls}) == len(QUESTIONS) * GROUP_SIZE  # one sticky id each


def test_reward_lands_on_the_last_response_token(verl_rollout, local_rollout):
    out, _ = verl_rollout
    rm = out.batch["rm_scores"]
    attention = out.batch["attention_mask"][:, MAX_PROMPT_TOKENS:]
    last = attention.sum(-1) - 1
    for i, traj in enumerate(local_rollout):
        assert rm[i].nonzero().flatten().tolist() in ([int(last[i])], [])  # one token, or a reward of 0
        assert float(rm[i, last[i]]) == pytest.approx(traj.reward.total)
        assert out.non_tensor_batch["score"][i] == pytest.approx(traj.reward.total)
    # the taught trajectory answered "Paris" after two valid calls: R = F1 = 1 (paper preset), on its
    # final agent token (mask 1)
    assert float(rm[0, last[0]]) == 1.0 and out.batch["response_mask"][0, last[0]] == 1


def test_equal_to_the_local_backend(verl_rollout, local_rollout):
    out, _ = verl_rollout
    batch = out.batch
    p = MAX_PROMPT_TOKENS
    assert len(local_rollout) == len(batch)
    for i, traj in enumerate(local_rollout):
        prompt_attention, response_attention = batch["attention_mask"][i, :p], batch["attention_mask"][i, p:]
        assert valid(batch["prompts"][i], prompt_attention) == traj.prompt_ids
        assert valid(batch["responses"][i], response_attention) == traj.response_ids
        assert valid(batch["response_mask"][i], response_attention) == traj.response_mask
        assert valid(batch["rollout_log_probs"][i], response_attention) == pytest.approx(
            traj.response_logprobs, abs=1e-4)
        assert out.non_tensor_batch["prompt_r1_stop_reason"][i] == traj.stop_reason
        assert int(out.non_tensor_batch["__num_turns__"][i]) == traj.num_turns
        assert out.non_tensor_batch["prompt_r1_turns"][i] == [t.parsed.text for t in traj.turns]
