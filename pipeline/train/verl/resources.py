"""What the verl stage checks on the machine before anything starts: GPUs here and in the Ray cluster, disk for
checkpoints, and verl's own config validation.

`promptr1 check` judges params only, anywhere; these need the machine, so `run_train` calls
`assert_resources(plan)` with backend verl before it opens an MLflow run or starts the environment server
(GPT-OSS-20B takes minutes to load, and verl would only find a missing GPU after that). The local backend
checks nothing here: it runs on whatever the machine has.

Each check is a pure function of the numbers (`gpu_problems`, `checkpoint_disk_problem`), so CI tests them
with layouts that would fail; the functions that read the host (`host_gpu_count`, `ray_cluster_gpus`,
`free_bytes`) are thin.

- **GPUs on this host**: every CUDA device id the layout starts here (`environment.server.gpus`, and
  `train.verl.gpus` unless training joins a Ray cluster elsewhere) must exist: the paper profile needs devices
  0-15 on one node. Counted by torch (`torch.cuda.device_count()`, which honours CUDA_VISIBLE_DEVICES as the
  ids do), else `nvidia-smi -L`.
- **GPUs in a joined Ray cluster** (`train.verl.ray_address` set): `ray.cluster_resources()["GPU"]` must cover
  `trainer.n_gpus_per_node × trainer.nnodes`; verl's own check (`ResourcePoolManager`) runs only after the
  environment is up.
- **Which GPUs that Ray owns** (`probe_ray_cluster`, judged by `ray_gpu_problems`): Ray reports GPU counts per
  node, not which CUDA devices, and verl's workers take whatever devices the raylet was started with (its
  `CUDA_VISIBLE_DEVICES`), not `train.verl.gpus`, which pins only a private Ray. So a probe task per node,
  scheduled on all of that node's GPUs, reports the CUDA device ids Ray assigns it (`ray.get_gpu_ids()`); on
  this host they must not include a device of the environment server that the layout does not also give
  training (`paper-1node`: a Ray started on devices 0-7 would put verl's rollout on 6-7, where vLLM holds 0.9
  of the memory). `smoke-1gpu` shares its one GPU on purpose (fractions 0.3 + 0.4), so a device in both
  `environment.server.gpus` and `train.verl.gpus` is not refused here.
- **A private Ray** (`train.verl.ray_address: ""`) is probed too, on a host with GPUs (`probe_private_ray`):
  started as verl's launch starts it, `ray.init(address="local")` with CUDA_VISIBLE_DEVICES =
  `train.verl.gpus`, then stopped. `local` always starts a new instance; with no address Ray would join the
  cluster named in the `ray_current_cluster` file of its temp folder (the last `ray start` here, running or
  crashed: ray/_private/services.py `get_ray_address_from_environment`), and the probe would judge that one.
- **Disk**: the checkpoints verl retains (`pipeline.train.verl.memory`: size of one save × how many it keeps at
  once) must fit in the free space of `trainer.default_local_dir` (`paths.checkpoint_dir`).
- **verl's validation** (`validate_config` and `ActorConfig.validate`) on the composed config, which
  imports verl (seconds), so it is not part of `promptr1 check`.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.disk_space import free_bytes
from pipeline.errors import UserError
from pipeline.placement import gpus_of_environment, gpus_of_training, private_ray_devices
from pipeline.train.verl import memory
from pipeline.train.verl.config import VerlRun, compose_plan, verl_validation_error
from pipeline.train.verl.overrides import PRIVATE_RAY_ADDRESS

if TYPE_CHECKING:
    from pipeline.config import TrainConfig
    from pipeline.train.plan import TrainPlan

log = logging.getLogger(__name__)

JOINED_HERE = ("", "auto")
"""ray_address values whose training GPUs are this host's: a private Ray, or the cluster started here."""
PROBE_TIMEOUT_S = 60.0
"""How long the probe waits for a node's GPUs: a probe still unscheduled then means another job holds them."""
PRIVATE_PROBE_TIMEOUT_S = 180.0
"""Start, probe and stop of the private Ray (`probe_private_ray`), all together."""
RAY_KEYS = "train.verl.ray_address, train.verl.gpus, environment.server.gpus"


