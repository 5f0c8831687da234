"""Which GPUs verl's Ray owns: the one-node profiles pin a private Ray to `train.verl.gpus`, and a Ray whose
devices include the environment server's is refused, judged from a probe that asks a real Ray which CUDA
devices it assigns.

Ray reports GPU counts, not devices, and verl's workers take the raylet's CUDA_VISIBLE_DEVICES: a `ray start`
on devices 0-7 puts paper-1node's rollout on GPT-OSS's devices 6-7. The judging function is pure (probe results
written by hand); the probe runs against a real local Ray on this CPU machine, started with a GPU count Ray
takes on trust and the CUDA_VISIBLE_DEVICES a `ray start` would have had.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.config import deep_merge, load_params, parse_override
from pipeline.placement import gpus_of_environment, gpus_of_training, private_ray_devices
from pipeline.train.verl.resources import (
    RayNode,
    RayProbe,
    probe_private_ray,
    probe_ray_cluster,
    ray_gpu_problems,
)

REPO = Path(__file__).resolve().parents[1]


def merged(*sets: str):
    overrides: dict = {}
    for item in sets:
        overrides = deep_merge(overrides, parse_override(item))
    return load_params(REPO / "params.yaml", overrides)


def probe(*nodes: tuple[bool, list[int]], busy: tuple[str, ...] = ()) -> RayProbe:
    """A probe result: one (on this host?, CUDA device ids Ray assigned) per node."""
    return RayProbe(
        address="auto",
        gpus=float(sum(len(ids) for _, ids in nodes)),
        busy=busy,
        nodes=tuple(
            RayNode(node_id=f"node{i}", ip=f"10.0.0.{i + 1}", here=here, gpu_ids=tuple(str(g) for g in ids))
            for i, (here, ids) in enumerate(nodes)
        ),
    )


def judged(params, result: RayProbe) -> list[str]:
    return ray_gpu_problems(result, gpus_of_environment(params.environment), gpus_of_training(params.train))


def test_the_one_node_profiles_start_a_private_ray_pinned_to_the_training_gpus():
    for profile, devices in (("paper-1node", "0,1,2,3,4,5"), ("smoke-1gpu", "0")):
        params = merged(f"profile={profile}")
        assert params.train.verl.ray_address == ""
        assert private_ray_devices(params.train) == devices
    assert merged("profile=paper").train.verl.ray_address == "auto"  # a 16-GPU node or a cluster: `ray start`


def test_a_ray_that_owns_the_environments_gpus_is_refused_naming_both_sets():
    one_node = merged("profile=paper-1node", "train.verl.ray_address=auto")
    # `CUDA_VISIBLE_DEVICES=0,...,7 ray start --num-gpus=8` on paper-1node's node: Ray owns GPT-OSS's 6-7
    [problem] = judged(one_node, probe((True, list(range(8)))))
    assert problem.startswith("train.verl.ray_address, train.verl.gpus, environment.server.gpus: ")
    assert "owns CUDA devices [0, 1, 2, 3, 4, 5, 6, 7] on this host" in problem
    assert "include [6, 7] of the environment server's [6, 7]" in problem
    assert "CUDA_VISIBLE_DEVICES=0,1,2,3,4,5 ray start --head --num-gpus=6" in problem
    # started on the training devices only: accepted
    assert judged(one_node, probe((True, [0, 1, 2, 3, 4, 5]))) == []
    # one environment device is enough to be refused
    assert "include [7]" in judged(one_node, probe((True, [0, 1, 2, 3, 4, 5, 7])))[0]
    # a node elsewhere owns its own devices 0-7: the environment's 6-7 are this host's
    assert judged(one_node, probe((True, [0, 1, 2, 3, 4, 5]), (False, list(range(8))))) == []


def test_a_gpu_shared_on_purpose_is_not_refused_and_busy_gpus_are():
    smoke = merged(
        "profile=smoke-1gpu", "train.verl.ray_address=auto"
    )  # vLLM and verl share device 0 by fractions
    assert judged(smoke, probe((True, [0]))) == []
    [busy] = judged(smoke, probe((True, []), busy=("10.0.0.9",)))
    assert "no GPUs of the Ray node(s) ['10.0.0.9']" in busy and "another job holds them" in busy
    # the environment elsewhere (paper's training node): nothing of the environment's on this host
    remote = merged("profile=paper", "environment.base_url=http://10.0.0.2:8000/v1")
    assert judged(remote, probe((True, list(range(8))))) == []


@pytest.mark.slow  # a Ray start: ~13 s on 2 busy cores
def test_the_probe_reads_the_devices_a_real_private_ray_assigns():
    """A private Ray started as verl's launch starts one (CUDA_VISIBLE_DEVICES = train.verl.gpus), here with
    a GPU count Ray takes on trust: the probe reports the pinned devices, which the judge accepts."""
    params = merged("profile=paper-1node")
    started = time.perf_counter()
    result = probe_private_ray(params.train, num_gpus=6)
    assert time.perf_counter() - started < 60
    assert result.address == "private" and result.gpus == 6 and result.busy == ()
    assert result.owned_here() == ["0", "1", "2", "3", "4", "5"]
    assert judged(merged("profile=paper-1node"), result) == []


@pytest.fixture(scope="module")
def ray_on_eight_devices():
    """A running Ray that owns CUDA devices 0-7, as `CUDA_VISIBLE_DEVICES=0,...,7 ray start --num-gpus=8`
    leaves one (started by a child process's `ray.init`, which stops it when the child ends)."""
    script = (
        "import ray, sys\n"
        "info = ray.init(num_cpus=1, num_gpus=8, include_dashboard=False)\n"
        "print(info.address_info['gcs_address'], flush=True)\n"
        "sys.stdin.read()\n"
    )
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    child = subprocess.Popen(
        [sys.executable, "-c", script], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        address = child.stdout.readline().strip()
        assert address, "the Ray head did not start"
        yield address
    finally:
        child.stdin.close()
        try:
            child.wait(timeout=60)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


@pytest.mark.slow  # the Ray fixture: ~15 s to start on 2 busy cores
def test_the_stage_start_probe_of_a_joined_ray_on_the_environments_devices_is_refused(ray_on_eight_devices):
    """The joined-cluster probe `assert_resources` runs, on a real Ray that owns devices 0-7: paper-1node
    told to join it is refused, naming GPT-OSS's devices 6-7."""
    result = probe_ray_cluster(ray_on_eight_devices)
    assert result.gpus == 8 and [n.here for n in result.nodes] == [True]
    assert result.owned_here() == [str(g) for g in range(8)]
    [problem] = judged(
        merged("profile=paper-1node", f"train.verl.ray_address={ray_on_eight_devices}"), result
    )
    assert "include [6, 7] of the environment server's [6, 7]" in problem


@pytest.mark.slow
def test_the_doctor_finds_the_joined_ray_and_refuses_it_before_the_environment_starts(
    ray_on_eight_devices, tmp_path, monkeypatch
):
    """The doctor's `resources` step on a node with 8 GPUs (a stand-in nvidia-smi: this machine has none)
    and paper-1node joining that Ray: it fails naming the environment's devices, with the disk figures of
    its one checkpoint, and its temporary checkpoint folder is gone when the doctor ends."""
    from pipeline.checks.doctor_state import Doctor
    from pipeline.checks.doctor_train import step_resources

    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text(
        '#!/bin/sh\nfor i in 0 1 2 3 4 5 6 7; do echo "GPU $i: NVIDIA H100 80GB HBM3 (UUID: GPU-$i)"; done\n'
    )
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{smi.parent}{os.pathsep}{os.environ['PATH']}")
    params = merged(
        "profile=paper-1node",
        f"train.verl.ray_address={ray_on_eight_devices}",
        f"paths.checkpoint_dir={tmp_path / 'checkpoints' / 'agent'}",
    )
    doc = Doctor(params=params, gpus=[{"index": str(i)} for i in range(8)])
    with doc.stack:
        status, detail, figures = step_resources(doc)
        assert doc.checkpoint_dir is not None and doc.checkpoint_dir.parent == tmp_path / "checkpoints"
    assert status == "fail", detail
    assert detail.startswith(
        f"Ray at {ray_on_eight_devices!r} found: CUDA devices ['0', '1', '2', '3', '4', '5', "
        "'6', '7'] on this host"
    )
    assert "include [6, 7] of the environment server's [6, 7]" in detail
    assert figures["ray_devices_here"] == [str(g) for g in range(8)] and figures["checkpoint_gib"] == 44.7
    # The host's 8 GPUs and verl's validation pass; the disk check passes only where this machine has room for
    # the one ~44.7 GiB checkpoint the doctor's single step saves, and otherwise names the setting to change.
    disk_short = figures["free_gib"] < figures["checkpoint_gib"]
    assert len(figures["problems"]) == 1 + disk_short, figures["problems"]
    if disk_short:
        assert "paths.checkpoint_dir" in figures["problems"][1] and "GiB are free" in figures["problems"][1]
    assert not doc.checkpoint_dir.exists()
