"""Layout check: can the merged params run at all on the machines they describe? Params only: no network, no GPU.

`layout_problems(params)` returns every problem found (each naming the param keys to change);
`assert_runnable(params)` raises `LayoutError` listing them. `promptr1 check [-S key=value …]` prints them
(exit 2) and every stage and the flow call `assert_runnable` before starting anything, so a layout that
would fail after an hour of model downloads and server start-ups fails in seconds, on any machine, CI
included: nothing here touches the network, a GPU or the data (verl's Hydra composition reads YAML: ~1 s).

Design decisions:
- **Only the components the active backends use are judged.** The local backend, a llama.cpp environment
  (CPU) and a paid API have no GPU layout; the default CPU profile passes with nothing to check.
- **Placement is explicit.** `train.verl.gpus` (per node, Ray's CUDA_VISIBLE_DEVICES) and
  `environment.server.gpus` (the vLLM server's CUDA_VISIBLE_DEVICES) name CUDA device ids; an empty list
  means what the tools do unasked — Ray takes the first `n_gpus_per_node` devices and vLLM the first
  `tensor_parallel_size` — so two empty lists overlap, as they do on a real node. An environment at a
  `base_url` other than its own host/port runs elsewhere and shares no GPU with training (the helpers live
  in `pipeline.placement`).
- **The composed config is judged, not the params**: with backend verl, `pipeline.train.verl.config`
  composes what `train` hands verl (params, `pipeline/train/verl/overrides.yaml`, `train.verl.extra_overrides`)
  with verl's own `ppo_trainer.yaml`, and the rules below read verl's keys from it; each problem names verl's
  key and ours (`train.verl.extra_overrides` when that list set the key).
- **verl's own arithmetic, copied with its source cited**, for FSDP without dynamic batch size or
  sequence parallelism (what `pipeline.train.verl.overrides.build_overrides` sets; with
  `use_dynamic_bsz` the micro-batch rules are skipped). `n` = `rollout.n` (`train.group_size`),
  world = `trainer.n_gpus_per_node × trainer.nnodes` (the actor, reference and rollout are colocated):
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
  6. `verl/utils/tensordict_utils.py::make_iterator` (called by `engine_workers.py::train_mini_batch`):
     each GPU's share of the batch must be a whole number of its mini-batch shares, i.e. `train_batch_size`
     divisible by `ppo_mini_batch_size`; it asserts at the first actor update, after rollout.
  7. `verl/experimental/agent_loop/agent_loop.py::AgentLoopManager.generate_sequences` splits the
     `train_batch_size × n` trajectories over `rollout.agent.num_workers` agent-loop workers with
     `DataProto.chunk` (`verl/protocol.py`: "only support equal chunk"), unpadded at training time. Validation
     batches are padded to that divisor first (`ray_trainer.py::_validate`, `pad_dataproto_to_divisor`), so
     they need no rule.
- **What the stage reads back from verl is kept as it reads it** (its console and MLflow loggers, resuming
  as the resume check assumes, the Ray it joins): pipeline/checks/verl_read_back.py, whose problems are
  wrapped here like the environment's reply-budget ones.
- **GPU memory is judged by fractions**, as vLLM and verl's rollout take it: on a GPU that both the
  environment server and verl's rollout use, `gpu_memory_utilization` + `rollout_gpu_memory_utilization`
  must not exceed 1 (vLLM refuses to start, or the second one runs out of memory). What the fractions leave
  of `train.verl.gpu_memory_gb` must hold what verl's FSDP actor keeps on the GPU while the rollout runs: its
  weights and Adam states, a CUDA context and the weight-sync bucket (no gradients, the reference in CPU
  memory; `pipeline.train.verl.memory`, an estimate whose assumptions it lists); a model whose parameter count is
  unknown offline is not judged (`describe` says so).
- **What only the machine knows** (its GPUs, a Ray cluster's GPUs, free disk for checkpoints) is checked at
  the verl stage's start, by `pipeline.train.verl.resources`, not here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from pipeline.checks.verl_read_back import read_back_problems
from pipeline.config import ConfigError, EnvironmentConfig, Params, VerlConfig
from pipeline.environment.budget import reply_budget_problems
from pipeline.errors import UserError
from pipeline.modelref import ModelRefError
from pipeline.placement import (
    gpus_of_environment,
    gpus_of_training,
    is_loopback,
    started_here,
)
from pipeline.train.plan import TrainPlan
from pipeline.train.verl import memory
from pipeline.train.verl.config import EXTRA_OVERRIDES, ComposeError, VerlRun, compose_plan

__all__ = ["LayoutError", "LayoutProblem", "actor_estimate", "assert_environment_runnable", "assert_runnable",
           "describe", "environment_layout_problems", "layout_problems", "smallest_batch"]

GPUS = ("trainer.n_gpus_per_node", "trainer.nnodes")
BATCH, N, MINI = "data.train_batch_size", "actor_rollout_ref.rollout.n", "actor_rollout_ref.actor.ppo_mini_batch_size"
MICRO = "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"
LOG_PROB_MICRO = ("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
                  "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu")
TP, ROLLOUT_FRACTION = "actor_rollout_ref.rollout.tensor_model_parallel_size", "actor_rollout_ref.rollout.gpu_memory_utilization"
AGENT_WORKERS = "actor_rollout_ref.rollout.agent.num_workers"
WEIGHT_SYNC_BUCKET = "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes"


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


@dataclass(frozen=True)
class Placement:
    """What the rules below read, resolved once from the params by `layout_problems`: the environment and
    verl sections, the agent, and which GPUs each part takes (pipeline/placement.py's answers)."""

    environment: EnvironmentConfig
    verl: VerlConfig
    agent_model: str
    root: Path
    environment_here: bool
    """Whether the pipeline starts the environment server on this machine (`started_here`)."""
    environment_gpus: tuple[int, ...]
    training_gpus: tuple[int, ...]

    @classmethod
    def for_layout(cls, params: Params) -> Placement:
        return cls(environment=params.environment, verl=params.train.verl, agent_model=params.agent.model,
                   root=params.root, environment_here=started_here(params.environment),
                   environment_gpus=tuple(gpus_of_environment(params.environment)),
                   training_gpus=tuple(gpus_of_training(params.train)))

    @property
    def shared_gpus(self) -> list[int]:
        """GPUs both the environment server and verl take."""
        return sorted(set(self.environment_gpus) & set(self.training_gpus))


def assert_runnable(params: Params) -> None:
    """Raise LayoutError when `layout_problems(params)` finds anything; call before starting any stage."""
    problems = layout_problems(params)
    if problems:
        raise LayoutError(problems)


def assert_environment_runnable(params: Params) -> None:
    """Raise LayoutError when `environment_layout_problems(params)` finds anything (`promptr1 env …`)."""
    problems = environment_layout_problems(params)
    if problems:
        raise LayoutError(problems)


def environment_layout_problems(params: Params) -> list[LayoutProblem]:
    """The problems of the environment server alone: its devices, memory fraction and tensor parallelism, and
    one call's time budget. What `promptr1 env start` judges: on a node that runs only the environment server
    (the paper's second 8-GPU node) the trainer's placement, which the params also describe, is not this
    node's to run, so its GPUs, memory and batch arithmetic are not judged there."""
    problems = _environment_problems(Placement.for_layout(params))
    budget = reply_budget_problems(params.environment)
    return problems + [LayoutProblem(keys, message) for keys, message in budget]


def layout_problems(params: Params) -> list[LayoutProblem]:
    """Every problem with the placement, parallelism, batch arithmetic and memory of the active backends."""
    place = Placement.for_layout(params)
    problems = _environment_problems(place)
    problems += [LayoutProblem(keys, message) for keys, message in reply_budget_problems(params.environment)]
    if params.train.backend == "verl":
        try:
            run = compose_plan(TrainPlan.from_params(params))
        except (ModelRefError, UserError) as exc:
            return [*problems, LayoutProblem(("agent.model",), str(exc))]
        except ComposeError as exc:
            return [*problems, LayoutProblem((EXTRA_OVERRIDES,), str(exc))]
        problems += _verl_problems(place, run)
        problems += [LayoutProblem(keys, message) for keys, message in read_back_problems(run)]
        problems += _batch_problems(run)
        problems += _sharing_problems(place, run)
        problems += _memory_problems(place, run)
    return problems


def _keys(run: VerlRun, *verl_keys: str, ours: tuple[str, ...] = ()) -> tuple[str, ...]:
    """Our keys for a problem: those that set `verl_keys` (or extra_overrides), then `ours`, no repeats."""
    return tuple(dict.fromkeys((*run.ours(*verl_keys), *ours)))


# --------------------------------------------------------------------------------------------- rules
def _fraction_problem(key: str, value: float) -> list[LayoutProblem]:
    if 0 < value <= 1:
        return []
    return [LayoutProblem((key,), f"a GPU memory fraction must be in (0, 1], got {value}")]


def _device_list_problems(key: str, gpus: list[int]) -> list[LayoutProblem]:
    if any(g < 0 for g in gpus) or len(set(gpus)) != len(gpus):
        return [LayoutProblem((key,), f"CUDA device ids must be distinct and >= 0, got {gpus}")]
    return []


def _environment_problems(place: Placement) -> list[LayoutProblem]:
    server = place.environment.server
    if place.environment.backend != "vllm" or not place.environment_here:
        return []
    problems = _device_list_problems("environment.server.gpus", server.gpus)
    problems += _fraction_problem("environment.server.gpu_memory_utilization", server.gpu_memory_utilization)
    if server.gpus and server.tensor_parallel_size > len(server.gpus):
        problems.append(LayoutProblem(
            ("environment.server.tensor_parallel_size", "environment.server.gpus"),
            f"tensor parallel {server.tensor_parallel_size} needs that many GPUs; "
            f"{len(server.gpus)} given ({server.gpus})"))
    return problems


def _verl_problems(place: Placement, run: VerlRun) -> list[LayoutProblem]:
    v, env = place.verl, place.environment
    per_node, nnodes, tp = run.value(GPUS[0]), run.value(GPUS[1]), run.value(TP)
    problems = _device_list_problems("train.verl.gpus", v.gpus)
    for p in _fraction_problem(ROLLOUT_FRACTION, run.value(ROLLOUT_FRACTION)):
        problems.append(LayoutProblem(run.ours(ROLLOUT_FRACTION), f"{ROLLOUT_FRACTION}: {p.message}"))
    if v.gpus and len(v.gpus) != per_node:
        problems.append(LayoutProblem(("train.verl.gpus", *run.ours(GPUS[0])),
                                      f"{len(v.gpus)} device ids given for {run.show(GPUS[0])} GPUs per node"))
    world = per_node * nnodes
    tp_keys = _keys(run, TP, *GPUS)
    where = f"({run.show(TP)}, {run.show(GPUS[0])}, {run.show(GPUS[1])})"
    if tp > world:
        problems.append(LayoutProblem(tp_keys, f"rollout tensor parallel {tp} is larger than the {world} training "
                                               f"GPUs {where}"))
    elif world % tp:
        problems.append(LayoutProblem(tp_keys, f"the {world} training GPUs do not split into rollout replicas of "
                                               f"tensor parallel {tp} {where}"))
    elif tp > per_node and tp % per_node:
        problems.append(LayoutProblem(tp_keys, f"rollout tensor parallel {tp} spans nodes of {per_node} GPUs "
                                               f"unevenly {where}"))
    if (run.value("trainer.test_freq") > 0 or run.value("trainer.val_before_train")) and not run.value(
            "data.val_files"):
        problems.append(LayoutProblem(
            ("data.id_eval_datasets", "data.ood_eval_datasets",
             *_keys(run, "trainer.test_freq", "trainer.val_before_train")),
            "validation is requested but the validation set is empty: name evaluation datasets, or set "
            "test_freq: -1 and val_before_train: false"))
    if nnodes > 1 and is_loopback(urlsplit(env.url).hostname or ""):
        problems.append(LayoutProblem(
            (*run.ours(GPUS[1]), "environment.base_url" if env.base_url else "environment.host"),
            f"agent-loop workers on {nnodes} nodes ({run.show(GPUS[1])}) cannot reach the environment at "
            f"{env.url}: give an address the other nodes reach"))
    return problems


def _batch_problems(run: VerlRun) -> list[LayoutProblem]:
    """verl's divisibility checks (module docstring, items 1-4, 6, 7), in questions × rollout.n."""
    n, batch, mini, micro = run.value(N), run.value(BATCH), run.value(MINI), run.value(MICRO)
    world = run.value(GPUS[0]) * run.value(GPUS[1])
    gpus = f"{world} training GPUs ({run.show(GPUS[0])} x {run.show(GPUS[1])})"
    problems: list[LayoutProblem] = []

    def problem(verl_keys: tuple[str, ...], message: str, ours: tuple[str, ...] = ()) -> None:
        problems.append(LayoutProblem(_keys(run, *verl_keys, ours=ours), message))

    if (batch * n) % world:
        problem((BATCH, N, *GPUS), f"batch {batch} x group {n} = {batch * n} trajectories ({BATCH} x {N}) do not "
                                   f"split over {gpus}")
    if batch < mini:
        problem((BATCH, MINI), f"mini-batch {mini} ({MINI}) is larger than the batch {batch} ({BATCH})")
    elif batch % mini:
        problem((BATCH, MINI), f"batch {batch} ({BATCH}) is not a whole number of mini-batches of {mini} ({MINI}): "
                               "verl's make_iterator asserts at the first actor update")
    workers = run.value(AGENT_WORKERS)
    if workers and (batch * n) % workers:
        problem((BATCH, N, AGENT_WORKERS),
                f"batch {batch} x group {n} = {batch * n} trajectories do not split over {run.show(AGENT_WORKERS)} "
                f"agent-loop workers (verl's DataProto.chunk asserts at the first rollout; set {AGENT_WORKERS} "
                f"through {EXTRA_OVERRIDES} to a divisor)", ours=(EXTRA_OVERRIDES,))
    if (mini * n) % world:
        problem((MINI, N, *GPUS), f"mini-batch {mini} x group {n} = {mini * n} trajectories ({MINI} x {N}) do not "
                                  f"split over {gpus}")
    if run.value("actor_rollout_ref.actor.use_dynamic_bsz"):
        return problems  # micro-batches are sized by tokens, not counts
    if not (mini * n) % world and (mini * n // world) % micro:
        problem((MICRO, MINI, N), f"each GPU's {mini * n // world} trajectories per mini-batch do not split "
                                  f"into micro-batches of {micro} ({MICRO})")
    share = batch * n // world
    failing = [key for key in LOG_PROB_MICRO if not (batch * n) % world and share % run.value(key)]
    if failing:
        problem((*failing, BATCH, N), f"each GPU's {share} trajectories per batch do not split into micro-batches "
                                      f"of {', '.join(map(run.show, failing))} (log-prob passes)")
    return problems


def smallest_batch(run: VerlRun) -> int:
    """The fewest questions per step verl accepts for the config `run` composes, as one mini-batch
    (`train_batch_size` = `ppo_mini_batch_size`): the smallest m for which m × `rollout.n` trajectories pass
    `_batch_problems` (module docstring, rules 1-4, 6, 7): a multiple of the training GPUs times each
    per-GPU micro-batch (the update's and both log-prob passes'; the GPUs alone with `use_dynamic_bsz`) and of
    the agent-loop workers. `promptr1 doctor`'s verl step runs one step of it."""
    n, world = run.value(N), run.value(GPUS[0]) * run.value(GPUS[1])
    micro = [] if run.value("actor_rollout_ref.actor.use_dynamic_bsz") else [MICRO, *LOG_PROB_MICRO]
    trajectories = math.lcm(world, *(world * run.value(key) for key in micro if run.value(key)),
                            run.value(AGENT_WORKERS) or 1)
    return trajectories // math.gcd(trajectories, n)


def _sharing_problems(place: Placement, run: VerlRun) -> list[LayoutProblem]:
    """Environment server and verl's rollout on the same GPU: their memory fractions must fit in one."""
    shared = place.shared_gpus
    env_fraction = place.environment.server.gpu_memory_utilization
    rollout_fraction = run.value(ROLLOUT_FRACTION)
    if not shared or env_fraction + rollout_fraction <= 1:
        return []
    return [LayoutProblem(
        ("environment.server.gpus", "train.verl.gpus", "environment.server.gpu_memory_utilization",
         *run.ours(ROLLOUT_FRACTION)),
        f"GPUs {shared} hold the environment server ({env_fraction}) and verl's rollout ({ROLLOUT_FRACTION}="
        f"{rollout_fraction}): {env_fraction + rollout_fraction:g} of their memory; give them disjoint GPUs or "
        "fractions that sum to at most 1")]


# --------------------------------------------------------------------------------------------- memory
def actor_estimate(place: Placement, run: VerlRun) -> tuple[memory.ActorMemory, float, str] | None:
    """(the FSDP actor's per-GPU memory, the GiB the memory fractions leave it, where the parameter count
    comes from), or None when the parameter count is unknown offline or the strategy is not FSDP."""
    actor, ref = "actor_rollout_ref.actor", "actor_rollout_ref.ref"
    found = memory.parameter_count(place.agent_model, place.root)
    if found is None or run.value(f"{actor}.strategy") not in ("fsdp", "fsdp2"):
        return None
    world = run.value(GPUS[0]) * run.value(GPUS[1])
    fsdp_size = run.value(f"{actor}.fsdp_config.fsdp_size")
    reference = bool(run.value(f"{actor}.use_kl_loss") or run.value("algorithm.use_kl_in_reward"))
    estimate = memory.actor_memory(
        found[0], shards=fsdp_size if fsdp_size and fsdp_size > 0 else world,
        model_dtype=run.value(f"{actor}.fsdp_config.model_dtype"),
        param_offload=bool(run.value(f"{actor}.fsdp_config.param_offload")),
        optimizer_offload=bool(run.value(f"{actor}.fsdp_config.optimizer_offload")),
        lora=bool(run.value("actor_rollout_ref.model.lora_rank")), reference=reference,
        ref_dtype=run.value(f"{ref}.fsdp_config.model_dtype") or "fp32",
        ref_on_cpu=bool(run.value(f"{ref}.fsdp_config.forward_only")
                        or run.value(f"{ref}.fsdp_config.param_offload")),
        weight_sync_megabytes=run.value(WEIGHT_SYNC_BUCKET))
    shared = place.shared_gpus
    taken = run.value(ROLLOUT_FRACTION) + (place.environment.server.gpu_memory_utilization if shared else 0)
    return estimate, max(0.0, 1 - taken) * place.verl.gpu_memory_gb, found[1]


def _memory_problems(place: Placement, run: VerlRun) -> list[LayoutProblem]:
    found = actor_estimate(place, run)
    if found is None:
        return []
    estimate, left_gib, source = found
    if estimate.total / memory.GIB <= left_gib:
        return []
    shared = place.shared_gpus
    offload = "actor_rollout_ref.actor.fsdp_config.param_offload/optimizer_offload"
    return [LayoutProblem(
        ("train.verl.gpu_memory_gb", *run.ours(ROLLOUT_FRACTION),
         *(("environment.server.gpu_memory_utilization",) if shared else ()), "agent.model",
         *run.ours(*GPUS, "actor_rollout_ref.actor.fsdp_config.param_offload")),
        f"verl's FSDP actor for {place.agent_model} ({source}) holds an estimated {estimate.describe()} per "
        f"training GPU during rollout, but the memory fractions leave {left_gib:.1f} of "
        f"{place.verl.gpu_memory_gb:g} GiB ({ROLLOUT_FRACTION}={run.value(ROLLOUT_FRACTION)}"
        f"{', plus the environment server' if shared else ''}): use more GPUs, lower the fractions, or offload "
        f"({offload}=true through {EXTRA_OVERRIDES})")]


def describe(params: Params) -> str:
    """One line: where training and the environment run (what `promptr1 check` prints on success)."""
    t, v, env = params.train, params.train.verl, params.environment
    if t.backend == "verl":
        train = (f"verl on {v.nnodes} node(s) x GPUs {gpus_of_training(t)}, rollout TP {v.rollout_tp}, "
                 f"batch {t.batch_size} x group {t.group_size}")
        found = actor_estimate(Placement.for_layout(params), compose_plan(TrainPlan.from_params(params)))
        train += (f", actor ~{found[0].total / memory.GIB:.1f} of {found[1]:.1f} GiB left per GPU" if found else
                  f", actor memory not estimated (no parameter count for {params.agent.model} offline)")
    else:
        train = "local backend"
    if env.backend == "vllm" and started_here(env):
        where = f"vllm on GPUs {gpus_of_environment(env)} (TP {env.server.tensor_parallel_size})"
    elif started_here(env):
        where = f"{env.backend} on this machine"
    else:
        where = f"{env.backend} at {env.url}"
    return f"profile {params.profile}: {train}; environment {env.model}: {where}"
