"""Layout check: can the merged params run at all on the machines they describe? Params only, no I/O.

`layout_problems(params)` returns every problem found (each naming the param keys to change);
`assert_runnable(params)` raises `LayoutError` listing them. `promptr1 check [-S key=value …]` prints them
(exit 2) and every stage and the flow call `assert_runnable` before starting anything, so a layout that
would fail after an hour of model downloads and server start-ups fails in a second, on any machine, CI
included: nothing here touches the network, a GPU or the data.

Design decisions:
- **Only the components the active backends use are judged.** The local backend, a llama.cpp environment
  (CPU) and a paid API have no GPU layout; the default CPU profile passes with nothing to check.
- **Placement is explicit.** `train.verl.gpus` (per node, Ray's CUDA_VISIBLE_DEVICES) and
  `environment.server.gpus` (the vLLM server's CUDA_VISIBLE_DEVICES) name CUDA device ids; an empty list
  means what the tools do unasked — Ray takes the first `n_gpus_per_node` devices and vLLM the first
  `tensor_parallel_size` — so two empty lists overlap, as they do on a real node. An environment at a
  `base_url` other than its own host/port runs elsewhere and shares no GPU with training.
- **verl's own arithmetic, copied with its source cited**, for FSDP without dynamic batch size or
  sequence parallelism (what `pipeline.train.verl_backend.build_overrides` sets). `n` = `train.group_size`
  (`rollout.n`), world = `n_gpus_per_node × nnodes` (the actor, reference and rollout are colocated):
  1. `verl/utils/config.py::validate_config`: `train_batch_size × n` divisible by world ("minimal
     possible batch size" = n_gpus for FSDP).
  2. `verl/workers/config/actor.py::ActorConfig.validate`: `train_batch_size >= ppo_mini_batch_size`.
  3. `verl/workers/engine_workers.py::train_mini_batch`: the mini-batch `ppo_mini_batch_size × n`
     (`verl/trainer/ppo/ray_trainer.py::_update_actor`) divisible by the data-parallel size (= world).
  4. `verl/workers/engine/utils.py::prepare_micro_batches`: each GPU's share of a mini-batch
     (`ppo_mini_batch_size × n / world`) and of the whole batch, for the log-prob passes
     (`train_batch_size × n / world`), divisible by `micro_batch_size_per_gpu`.
  5. `verl/workers/rollout/llm_server.py` (replicas = world // TP) and `verl/workers/engine_workers.py`
     ("rollout world_size … not divisible by infer_world_size"): world divisible by the rollout TP;
     `verl/workers/rollout/replica.py`: a TP wider than a node must be a multiple of `n_gpus_per_node`.
- **GPU memory is judged by fractions**, as vLLM and verl's rollout take it: on a GPU that both the
  environment server and verl's rollout use, `gpu_memory_utilization` + `rollout_gpu_memory_utilization`
  must not exceed 1 (vLLM refuses to start, or the second one runs out of memory).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from urllib.parse import urlsplit

from pipeline.config import ConfigError, Params
from pipeline.environment.budget import reply_budget_problems

LOOPBACK_NAMES = frozenset({"localhost", "ip6-localhost", ""})


@dataclass(frozen=True)
class LayoutProblem:
    """One reason the params cannot run, and the param keys that decide it."""

    keys: tuple[str, ...]
    message: str

    def __str__(self) -> str:
        return f"{', '.join(self.keys)}: {self.message}"


class LayoutError(ConfigError):
    """The merged params describe a layout that cannot run (one problem per line of the message)."""

    def __init__(self, problems: list[LayoutProblem]) -> None:
        self.problems = problems
        super().__init__("the params describe a layout that cannot run:\n" + "\n".join(map(str, problems)))


def assert_runnable(params: Params) -> None:
    """Raise LayoutError when `layout_problems(params)` finds anything; call before starting any stage."""
    problems = layout_problems(params)
    if problems:
        raise LayoutError(problems)


def layout_problems(params: Params) -> list[LayoutProblem]:
    """Every problem with the placement, parallelism and batch arithmetic of the active backends."""
    problems = _environment_problems(params)
    problems += [LayoutProblem(keys, message) for keys, message in reply_budget_problems(params)]
    if params.train.backend == "verl":
        problems += _verl_problems(params)
        problems += _sharing_problems(params)
    return problems


# --------------------------------------------------------------------------------------------- placement
def is_loopback(host: str) -> bool:
    """True for an address only this machine reaches (127.0.0.0/8, ::1, localhost, 0.0.0.0, ::)."""
    host = host.strip("[]").lower()
    if host in LOOPBACK_NAMES:
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return address.is_loopback or address.is_unspecified


def environment_started_here(params: Params) -> bool:
    """Whether the pipeline starts the environment server on this machine (vllm/llamacpp at its own
    host:port) rather than using one at a `base_url` elsewhere."""
    env = params.environment
    if env.backend == "api":
        return False
    return not env.base_url or env.url == f"http://{env.host}:{env.port}/v1"


def environment_gpus(params: Params) -> list[int]:
    """CUDA device ids the environment server takes on this machine ([] when it takes none here)."""
    server = params.environment.server
    if params.environment.backend != "vllm" or not environment_started_here(params):
        return []
    return list(server.gpus) or list(range(server.tensor_parallel_size))


def training_gpus(params: Params) -> list[int]:
    """CUDA device ids verl takes on each node ([] with the local backend, which is not placed here)."""
    verl = params.train.verl
    if params.train.backend != "verl":
        return []
    return list(verl.gpus) or list(range(verl.n_gpus_per_node))


def cuda_visible_devices(gpus: list[int]) -> str:
    """The CUDA_VISIBLE_DEVICES value for a device list."""
    return ",".join(str(g) for g in gpus)


# --------------------------------------------------------------------------------------------- rules
def _fraction_problem(key: str, value: float) -> list[LayoutProblem]:
    if 0 < value <= 1:
        return []
    return [LayoutProblem((key,), f"a GPU memory fraction must be in (0, 1], got {value}")]


def _device_list_problems(key: str, gpus: list[int]) -> list[LayoutProblem]:
    if any(g < 0 for g in gpus) or len(set(gpus)) != len(gpus):
        return [LayoutProblem((key,), f"CUDA device ids must be distinct and >= 0, got {gpus}")]
    return []


def _environment_problems(params: Params) -> list[LayoutProblem]:
    server = params.environment.server
    if params.environment.backend != "vllm" or not environment_started_here(params):
        return []
    problems = _device_list_problems("environment.server.gpus", server.gpus)
    problems += _fraction_problem("environment.server.gpu_memory_utilization", server.gpu_memory_utilization)
    if server.gpus and server.tensor_parallel_size > len(server.gpus):
        problems.append(LayoutProblem(
            ("environment.server.tensor_parallel_size", "environment.server.gpus"),
            f"tensor parallel {server.tensor_parallel_size} needs that many GPUs; "
            f"{len(server.gpus)} given ({server.gpus})"))
    return problems


def _verl_problems(params: Params) -> list[LayoutProblem]:
    v = params.train.verl
    problems = _device_list_problems("train.verl.gpus", v.gpus)
    problems += _fraction_problem("train.verl.rollout_gpu_memory_utilization", v.rollout_gpu_memory_utilization)
    if v.gpus and len(v.gpus) != v.n_gpus_per_node:
        problems.append(LayoutProblem(
            ("train.verl.gpus", "train.verl.n_gpus_per_node"),
            f"{len(v.gpus)} device ids given for {v.n_gpus_per_node} GPUs per node"))
    world = v.n_gpus_per_node * v.nnodes
    tp_keys = ("train.verl.rollout_tp", "train.verl.n_gpus_per_node", "train.verl.nnodes")
    if v.rollout_tp > world:
        problems.append(LayoutProblem(tp_keys, f"rollout tensor parallel {v.rollout_tp} is larger than the "
                                               f"{world} training GPUs"))
    elif world % v.rollout_tp:
        problems.append(LayoutProblem(tp_keys, f"the {world} training GPUs do not split into rollout "
                                               f"replicas of tensor parallel {v.rollout_tp}"))
    elif v.rollout_tp > v.n_gpus_per_node and v.rollout_tp % v.n_gpus_per_node:
        problems.append(LayoutProblem(tp_keys, f"rollout tensor parallel {v.rollout_tp} spans nodes of "
                                               f"{v.n_gpus_per_node} GPUs unevenly"))
    problems += _batch_problems(params, world)
    if (v.test_freq > 0 or v.val_before_train) and not params.eval_datasets:
        problems.append(LayoutProblem(
            ("data.id_eval_datasets", "data.ood_eval_datasets", "train.verl.test_freq",
             "train.verl.val_before_train"),
            "validation is requested but the validation set is empty: name evaluation datasets, or set "
            "test_freq: -1 and val_before_train: false"))
    if v.nnodes > 1 and is_loopback(urlsplit(params.environment.url).hostname or ""):
        problems.append(LayoutProblem(
            ("train.verl.nnodes", "environment.base_url" if params.environment.base_url else "environment.host"),
            f"agent-loop workers on {v.nnodes} nodes cannot reach the environment at {params.environment.url}: "
            "give an address the other nodes reach"))
    return problems


def _batch_problems(params: Params, world: int) -> list[LayoutProblem]:
    """verl's divisibility checks (module docstring, items 1-4), in questions × group size."""
    t = params.train
    n, batch, mini, micro = t.group_size, t.batch_size, t.mini_batch_size, t.micro_batch_size
    gpus = ("train.verl.n_gpus_per_node", "train.verl.nnodes")
    problems: list[LayoutProblem] = []
    if (batch * n) % world:
        problems.append(LayoutProblem(("train.batch_size", "train.group_size", *gpus),
                                      f"batch {batch} x group {n} = {batch * n} trajectories do not split "
                                      f"over {world} training GPUs"))
    if batch < mini:
        problems.append(LayoutProblem(("train.batch_size", "train.mini_batch_size"),
                                      f"mini-batch {mini} is larger than the batch {batch}"))
    if (mini * n) % world:
        problems.append(LayoutProblem(("train.mini_batch_size", "train.group_size", *gpus),
                                      f"mini-batch {mini} x group {n} = {mini * n} trajectories do not split "
                                      f"over {world} training GPUs"))
    elif (mini * n // world) % micro:
        problems.append(LayoutProblem(("train.micro_batch_size", "train.mini_batch_size", "train.group_size"),
                                      f"each GPU's {mini * n // world} trajectories per mini-batch do not split "
                                      f"into micro-batches of {micro}"))
    if not (batch * n) % world and (batch * n // world) % micro:
        problems.append(LayoutProblem(("train.micro_batch_size", "train.batch_size", "train.group_size"),
                                      f"each GPU's {batch * n // world} trajectories per batch do not split into "
                                      f"micro-batches of {micro} (log-prob passes)"))
    return problems


def _sharing_problems(params: Params) -> list[LayoutProblem]:
    """Environment server and verl's rollout on the same GPU: their memory fractions must fit in one."""
    shared = sorted(set(environment_gpus(params)) & set(training_gpus(params)))
    env_fraction = params.environment.server.gpu_memory_utilization
    rollout_fraction = params.train.verl.rollout_gpu_memory_utilization
    if not shared or env_fraction + rollout_fraction <= 1:
        return []
    return [LayoutProblem(
        ("environment.server.gpus", "train.verl.gpus", "environment.server.gpu_memory_utilization",
         "train.verl.rollout_gpu_memory_utilization"),
        f"GPUs {shared} hold the environment server ({env_fraction}) and verl's rollout ({rollout_fraction}): "
        f"{env_fraction + rollout_fraction:g} of their memory; give them disjoint GPUs or fractions that sum to "
        "at most 1")]


def describe(params: Params) -> str:
    """One line: where training and the environment run (what `promptr1 check` prints on success)."""
    t, v, env = params.train, params.train.verl, params.environment
    if t.backend == "verl":
        train = (f"verl on {v.nnodes} node(s) x GPUs {training_gpus(params)}, rollout TP {v.rollout_tp}, "
                 f"batch {t.batch_size} x group {t.group_size}")
    else:
        train = "local backend"
    if env.backend == "vllm" and environment_started_here(params):
        where = f"vllm on GPUs {environment_gpus(params)} (TP {env.server.tensor_parallel_size})"
    elif environment_started_here(params):
        where = f"{env.backend} on this machine"
    else:
        where = f"{env.backend} at {env.url}"
    return f"profile {params.profile}: {train}; environment {env.model}: {where}"
