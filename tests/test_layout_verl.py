"""The layout check on the config verl runs (params + overrides + extra_overrides composed with verl's own
ppo_trainer.yaml), its verl rules, and the stage-start checks of the machine (GPUs, Ray, disk).

Each rule is shown with a layout verl 0.9.1 really rejects; where the rejection is an assertion deep in a
training step, the slow tests run that very verl function (DataProto.chunk, make_iterator) on the sizes the
layout produces."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.checks.layout import Placement, actor_estimate, layout_problems
from pipeline.config import deep_merge, load_params, parse_override
from pipeline.train.plan import TrainPlan
from pipeline.train.verl import memory
from pipeline.train.verl.config import compose_plan, override_key
from pipeline.train.verl.resources import checkpoint_disk_problem, gpu_problems

REPO_ROOT = Path(__file__).resolve().parents[1]
GIB = memory.GIB


def compose_run(params):
    """What the train stage hands verl for these params: `compose_plan` of their train plan."""
    return compose_plan(TrainPlan.from_params(params))


def merged(*sets: str):
    overrides: dict = {}
    for item in sets:
        overrides = deep_merge(overrides, parse_override(item))
    return load_params(REPO_ROOT / "params.yaml", overrides or None)


def problems_naming(params, *keys: str) -> list[str]:
    """The problems whose keys include all of `keys`, as text."""
    return [str(p) for p in layout_problems(params) if set(keys) <= set(p.keys)]


# ------------------------------------------------------------------------------ divisibility rules
def test_batch_must_be_whole_mini_batches():
    """paper with mini-batch 48: 128 x 5 = 640 trajectories, 80 per GPU, mini-batches of 30 per GPU: every older
    rule passes (240 % 8 == 0, 30 % 2 == 0), and verl's make_iterator asserts 80 % 30 at the first update."""
    found = problems_naming(merged("profile=paper", "train.mini_batch_size=48"), "train.batch_size",
                            "train.mini_batch_size")
    assert len(found) == 1, found
    assert "data.train_batch_size" in found[0] and "actor_rollout_ref.actor.ppo_mini_batch_size" in found[0]
    assert problems_naming(merged("profile=paper", "train.mini_batch_size=32"), "train.mini_batch_size") == []


def test_trajectories_must_split_over_agent_loop_workers():
    """smoke-1gpu with 3 questions: 12 trajectories over verl's default 8 agent-loop workers."""
    found = problems_naming(merged("profile=smoke-1gpu", "train.batch_size=3", "train.mini_batch_size=3"),
                            "train.batch_size", "train.group_size", "train.verl.extra_overrides")
    assert len(found) == 1 and "actor_rollout_ref.rollout.agent.num_workers=8" in found[0], found
    fixed = merged("profile=smoke-1gpu", "train.batch_size=3", "train.mini_batch_size=3",
                   "train.verl.extra_overrides=[trainer.total_training_steps=3,actor_rollout_ref.rollout.agent.num_workers=4]")
    assert layout_problems(fixed) == []


@pytest.mark.parametrize(("extra", "verl_key"), [
    ("actor_rollout_ref.rollout.agent.num_workers=7", "actor_rollout_ref.rollout.agent.num_workers"),
    ("actor_rollout_ref.actor.ppo_mini_batch_size=48", "actor_rollout_ref.actor.ppo_mini_batch_size"),
    ("++actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"),
    ("trainer.n_gpus_per_node=6", "trainer.n_gpus_per_node"),
    ("actor_rollout_ref.rollout.gpu_memory_utilization=0.97", "actor_rollout_ref.rollout.gpu_memory_utilization"),
])
def test_extra_overrides_cannot_bypass_the_check(extra, verl_key):
    """paper passes; the same layout with one key changed through train.verl.extra_overrides is refused, and
    the problem names the list (where the key was set) and verl's key."""
    assert layout_problems(merged("profile=paper")) == []
    params = merged("profile=paper", f"train.verl.extra_overrides=[{extra}]")
    assert str(compose_run(params).value(verl_key)).lower() == extra.split("=")[1]  # the extra override won
    found = problems_naming(params, "train.verl.extra_overrides")
    assert found and any(verl_key in text for text in found), layout_problems(params)