@dataclass(frozen=True)
class RayNode:
    """One Ray node's GPUs, as a probe task scheduled on all of them saw them."""

    node_id: str
    ip: str
    here: bool
    """The node of this host (the one the probing driver is attached to)."""
    gpu_ids: tuple[str, ...]
    """The CUDA device ids Ray assigned the probe (`ray.get_gpu_ids()`: ids from the raylet's
    CUDA_VISIBLE_DEVICES, which can be UUIDs), i.e. every device this node's Ray hands its workers."""


@dataclass(frozen=True)
class RayProbe:
    """What the probe found in one Ray instance."""

    address: str
    """`train.verl.ray_address`, or "private" for the private Ray `probe_private_ray` started."""
    gpus: float
    """`ray.cluster_resources()["GPU"]`."""
    nodes: tuple[RayNode, ...]
    busy: tuple[str, ...] = ()
    """Nodes (ip) whose GPUs the probe could not get within its timeout: another job holds them."""

    @classmethod
    def from_json(cls, data: dict) -> RayProbe:
        nodes = tuple(RayNode(**{**n, "gpu_ids": tuple(n["gpu_ids"])}) for n in data["nodes"])
        return cls(address=data["address"], gpus=data["gpus"], nodes=nodes, busy=tuple(data["busy"]))

    def owned_here(self) -> list[str]:
        """The CUDA device ids Ray owns on this host."""
        return [g for node in self.nodes if node.here for g in node.gpu_ids]


def ray_gpu_problems(probe: RayProbe, environment_gpus: list[int], training_gpus: list[int]) -> list[str]:
    """Why the Ray `probe` describes would put verl's workers on the environment server's GPUs (or could not
    be probed); [] when it would not. `environment_gpus` are the devices the environment server takes on this
    host, `training_gpus` the devices the layout gives verl; a device in both is shared on purpose."""
    problems = []
    owned = probe.owned_here()
    clash = [g for g in environment_gpus if g not in training_gpus and str(g) in owned]
    if clash:
        training = ",".join(str(g) for g in training_gpus)
        problems.append(
            f"{RAY_KEYS}: the Ray at {probe.address!r} owns CUDA devices [{', '.join(owned)}] on this host, which "
            f"include {clash} of the environment server's {environment_gpus} (environment.server.gpus): verl's "
            f"workers would load onto GPUs the environment holds. Start Ray with only the training devices "
            f"{training_gpus} (train.verl.gpus): `CUDA_VISIBLE_DEVICES={training} ray start --head "
            f"--num-gpus={len(training_gpus)}`, or set train.verl.ray_address='' (a private Ray pinned to "
            "train.verl.gpus)")
    if probe.busy:
        problems.append(
            f"train.verl.ray_address: the probe got no GPUs of the Ray node(s) {list(probe.busy)} at "
            f"{probe.address!r} within {PROBE_TIMEOUT_S:g} s: another job holds them (`ray status`), and verl "
            "would wait for them")
    return problems


