"""Format warm-up (pipeline.train.local.warmup): demonstrations in the exact protocol
(pipeline.train.local.demonstrations), the supervised loss, and its place in the local trainer (once,
checkpointed, the KL reference).

Fast tests: tiny random Llama (conftest `tiny_llama_dir`) and the fault-injecting test server as a real
HTTP environment (`echo: …` replies). The real SmolLM2 + llama.cpp measurement is benchmarks/bench_train.py.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pandas as pd
import pytest
import torch
from helpers import QUESTIONS, REPO_ROOT, tiny_overrides, write_train_parquet

from pipeline.config import load_params
from pipeline.train import checkpoint as ckpt
from pipeline.train.plan import TrainPlan


def warm_params(tmp_path: Path, model_dir: Path, env_url: str, **warmup):
    overrides = tiny_overrides(tmp_path, model_dir, env_url, warmup={"steps": 2, "batch_size": 2, "lr": 1e-3,
                                                                      "demonstrations": 4, **warmup})
    overrides["agent"].update(max_turns=3, max_turn_tokens=96, max_response_tokens=1024)
    return load_params(REPO_ROOT / "params.yaml", overrides)


def build(params, count: int):
    from pipeline.environment.client import EnvironmentClient
    from pipeline.train.local.demonstrations import build_demonstrations
    from pipeline.train.local.models import load_tokenizer
    from pipeline.train.local.questions import prompt_item_from_row

    frame = pd.read_parquet(params.path(params.paths.rl_dir) / "train.parquet")
    tokenizer = load_tokenizer(params.agent.model, params.root)
    env = EnvironmentClient(params.environment)
    return build_demonstrations(TrainPlan.from_params(params), frame, tokenizer, env, count, prompt_item_from_row), tokenizer, frame


def test_demonstrations_follow_the_protocol_and_earn_the_maximum_reward(tmp_path, tiny_llama_dir, env_server):
    from pipeline.agent.protocol import ConversationBuilder, parse_turn
    from pipeline.config import RewardConfig
    from pipeline.reward import compute_reward, reward_for_trajectory

    write_train_parquet(tmp_path / "data/rl/train.parquet")
    params = warm_params(tmp_path, tiny_llama_dir, env_server, answer="gold")
    demos, tokenizer, _ = build(params, 4)
    assert len(demos) == 4 and len({d.item.uid for d in demos}) == 4
    builder = ConversationBuilder(tokenizer, params.agent.env_reply_max_chars)
    for demo in demos:
        assert demo.prompt_ids == builder.start(demo.item.messages)
        assert len(demo.turns) == params.train.warmup.interaction_turns + 1
        # Mask 1 exactly on the agent's ids, 0 exactly on the builder's environment ids, in rollout order.
        ids, mask = [], []
        for turn in demo.turns:
            ids += turn.agent_token_ids
            mask += [1] * len(turn.agent_token_ids)
            if turn.env_reply is not None:
                assert turn.env_reply.text.startswith("echo:")  # a live reply, not a placeholder
                assert turn.env_token_ids == builder.env_turn_ids(turn.env_reply.text, turn.agent_token_ids)
                ids += turn.env_token_ids
                mask += [0] * len(turn.env_token_ids)
        assert demo.response_ids == ids and demo.response_mask == mask
        assert len(demo.response_mask) == len(demo.response_ids)
        *middle, final = [t.parsed for t in demo.turns]
        assert all(t.valid_intermediate for t in middle)
        assert final.complete_final and final.has_answer_tags and final.answer_nonempty
        assert final.answer == demo.item.gold_answers[0]
        # The rollout parses `<think>\n` + the decoded sampled ids: the demo's ids parse the same way.
        for turn in demo.turns:
            again = parse_turn(builder.think_opener + tokenizer.decode(turn.agent_token_ids))
            assert (again.valid_intermediate, again.complete_final, again.answer) == (
                turn.parsed.valid_intermediate, turn.parsed.complete_final, turn.parsed.answer)
        for preset, eps in (("paper", 1.5), ("released", 1.0)):
            reward = compute_reward([t.parsed for t in demo.turns], demo.item.gold_answers, RewardConfig(preset=preset))
            assert reward.gated and reward.format == eps and reward.answer == 1.0 and reward.total == 1.0
        assert reward_for_trajectory(demo, params.reward).total == 1.0


def test_demonstrations_vary_their_wording_and_respect_budgets(tmp_path, tiny_llama_dir, env_server):
    write_train_parquet(tmp_path / "data/rl/train.parquet")
    params = warm_params(tmp_path, tiny_llama_dir, env_server)
    demos, _, _ = build(params, len(QUESTIONS))
    thinks = {d.turns[0].parsed.think for d in demos}
    assert len(thinks) > 1  # seeded templates, not one string
    again, _, _ = build(params, len(QUESTIONS))
    assert [d.response_ids for d in demos] == [d.response_ids for d in again]  # seeded: reproducible
    for d in demos:
        assert all(len(t.agent_token_ids) <= params.agent.max_turn_tokens for t in d.turns)
    # A gold answer longer than max_answer_tokens keeps the row out; no row fitting is a DataError.
    from pipeline.errors import DataError

    params.train.warmup.max_answer_tokens = 0
    with pytest.raises(DataError, match="warm-up"):
        build(params, 2)


def test_verbatim_request_sends_the_question_alone_and_keeps_the_other_wordings():
    import random

    from pipeline.train.local.demonstrations import FIRST_PROMPT, demo_texts

    question = "Who wrote Dune?"
    framed = [demo_texts(question, "Frank Herbert", 2, random.Random(s)) for s in range(12)]
    verbatim = [demo_texts(question, "Frank Herbert", 2, random.Random(s), "verbatim") for s in range(12)]
    assert {d.prompts[0] for d in verbatim} == {question}
    assert {d.prompts[0] for d in framed} == {p.format(question=question) for p in FIRST_PROMPT}  # all four seen
    for f, v in zip(framed, verbatim, strict=True):  # same draws: thinks, follow-up and final turn unchanged
        assert v.prompts[1] == f.prompts[1] and v.final_turn == f.final_turn
        assert v.interaction_turns[0].split("</think>")[0] == f.interaction_turns[0].split("</think>")[0]
        assert v.interaction_turns[0].endswith(f"<interaction_prompt>{question}</interaction_prompt>")


def test_warmup_loss_decreases_on_the_tiny_model(tmp_path, tiny_llama_dir, env_server):
    from transformers import AutoModelForCausalLM

    from pipeline.environment.client import EnvironmentClient
    from pipeline.train.local.models import load_tokenizer
    from pipeline.train.local.questions import prompt_item_from_row
    from pipeline.train.local.warmup import run_warmup

    write_train_parquet(tmp_path / "data/rl/train.parquet")
    params = warm_params(tmp_path, tiny_llama_dir, env_server, steps=6, demonstrations=2, lr=3e-3)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir))
    tokenizer = load_tokenizer(params.agent.model, params.root)
    frame = pd.read_parquet(tmp_path / "data/rl/train.parquet")
    logged = []
    rows = run_warmup(TrainPlan.from_params(params), model, tokenizer, frame, EnvironmentClient(params.environment), torch.device("cpu"),
                      prompt_item_from_row, log_metrics=lambda m, s: logged.append(s))
    losses = [r["warmup/loss"] for r in rows]
    assert len(rows) == 6 and logged == [1, 2, 3, 4, 5, 6]
    # grad_clip 1.0 bounds each step, so the drop is steady rather than steep
    assert all(b < a for a, b in itertools.pairwise(losses)) and losses[-1] < losses[0] - 1.0, losses
    assert rows[0]["warmup/demonstrations"] == 2 and rows[0]["warmup/env_calls"] == 4


def test_trainer_warms_up_once_and_uses_the_warmed_model_as_reference(tmp_path, tiny_llama_dir, env_server,
                                                                        monkeypatch, caplog):
    from safetensors.torch import load_file

    from pipeline.train.local import warmup as warmup_module
    from pipeline.train.local.backend import train_local

    write_train_parquet(tmp_path / "data/rl/train.parquet")
    params = warm_params(tmp_path, tiny_llama_dir, env_server)
    params.train.steps = 1
    # Killed right after the warm-up (no GRPO step yet): step_0 holds the warmed weights and the flag.
    train_local(TrainPlan.from_params(params), max_steps=0)
    root = tmp_path / "checkpoints/agent"
    state = ckpt.TrainerState.read(ckpt.latest_checkpoint(root))
    assert state.step == 0 and state.warmup_done
    warm = pd.read_csv(tmp_path / "reports/train/warmup.csv")
    assert warm["warmup/step"].tolist() == [1, 2] and "warmup/loss" in warm
    warmed = load_file(str(next((root / "warmup/model").glob("*.safetensors"))))
    step0 = load_file(str(next((root / "step_0/model").glob("*.safetensors"))))
    base = load_file(str(next(Path(tiny_llama_dir).glob("*.safetensors"))))
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(warmed[name], step0[name]) and not torch.equal(warmed[name], base[name])

    # The resumed run goes straight to GRPO (never calls the warm-up) with the warmed KL reference.
    def no_second_warmup(*args, **kwargs):
        raise AssertionError("warm-up repeated")

    monkeypatch.setattr(warmup_module, "run_warmup", no_second_warmup)
    caplog.set_level("INFO", logger="pipeline.train.local.backend")
    metrics = train_local(TrainPlan.from_params(params))
    assert "KL reference: the warmed-up weights" in caplog.text
    assert metrics["actor/num_optimizer_steps"] + metrics["actor/skipped_no_signal"] >= 1  # a GRPO update ran
    state = ckpt.TrainerState.read(ckpt.latest_checkpoint(root))
    assert state.step == 1 and state.warmup_done
    assert pd.read_csv(tmp_path / "reports/train/steps.csv")["step"].tolist() == [1]
    assert pd.read_csv(tmp_path / "reports/train/warmup.csv")["warmup/step"].tolist() == [1, 2]


def test_warmup_with_lora_is_refused(tmp_path, tiny_llama_dir, env_server):
    from pipeline.errors import UserError
    from pipeline.train.local.backend import train_local

    write_train_parquet(tmp_path / "data/rl/train.parquet")
    params = warm_params(tmp_path, tiny_llama_dir, env_server)
    params.train.lora.enabled = True
    with pytest.raises(UserError, match="warmup"):
        train_local(TrainPlan.from_params(params))


def test_paper_profile_turns_the_warmup_off():
    params = load_params(REPO_ROOT / "params.yaml", {"profile": "paper"})
    assert params.train.warmup.steps == 0
    assert load_params(REPO_ROOT / "params.yaml").train.warmup.steps > 0


# ------------------------------------------------------------------------------- answers grounded in replies


def _words(text: str) -> int:
    return len(text.split())


@pytest.mark.parametrize(("replies", "golds", "expected"), [
    (["I believe it is Paris."], ["Paris"], "Paris"),                       # a reply states the gold
    (["Paris, I think.", "Let me check: it is Lyon."], ["Paris"], "Paris"),  # any reply, not only the last
    (["A spider has 18 legs."], ["8", "eight"], "A spider has 18"),        # "8" is not a word of "18"
    (["1. Add the numbers.\n2. Check.\n\nThe answer is: 3"], ["5"], "3"),
    (["Answer: **Mars**"], ["Venus"], "Mars"),
    (["So the final answer is \"William\"."], ["Shakespeare"], "William"),
    (["one two three four five six seven"], ["x"], "one two three four"),   # cut to max_tokens words
    (["", "   \n "], ["x"], ""),                                            # nothing to answer with
])
def test_reply_answer_takes_a_stated_gold_else_the_last_replys_answer(replies, golds, expected):
    from pipeline.train.local.demonstrations import reply_answer

    assert reply_answer(replies, golds, _words, max_tokens=4) == expected


def test_a_stated_gold_longer_than_the_budget_falls_back_to_the_reply():
    from pipeline.train.local.demonstrations import reply_answer

    assert reply_answer(["It was William Shakespeare, the playwright"], ["William Shakespeare"], _words,
                        max_tokens=1) == "It"


def test_answer_source_auto_follows_the_replies():
    from pipeline.train.local.demonstrations import answer_source

    params = load_params(REPO_ROOT / "params.yaml")
    assert params.train.warmup.answer == "auto" and answer_source(params.train.warmup) == "reply"
    learn = load_params(REPO_ROOT / "params.yaml", {"profile": "learn"})
    assert learn.train.warmup.replies == "withheld" and answer_source(learn.train.warmup) == "gold"
    params.train.warmup.answer = "gold"
    assert answer_source(params.train.warmup) == "gold"


def test_live_reply_demonstrations_answer_with_what_the_environment_said(tmp_path, tiny_llama_dir):
    """A real HTTP environment that knows one answer (France → Paris) and says "42" to everything else: the
    demos' answers are the gold where a reply stated it and the reply's answer otherwise, never a gold answer
    the environment did not give (which would teach the agent to make answers up); `answer: gold` keeps the
    gold everywhere; each demo still earns the full format reward."""
    from fault_server import FaultServer

    from pipeline.config import RewardConfig
    from pipeline.metrics import normalize_answer
    from pipeline.reward import compute_reward

    def responder(messages):
        asked = " ".join(str(m["content"]) for m in messages if m["role"] == "user")
        return "I believe it is Paris." if "France" in asked else "1. Think it through.\n\nThe answer is: 42"

    write_train_parquet(tmp_path / "data/rl/train.parquet")
    with FaultServer(responder=responder) as server:
        params = warm_params(tmp_path, tiny_llama_dir, server.url)
        demos, _, _ = build(params, len(QUESTIONS))
        params.train.warmup.answer = "gold"
        gold_demos, _, _ = build(params, len(QUESTIONS))
    assert len(demos) == len(QUESTIONS) == len(gold_demos)
    for demo in demos:
        final = demo.turns[-1].parsed
        replies = " ".join(normalize_answer(t.env_reply.text) for t in demo.turns if t.env_reply is not None)
        assert normalize_answer(final.answer) in replies.split() or normalize_answer(final.answer) in replies
        if "France" in demo.item.question:
            assert final.answer == "Paris" == demo.item.gold_answers[0]
        else:
            assert final.answer == "42" and final.answer not in demo.item.gold_answers
        reward = compute_reward([t.parsed for t in demo.turns], demo.item.gold_answers, RewardConfig(preset="paper"))
        assert reward.gated and reward.format == 1.5
    assert [d.turns[-1].parsed.answer for d in gold_demos] == [d.item.gold_answers[0] for d in gold_demos]
    # The same rows and wording either way: only the answer differs.
    assert [d.turns[0].agent_token_ids for d in demos] == [d.turns[0].agent_token_ids for d in gold_demos]


class _HopsEnvironment:
    """The `hops` knowledge base asked in-process with the server's own reply code (the real rules)."""

    def __init__(self) -> None:
        from pipeline.environment.simulated.knowledge_server import knowledge_base

        self.kb = knowledge_base([], 0.6, "hops")
        self.calls = 0

    async def reply(self, history, prompt):
        from pipeline.evaluation.trivial_rules import ask
        from pipeline.types import EnvironmentReply

        self.calls += 1
        return EnvironmentReply(text=ask(self.kb, prompt, 96))


