"""The layout check (pipeline/checks/layout.py, `promptr1 check`): each infeasible layout fails naming its keys,
every shipped profile passes, and the batch arithmetic agrees with verl 0.9.1's own validation."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.checks.layout import LayoutError, assert_runnable, layout_problems
from pipeline.config import deep_merge, load_params, parse_override
from pipeline.placement import cuda_visible_devices, gpus_of_environment, gpus_of_training, is_loopback
from pipeline.train.plan import TrainPlan

REPO_ROOT = Path(__file__).resolve().parents[1]
PROFILES = sorted(p.stem for p in (REPO_ROOT / "profiles").glob("*.yaml"))


def merged(*sets: str):
    overrides: dict = {}
    for item in sets:
        overrides = deep_merge(overrides, parse_override(item))
    return load_params(REPO_ROOT / "params.yaml", overrides or None)


def problem_keys(params) -> list[set[str]]:
    return [set(p.keys) for p in layout_problems(params)]


@pytest.mark.parametrize("profile", ["default", *PROFILES])
def test_every_shipped_profile_passes(profile):
    params = merged(f"profile={profile}")
    assert layout_problems(params) == []
    assert_runnable(params)


def test_shipped_profiles_include_the_gpu_layouts():
    assert {"paper", "paper-1node", "smoke-1gpu"} <= set(PROFILES)


# Each infeasible layout, one per rule: (overrides over a profile, keys the problem must name).
INFEASIBLE = {
    "overlapping GPUs, fractions above 1": (
        ["profile=paper", "environment.server.gpus=[0,1,2,3,4,5,6,7]"],
        {"environment.server.gpus", "train.verl.gpus", "environment.server.gpu_memory_utilization",
         "train.verl.rollout_gpu_memory_utilization"}),
    "default placement: both on the first 8 GPUs": (
        ["profile=paper", "environment.server.gpus=[]", "train.verl.gpus=[]"],
        {"environment.server.gpus", "train.verl.gpus"}),
    "one shared GPU, 0.5 + 0.6": (
        ["profile=smoke-1gpu", "environment.server.gpu_memory_utilization=0.5",
         "train.verl.rollout_gpu_memory_utilization=0.6"],
        {"environment.server.gpu_memory_utilization", "train.verl.rollout_gpu_memory_utilization"}),
    "environment TP wider than its GPUs": (
        ["profile=paper-1node", "environment.server.tensor_parallel_size=4"],
        {"environment.server.tensor_parallel_size", "environment.server.gpus"}),
    "rollout TP wider than the training GPUs": (
        ["profile=paper-1node", "train.verl.rollout_tp=8"],
        {"train.verl.rollout_tp", "train.verl.n_gpus_per_node"}),
    "rollout TP does not divide the training GPUs": (
        ["profile=paper-1node", "train.verl.rollout_tp=4"],
        {"train.verl.rollout_tp", "train.verl.n_gpus_per_node"}),
    "rollout TP across nodes unevenly": (
        ["profile=paper", "train.verl.nnodes=3", "train.verl.n_gpus_per_node=4", "train.verl.gpus=[0,1,2,3]",
         "train.verl.rollout_tp=6", "train.batch_size=120", "train.mini_batch_size=48",
         "environment.base_url=http://env-node:8000/v1"],
        {"train.verl.rollout_tp", "train.verl.n_gpus_per_node", "train.verl.nnodes"}),
    "batch x group not divisible by the training GPUs": (
        ["profile=paper-1node", "train.batch_size=128", "train.mini_batch_size=48"],
        {"train.batch_size", "train.group_size", "train.verl.n_gpus_per_node"}),
    "mini-batch x group not divisible by the training GPUs": (
        ["profile=paper-1node", "train.mini_batch_size=64"],
        {"train.mini_batch_size", "train.group_size", "train.verl.n_gpus_per_node"}),
    "mini-batch larger than the batch": (
        ["profile=paper", "train.mini_batch_size=256"],
        {"train.batch_size", "train.mini_batch_size"}),
    "per-GPU mini-batch not divisible by the micro-batch": (
        ["profile=paper", "train.micro_batch_size=16"],
        {"train.micro_batch_size", "train.mini_batch_size"}),
    "per-GPU batch not divisible by the micro-batch": (
        ["profile=smoke-1gpu", "train.batch_size=6", "train.mini_batch_size=4", "train.micro_batch_size=16"],
        {"train.micro_batch_size", "train.batch_size"}),
    "training device list of the wrong length": (
        ["profile=paper", "train.verl.gpus=[0,1,2,3]"],
        {"train.verl.gpus", "train.verl.n_gpus_per_node"}),
    "duplicate device ids": (
        ["profile=paper", "environment.server.gpus=[8,8,9,10,11,12,13,14]"],
        {"environment.server.gpus"}),
    "memory fraction out of range": (
        ["profile=paper", "train.verl.rollout_gpu_memory_utilization=1.5"],
        {"train.verl.rollout_gpu_memory_utilization"}),
    "two nodes, environment on loopback": (
        ["profile=paper", "train.verl.nnodes=2"],
        {"train.verl.nnodes", "environment.host"}),
    "two nodes, environment base_url on localhost": (
        ["profile=paper", "train.verl.nnodes=2", "environment.backend=api",
         "environment.base_url=http://localhost:9000/v1"],
        {"train.verl.nnodes", "environment.base_url"}),
    "empty validation set with test_freq": (
        ["profile=paper", "data.id_eval_datasets=[]", "data.ood_eval_datasets=[]", "train.verl.val_before_train=false"],
        {"data.id_eval_datasets", "data.ood_eval_datasets", "train.verl.test_freq"}),
}


@pytest.mark.parametrize("case", sorted(INFEASIBLE))
def test_each_infeasible_layout_fails_naming_its_keys(case):
    sets, keys = INFEASIBLE[case]
    params = merged(*sets)
    found = problem_keys(params)
    assert any(keys <= named for named in found), f"{case}: no problem names {keys}; got {found}"
    with pytest.raises(LayoutError) as err:
        assert_runnable(params)
    assert len(str(err.value).splitlines()) == 1 + len(found)  # a heading, then one line per problem
    assert all(key in str(err.value) for key in keys)


def test_fixes_make_each_case_pass():
    """The variants next to the failures pass, so each rule fails only where it should."""
    for sets in (["profile=paper", "environment.server.gpus=[0,1,2,3,4,5,6,7]",
                  "environment.server.gpu_memory_utilization=0.25"],  # shared: 0.25 + 0.6 leave 12 GiB (actor 9.3)
                 ["profile=paper", "train.verl.nnodes=2", "environment.host=10.0.0.5"],
                 ["profile=paper", "train.verl.nnodes=2", "environment.base_url=http://env-node:8000/v1"],
                 ["profile=paper", "data.id_eval_datasets=[]", "data.ood_eval_datasets=[]",
                  "train.verl.test_freq=-1", "train.verl.val_before_train=false"],
                 ["profile=paper-1node", "environment.server.tensor_parallel_size=4",
                  "environment.server.gpus=[4,5,6,7]", "train.verl.gpus=[0,1,2,3]",
                  "train.verl.n_gpus_per_node=4", "train.batch_size=128", "train.mini_batch_size=64"]):
        assert layout_problems(merged(*sets)) == [], sets


def test_only_active_backends_are_judged():
    # The local backend has no verl layout: verl's batch arithmetic is not applied to it.
    local = merged("train.batch_size=3", "train.group_size=3", "train.verl.n_gpus_per_node=8",
                   "train.verl.nnodes=2")
    assert layout_problems(local) == []
    # An environment served elsewhere shares no GPU with training, whatever its server block says.
    remote = merged("profile=paper", "environment.server.gpus=[0,1,2,3,4,5,6,7]",
                    "environment.base_url=http://env-node:8000/v1")
    assert gpus_of_environment(remote.environment) == [] and layout_problems(remote) == []
    assert gpus_of_environment(merged("profile=api").environment) == []


def test_placement_defaults_are_what_ray_and_vllm_take():
    params = merged("profile=paper", "environment.server.gpus=[]", "train.verl.gpus=[]",
                    "environment.server.tensor_parallel_size=2")
    assert gpus_of_training(params.train) == list(range(8))
    assert gpus_of_environment(params.environment) == [0, 1]
    assert gpus_of_training(merged().train) == []  # local backend
    paper = merged("profile=paper").environment
    assert cuda_visible_devices(gpus_of_environment(paper)) == "8,9,10,11,12,13,14,15"


@pytest.mark.parametrize(("host", "loopback"), [
    ("127.0.0.1", True), ("127.8.0.2", True), ("localhost", True), ("LOCALHOST", True), ("::1", True),
    ("[::1]", True), ("0.0.0.0", True), ("", True), ("10.0.0.5", False), ("env-node", False),
    ("api.openai.com", False), ("fe80::1", False),
])
def test_loopback_addresses(host, loopback):
    assert is_loopback(host) is loopback


def test_smoke_profile_is_one_gpu_with_a_small_agent():
    params = merged("profile=smoke-1gpu")
    assert params.train.backend == "verl" and params.train.verl.rollout_name == "vllm"
    assert params.environment.backend == "vllm"
    assert gpus_of_training(params.train) == gpus_of_environment(params.environment) == [0]
    assert params.environment.server.gpu_memory_utilization + params.train.verl.rollout_gpu_memory_utilization <= 1
    assert params.agent.model == "Qwen/Qwen3-0.6B"
    assert "trainer.total_training_steps=3" in params.train.verl.extra_overrides


def test_paper_1node_is_the_paper_but_for_the_layout():
    """paper-1node repeats paper.yaml (profiles do not inherit); only the layout keys may differ."""
    from pipeline.config import flatten

    layout_keys = {"train.batch_size", "train.mini_batch_size", "train.verl.n_gpus_per_node", "train.verl.gpus",
                   "train.verl.rollout_tp", "environment.server.tensor_parallel_size", "environment.server.gpus",
                   "train.verl.ray_address", "profile"}
    paper, one_node = flatten(merged("profile=paper")), flatten(merged("profile=paper-1node"))
    differing = {k for k in paper.keys() | one_node.keys() if paper.get(k) != one_node.get(k)}
    assert differing == layout_keys
    one = merged("profile=paper-1node")
    assert set(gpus_of_training(one.train)).isdisjoint(gpus_of_environment(one.environment))
    assert len(gpus_of_training(one.train) + gpus_of_environment(one.environment)) == 8


def _compose_verl(overrides: list[str]):
    import verl
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(Path(verl.__file__).parent / "trainer" / "config"),
                                   version_base=None):
            return compose(config_name="ppo_trainer", overrides=overrides)
    finally:
        GlobalHydra.instance().clear()


def _verl_validates(cfg) -> None:
    """verl's own checks: validate_config (utils/config.py) and ActorConfig.validate (workers/config/actor.py)."""
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    validate_config(cfg, use_reference_policy=True, use_critic=False)
    omega_conf_to_dataclass(cfg.actor_rollout_ref.actor).validate(
        cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes, cfg.data.train_batch_size)