def test_override_keys():
    assert override_key("+a.b=1") == "a.b" and override_key("++a.b=[1,2]") == "a.b" and override_key("~a.b") == "a.b"


def test_unknown_extra_override_is_a_problem_not_a_crash():
    params = merged("profile=paper", "train.verl.extra_overrides=[actor_rollout_ref.no_such_key=1]")
    [problem] = layout_problems(params)
    assert problem.keys == ("train.verl.extra_overrides",) and "no_such_key" in problem.message


def test_gguf_agent_with_verl_is_a_problem():
    [problem] = layout_problems(merged("train.backend=verl", "train.verl.n_gpus_per_node=1",
                                       "train.verl.rollout_tp=1"))
    assert problem.keys == ("agent.model",) and "GGUF" in problem.message


# ------------------------------------------------------------------------------ actor memory
@pytest.fixture()
def no_cached_configs(tmp_path, monkeypatch):
    """An empty Hugging Face cache: parameter counts come from the published table, as on CI."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))


def test_actor_memory_arithmetic():
    """What stays on a training GPU during rollout: fp32 weights (4 B) and two Adam states (8 B) per parameter
    over the FSDP group, no gradients, the reference in CPU memory, plus one CUDA context (1 GiB, an estimate)
    and the weight-sync bucket; offloading removes what it moves; LoRA keeps the frozen weights only."""
    kwargs = {"shards": 8, "model_dtype": "fp32", "lora": False, "reference": True, "ref_dtype": "fp32",
              "weight_sync_megabytes": 2048}
    full = memory.actor_memory(8 * 10**9, param_offload=False, optimizer_offload=False, ref_on_cpu=True, **kwargs)
    assert (full.weights, full.optimizer, full.reference) == (4e9, 8e9, 0.0)
    assert (full.cuda_context, full.weight_sync) == (GIB, 2 * GIB)
    assert full.total == 12e9 + 3 * GIB
    offloaded = memory.actor_memory(8 * 10**9, param_offload=True, optimizer_offload=True, ref_on_cpu=True, **kwargs)
    assert offloaded.total == 3 * GIB  # the context and the bucket stay
    # a reference built without forward_only (an override) keeps its fp32 weights on the GPU
    on_gpu = memory.actor_memory(8 * 10**9, param_offload=False, optimizer_offload=False, ref_on_cpu=False, **kwargs)
    assert on_gpu.reference == 4e9 and on_gpu.total == full.total + 4e9
    lora = memory.actor_memory(8 * 10**9, param_offload=False, optimizer_offload=False, ref_on_cpu=False,
                               **{**kwargs, "lora": True})
    assert lora.total == 4e9 + 3 * GIB


def test_smoke_profile_actor_memory_worked_by_hand(no_cached_configs):
    """smoke-1gpu, computed by hand from verl's composed config: Qwen3-0.6B (0.6e9 parameters, published count)
    on one GPU: fp32 weights 0.6e9 x 4 B = 2.4e9 B = 2.24 GiB, Adam states 0.6e9 x 8 B = 4.47 GiB (6.7 GiB of
    actor state), no gradients, the fsdp2 reference in pinned CPU memory (0), one CUDA context 1 GiB and the
    2048 MiB weight-sync bucket: 9.7 GiB, within the 0.3 x 40 = 12 GiB the two vLLM fractions leave."""
    params = merged("profile=smoke-1gpu")
    run = compose_run(params)
    assert run.value("actor_rollout_ref.ref.strategy") == "fsdp2"
    assert run.value("actor_rollout_ref.ref.fsdp_config.forward_only") is True
    assert run.value("actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes") == 2048
    estimate, left, source = actor_estimate(Placement.for_layout(params), run)
    assert source.startswith("published count")
    assert (estimate.weights, estimate.optimizer, estimate.reference) == (2.4e9, 4.8e9, 0.0)
    assert (estimate.cuda_context, estimate.weight_sync) == (GIB, 2048 * 1024**2)
    assert round((estimate.weights + estimate.optimizer) / GIB, 1) == 6.7
    assert round(estimate.total / GIB, 2) == 9.71 and left == pytest.approx(12.0)
    assert estimate.describe() == ("weights 2.2 + Adam states 4.5 + CUDA context 1.0 + weight-sync bucket 2.0 "
                                   "= 9.7 GiB")


PROFILE_ACTOR_GIB = {"paper": 8.6, "paper-1node": 10.5, "smoke-1gpu": 9.7}
"""Per-GPU actor estimates of the shipped GPU profiles (published parameter counts): paper 4.0e9 x 12 B / 8 GPUs
+ 3 GiB, paper-1node 4.0e9 x 12 B / 6 GPUs + 3 GiB, smoke-1gpu above."""


def test_shipped_gpu_profiles_fit_and_smoke_declares_its_gpu(no_cached_configs):
    for profile, per_gpu in PROFILE_ACTOR_GIB.items():
        params = merged(f"profile={profile}")
        estimate, left, _ = actor_estimate(Placement.for_layout(params), compose_run(params))
        assert round(estimate.total / GIB, 1) == per_gpu and estimate.total / GIB <= left, profile
    assert merged("profile=smoke-1gpu").train.verl.gpu_memory_gb == 40


def test_profile_comments_quote_the_current_estimate():
    """The arithmetic written beside `gpu_memory_gb` in each GPU profile is the rule's own figure."""
    for profile, per_gpu in PROFILE_ACTOR_GIB.items():
        text = (REPO_ROOT / "profiles" / f"{profile}.yaml").read_text()
        (line,) = [line for line in text.splitlines() if line.strip().startswith("gpu_memory_gb:")]
        assert f" {per_gpu} GiB" in line and "16 B" not in text, (profile, line)