def probe_connected_ray(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> RayProbe:
    """Probe the Ray this process is attached to as a driver: one task per node that has GPUs, asking for all
    of them, reports the CUDA device ids Ray assigned it."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    @ray.remote(num_cpus=0)
    def assigned_devices() -> list[str]:
        ids = [str(g) for g in ray.get_gpu_ids()]  # in Ray's assignment order: sorted for the reader
        return sorted(ids, key=lambda g: (not g.isdigit(), int(g) if g.isdigit() else 0, g))

    here = ray.get_runtime_context().get_node_id()
    pending = {}
    for node in ray.nodes():
        gpus = int(node["Resources"].get("GPU", 0)) if node["Alive"] else 0
        if gpus:
            strategy = NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)
            pending[assigned_devices.options(num_gpus=gpus, scheduling_strategy=strategy).remote()] = node
    ready, late = ray.wait(list(pending), num_returns=len(pending), timeout=timeout_s) if pending else ([], [])
    for ref in late:
        ray.cancel(ref, force=True)
    nodes = tuple(RayNode(node_id=pending[ref]["NodeID"], ip=pending[ref]["NodeManagerAddress"],
                          here=pending[ref]["NodeID"] == here, gpu_ids=tuple(ray.get(ref))) for ref in ready)
    return RayProbe(address=address, gpus=float(ray.cluster_resources().get("GPU", 0)), nodes=nodes,
                    busy=tuple(pending[ref]["NodeManagerAddress"] for ref in late))


def probe_ray_cluster(address: str) -> RayProbe:
    """`probe_connected_ray` on the Ray cluster at `address` (joined as a short-lived driver)."""
    import ray

    try:
        ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False)
    except ConnectionError as exc:
        raise UserError(f"train.verl.ray_address={address!r}: no Ray cluster there ({exc}); start it with the "
                        "training devices only (`CUDA_VISIBLE_DEVICES=<train.verl.gpus> ray start --head "
                        "--num-gpus=<their count>`, docs/gpu.md), or set train.verl.ray_address='' for a private "
                        "Ray") from None
    try:
        return probe_connected_ray(address)
    finally:
        ray.shutdown()


def _private_probe(num_gpus: int | None) -> None:
    """The child of `probe_private_ray`: start a private Ray here, print its probe as JSON, stop it."""
    import ray

    ray.init(address=PRIVATE_RAY_ADDRESS, num_gpus=num_gpus, include_dashboard=False,
             logging_level=logging.ERROR, log_to_driver=False)
    try:
        print(json.dumps(asdict(probe_connected_ray("private"))))
    finally:
        ray.shutdown()


def probe_private_ray(train: TrainConfig, num_gpus: int | None = None) -> RayProbe:
    """Start a private Ray as verl's launch starts one (`train.verl.ray_address: ""`: address `local`, no
    RAY_ADDRESS, CUDA_VISIBLE_DEVICES from `private_ray_devices`), probe it and stop it, in a child process so that this
    process's environment and Ray state stay as they were. `num_gpus` None: Ray counts the visible devices,
    as under verl."""
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    devices = private_ray_devices(train)
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = devices
    code = f"from pipeline.train.verl.resources import _private_probe; _private_probe({num_gpus!r})"
    try:
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                              timeout=PRIVATE_PROBE_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise UserError(f"a private Ray did not start and answer the probe within {PRIVATE_PROBE_TIMEOUT_S:g} s "
                        "(train.verl.ray_address='')") from None
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise UserError(f"a private Ray could not be started here (train.verl.ray_address=''; exit code "
                        f"{done.returncode}): {done.stderr.strip()[-600:]}")
    return RayProbe.from_json(json.loads(lines[-1]))


def gpu_problems(plan: TrainPlan, run: VerlRun, host_gpus: int, cluster_gpus: float | None) -> list[str]:
    """Why the layout does not fit this host's `host_gpus` devices or the Ray cluster's `cluster_gpus`
    (None: no cluster joined); [] when it fits."""
    problems = []
    here = set(gpus_of_environment(plan.environment))
    keys = ["environment.server.gpus"] if here else []
    if plan.train.verl.ray_address in JOINED_HERE:
        here |= set(gpus_of_training(plan.train))
        keys.append("train.verl.gpus")
    missing = sorted(g for g in here if g >= host_gpus)
    if missing:
        problems.append(f"{', '.join(keys)}: the layout uses CUDA devices {sorted(here)} on this host, which has "
                        f"{host_gpus} GPU(s) (devices {missing} do not exist)")
    world = run.value("trainer.n_gpus_per_node") * run.value("trainer.nnodes")
    if cluster_gpus is not None and cluster_gpus < world:
        problems.append(
            f"train.verl.n_gpus_per_node, train.verl.nnodes, train.verl.ray_address: verl needs "
            f"trainer.n_gpus_per_node x trainer.nnodes = {run.value('trainer.n_gpus_per_node')} x "
            f"{run.value('trainer.nnodes')} = {world} GPUs, but {_ray_named(plan.train.verl.ray_address)} has "
            f"{cluster_gpus:g} (start every node with `ray start --num-gpus=...`, see docs/gpu.md)")
    return problems


def _ray_named(address: str) -> str:
    return f"the Ray cluster at {address!r}" if address else "the private Ray (train.verl.gpus)"


def checkpoint_estimate(plan: TrainPlan, run: VerlRun) -> tuple[int, int | None, tuple[int, str]] | None:
    """(bytes of one verl checkpoint, how many verl holds at once (None: unbounded), the parameter count and
    its source), or None when the model's parameter count is unknown offline (logged)."""
    found = memory.parameter_count(plan.agent.model, plan.root)
    if found is None:
        log.warning("checkpoint size not estimated: no parameter count for %s offline", plan.agent.model)
        return None
    actor = "actor_rollout_ref.actor"
    one = memory.checkpoint_bytes(found[0], save_contents=list(run.value(f"{actor}.checkpoint.save_contents")),
                                  model_dtype=run.value(f"{actor}.fsdp_config.model_dtype"),
                                  lora=bool(run.value("actor_rollout_ref.model.lora_rank")))
    saves = memory.saves_in_run(run.value("trainer.save_freq"), run.value("trainer.total_training_steps"))
    return one, memory.checkpoints_on_disk(run.value("trainer.max_actor_ckpt_to_keep"), saves), found


