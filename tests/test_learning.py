"""GRPO moves the policy the right way, in CI: the whole local loop against a live environment, checked on what
one update does to the trajectories it learned from, and shown to fail when the update is deliberately broken.

Setup (all real: the local backend's rollout and update (`LocalTrainer`), the `released` reward, verl's GRPO
functions, the knowledgeable environment server as a process on 127.0.0.1, started by the launcher registry):
- the agent is a tiny randomly initialised Llama (conftest `tiny_llama_dir`: 2 layers, hidden 64, the SmolLM2
  tokenizer and chat template) after the pipeline's own format warm-up, deliberately short (`WARMUP_STEPS`),
  so that at temperature 1 it writes the Prompt-R1 protocol only part of the time: groups whose trajectories
  earn different rewards, i.e. a GRPO signal;
- the task: twelve questions whose answers only the environment knows, one interaction turn, then the answer.

The check (`direction`): run ONE `LocalTrainer.step()` (the default profile's code: it draws every question,
rolls each out G times, scores, groups, computes advantages and updates through the shared-prompt forward),
then re-measure each of its trajectories' log-likelihood (sum over its agent tokens) before (a copy of the
pre-step weights) and after. The advantages judged against are recomputed by the test from each trajectory's
`reward.total` and question (`item.uid`), independently of `step()`'s wiring. A correct policy-gradient step
raises the likelihood of above-average trajectories and lowers the others, so the correlation between a
trajectory's advantage and its likelihood change must be strongly positive (`MIN_CORRELATION`). This exercises
what a reward curve would (sampling across turns, the masks, which score is used, the grouping, advantages, the
loss, the optimizer step, the reference/KL term) without a curve's noise. Besides the direction, the groups
`step()` hands verl's advantage function must each hold one question's trajectories (`grouped_by_question`).
Measured through `step()` (one seed, 48 trajectories, lr 5e-4, the shared-prompt forward), on a 2-core
AVX-512 host, the same in five runs of this file: intact 0.82 (full) and 0.82 (LoRA); advantage sign flipped
-0.78; log-probs read one position late inside the shared-prompt forward -0.47; trajectories grouped across
questions 0.84 (caught by `grouped_by_question` only). Another host sampled another batch: intact 0.72 and
0.76, flipped -0.71, late 0.17, grouped across questions 0.13. Earlier, through `update()`
alone: intact 0.80, flipped -0.61, late 0.33, response mask shifted right by one token 0.79.

Broken variants (`BROKEN`), injected into the code `step()` runs, must FAIL the check:
- `advantage_sign`: advantages negated (the policy is pushed away from better trajectories);
- `logprob_shift`: inside the real shared-prompt forward (`batch.shared_prompt_log_probs`, the default
  `train.share_prompt_forward`), each response token's log-prob read from the logits one position late (the
  classic off-by-one between logits and labels), by handing that function a policy whose response-position
  logits come one position late;
- `interleaved_groups`: `step()`'s grouping broken, trajectory i put in group i % G, so each group mixes G
  questions.
Wrong KL sign or direction, missing clipping and a sequence-mean loss are pinned by the hand-worked loss
example in tests/test_train_grpo.py (each injected there changes a figure it pins).
A response mask shifted by one token is NOT visible to any learning check (measured 0.79: it drops the first
token of each agent turn from the loss and adds one template token, which barely changes the gradient); the
exact mask, the token that carries the reward and the per-token gradient sign are pinned by hand in
tests/test_multiturn_worked_example.py instead.

Why not a reward curve (the issue's first wording): measured on this model, the per-step mean reward does not
rise within the steps CI can afford, and the cause is the tiny random model, not the update (whose direction
this module checks). With all 12 questions every step (48 trajectories) the reward fell from -0.29 to -0.49
over 12 steps at lr 1e-3 (format rate 0.60 -> 0.30: garbled tags, mostly a first turn that no longer holds a
call) and stayed flat at lr 5e-4; with 8 trajectories per step the step means are dominated by which questions
were drawn. A policy-gradient step raises the surrogate on its own samples (checked here), but on a 2-layer
random model with a 49k vocabulary and Adam (which moves every touched weight by about lr per step, noise
included) the step also moves the tied embedding rows of every junk token sampled at temperature 1, and those
moves, not the signal, decide the next samples. The reward curve on the real SmolLM2 agent is the learning
experiment (`benchmarks/bench_learning.py`, `benchmarks/results/learning.json`).
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest
import torch
from demo_project import free_port
from helpers import environment_client, knowledge_server_overrides, server_spec, write_train_parquet

from pipeline.config import load_params
from pipeline.environment.servers import serve_environment
from pipeline.train.plan import TrainPlan

pytestmark = pytest.mark.slow
_ROOT = Path(__file__).resolve().parents[1]

WARMUP_STEPS = 80
WARMUP_LR = 1e-2
WARMUP_BATCH = 8
TEMPERATURE = 1.0
WARMUP_DEMOS = 2
GROUP = 4
LR = {"full": 5e-4, "lora": 2e-3}
MIN_CORRELATION = 0.5

TASK = [(f"What is the code word of locker {n}?", [word]) for n, word in enumerate(
    ["apple", "river", "stone", "cloud", "tiger", "maple", "ocean", "piano", "lemon", "eagle", "candle", "violet"],
    start=1)]


def _train_parquet(path):
    return write_train_parquet(path, TASK, data_source="learning_task", id_prefix="task",
                               instruction="Ask the large language model, then answer in <answer></answer>.")


def _params(folder, model_dir, url, **train):
    overrides = {
        "paths": {"rl_dir": str(folder / "data/rl"), "checkpoint_dir": str(folder / "checkpoints"),
                  "reports_dir": str(folder / "reports"), "cache_dir": str(folder / "cache")},
        "agent": {"model": str(model_dir), "temperature": TEMPERATURE, "max_turns": 2, "max_turn_tokens": 48, "max_response_tokens": 160,
                  "max_prompt_tokens": 256},
        "environment": {"backend": "knowledge", "model": "knowledge", "served_name": "knowledge", "base_url": url,
                        "cache": False, "max_retries": 0, "timeout_s": 10.0, "max_tokens": 64},
        "reward": {"preset": "released"},
        "train": {"steps": 1, "batch_size": len(TASK), "group_size": GROUP, "mini_batch_size": len(TASK),
                  "micro_batch_size": len(TASK) * GROUP, "lr": LR["full"], "save_every": 1, "keep_checkpoints": 1,
                  "warmup": {"steps": 0}, **train},
        "mlflow": {"tracking_uri": f"sqlite:///{folder / 'mlflow.db'}", "artifact_root": str(folder / "mlartifacts")},
    }
    return load_params(_ROOT / "params.yaml", overrides)


@pytest.fixture(scope="module")
def knowledge_url(tmp_path_factory):
    """The knowledgeable environment as a real server process, for the module."""
    folder = tmp_path_factory.mktemp("knowledge_env")
    params = load_params(_ROOT / "params.yaml", knowledge_server_overrides(folder, TASK, free_port()))
    with serve_environment(server_spec(params)) as url:
        yield url


@pytest.fixture(scope="module")
def format_aware_model(tiny_llama_dir, knowledge_url, tmp_path_factory):
    """The tiny model after the pipeline's (short) format warm-up: a HF directory to start GRPO from."""
    from pipeline.train.local.backend import WARMUP_DIR, train_local

    folder = tmp_path_factory.mktemp("warm")
    _train_parquet(folder / "data/rl/train.parquet")
    params = _params(folder, tiny_llama_dir, knowledge_url,
                     warmup={"steps": WARMUP_STEPS, "batch_size": WARMUP_BATCH, "lr": WARMUP_LR, "demonstrations": WARMUP_DEMOS,
                             "interaction_turns": 1, "max_answer_tokens": 8})
    train_local(TrainPlan.from_params(params), max_steps=0)  # the warm-up only
    model_dir = folder / "checkpoints" / WARMUP_DIR / "model"
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (tiny_llama_dir / name).is_file():
            shutil.copy(tiny_llama_dir / name, model_dir / name)
    return model_dir


