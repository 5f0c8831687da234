"""A two-turn trajectory worked by hand, end to end: rollout bookkeeping → reward → advantage → loss → gradient.

One question ("Who wrote the play Hamlet?", gold "William Shakespeare"), a group of G = 2 trajectories that
play the same first turn and differ only in their final answer:

    prompt   <|im_start|>system…<|im_end|>\\n<|im_start|>user\\nQuestion: …<|im_end|>\\n<|im_start|>assistant\\n<think>\\n          (not a response)
    turn 1   I will ask.</think>\\n<interaction_prompt>Who wrote the play Hamlet?</interaction_prompt>   mask 1
    env      <|im_end|>\\n<|im_start|>user\\n<interaction_response>\\n{reply}\\n</interaction_response>
             <|im_end|>\\n<|im_start|>assistant\\n<think>\\n                                            mask 0
    turn 2   It says so.</think>\\n<answer>William Shakespeare</answer>   (trajectory 0)             mask 1
             It says so.</think>\\n<answer>Bob</answer>                (trajectory 1)

The environment is the real knowledgeable server (in a thread, real HTTP) asked by the real EnvironmentClient;
the agent is a scripted policy that returns those texts as SmolLM2 token ids, so every number is known.

By hand, reward preset `released` (0.4 per valid intermediate turn, 0.25 answer tags, 0.25 non-empty answer,
0.1 complete final, cap k = 1.0):
    R_fmt = 0.4·1 + 0.25 + 0.25 + 0.1 = 1.0 = k  → gated in, R = -k + R_fmt + F1
    trajectory 0: F1("William Shakespeare", gold) = 1  → R0 = 1.0
    trajectory 1: F1("Bob", gold) = 0                   → R1 = 0.0
The reward sits on each trajectory's last agent token (the final `</answer>`), nowhere else.
GRPO advantage: mean 0.5, unbiased std sqrt((0.5² + 0.5²) / 1) = 0.70711 → A0 = +0.70711, A1 = -0.70711 on
every agent token, 0 on environment tokens and padding.
Loss (token-mean over the N agent tokens of the batch, on-policy so ratio = 1, no clipping; the low-var-KL
term has zero gradient where policy = reference): L = -(1/N) Σ_i Σ_t A_i·m_it·ratio_it, so
    ∂L/∂logπ(token t of trajectory i) = -A_i·m_it / N:
negative on trajectory 0's agent tokens (a descent step raises their probability), positive on trajectory
1's, exactly 0 on every environment token.
"""

from __future__ import annotations

import math
import threading

import pytest
import torch

from pipeline.agent.policy import Generation
from pipeline.agent.protocol import ConversationBuilder
from pipeline.agent.rollout import RolloutSettings, run_rollout
from pipeline.config import EnvironmentConfig, RewardConfig
from pipeline.environment.client import EnvironmentClient
from pipeline.environment.simulated.knowledge import KnowledgeBase, make_server
from pipeline.reward import reward_for_trajectory
from pipeline.train.local.batch import collate, response_log_probs
from pipeline.train.local.grpo import GRPOObjective, grpo_advantages, grpo_loss, outcome_token_rewards
from pipeline.types import PromptItem

QUESTION, GOLD = "Who wrote the play Hamlet?", "William Shakespeare"
TURN1 = f"I will ask.</think>\n<interaction_prompt>{QUESTION}</interaction_prompt>"
FINALS = ["It says so.</think>\n<answer>William Shakespeare</answer>", "It says so.</think>\n<answer>Bob</answer>"]
A = 0.5 / math.sqrt(0.5)  # 0.70711: (R - mean) / unbiased std of [1, 0]