def test_reask_demonstrations_ask_twice_with_live_replies_on_two_hop_questions(tmp_path, tiny_llama_dir):
    from pipeline.data.sources.synthetic import hops_rows
    from pipeline.environment.simulated.hops_world import world
    from pipeline.metrics import normalize_answer
    from pipeline.stages.build import rl_row
    from pipeline.train.local.demonstrations import build_demonstrations, needed_followup
    from pipeline.train.local.models import load_tokenizer
    from pipeline.train.local.questions import prompt_item_from_row

    records, _ = hops_rows()
    frame = pd.DataFrame([rl_row(dataset="hops", content=f"Question: {r['question']}", task_type="multi_hop_qa",
                                 answers=r["answers"], row_id=r["id"], split="train", question=r["question"],
                                 index=i) for i, r in enumerate(records[:60])])
    params = warm_params(tmp_path, tiny_llama_dir, "http://127.0.0.1:9/v1", interaction_turns=2,
                         replies="environment", answer="reply", request="verbatim", followup="reask",
                         require_followup=True)
    env = _HopsEnvironment()
    demos = build_demonstrations(TrainPlan.from_params(params), frame, load_tokenizer(params.agent.model,
                                 params.root), env, 8, prompt_item_from_row)
    assert len(demos) == 8
    for demo in demos:
        question = world().question(demo.item.question)
        assert question is not None and question.hops == 2  # only questions the second request was needed for
        first, second, final = demo.turns
        assert first.parsed.interaction_prompt == question.text
        assert second.parsed.interaction_prompt.startswith(question.bridge)  # the re-ask names the bridge
        assert question.answer not in first.env_reply.text and question.answer in second.env_reply.text
        assert normalize_answer(final.parsed.answer) == normalize_answer(question.answer)
    # the filter dropped rows: 1-hop questions (the first reply states the answer) and failed re-asks
    assert env.calls > 2 * len(demos)
    assert needed_followup(["X directed Y.", "X was born in Velmora."], ["Velmora"])
    assert not needed_followup(["X was born in Velmora.", "About X I know: father."], ["Velmora"])
    assert not needed_followup(["Velmora.", "Velmora."], ["Velmora"]) and not needed_followup(["Velmora"], ["Velmora"])