def direction(model_dir, url, folder, lora: bool, seed: int = 1) -> dict[str, float]:
    """One GRPO step (`LocalTrainer.step`: its draw, rollout, scores, grouping, advantages and update) on every
    question x GROUP; how it moved each trajectory's likelihood.

    The advantages judged against are computed HERE, independently of `step()`'s wiring: each trajectory's
    `reward.total` normalised within the trajectories of the same question (`item.uid`), so a step that
    groups or scores wrongly moves the policy in a direction that disagrees with them. Returns `correlation`
    (Pearson, advantage vs change of the summed agent-token log-prob, over trajectories with a non-zero
    advantage), `surrogate` (sum of advantage x likelihood change: the first-order change of the policy-gradient
    objective on these samples), and `n` (trajectories with a non-zero advantage). The likelihoods are measured
    with the intact collate and padded forward, before (a copy of the pre-step weights) and after the step.
    """
    import copy

    import numpy as np

    from pipeline.train.local import trainer as trainer_module
    from pipeline.train.local.batch import collate, response_log_probs
    from pipeline.train.local.grpo import grpo_advantages as intact_advantages
    from pipeline.train.local.models import load_policy_models
    from pipeline.train.local.questions import QuestionSampler, load_training_set

    _train_parquet(folder / "data/rl/train.parquet")
    params = _params(folder, model_dir, url, lora={"enabled": lora, "r": 8, "alpha": 16,
                                                     "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj",
                                                                        "gate_proj", "up_proj", "down_proj"]})
    params.seed = seed
    params.train.lr = LR["lora" if lora else "full"]
    assert params.train.shares_prompts, "the default profile's update reads each prompt once: test that forward"
    torch.manual_seed(seed)
    device = torch.device("cpu")
    plan = TrainPlan.from_params(params)
    models = load_policy_models(plan.require_agent_model(), plan.agent, plan.train, None, device)
    frame = load_training_set(plan.train_file)
    trainer = trainer_module.LocalTrainer(plan, models, frame, device, QuestionSampler(len(frame), seed))
    trainer.reference_is_policy = True  # a fresh run, as pipeline.train.local.backend sets it
    before_model = copy.deepcopy(models.model).eval()
    env = environment_client(params)
    handed: list[list[str]] = []  # the group ids verl's advantage function got from step()
    advantage_fn = trainer_module.grpo_advantages
    trainer_module.grpo_advantages = lambda s, m, ids, *a, **k: handed.append(list(ids)) or advantage_fn(s, m, ids, *a, **k)
    try:
        trainer.step(env, step=1)
    finally:
        trainer_module.grpo_advantages = advantage_fn
        asyncio.run(env.aclose())
    trajectories = trainer.last_trajectories
    assert len(trajectories) == len(TASK) * GROUP
    scores = torch.tensor([t.reward.total for t in trajectories], dtype=torch.float32)
    mask = torch.zeros((len(trajectories), max(len(t.response_ids) for t in trajectories)))
    for i, t in enumerate(trajectories):
        mask[i, : len(t.response_mask)] = torch.tensor(t.response_mask, dtype=torch.float32)
    advantages = intact_advantages(scores, mask, [t.item.uid for t in trajectories])
    pad_id = models.tokenizer.pad_token_id

    def likelihoods(model) -> torch.Tensor:
        batch = collate(trajectories, pad_id)
        with torch.no_grad():
            return (response_log_probs(model, batch, trainer.temperature) * batch.response_mask).sum(-1)

    change = likelihoods(models.model) - likelihoods(before_model)
    per_trajectory = advantages.sum(-1) / mask.sum(-1).clamp(min=1)  # the advantage, constant over its tokens
    signal = per_trajectory != 0
    assert int(signal.sum()) >= 8, f"too few trajectories with a GRPO signal to judge: {int(signal.sum())}"
    correlation = float(np.corrcoef(per_trajectory[signal].numpy(), change[signal].numpy())[0, 1])
    # GRPO compares a trajectory with the others of its own question: every group handed to the advantage
    # function must hold the G trajectories of one question (an exact check, whatever the batch sampled).
    members: dict[str, set[str]] = {}
    for ids in handed:
        for group, t in zip(ids, trajectories, strict=True):
            members.setdefault(group, set()).add(t.item.uid)
    by_question = bool(handed) and all(len(uids) == 1 for uids in members.values())
    return {"correlation": correlation, "surrogate": float((per_trajectory * change).sum()),
            "n": int(signal.sum()), "reward_mean": float(scores.mean()), "grouped_by_question": by_question}


