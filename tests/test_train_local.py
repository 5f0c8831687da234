"""The local GRPO backend: batching/log-probs, data position, checkpoints, resume after a kill, the stage.

Fast tests use a tiny random Llama (conftest `tiny_llama_dir`) and the fault-injecting OpenAI-compatible
test server as the environment (a real HTTP server answering `echo: …`). The slow tests run the real
SmolLM2-135M-Instruct agent against the real llama.cpp environment, and kill a real training process.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml
from helpers import REPO_ROOT, tiny_overrides, write_train_parquet

from pipeline.config import load_params
from pipeline.train import checkpoint as ckpt
from pipeline.train.local.batch import collate, response_log_probs
from pipeline.train.local.questions import QuestionSampler
from pipeline.train.local.step_metrics import StepsLog
from pipeline.train.plan import TrainPlan
from pipeline.types import PromptItem, Trajectory


def make_traj(prompt: list[int], response: list[int], mask: list[int]) -> Trajectory:
    item = PromptItem(uid="u", messages=[], gold_answers=[], data_source="x")
    return Trajectory(item=item, prompt_ids=prompt, response_ids=response, response_mask=mask)


# ------------------------------------------------------------------------------------------------ unit


def test_collate_left_pads_prompts_right_pads_responses():
    a = make_traj([1, 2, 3], [4, 5], [1, 0])
    b = make_traj([6], [7, 8, 9], [1, 1, 1])
    batch = collate([a, b], pad_id=0)
    assert batch.input_ids.tolist() == [[1, 2, 3, 4, 5, 0], [0, 0, 6, 7, 8, 9]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4, 4], [0, 0, 0, 1, 2, 3]]
    assert batch.responses.tolist() == [[4, 5, 0], [7, 8, 9]]
    assert batch.response_mask.tolist() == [[1, 0, 0], [1, 1, 1]]
    assert batch.num_tokens == 9


def test_response_log_probs_match_unpadded_forward(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir)).eval()
    a = make_traj([11, 12, 13, 14], [15, 16], [1, 1])
    b = make_traj([21, 22], [23, 24, 25, 26], [1, 0, 1, 1])
    batch = collate([a, b], pad_id=0)
    with torch.no_grad():
        padded = response_log_probs(model, batch, temperature=1.0)
        for row, t in enumerate((a, b)):
            ids = torch.tensor([t.prompt_ids + t.response_ids])
            logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
            alone = logp[len(t.prompt_ids) - 1:].gather(-1, ids[0, len(t.prompt_ids):, None]).squeeze(-1)
            assert torch.allclose(padded[row, : len(t.response_ids)], alone, atol=1e-5)


def test_sampler_is_seeded_resumable_and_wraps_epochs():
    s = QuestionSampler(5, seed=3)
    first = s.next_batch(3) + s.next_batch(3)
    assert sorted(first[:5]) == [0, 1, 2, 3, 4] and s.epoch == 1 and s.position == 1
    resumed = QuestionSampler(5, seed=3, epoch=0, position=3)
    again = QuestionSampler(5, seed=3)
    again.next_batch(3)
    assert resumed.next_batch(4) == again.next_batch(4)


def test_steps_log_drops_rows_after_the_resumed_checkpoint(tmp_path):
    path = tmp_path / "steps.csv"
    log = StepsLog(path, keep_upto=0)
    for step in (1, 2, 3):
        log.append(step, {"critic/score/mean": float(step)})
    resumed = StepsLog(path, keep_upto=2)
    resumed.append(3, {"critic/score/mean": 30.0})
    frame = pd.read_csv(path)
    assert frame["step"].tolist() == [1, 2, 3] and frame["critic/score/mean"].tolist() == [1.0, 2.0, 30.0]


def test_checkpoint_is_atomic_and_pruned(tmp_path):
    def weights(folder: Path) -> None:
        (folder / "model").mkdir()
        (folder / "model" / "w.txt").write_text("w")

    for step in (1, 2, 3):
        ckpt.save_checkpoint(tmp_path, ckpt.TrainerState(step=step, position=step), weights, None, keep=2)
    assert ckpt.complete_steps(tmp_path) == [2, 3]
    assert (tmp_path / "latest").read_text() == "step_3"
    # A half-written folder from a killed save is ignored and cleaned at the next save.
    (tmp_path / ".tmp-step_4-dead").mkdir()
    (tmp_path / "step_4").mkdir()  # no trainer_state.json: incomplete
    assert ckpt.latest_checkpoint(tmp_path) == tmp_path / "step_3"
    ckpt.save_checkpoint(tmp_path, ckpt.TrainerState(step=4), weights, None, keep=2)
    assert not list(tmp_path.glob(".tmp-*")) and ckpt.TrainerState.read(tmp_path / "step_4").step == 4


# ------------------------------------------------------------------------------------------------ trainer


def _metrics_rows(path: Path) -> pd.DataFrame:
    return pd.read_csv(path)


def test_tiny_training_logs_checkpoints_and_resumes_in_process(tmp_path, tiny_llama_dir, env_server):
    import mlflow

    from pipeline.stages.train import run_train

    write_train_parquet(tmp_path / "data/rl/train.parquet")
    params = load_params(REPO_ROOT / "params.yaml", tiny_overrides(tmp_path, tiny_llama_dir, env_server))
    run_train(params)

    steps = _metrics_rows(tmp_path / "reports/train/steps.csv")
    assert steps["step"].tolist() == [1, 2]
    for name in ("critic/score/mean", "critic/score/min", "critic/score/max", "critic/advantages/mean",
                 "actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/lr", "response_length/mean",
                 "num_turns/mean", "reward/format/mean", "reward/answer/mean", "reward/complete_final/mean",
                 "env/calls", "env/errors", "env/failure_rate", "env/truncated", "env/empty_after_length", "env/cost_usd", "timing_s/gen", "timing_s/env",
                 "timing_s/update", "timing_s/step"):
        assert name in steps.columns, name
    # A random tiny model never hits the format, so all rewards tie (advantage 0): both mini-batches of each
    # step carry no signal and take no optimizer step (see the update tests below), logged to steps.csv and
    # MLflow; the KL was not measured (no forward ran).
    assert steps["actor/grad_norm"].eq(0).all() and steps["critic/score/mean"].eq(-1.5).all()
    assert steps["critic/advantages/max"].eq(0).all() and steps["critic/advantages/min"].eq(0).all()
    assert steps["actor/num_optimizer_steps"].eq(0).all() and steps["actor/skipped_no_signal"].eq(2).all()
    assert steps["actor/kl_loss"].isna().all()
    state = ckpt.TrainerState.read(ckpt.latest_checkpoint(tmp_path / "checkpoints/agent"))
    assert state.step == 2 and state.position == 4
    # what the agent wrote: one JSON line per trajectory (batch 2 x group 2 per step), with turns and reward
    lines = [json.loads(x) for x in (tmp_path / "reports/train/trajectories.jsonl").read_text().splitlines()]
    assert [rec["step"] for rec in lines] == [1, 1, 1, 1, 2, 2, 2, 2]
    assert all(rec["turns"] and rec["reward"]["total"] == -1.5 and rec["gold_answers"] for rec in lines)
    assert (tmp_path / "checkpoints/agent/step_2/model").is_dir()
    assert (tmp_path / "checkpoints/agent/step_2/optimizer.pt").is_file()

    run_file = json.loads((tmp_path / "reports/mlflow_run.json").read_text())
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    client = mlflow.MlflowClient()
    child = client.search_runs([client.get_run(run_file["run_id"]).info.experiment_id],
                               f"tags.mlflow.parentRunId = '{run_file['run_id']}'")[0]
    history = client.get_metric_history(child.info.run_id, "critic/score/mean")
    assert sorted(m.step for m in history) == [1, 2]
    skips = client.get_metric_history(child.info.run_id, "actor/skipped_no_signal")
    assert sorted((m.step, m.value) for m in skips) == [(1, 2.0), (2, 2.0)]
    # the reward under its own name (verl's critic/score/mean stays as an alias), on the run and in steps.csv
    assert steps["reward/mean"].tolist() == steps["critic/score/mean"].tolist()
    assert sorted(m.step for m in client.get_metric_history(child.info.run_id, "reward/mean")) == [1, 2]
    # the train run logs its params and its input; the parent gets the last step's reward
    assert child.data.params["train.steps"] == "2" and child.data.params["agent.model"] == str(tiny_llama_dir)
    (train_input,) = child.inputs.dataset_inputs
    assert train_input.dataset.name == "train" and {t.key for t in train_input.tags} >= {"dvc.md5"}
    parent = client.get_run(run_file["run_id"])
    assert parent.data.metrics["reward/last_step_mean"] == steps["reward/mean"].iloc[-1]
    assert parent.data.params["git_commit"] and parent.data.params["train.group_size"]

    # Done: a rerun is a no-op that leaves the outputs in place.
    before = (tmp_path / "reports/train/steps.csv").read_text()
    run_train(params)
    assert (tmp_path / "reports/train/steps.csv").read_text() == before

    # More steps requested: resumes from step 2 and continues the same curve.
    more = load_params(REPO_ROOT / "params.yaml", tiny_overrides(tmp_path, tiny_llama_dir, env_server, steps=3))
    run_train(more)
    steps = _metrics_rows(tmp_path / "reports/train/steps.csv")
    assert steps["step"].tolist() == [1, 2, 3]
    lines = (tmp_path / "reports/train/trajectories.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1] * 4 + [2] * 4 + [3] * 4
    assert ckpt.TrainerState.read(ckpt.latest_checkpoint(tmp_path / "checkpoints/agent")).position == 6


@pytest.mark.parametrize("autocast", [None, "bfloat16"], ids=["float32", "bf16-autocast"])
def test_update_moves_the_policy_towards_the_better_trajectory(tiny_llama_dir, params, autocast):
    """GRPO on a hand-made group: the rewarded response gains log-prob, the other loses it; env tokens
    (mask 0) between them do not enter the loss. Also under `train.autocast: bfloat16` (weights stay float32)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.train.local.grpo import grpo_advantages
    from pipeline.train.local.models import PolicyModels
    from pipeline.train.local.trainer import LocalTrainer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir))
    reference = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir)).eval().requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    models = PolicyModels(model=model, reference=reference, tokenizer=tokenizer, lora=False)
    params.train.lr, params.train.mini_batch_size, params.train.group_size = 1e-2, 1, 2
    params.train.autocast = autocast
    trainer = LocalTrainer(TrainPlan.from_params(params), models, pd.DataFrame(), torch.device("cpu"), QuestionSampler(1, 0))
    good = make_traj([5, 6, 7], [100, 101, 900, 901, 102], [1, 1, 0, 0, 1])
    bad = make_traj([5, 6, 7], [200, 201, 202], [1, 1, 1])
    batch = collate([good, bad], tokenizer.pad_token_id)
    with torch.no_grad():
        before = response_log_probs(model, batch, 1.0)
    mask = batch.response_mask
    adv = grpo_advantages(torch.tensor([1.0, 0.0]), mask, ["q", "q"])
    for _ in range(3):
        result = trainer.update([good, bad], adv)
    with torch.no_grad():
        after = response_log_probs(model, batch, 1.0)
    gain = ((after - before) * mask).sum(-1)
    assert gain[0] > 0 > gain[1]
    assert result.metrics["actor/grad_norm"] > 0 and result.metrics["actor/kl_loss"] > 0
    assert result.tokens == (3 + 5) + (3 + 3)  # non-padding tokens of one pass
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_a_mini_batch_without_signal_leaves_weights_and_optimizer_bit_identical(tiny_llama_dir, params):
    """After a real step AdamW holds momentum: stepping on a batch whose advantages are all zero would still move
    every weight (~0.9x the last update) and the KL term's gradient would enter the moments. The update skips
    such a mini-batch: weights and optimizer state stay bit-identical, `actor/skipped_no_signal` counts it; a
    batch with signal still moves them, and in a mixed step only the mini-batch with signal steps."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.train.local.grpo import grpo_advantages
    from pipeline.train.local.models import PolicyModels
    from pipeline.train.local.trainer import LocalTrainer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir))
    reference = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir)).eval().requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    models = PolicyModels(model=model, reference=reference, tokenizer=tokenizer, lora=False)
    params.train.lr, params.train.mini_batch_size, params.train.group_size = 1e-2, 1, 2
    params.train.kl_loss_coef = 0.5
    trainer = LocalTrainer(TrainPlan.from_params(params), models, pd.DataFrame(), torch.device("cpu"),
                           QuestionSampler(2, 0))
    good = make_traj([5, 6, 7], [100, 101, 900, 901, 102], [1, 1, 0, 0, 1])
    bad = make_traj([5, 6, 7], [200, 201, 202], [1, 1, 1])
    mask = collate([good, bad], tokenizer.pad_token_id).response_mask
    signal = grpo_advantages(torch.tensor([1.0, 0.0]), mask, ["q", "q"])
    flat = torch.zeros_like(signal)

    def snapshot():
        state = trainer.optimizer.state_dict()["state"]
        return ({k: v.clone() for k, v in model.state_dict().items()},
                {i: {k: v.clone() for k, v in s.items()} for i, s in state.items()})

    def same(a, b) -> bool:
        return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    initial, _ = snapshot()
    first = trainer.update([good, bad], signal).metrics
    assert first["actor/num_optimizer_steps"] == 1 and first["actor/skipped_no_signal"] == 0
    weights, moments = snapshot()
    assert not same(initial, weights) and moments  # a real step: weights moved, AdamW has momentum

    skipped = trainer.update([good, bad], flat).metrics
    after_weights, after_moments = snapshot()
    assert same(weights, after_weights)
    assert after_moments.keys() == moments.keys() and all(same(moments[i], after_moments[i]) for i in moments)
    assert skipped["actor/skipped_no_signal"] == 1 and skipped["actor/num_optimizer_steps"] == 0
    assert skipped["actor/grad_norm"] == 0.0 and skipped["actor/pg_loss"] == 0.0
    assert math.isnan(skipped["actor/kl_loss"])  # not measured, not 0: the health gate's KL mean ignores it

    again = trainer.update([good, bad], signal).metrics
    assert again["actor/num_optimizer_steps"] == 1 and not same(weights, snapshot()[0])

    # two questions, two mini-batches: the flat one is skipped, the other steps
    c, d = make_traj([8, 9], [300, 301], [1, 1]), make_traj([8, 9], [400, 401], [1, 1])
    mixed_mask = collate([good, bad, c, d], tokenizer.pad_token_id).response_mask
    mixed = grpo_advantages(torch.tensor([1.0, 0.0, 0.5, 0.5]), mixed_mask, ["q", "q", "r", "r"])
    result = trainer.update([good, bad, c, d], mixed).metrics
    assert result["actor/num_optimizer_steps"] == 1 and result["actor/skipped_no_signal"] == 1
    assert result["actor/kl_loss"] > 0


def test_flat_groups_get_exactly_zero_advantage():
    """At G = 5 (the paper's) verl's float32 group mean of five equal scores 0.4 + 0.25/3 (a partial answer F1) is
    an ulp off while their std is 0, so verl's advantage is +-0.029 of pure noise; the step zeroes such groups,
    so the update sees no signal there, and leaves every other group's advantages as verl computes them."""
    from pipeline.train.local.grpo import grpo_advantages
    from pipeline.train.local.trainer import step_advantages

    flat = 0.4 + 0.25 / 3
    scores = torch.tensor([flat] * 5 + [1.0, 0.0, flat, flat, 0.65])
    mask = torch.ones((10, 3))
    groups = ["a"] * 5 + ["b"] * 5
    verl = grpo_advantages(scores, mask, groups)
    ours = step_advantages(scores, mask, groups)
    assert verl[:5].abs().max() == pytest.approx(0.0288, abs=1e-3)  # verl's noise on the flat group
    assert torch.equal(ours[:5], torch.zeros((5, 3)))
    assert torch.equal(ours[5:], verl[5:]) and ours[5:].abs().max() > 0.5


@pytest.mark.parametrize("ppo_epochs", [1, 2])
def test_fresh_runs_first_update_takes_the_reference_from_the_policy_exactly(tiny_llama_dir, params, ppo_epochs):
    """`reference_is_policy` (a fresh run, before any optimizer step): the reference forward is skipped and
    the update is the one the reference model gives: losses, KL, gradient norm and the weights after two
    updates over two mini-batches (the second mini-batch takes its reference from old_log_prob). Equal up
    to float32 rounding, not to the bit: two model objects with the same weights give log-probs that differ
    by ~1e-6 (measured: 9.5e-7 on the second mini-batch), the policy's own forward does not differ from
    itself. The second update runs the reference forward again (the policy has moved)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.train.local.grpo import grpo_advantages
    from pipeline.train.local.models import PolicyModels
    from pipeline.train.local.trainer import LocalTrainer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    params.train.lr, params.train.mini_batch_size, params.train.group_size = 1e-2, 1, 2
    params.train.ppo_epochs, params.train.kl_loss_coef = ppo_epochs, 0.5
    trajs = [make_traj([5, 6, 7], [100, 101, 900, 901, 102], [1, 1, 0, 0, 1]),
             make_traj([5, 6, 7], [200, 201, 202], [1, 1, 1]),
             make_traj([8, 9], [300, 301, 302, 303], [1, 1, 1, 1]),
             make_traj([8, 9], [400, 401], [1, 1])]
    mask = collate(trajs, tokenizer.pad_token_id).response_mask
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), mask, ["a", "a", "b", "b"])

    def run(shortcut: bool):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir))
        reference = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir)).eval().requires_grad_(False)
        models = PolicyModels(model=model, reference=reference, tokenizer=tokenizer, lora=False)
        trainer = LocalTrainer(TrainPlan.from_params(params), models, pd.DataFrame(), torch.device("cpu"), QuestionSampler(2, 0))
        trainer.reference_is_policy = shortcut
        first = trainer.update(trajs, adv).metrics
        assert trainer.reference_is_policy is False
        second = trainer.update(trajs, adv).metrics
        return first, second, {k: v.clone() for k, v in model.state_dict().items()}

    first_a, second_a, weights_a = run(shortcut=True)
    first_b, second_b, weights_b = run(shortcut=False)
    assert first_a["timing_s/ref"] == 0.0 < first_b["timing_s/ref"]
    assert second_a["timing_s/ref"] > 0.0
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/ppo_kl"):
        assert first_a[key] == pytest.approx(first_b[key], rel=1e-5, abs=1e-9), key
        assert second_a[key] == pytest.approx(second_b[key], rel=1e-5, abs=1e-9), key
    assert first_a["actor/num_optimizer_steps"] == 2 * ppo_epochs
    assert second_a["actor/kl_loss"] > 1e-6  # the second update's KL is real: the policy moved
    moved = max(float((weights_a[k] - weights_b[k]).abs().max()) for k in weights_a)
    assert moved < 1e-5


def test_lora_training_keeps_base_frozen(tmp_path, tiny_llama_dir, env_server):
    from pipeline.train.local.backend import train_local

    write_train_parquet(tmp_path / "data/rl/train.parquet")
    params = load_params(REPO_ROOT / "params.yaml", tiny_overrides(
        tmp_path, tiny_llama_dir, env_server, steps=1, mini_batch_size=2,
        lora={"enabled": True, "r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}))
    metrics = train_local(TrainPlan.from_params(params))
    assert metrics["actor/num_optimizer_steps"] + metrics["actor/skipped_no_signal"] == 1  # one mini-batch
    folder = ckpt.latest_checkpoint(tmp_path / "checkpoints/agent")
    assert (folder / "adapter" / "adapter_config.json").is_file() and not (folder / "model").exists()
    assert ckpt.TrainerState.read(folder).lora is True


def test_changed_training_params_start_afresh_instead_of_reusing_the_old_model(tmp_path, tiny_llama_dir,
                                                                               env_server):
    # DVC reruns train when e.g. train.lr or reward.preset change; the persisted checkpoint of the old
    # params must not count as "already complete" nor be resumed.
    from pipeline.stages.train import training_complete
    from pipeline.train.local.backend import train_local
    from pipeline.train.local.resume import stale_folders

    write_train_parquet(tmp_path / "data/rl/train.parquet")
    params = load_params(REPO_ROOT / "params.yaml", tiny_overrides(tmp_path, tiny_llama_dir, env_server, steps=1))
    train_local(TrainPlan.from_params(params))
    assert training_complete(TrainPlan.from_params(params))
    old = ckpt.TrainerState.read(ckpt.latest_checkpoint(tmp_path / "checkpoints/agent"))

    old_files = {p.relative_to(tmp_path / "checkpoints/agent"): p.read_bytes()
                 for p in (tmp_path / "checkpoints/agent").rglob("*") if p.is_file()}
    old_steps = (tmp_path / "reports/train/steps.csv").read_bytes()

    changed = load_params(REPO_ROOT / "params.yaml",
                          tiny_overrides(tmp_path, tiny_llama_dir, env_server, steps=1, lr=3e-4))
    assert not training_complete(TrainPlan.from_params(changed))
    train_local(TrainPlan.from_params(changed))
    new = ckpt.TrainerState.read(ckpt.latest_checkpoint(tmp_path / "checkpoints/agent"))
    assert new.step == 1 and new.config["train"]["lr"] == pytest.approx(3e-4)
    assert old.config["train"]["lr"] != new.config["train"]["lr"]
    assert _metrics_rows(tmp_path / "reports/train/steps.csv")["step"].tolist() == [1]
    assert training_complete(TrainPlan.from_params(changed)) and not training_complete(TrainPlan.from_params(params))

    # The old run was set aside beside the DVC output, not deleted: every file byte for byte, its steps.csv too.
    (aside,) = stale_folders(tmp_path / "checkpoints/agent")
    assert aside.parent == tmp_path / "checkpoints" and aside.name.startswith("agent.stale-")
    assert {p.relative_to(aside): p.read_bytes() for p in aside.rglob("*") if p.is_file()
            and p.name not in {".gitignore", "steps.csv"}} == old_files
    assert (aside / "steps.csv").read_bytes() == old_steps
    assert ckpt.TrainerState.read(ckpt.latest_checkpoint(aside)).config == old.config
    assert (aside / ".gitignore").read_text() == "*\n"


# ------------------------------------------------------------------------------------------------ slow


def _write_params(tmp: Path, overrides: dict) -> Path:
    from pipeline.config import deep_merge

    raw = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
    path = tmp / "params.yaml"
    path.write_text(yaml.safe_dump(deep_merge(raw, overrides)))
    return path


@pytest.mark.slow
def test_killed_training_resumes_without_repeating_steps(tmp_path, tiny_llama_dir, env_server):
    write_train_parquet(tmp_path / "data/rl/train.parquet")
    total = 30  # long enough (~0.2 s/step) that the kill lands mid-run
    # The tiny random model's groups all score the same: over 28 steps the health gate would (rightly) stop it
    # at step 18; this test is about resuming, so the gate is off (tests/test_train_health*.py test it).
    overrides = tiny_overrides(tmp_path, tiny_llama_dir, env_server, steps=total, save_every=2, mini_batch_size=2,
                               health={"enabled": False})
    params_file = _write_params(tmp_path, overrides)
    cmd = [sys.executable, "-m", "pipeline.cli", "train", "--params", str(params_file)]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    log_file = (tmp_path / "first.log").open("w")
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=log_file, stderr=subprocess.STDOUT,
                            start_new_session=True)
    steps_csv = tmp_path / "reports/train/steps.csv"
    deadline = time.time() + 240
    try:
        # Kill right after an odd step >= 3 is logged: it ran after the last checkpoint (save_every=2).
        while time.time() < deadline and proc.poll() is None:
            if steps_csv.is_file() and (tmp_path / "checkpoints/agent/latest").is_file():
                last = steps_csv.read_text().strip().splitlines()[-1].split(",")[0]
                if last.isdigit() and int(last) >= 3 and int(last) % 2 == 1:
                    break
            time.sleep(0.01)
        assert proc.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        log_file.close()
    killed_at = ckpt.TrainerState.read(ckpt.latest_checkpoint(tmp_path / "checkpoints/agent")).step
    assert killed_at % 2 == 0 and 2 <= killed_at < total
    logged_before = pd.read_csv(steps_csv)["step"].tolist()
    assert max(logged_before) >= killed_at  # steps after the checkpoint (if any) are redone exactly once

    second = subprocess.run(cmd, check=False, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"resumed at step {killed_at}" in second.stderr
    steps = pd.read_csv(steps_csv)["step"].tolist()
    assert steps == list(range(1, total + 1))
    state = ckpt.TrainerState.read(ckpt.latest_checkpoint(tmp_path / "checkpoints/agent"))
    assert (state.step, state.epoch, state.position) == (total, 9, 6)  # 60 questions: 10 passes over 6 rows

    # The resumed run's MLflow child has exactly the steps it ran.
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run_id = json.loads((tmp_path / "reports/mlflow_run.json").read_text())["run_id"]
    client = mlflow.MlflowClient()
    child = client.search_runs([client.get_run(run_id).info.experiment_id],
                               f"tags.mlflow.parentRunId = '{run_id}'")[0]
    resumed_steps = sorted(m.step for m in client.get_metric_history(child.info.run_id, "critic/score/mean"))
    assert resumed_steps == list(range(killed_at + 1, total + 1))

    third = subprocess.run(cmd, check=False, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert third.returncode == 0 and "already complete" in third.stderr


@pytest.mark.slow
def test_real_stage_one_step_smollm2_llamacpp(tmp_path, llama_server, params):
    """The real stage: SmolLM2-135M-Instruct agent, real llama.cpp environment, 1 step, short generations."""
    from pipeline.stages.train import run_train

    write_train_parquet(tmp_path / "data/rl/train.parquet")
    overrides = {
        "paths": {"rl_dir": str(tmp_path / "data/rl"), "checkpoint_dir": str(tmp_path / "ckpt"),
                  "reports_dir": str(tmp_path / "reports"), "cache_dir": str(tmp_path / ".cache")},
        "agent": {"max_turns": 2, "max_turn_tokens": 24, "max_response_tokens": 96},
        "environment": {"base_url": llama_server, "max_tokens": 24, "cache": False},
        "train": {"steps": 1, "batch_size": 1, "group_size": 2, "mini_batch_size": 1, "micro_batch_size": 2,
                  "save_every": 1, "lora": {"enabled": True}, "warmup": {"steps": 0}},
        "mlflow": {"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "artifact_root": str(tmp_path / "mla")},
    }
    real = load_params(REPO_ROOT / "params.yaml", overrides)
    run_train(real)
    row = pd.read_csv(tmp_path / "reports/train/steps.csv").iloc[0]
    assert row["step"] == 1 and row["perf/num_params"] > 1e8
    assert row["response_length/mean"] > 0 and pd.notna(row["actor/pg_loss"])
    assert pd.notna(row["critic/score/mean"])
    assert (ckpt.latest_checkpoint(tmp_path / "ckpt") / "adapter").is_dir()

    # ... and the merge stage turns that real LoRA checkpoint into a verified HF model with its template.
    from pipeline.stages.merge import run_merge

    real.paths.model_dir = str(tmp_path / "models/agent")
    report = run_merge(real)
    assert report.source == "local-lora" and report.generated_tokens >= 1
    assert report.max_abs_logit_diff < 1e-2
    assert "chat_template" in (tmp_path / "models/agent/tokenizer_config.json").read_text() or (
        tmp_path / "models/agent/chat_template.jinja").is_file()


def test_stage_dispatches_verl_backend_inside_the_train_run(tmp_path, monkeypatch, tiny_llama_dir):
    """backend verl → run_verl(plan, tracking_uri, run) with the active MLflow child run (verl itself needs GPUs)."""
    import mlflow

    from pipeline.stages.train import run_train
    from pipeline.train.verl import backend as verl_backend
    from pipeline.train.verl import resources

    calls = []

    def fake_run_verl(plan, uri, run):
        calls.append((plan.train.backend, run.info.run_id, mlflow.active_run().info.run_id))

    def fake_assert_resources(plan):  # the machine checks need GPUs and a Ray cluster (test_layout_verl.py)
        calls.append(("resources", mlflow.active_run()))

    monkeypatch.setattr(verl_backend, "run_verl", fake_run_verl)
    monkeypatch.setattr(resources, "assert_resources", fake_assert_resources)
    params = load_params(REPO_ROOT / "params.yaml", {
        **tiny_overrides(tmp_path, tiny_llama_dir, "http://127.0.0.1:9/v1"), "train": {"backend": "verl"}})
    run_train(params)
    assert calls[0] == ("resources", None)  # checked before the MLflow run opens
    calls = calls[1:]
    assert len(calls) == 1 and calls[0][0] == "verl" and calls[0][1] == calls[0][2]
    assert json.loads((tmp_path / "reports/mlflow_run.json").read_text())["run_id"]


@pytest.mark.slow
def test_failing_environment_stops_training_with_the_keys_named(tmp_path, tiny_llama_dir):
    """A dead environment must stop training, not turn into reward: warm-up demonstrations call it first."""
    from fault_server import Behaviour, FaultServer

    from pipeline.errors import EnvironmentUnhealthy
    from pipeline.train.local.backend import train_local

    write_train_parquet(tmp_path / "data/rl/train.parquet")
    with FaultServer(Behaviour("status", status=400)) as server:
        overrides = tiny_overrides(tmp_path, tiny_llama_dir, server.url,
                                   warmup={"steps": 2, "batch_size": 2, "demonstrations": 4})
        overrides["environment"].update(failure_window=4, max_failure_rate=0.25)
        overrides["agent"].update(max_turns=3, max_turn_tokens=96, max_response_tokens=1024)
        params = load_params(REPO_ROOT / "params.yaml", overrides)
        with pytest.raises(EnvironmentUnhealthy, match=r"environment\.max_failure_rate=0\.25.*HTTP 400"):
            train_local(TrainPlan.from_params(params))
        assert len(server.chat_requests) == 4  # stopped at the first full window, not after every demo
    assert ckpt.latest_checkpoint(tmp_path / "checkpoints/agent") is None