def _verl_accepts(batch: int, n: int, mini: int, micro: int, gpus: int, nnodes: int) -> bool:
    cfg = _compose_verl([f"data.train_batch_size={batch}", f"actor_rollout_ref.rollout.n={n}",
                         f"actor_rollout_ref.actor.ppo_mini_batch_size={mini}",
                         f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}",
                         f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={micro}",
                         f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={micro}",
                         f"trainer.n_gpus_per_node={gpus}", f"trainer.nnodes={nnodes}",
                         "algorithm.adv_estimator=grpo"])
    try:
        _verl_validates(cfg)
    except (AssertionError, ValueError):
        return False
    return True


@pytest.mark.slow  # imports verl (Ray, torch): ~1 min cold on 2 cores
@pytest.mark.parametrize("profile", ["paper", "paper-1node", "smoke-1gpu"])
def test_gpu_profiles_compose_into_a_config_verl_validates(profile):
    """What `train` hands verl for each GPU profile passes verl's own validation, with the profile's sizes."""
    from pipeline.train.verl.overrides import build_overrides

    params = merged(f"profile={profile}")
    cfg = _compose_verl(build_overrides(TrainPlan.from_params(params)))
    _verl_validates(cfg)
    assert cfg.trainer.n_gpus_per_node == len(gpus_of_training(params.train))
    assert cfg.actor_rollout_ref.rollout.tensor_model_parallel_size == params.train.verl.rollout_tp
    assert cfg.data.train_batch_size * cfg.actor_rollout_ref.rollout.n % cfg.trainer.n_gpus_per_node == 0
    if profile == "smoke-1gpu":
        assert cfg.trainer.total_training_steps == 3