def judged_right(stats: dict) -> bool:
    """The step moved the policy toward its better trajectories, judged within each trajectory's own question."""
    return stats["grouped_by_question"] and stats["correlation"] > MIN_CORRELATION and stats["surrogate"] > 0


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_one_update_moves_the_policy_toward_better_trajectories(format_aware_model, knowledge_url, tmp_path, lora):
    stats = direction(format_aware_model, knowledge_url, tmp_path, lora)
    print(f"intact ({'lora' if lora else 'full'}): {stats}")
    assert judged_right(stats), f"wrong direction: {stats}"


def _negated_advantages(original):
    def broken(*args, **kwargs):
        return -original(*args, **kwargs)

    return broken


def _interleaved_groups(original):
    """step()'s grouping broken: trajectory i put in group i % G (every group mixes G questions)."""
    def broken(scores, mask, group_ids, *args, **kwargs):
        g = len(group_ids) // len(set(group_ids))
        return original(scores, mask, [f"q{i % g}" for i in range(len(group_ids))], *args, **kwargs)

    return broken


class _LateLogits(torch.nn.Module):
    """The policy as the shared-prompt forward sees it, with the off-by-one bug inside that forward: where it
    asks for the logits at response positions j-1 (which predict token j) it gets those at j (one late)."""

    def __init__(self, model):
        super().__init__()
        self.inner = model

    def forward(self, input_ids, logits_to_keep=0, **kwargs):
        if torch.is_tensor(logits_to_keep):
            logits_to_keep = (logits_to_keep + 1).clamp(max=input_ids.shape[1] - 1)
        return self.inner(input_ids=input_ids, logits_to_keep=logits_to_keep, **kwargs)


