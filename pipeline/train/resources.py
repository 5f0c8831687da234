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
- **Disk**: the checkpoints verl retains (`pipeline.train.memory`: size of one save × how many it keeps at
  once) must fit in the free space of `trainer.default_local_dir` (`paths.checkpoint_dir`).
- **verl's validation** (`validate_config` and `ActorConfig.validate`) on the composed config, which
  imports verl (seconds), so it is not part of `promptr1 check`.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.errors import UserError
from pipeline.placement import gpus_of_environment, gpus_of_training
from pipeline.train import memory
from pipeline.train.verl_config import VerlRun, compose_plan, verl_validation_error

if TYPE_CHECKING:
    from pipeline.train.plan import TrainPlan

log = logging.getLogger(__name__)

JOINED_HERE = ("", "auto")
"""ray_address values whose training GPUs are this host's: a private Ray, or the cluster started here."""


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
            f"{run.value('trainer.nnodes')} = {world} GPUs, but the Ray cluster at "
            f"{plan.train.verl.ray_address!r} has {cluster_gpus:g} (start every node with "
            f"`ray start --num-gpus=...`, see docs/gpu.md)")
    return problems


def checkpoint_disk_problem(plan: TrainPlan, run: VerlRun, free: int) -> str | None:
    """Why the checkpoints verl retains do not fit in `free` bytes, or None (also when the model's parameter
    count is unknown offline: logged)."""
    found = memory.parameter_count(plan.agent.model, plan.root)
    if found is None:
        log.warning("checkpoint size not estimated: no parameter count for %s offline", plan.agent.model)
        return None
    actor = "actor_rollout_ref.actor"
    one = memory.checkpoint_bytes(found[0], save_contents=list(run.value(f"{actor}.checkpoint.save_contents")),
                                  model_dtype=run.value(f"{actor}.fsdp_config.model_dtype"),
                                  lora=bool(run.value("actor_rollout_ref.model.lora_rank")))
    saves = memory.saves_in_run(run.value("trainer.save_freq"), run.value("trainer.total_training_steps"))
    keep = run.value("trainer.max_actor_ckpt_to_keep")
    problem = memory.disk_problem(free, one, memory.checkpoints_on_disk(keep, saves))
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


def ray_cluster_gpus(address: str) -> float:
    """GPUs of the Ray cluster at `address` (joined as a short-lived driver)."""
    import ray

    try:
        ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False)
    except ConnectionError as exc:
        raise UserError(f"train.verl.ray_address={address!r}: no Ray cluster there ({exc}); run `ray start "
                        "--head` first, or set train.verl.ray_address='' for a private Ray") from None
    try:
        return float(ray.cluster_resources().get("GPU", 0))
    finally:
        ray.shutdown()


def free_bytes(folder: Path) -> int:
    """Free bytes of the file system that holds `folder` (its nearest existing parent)."""
    folder = folder.resolve()
    while not folder.exists():
        folder = folder.parent
    return shutil.disk_usage(folder).free


def assert_resources(plan: TrainPlan) -> None:
    """Raise UserError, with every problem found, when this machine cannot run the verl layout."""
    run = compose_plan(plan)
    address = plan.train.verl.ray_address
    problems = gpu_problems(plan, run, host_gpu_count(), ray_cluster_gpus(address) if address else None)
    disk = checkpoint_disk_problem(plan, run, free_bytes(Path(run.value("trainer.default_local_dir"))))
    problems += [disk] if disk else []
    invalid = verl_validation_error(run)
    if invalid:
        problems.append(f"verl's own validation refuses the composed config: {invalid}")
    if problems:
        raise UserError("this machine cannot run the verl layout:\n" + "\n".join(problems))