@pytest.mark.parametrize(("earned", "ok", "setting"), [
    (5, False, "raise train.warmup.demonstrations"),   # 5 of 96: GRPO would find no reward difference
    (10, True, None),                                   # 10.4%
    (40, True, None),
    (57, True, None),                                   # 59.4%
    (60, False, "lower train.warmup.demonstrations"),   # 62.5%: the warm-up already does the skill
])
def test_warmup_precheck_decides_from_recorded_answer_rewards(earned, ok, setting):
    from pipeline.train.local.warmup import PRECHECK_QUESTIONS, PRECHECK_SAMPLES, warmup_precheck

    samples = PRECHECK_QUESTIONS * PRECHECK_SAMPLES
    assert samples == 96
    rewards = [0.5] * (earned - 1) + [1.0] * (earned > 0) + [0.0] * (samples - earned)
    verdict = warmup_precheck(rewards)
    assert (verdict.ok, verdict.earned, verdict.samples) == (ok, earned, 96)
    assert verdict.share == pytest.approx(earned / 96)
    assert f"{earned} of 96 samples" in verdict.message
    if setting:
        assert setting in verdict.message
    else:
        assert "train.warmup" not in verdict.message


def test_warmup_precheck_bounds_are_inclusive_and_empty_input_is_refused():
    from pipeline.train.local.warmup import warmup_precheck

    assert warmup_precheck([1.0] + [0.0] * 9).ok  # exactly 10%
    assert warmup_precheck([1.0] * 6 + [0.0] * 4).ok  # exactly 60%
    assert not warmup_precheck([1.0] * 7 + [0.0] * 4).ok  # 64%
    with pytest.raises(ValueError, match="no samples"):
        warmup_precheck([])