def checkpoint_disk_problem(plan: TrainPlan, run: VerlRun, free: int) -> str | None:
    """Why the checkpoints verl retains do not fit in `free` bytes, or None (also when the model's parameter
    count is unknown offline: logged)."""
    estimate = checkpoint_estimate(plan, run)
    if estimate is None:
        return None
    one, copies, found = estimate
    keep = run.value("trainer.max_actor_ckpt_to_keep")
    problem = memory.disk_problem(free, one, copies)
    if problem is None:
        return None
    keys = ", ".join(("paths.checkpoint_dir", *run.ours("trainer.max_actor_ckpt_to_keep", "trainer.save_freq")))
    return (f"{keys}: {problem} in {run.value('trainer.default_local_dir')} ({found[1]}: {found[0] / 1e9:.2f}B "
            f"parameters; trainer.max_actor_ckpt_to_keep={keep}): free space there, lower train.keep_checkpoints, "
            "or point paths.checkpoint_dir at a larger disk")


def host_gpu_count() -> int:
    """CUDA devices this process can use: torch's count, else nvidia-smi's, else 0."""
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.device_count()
    except ImportError:
        pass
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in listed.stdout.splitlines() if line.startswith("GPU "))


def resource_problems(plan: TrainPlan, run: VerlRun, probe: RayProbe | None) -> list[str]:
    """Every reason this machine cannot run the verl layout `run` composes: its GPUs, the probed Ray's (None:
    no Ray probed), the disk for the checkpoints verl retains, and verl's own validation."""
    problems = gpu_problems(plan, run, host_gpu_count(), probe.gpus if probe is not None else None)
    if probe is not None:
        problems += ray_gpu_problems(probe, gpus_of_environment(plan.environment), gpus_of_training(plan.train))
    disk = checkpoint_disk_problem(plan, run, free_bytes(Path(run.value("trainer.default_local_dir"))))
    problems += [disk] if disk else []
    invalid = verl_validation_error(run)
    if invalid:
        problems.append(f"verl's own validation refuses the composed config: {invalid}")
    return problems


def assert_resources(plan: TrainPlan) -> None:
    """Raise UserError, with every problem found, when this machine cannot run the verl layout. The Ray verl
    will use is probed: a joined cluster (`train.verl.ray_address` set), or a private one started and stopped
    as verl starts it. A host without GPUs is refused by the device check alone, without a Ray started."""
    address = plan.train.verl.ray_address
    if address:
        probe: RayProbe | None = probe_ray_cluster(address)
    else:
        probe = probe_private_ray(plan.train) if host_gpu_count() else None
    problems = resource_problems(plan, compose_plan(plan), probe)
    if problems:
        raise UserError("this machine cannot run the verl layout:\n" + "\n".join(problems))