def _late_shared_prompt(original):
    def broken(model, batch, temperature, entropy=None):
        return original(_LateLogits(model), batch, temperature, entropy)

    return broken


BROKEN = [
    "advantage_sign",
    "logprob_shift",
    # The likelihood direction alone does not see this one: on this task the scores vary with the format far
    # more than with the question, so a step that compares copies across questions still moves the policy much
    # as the intact one does (correlation 0.84 on one host, below 0.5 on another). The groups step() hands the
    # advantage function are checked exactly instead (`grouped_by_question`).
    "interleaved_groups",
]


@pytest.mark.parametrize("variant", BROKEN)
def test_broken_update_fails_the_direction_check(format_aware_model, knowledge_url, tmp_path, monkeypatch, variant):
    from pipeline.train.local import trainer

    if variant == "advantage_sign":
        monkeypatch.setattr(trainer, "grpo_advantages", _negated_advantages(trainer.grpo_advantages))
    elif variant == "interleaved_groups":  # the groups step() hands its advantages (and its flat-group rule)
        monkeypatch.setattr(trainer, "step_advantages", _interleaved_groups(trainer.step_advantages))
    else:  # the real shared-prompt forward (the default profile's: train.share_prompt_forward), broken inside
        monkeypatch.setattr(trainer, "shared_prompt_log_probs", _late_shared_prompt(trainer.shared_prompt_log_probs))
    stats = direction(format_aware_model, knowledge_url, tmp_path, lora=False)
    print(f"{variant}: {stats}")
    assert not judged_right(stats), f"the {variant} variant passed the direction check: {stats}"