@pytest.mark.parametrize(("sets", "fix"), [
    # one shared 24 GiB GPU: 0.3 x 24 = 7.2 GiB < 9.7 GiB; offloading weights and Adam states (3 GiB left) fits
    (["profile=smoke-1gpu", "train.verl.gpu_memory_gb=24"],
     ("train.verl.extra_overrides=[trainer.total_training_steps=3,actor_rollout_ref.actor.fsdp_config.param_offload"
      "=true,actor_rollout_ref.actor.fsdp_config.optimizer_offload=true]")),
    # fractions that sum to 1.0 leave the actor nothing (the issue's case)
    (["profile=smoke-1gpu", "environment.server.gpu_memory_utilization=0.5",
      "train.verl.rollout_gpu_memory_utilization=0.5"], "train.verl.rollout_gpu_memory_utilization=0.2"),
    (["profile=paper", "train.verl.rollout_gpu_memory_utilization=0.95"],
     "train.verl.rollout_gpu_memory_utilization=0.6"),
])
def test_actor_memory_must_fit_beside_the_vllm_fractions(sets, fix):
    found = problems_naming(merged(*sets), "train.verl.gpu_memory_gb", "agent.model")
    assert len(found) == 1 and "GiB" in found[0] and "actor_rollout_ref.rollout.gpu_memory_utilization" in found[0]
    assert problems_naming(merged(*sets, fix), "train.verl.gpu_memory_gb") == []


def test_unknown_model_is_not_judged_but_said(tmp_path):
    params = merged("profile=paper", "agent.model=example-org/unlisted-7b")
    assert actor_estimate(Placement.for_layout(params), compose_run(params)) is None and layout_problems(params) == []
    from pipeline.checks.layout import describe

    assert "actor memory not estimated" in describe(params)