@pytest.mark.slow  # imports verl (Ray, torch): ~1 min cold on 2 cores
@pytest.mark.parametrize(("batch", "n", "mini", "gpus", "nnodes"), [
    (128, 5, 64, 8, 1), (128, 5, 64, 6, 1), (96, 5, 48, 6, 1), (4, 4, 4, 1, 1), (4, 4, 8, 1, 1),
    (7, 4, 7, 4, 1), (3, 5, 3, 4, 2), (128, 5, 64, 8, 2), (10, 3, 10, 6, 1), (12, 2, 3, 4, 1),
])
def test_batch_rules_agree_with_verls_validation(batch, n, mini, gpus, nnodes):
    """Where verl's config validation refuses, so do we; where it accepts, we refuse only for what verl asserts
    later, in the first step: the mini-batch split over the GPUs (engine_workers.train_mini_batch), the batch
    into whole mini-batches (make_iterator) and the trajectories over the 8 agent-loop workers (DataProto.chunk).
    The agent is Qwen3-0.6B, whose actor fits one GPU, so only the batch rules are in play."""
    params = merged("profile=paper", "agent.model=Qwen/Qwen3-0.6B", f"train.batch_size={batch}", f"train.group_size={n}",
                    f"train.mini_batch_size={mini}", "train.micro_batch_size=1", f"train.verl.n_gpus_per_node={gpus}",
                    f"train.verl.nnodes={nnodes}", "train.verl.gpus=[]", "train.verl.rollout_tp=1",
                    "environment.base_url=http://env-node:8000/v1")
    ours = layout_problems(params)
    if _verl_accepts(batch, n, mini, 1, gpus, nnodes):
        later = [(mini * n) % (gpus * nnodes), batch % mini, (batch * n) % 8]
        assert bool(ours) == any(later), ours
    else:
        assert ours


def run_check(*sets: str) -> subprocess.CompletedProcess:
    args = [a for s in sets for a in ("-S", s)]
    return subprocess.run([sys.executable, "-m", "pipeline.cli", "check", *args], check=False,
                          cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)


def test_cli_exit_codes():
    ok = run_check("profile=paper")
    assert ok.returncode == 0, ok.stderr
    assert "layout ok" in ok.stdout and "GPUs [8, 9, 10, 11, 12, 13, 14, 15]" in ok.stdout

    bad = run_check("profile=paper", "environment.server.gpus=[0,1,2,3,4,5,6,7]", "train.verl.nnodes=2")
    assert bad.returncode == 2
    lines = [line for line in bad.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 3, bad.stderr
    assert any("environment.server.gpus" in line and "train.verl.rollout_gpu_memory_utilization" in line
               for line in lines)
    assert any("train.verl.gpu_memory_gb" in line and "leave 0.0 of 80 GiB" in line for line in lines)  # no room
    assert any("train.verl.nnodes" in line and "environment.host" in line for line in lines)

    invalid = run_check("train.verl.gpus=notalist")
    assert invalid.returncode == 2 and "train.verl.gpus" in invalid.stderr
    assert run_check().returncode == 0  # the default CPU profile
