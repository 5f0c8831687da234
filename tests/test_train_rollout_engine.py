"""GRPO rollouts sampled by llama.cpp's server (pipeline.train.local.rollout_engine): the served policy must be the
policy being trained, at every step.

Real parts: a tiny random Llama written as a complete GGUF (SmolLM2's tokenizer and metadata, F32 weights)
as `agent.model`, loaded for training by transformers' GGUF reader; at each step the trainer exports the
policy from memory and serves it with llama.cpp's own server on 127.0.0.1; a scripted OpenAI-compatible
environment server (tests/fault_server.py) answers the interaction turns.

The check (`gap`): for every agent token the server sampled, the log-prob llama.cpp reported against the
log-prob the policy in this process computes for the same token in the same context (the trainer's own
collate and log-prob functions). Equal policies give a gap at float precision; the check fails when the
served weights are not the policy's: the rotary permutation left out of the export (measured below), or a
step served with the previous step's weights after the policy changed.
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest
import torch
from demo_project import free_port, tiny_gguf_template, tiny_random_llama
from helpers import REPO_ROOT, tiny_overrides, write_train_parquet

from pipeline.config import load_params
from pipeline.train.plan import TrainPlan

GAP_OK = 0.02  # mean |llama.cpp log-prob - policy log-prob| over sampled agent tokens, F32 export
GAP_BROKEN = 0.2


@pytest.fixture(scope="module")
def tiny_agent_gguf(tmp_path_factory) -> Path:
    """A tiny random Llama as a complete GGUF file (what `agent.model` names in the default profile)."""
    from pipeline.agent.gguf_export import export_model

    folder = tmp_path_factory.mktemp("tiny_agent")
    model, _ = tiny_random_llama(folder)
    template = tiny_gguf_template(folder, model)
    return export_model(model, template, folder / "tiny-agent.gguf", "f32")


def _params(tmp_path: Path, agent: Path, env_server: str, **train):
    overrides = tiny_overrides(tmp_path, agent, env_server, rollout_gguf_dtype="f32", **train)
    overrides["agent"].update(max_turn_tokens=24, max_response_tokens=96, temperature=1.0)
    overrides["evaluate"] = {"agent_port": free_port()}
    write_train_parquet(tmp_path / "data/rl/train.parquet")
    return load_params(REPO_ROOT / "params.yaml", overrides)


def _trainer(params):
    from pipeline.train.local.models import load_policy_models
    from pipeline.train.local.questions import QuestionSampler, load_training_set
    from pipeline.train.local.trainer import LocalTrainer

    plan = TrainPlan.from_params(params)
    models = load_policy_models(plan.require_agent_model(), plan.agent, plan.train, None, torch.device("cpu"))
    frame = load_training_set(plan.train_file)
    return LocalTrainer(plan, models, frame, torch.device("cpu"), QuestionSampler(len(frame), params.seed))


def _rollout(trainer, step: int, items=None):
    from pipeline.environment.client import EnvironmentClient

    env = EnvironmentClient.in_cache_dir(trainer.plan.environment, trainer.plan.cache_dir)
    try:
        return trainer.rollout(env, items if items is not None else trainer.draw_items(), step)
    finally:
        asyncio.run(env.aclose())


def gap(trainer, trajectories) -> tuple[float, int]:
    """Mean |server log-prob - policy log-prob| over the sampled agent tokens that have one, and their count."""
    from pipeline.train.local.batch import collate, response_log_probs

    batch = collate(trajectories, trainer.models.tokenizer.pad_token_id)
    with torch.no_grad():
        ours = response_log_probs(trainer.models.model, batch, trainer.temperature)
    theirs = batch.sampling_log_probs
    assert theirs is not None, "the rollout recorded no sampling log-probs"
    keep = batch.response_mask.bool() & torch.isfinite(theirs)
    diffs = (ours - theirs).abs()[keep]
    return float(diffs.mean()), int(keep.sum())


def test_auto_picks_llama_cpp_for_a_gguf_agent_on_cpu_and_transformers_otherwise(tmp_path, tiny_agent_gguf,
                                                                                 tiny_llama_dir):
    from pipeline.train.local.rollout_engine import rollout_engine

    params = load_params(REPO_ROOT / "params.yaml", {"agent": {"model": str(tiny_agent_gguf)}})
    assert rollout_engine(TrainPlan.from_params(params)) == "llama.cpp"
    params.train.lora.enabled = True  # a LoRA policy has no merged weights to export each step
    assert rollout_engine(TrainPlan.from_params(params)) == "transformers"
    params = load_params(REPO_ROOT / "params.yaml", {"agent": {"model": str(tiny_llama_dir)}})
    assert rollout_engine(TrainPlan.from_params(params)) == "transformers"  # no GGUF template to export into
    params.train.rollout_engine = "llama.cpp"
    assert rollout_engine(TrainPlan.from_params(params)) == "llama.cpp"  # asked for: served_step_policy then refuses, naming it


def test_forcing_llama_cpp_without_a_gguf_agent_is_refused_by_name(tmp_path, tiny_llama_dir, env_server):
    from pipeline.errors import UserError

    trainer = _trainer(_params(tmp_path, tiny_llama_dir, env_server, rollout_engine="llama.cpp"))
    with pytest.raises(UserError, match="train.rollout_engine"):
        _rollout(trainer, 1)


@pytest.mark.slow
def test_llama_cpp_samples_the_policy_being_trained_at_every_step(tmp_path, tiny_agent_gguf, env_server):
    params = _params(tmp_path, tiny_agent_gguf, env_server)
    trainer = _trainer(params)
    assert trainer.engine == "llama.cpp"

    first = _rollout(trainer, 1)
    assert len(first) == params.train.batch_size * params.train.group_size
    assert all(len(t.response_ids) == len(t.response_mask) == len(t.response_logprobs) for t in first)
    mean, count = gap(trainer, first)
    assert count >= 40 and mean < GAP_OK, (mean, count)
    # The trajectories' ids are the ones the server sampled: its log-prob exists for most agent tokens.
    agent_tokens = sum(sum(t.response_mask) for t in first)
    assert count >= 0.8 * agent_tokens, (count, agent_tokens)
    assert not (tmp_path / ".cache/train_rollout").exists() or not any((tmp_path / ".cache/train_rollout").iterdir())

    with torch.no_grad():  # a large change of the policy, as a big update would make
        generator = torch.Generator().manual_seed(3)
        for p in trainer.models.model.parameters():
            if p.ndim == 2:
                p.add_(torch.randn(p.shape, generator=generator) * 0.1)
    items = trainer.draw_items()
    second = _rollout(trainer, 2, items)
    mean, count = gap(trainer, second)
    assert count >= 40 and mean < GAP_OK, (mean, count)

    # Same seed, step and questions, all slots decoding in one batch: the same requests and the same samples,
    # log-probs included (each turn's prompts reach the server in one request, so which sequences share a
    # decode batch is the same on every run).
    again = _rollout(trainer, 2, items)
    assert [t.item.uid for t in again] == [t.item.uid for t in second]
    same = sum(a.response_ids == b.response_ids and a.response_logprobs == b.response_logprobs
               for a, b in zip(second, again, strict=True))
    assert same == len(second), f"{same} of {len(second)} trajectories resampled identically with every slot"

    # One slot (train.rollout_slots: 1): one trajectory decoded at a time; a repeated step resamples
    # bit-identically too (a resumed step asks for what the killed one did).
    trainer.cfg.rollout_slots = 1
    serial = _rollout(trainer, 2, items)
    serial_again = _rollout(trainer, 2, items)
    same = sum(a.response_ids == b.response_ids for a, b in zip(serial, serial_again, strict=True))
    assert same == len(serial), f"{same} of {len(serial)} trajectories resampled identically with one slot"


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["no_rotary_permutation", "stale_weights"])
def test_the_gap_check_fails_when_the_server_does_not_serve_the_policy(tmp_path, tiny_agent_gguf, env_server,
                                                                      monkeypatch, variant):
    import copy

    from pipeline.agent import gguf_export

    params = _params(tmp_path, tiny_agent_gguf, env_server)
    trainer = _trainer(params)
    if variant == "no_rotary_permutation":
        monkeypatch.setattr(gguf_export, "permute_rotary", lambda weight, n_head: weight)
    else:
        frozen = copy.deepcopy(trainer.models.model)  # the step-1 weights, exported at every step
        real = gguf_export.export_model
        monkeypatch.setattr(gguf_export, "export_model",
                            lambda model, *args, **kwargs: real(frozen, *args, **kwargs))
        with torch.no_grad():
            generator = torch.Generator().manual_seed(3)
            for p in trainer.models.model.parameters():
                if p.ndim == 2:
                    p.add_(torch.randn(p.shape, generator=generator) * 0.1)
    mean, count = gap(trainer, _rollout(trainer, 1))
    assert count > 0 and not math.isnan(mean)
    assert mean > GAP_BROKEN, f"the {variant} variant passed the gap check: {mean:.4f} over {count} tokens"