def test_parameter_count_from_a_local_config_matches_the_model(tiny_llama_dir):
    """The config.json formula counts exactly what transformers builds, for each architecture we train."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    assert memory.parameter_count(str(tiny_llama_dir))[1] == "its config.json"
    shapes = {"vocab_size": 1000, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2}
    for model_type, extra in (("llama", {"tie_word_embeddings": True}), ("qwen2", {"tie_word_embeddings": False}),
                              ("qwen3", {"tie_word_embeddings": True, "head_dim": 32})):
        config = AutoConfig.for_model(model_type, **shapes, **extra)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        assert memory.count_from_config(config.to_dict()) == sum(p.numel() for p in model.parameters()), model_type


def test_published_counts_are_found_by_hub_id():
    assert memory.parameter_count("Qwen/Qwen3-4B") == (4_000_000_000, "published count, pipeline/train/verl/memory.py")
    assert memory.parameter_count("Qwen/Qwen2.5-7B-Instruct")[0] == 7_610_000_000
    assert memory.parameter_count("example-org/unlisted-7b") is None


# ------------------------------------------------------------------------------ stage start: GPUs, disk
def test_paper_needs_sixteen_gpus_on_this_host():
    params = merged("profile=paper")
    run = compose_run(params)
    [problem] = gpu_problems(TrainPlan.from_params(params), run, host_gpus=8, cluster_gpus=16)
    assert "train.verl.gpus" in problem and "environment.server.gpus" in problem
    assert "8 GPU(s)" in problem and "[8, 9, 10, 11, 12, 13, 14, 15] do not exist" in problem
    assert gpu_problems(TrainPlan.from_params(params), run, host_gpus=16, cluster_gpus=8) == []


def test_joined_ray_cluster_must_hold_the_training_gpus():
    params = merged("profile=paper", "train.verl.nnodes=2", "environment.base_url=http://env-node:8000/v1")
    run = compose_run(params)
    [problem] = gpu_problems(TrainPlan.from_params(params), run, host_gpus=8, cluster_gpus=8)
    assert "train.verl.n_gpus_per_node, train.verl.nnodes" in problem and "= 16 GPUs" in problem and "has 8" in problem
    assert gpu_problems(TrainPlan.from_params(params), run, host_gpus=8, cluster_gpus=16) == []
    # a cluster joined elsewhere: this host needs none of the training devices
    remote = merged("profile=paper", "train.verl.ray_address=10.0.0.1:6379",
                    "environment.base_url=http://env-node:8000/v1")
    assert gpu_problems(TrainPlan.from_params(remote), compose_run(remote), host_gpus=0, cluster_gpus=8) == []


def test_keep_checkpoints_maps_onto_verls_retention():
    assert compose_run(merged("profile=paper")).value("trainer.max_actor_ckpt_to_keep") == 2
    assert compose_run(merged("profile=paper", "train.keep_checkpoints=3")).value("trainer.max_actor_ckpt_to_keep") == 3


def test_retained_checkpoints_must_fit_on_disk():
    """paper: Qwen3-4B saves 4.0B x (4 B fp32 weights + 8 B Adam states) = 44.7 GiB each, and verl holds 2 of
    them at once (keep 2; with keep 1 the previous stays until the new save completes)."""
    params = merged("profile=paper")
    run = compose_run(params)
    problem = checkpoint_disk_problem(TrainPlan.from_params(params), run, free=80 * GIB)
    assert problem and "~44.7 GiB" in problem and "~89.4 GiB" in problem and "80.0 GiB are free" in problem
    assert "train.keep_checkpoints" in problem and "trainer.max_actor_ckpt_to_keep=2" in problem
    assert checkpoint_disk_problem(TrainPlan.from_params(params), run, free=90 * GIB) is None
    one = merged("profile=paper", "train.keep_checkpoints=1")
    assert checkpoint_disk_problem(TrainPlan.from_params(one), compose_run(one), free=80 * GIB)  # still two at the moment of a save
    # smoke: 3 steps, one save at step 3 → one checkpoint of 0.6B x 12 B = 6.7 GiB
    smoke = merged("profile=smoke-1gpu")
    assert checkpoint_disk_problem(TrainPlan.from_params(smoke), compose_run(smoke), free=7 * GIB) is None
    assert "6.7 GiB" in checkpoint_disk_problem(TrainPlan.from_params(smoke), compose_run(smoke), free=6 * GIB)


def test_checkpoint_rotation_counts():
    assert memory.checkpoints_on_disk(keep=1, saves=None) == 2
    assert memory.checkpoints_on_disk(keep=3, saves=None) == 3
    assert memory.checkpoints_on_disk(keep=3, saves=1) == 1
    assert memory.checkpoints_on_disk(keep=None, saves=None) is None
    assert memory.saves_in_run(10, 32) == 4 and memory.saves_in_run(-1, 32) == 0
    assert "keeps every checkpoint" in memory.disk_problem(10**12, 10**9, None)


# ------------------------------------------------------------------------------ the CLI
def run_check(*sets: str) -> subprocess.CompletedProcess:
    args = [a for s in sets for a in ("-S", s)]
    return subprocess.run([sys.executable, "-m", "pipeline.cli", "check", *args], check=False, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)


def test_cli_refuses_the_issues_layouts():
    bad = run_check("profile=paper", "train.mini_batch_size=48")
    assert bad.returncode == 2, bad.stdout + bad.stderr
    assert "train.batch_size, train.mini_batch_size" in bad.stderr and "ppo_mini_batch_size" in bad.stderr
    smoke = run_check("profile=smoke-1gpu", "train.batch_size=3", "train.mini_batch_size=3")
    assert smoke.returncode == 2 and "agent.num_workers=8" in smoke.stderr, smoke.stderr
    ok = run_check("profile=smoke-1gpu")
    assert ok.returncode == 0 and "actor ~9.7 of 12.0 GiB left per GPU" in ok.stdout, ok.stdout + ok.stderr


# ------------------------------------------------------------------------------ verl's own code agrees
@pytest.mark.slow  # imports verl (torch, tensordict): ~1 min cold on 2 cores
def test_verl_asserts_where_the_new_rules_refuse():
    """The functions verl runs in a training step, on the sizes each refused layout produces."""
    import torch
    from tensordict import TensorDict
    from verl.protocol import DataProto
    from verl.utils.tensordict_utils import make_iterator

    # paper, mini-batch 48: each GPU holds 128 x 5 / 8 = 80 trajectories, mini-batches of 48 x 5 / 8 = 30
    per_gpu = TensorDict({"x": torch.zeros(80, 1)}, batch_size=[80])
    with pytest.raises(AssertionError, match="80 % 30"):
        make_iterator(per_gpu, mini_batch_size=30, epochs=1)
    make_iterator(TensorDict({"x": torch.zeros(80, 1)}, batch_size=[80]), mini_batch_size=40, epochs=1)  # 32: ok
    # smoke-1gpu, 3 questions: 12 trajectories over 8 agent-loop workers
    with pytest.raises(AssertionError, match="only support equal chunk"):
        DataProto.from_dict({"x": torch.zeros(12, 1)}).chunk(8)
    assert len(DataProto.from_dict({"x": torch.zeros(16, 1)}).chunk(8)) == 8


@pytest.mark.slow  # imports verl: ~1 min cold on 2 cores
def test_verl_validation_runs_on_the_composed_config():
    from pipeline.train.verl.config import verl_validation_error

    assert verl_validation_error(compose_run(merged("profile=paper"))) is None
    refused = verl_validation_error(compose_run(merged("profile=paper", "train.mini_batch_size=256")))
    assert refused and "ppo_mini_batch_size" in refused


def test_free_bytes_reads_the_nearest_existing_folder(tmp_path):
    from pipeline.disk_space import free_bytes

    free = free_bytes(tmp_path / "not" / "yet" / "created")
    assert 0 < free <= shutil.disk_usage(tmp_path).total


@pytest.mark.slow  # verl's validation imports verl: ~20 s warm on 2 cores
def test_stage_start_refuses_a_machine_without_the_layouts_gpus(tmp_path):
    """The real stage-start check on this machine: no GPU here, so smoke-1gpu's device 0 is missing; the disk
    (a tmp folder) and verl's validation pass."""
    import torch

    from pipeline.errors import UserError
    from pipeline.train.verl.resources import assert_resources

    if torch.cuda.is_available():
        pytest.skip("this machine has GPUs: the refusal needs one without")
    params = merged("profile=smoke-1gpu", "train.verl.ray_address=", f"paths.checkpoint_dir={tmp_path / 'ckpt'}")
    with pytest.raises(UserError) as err:
        assert_resources(TrainPlan.from_params(params))
    lines = str(err.value).splitlines()[1:]
    assert len(lines) == 1 and "environment.server.gpus, train.verl.gpus" in lines[0] and "0 GPU(s)" in lines[0]