class TwoTurnAgent:
    """Plays TURN1 for both trajectories, then FINALS[row] (row = position in the group)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.builder = ConversationBuilder(tokenizer)
        self.round = 0

    def generate(self, prompts, max_new_tokens, temperature, top_p, stop, return_logprobs):
        texts = [TURN1] * len(prompts) if self.round == 0 else FINALS[: len(prompts)]
        self.round += 1
        out = []
        for text in texts:
            ids = self.builder.encode(text)
            out.append(Generation(ids, [-1.0] * len(ids) if return_logprobs else None, text, "stop"))
        return out


@pytest.fixture(scope="module")
def knowledge_url():
    server = make_server(KnowledgeBase([(QUESTION, [GOLD])]), "127.0.0.1", 0, "kb")
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def test_two_turn_trajectory_by_hand(tiny_llama_dir, knowledge_url):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    builder = ConversationBuilder(tokenizer)
    env = EnvironmentClient(EnvironmentConfig(model="kb", served_name="kb", base_url=knowledge_url, cache=False,
                                              system_prompt="You are a helpful assistant.", max_retries=0))
    item = PromptItem(uid="hamlet", messages=[{"role": "user", "content": f"Question: {QUESTION}\n"}],
                      gold_answers=[GOLD], data_source="hotpotqa", question=QUESTION)
    reward = RewardConfig(preset="released")
    settings = RolloutSettings(max_turns=5, max_turn_tokens=64, max_response_tokens=512, env_reply_max_chars=2048,
                               temperature=1.0, top_p=1.0)
    trajs = run_rollout(TwoTurnAgent(tokenizer), env, [item], settings, group_size=2, return_logprobs=True,
                        reward_fn=lambda t: reward_for_trajectory(t, reward))

    # --- bookkeeping: response = agent turn 1 | environment turn | agent turn 2, masks 1 | 0 | 1 -----------
    reply = trajs[0].turns[0].env_reply.text
    assert GOLD in reply and reply != GOLD  # the environment embeds the answer in a longer reply
    turn1 = builder.encode(TURN1)
    env_ids = builder.encode("<|im_end|>\n<|im_start|>user\n<interaction_response>\n" + reply
                             + "\n</interaction_response><|im_end|>\n<|im_start|>assistant\n<think>\n")
    assert trajs[0].prompt_ids == builder.encode(  # SmolLM2's template adds its default system message
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        f"<|im_start|>user\nQuestion: {QUESTION}\n<|im_end|>\n<|im_start|>assistant\n<think>\n")
    for traj, final in zip(trajs, FINALS, strict=True):
        final_ids = builder.encode(final)
        assert traj.response_ids == turn1 + env_ids + final_ids
        assert traj.response_mask == [1] * len(turn1) + [0] * len(env_ids) + [1] * len(final_ids)
        assert traj.stop_reason == "answer" and traj.num_turns == 2 and traj.usage.calls == 1

    # --- reward, by hand -------------------------------------------------------------------------------
    r0, r1 = trajs[0].reward, trajs[1].reward
    assert (r0.format, r0.valid_intermediate_turns, r0.answer_tags, r0.answer_nonempty, r0.complete_final) == (
        1.0, 1, 1.0, 1.0, 1.0)
    assert r0.gated and r1.gated
    assert (r0.answer, r0.total) == (1.0, 1.0)
    assert (r1.answer, r1.total) == (0.0, 0.0)

    # --- the token carrying the reward: the last agent token (the final turn's `</answer>`) ----------------
    batch = collate(trajs, pad_id=tokenizer.pad_token_id or 0)
    mask = batch.response_mask
    scores = torch.tensor([r0.total, r1.total])
    assert len(trajs[1].response_ids) < len(trajs[0].response_ids)  # trajectory 1 ends before the padding
    token_rewards = outcome_token_rewards(torch.tensor([1.0, 2.0]), mask)  # non-zero on both rows
    for i, traj in enumerate(trajs):
        last = len(traj.response_ids) - 1
        assert tokenizer.decode(traj.response_ids[last - 1 : last + 1]).endswith("answer>")
        assert token_rewards[i, last] == i + 1.0 and float(token_rewards[i].abs().sum()) == i + 1.0

    # --- advantage: +A / -A on agent tokens, 0 on environment tokens and padding -------------------------
    adv = grpo_advantages(scores, mask, ["q0", "q0"])
    env_cols = slice(len(turn1), len(turn1) + len(env_ids))
    for i, sign in ((0, 1.0), (1, -1.0)):
        n = len(trajs[i].response_ids)
        assert torch.allclose(adv[i, : len(turn1)], torch.full((len(turn1),), sign * A), atol=1e-5)
        assert torch.all(adv[i, env_cols] == 0)
        assert torch.allclose(adv[i, env_cols.stop : n], torch.full((n - env_cols.stop,), sign * A), atol=1e-5)
        assert torch.all(adv[i, n:] == 0)

    # --- loss and per-token gradient sign on the log-probs ---------------------------------------------
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir)).eval()
    log_prob = response_log_probs(model, batch, temperature=1.0).detach().requires_grad_(True)
    objective = GRPOObjective(kl_loss_coef=0.001)
    loss, parts = grpo_loss(log_prob, log_prob.detach(), adv, mask, objective, ref_log_prob=log_prob.detach())
    loss.backward()
    n_agent = float(mask.sum())
    assert n_agent == 2 * len(turn1) + sum(len(builder.encode(f)) for f in FINALS)
    expected = -adv * mask / n_agent
    assert torch.allclose(log_prob.grad, expected, atol=1e-7)
    assert torch.all(log_prob.grad[0][mask[0].bool()] < 0) and torch.all(log_prob.grad[1][mask[1].bool()] > 0)
    assert torch.all(log_prob.grad[mask == 0] == 0)
    # On-policy, the loss value is -(1/N) Σ A·m = -(A·n0 - A·n1) / N, and the KL part is 0.
    n0, n1 = float(mask[0].sum()), float(mask[1].sum())
    assert parts["actor/pg_loss"] == pytest.approx(-(A * n0 - A * n1) / n_agent, abs=1e-5)
    assert parts["actor/kl_loss"] == pytest.approx(0.0, abs=1e-7)
