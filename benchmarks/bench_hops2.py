"""The pre-registered `hops2` learning experiment: GRPO at settings GRPO is known to work with, against its controls.

    bash benchmarks/run_hops2.sh                          # both workers (one core each), then the report
    python benchmarks/bench_hops2.py --worker A           # one worker: takes the plan's next open task
    python benchmarks/bench_hops2.py --report             # learning.json's `hops2` from the committed files

What runs, why, what is predicted and when a seed stops are fixed in benchmarks/results/learning/hops2/plan.md,
committed before any result; this script runs exactly that plan (its `SETTINGS` and `TASKS`).

Tasks, in the plan's order, each taken by the first idle worker whose inputs exist (a claim is a folder under
`.cache/hops2/claims/`; a dead worker's claim is taken over):
- `warmup/<seed>`: the seed's data stages, every hops rule on the held-out rows, the learn-hops warm-up
  (unchanged) and its held-out evaluation (`grpo_step0.json`); the warm-up checkpoint is copied for the
  shuffled arm before GRPO can move it.
- `grpo/<seed>`: GRPO from the warm-up on the seed's 2-hop training questions. After 3 steps the seed stops
  (`early_stop.json`) when no group of those steps had answer-reward variance; the health gate may stop it
  later, and then its result is the checkpoint the gate kept. Its final checkpoint is evaluated.
- `shuffled_advantage/<seed>`: the same run with each step's scores permuted within each group before the
  advantage (so flat groups stay flat and the update's size is GRPO's, without the reward's information);
  it follows GRPO's early stop.
- `warmup_continued/<seed>`: the warm-up run on as many more demonstrations as GRPO sampled (GRPO's steps x 24).
- `transfer/<seed>`: the PopQA 2-hop chains (benchmarks/hops_transfer.py) on every final checkpoint.

Every evaluation is greedy through llama.cpp's server (an F16 GGUF export of the checkpoint), as the evaluate
stage runs a CPU agent; files land in `benchmarks/results/learning/hops2/seed<N>/`. A task resumes after an
interruption: training from its last checkpoint (save_every 1), evaluations skipped when their file exists.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import sys
import time
import zlib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_learning import (
    build_data,
    free_port,
    heldout_rows,
    hops_rules_file,
    keep_rollouts,
    knowledge_store,
    training_questions,
    transfer_rows,
    write_json,
)

OUT = ROOT / "benchmarks" / "results" / "learning" / "hops2"
WORK = ROOT / ".cache" / "hops2"
SEEDS = (1, 2, 3)
EARLY_STEPS = 3
"""The seed stops after this many GRPO steps when none of their groups had answer-reward variance."""
SETTINGS: dict[str, Any] = {
    "profile": "learn-hops",
    "reward": {"preset": "paper"},
    "train": {"steps": 10, "batch_size": 4, "group_size": 6, "mini_batch_size": 4, "micro_batch_size": 6,
              "lr": 1.0e-5, "lr_warmup_steps": 2, "save_every": 1, "keep_checkpoints": 2,
              "health": {"max_kl": 0.1}},
    "evaluate": {"rows_per_dataset": 48, "agent_engine": "llama.cpp"},
}
"""The plan's settings over the learn-hops profile (plan.md, "Settings"); the warm-up is the profile's."""
ARMS = ("grpo", "shuffled_advantage")
TRANSFER_LIMIT: int | None = None
"""PopQA chains evaluated (None: hops_transfer.CHAINS)."""
log = logging.getLogger("bench_hops2")


def tasks() -> list[tuple[str, int]]:
    """(task, seed) in the plan's order."""
    out: list[tuple[str, int]] = []
    for seed in SEEDS:
        out += [("warmup", seed), ("grpo", seed), ("shuffled_advantage", seed)]
    out += [("warmup_continued", seed) for seed in SEEDS]
    out += [("transfer", seed) for seed in SEEDS]
    return out


def seed_out(seed: int) -> Path:
    return OUT / f"seed{seed}"


def arm_params(seed: int, arm: str, port: int):
    """The plan's params for one arm of one seed, every output under `.cache/hops2/seed<N>/<arm>/`."""
    from pipeline.config import load_params

    work = WORK / f"seed{seed}" / arm
    paths = {name: str(work / sub) for name, sub in (
        ("sampled_dir", "data/sampled"), ("rl_dir", "data/rl"), ("reports_dir", "reports"),
        ("checkpoint_dir", "checkpoints/agent"), ("model_dir", "models/agent"), ("cache_dir", "cache"))}
    overrides = json.loads(json.dumps(SETTINGS))
    overrides.update({"paths": paths, "seed": seed,
                      "environment": {"port": port, "knowledge": {"mode": "hops"}}})
    params = load_params(ROOT / "params.yaml", overrides)
    data = WORK / f"seed{seed}" / "grpo" / "data" / "rl"
    params.environment.knowledge.sources = [str(data / "train.parquet"), str(data / "eval")]
    return params


def eval_params_of(params):
    """The evaluation's params: the environment at the evaluate stage's temperature."""
    p = params.model_copy(deep=True)
    p.root = params.root
    p.environment.temperature = params.evaluate.env_temperature
    return p


def evaluate_served(model_dir: Path, tokenizer, env, rows_by_ds, params, label: str) -> dict[str, Any]:
    """Greedy held-out answers of the checkpoint in `model_dir` through llama.cpp's server, per question (the
    fields of `bench_learning.evaluate_agent`)."""
    from bench_learning import evaluation_record

    from pipeline.agent.evaluation_policy import evaluation_policy, rollout_batch_size
    from pipeline.evaluation.plan import EvaluatePlan
    from pipeline.evaluation.systems import run_agent_with_environment

    plan = EvaluatePlan.for_evaluate(params)
    start = time.perf_counter()
    with evaluation_policy(str(model_dir), plan.agent_serving, params.evaluate, tokenizer,
                           engine="llama.cpp") as policy:
        answers = run_agent_with_environment(policy, env, rows_by_ds, params.agent, params.evaluate, label,
                                             batch_size=rollout_batch_size("llama.cpp", params.evaluate))
    return evaluation_record(answers, rows_by_ds, params, time.perf_counter() - start)


@contextlib.contextmanager
def two_hop_questions(params):
    """GRPO draws only the training file's 2-hop questions (the seeded shuffle over them, checkpointed as
    usual); the warm-up still chooses its demonstrations from the whole file, as the profile does."""
    from pipeline.environment.simulated.hops_world import world
    from pipeline.train.local import backend as local
    from pipeline.train.local.questions import QuestionSampler

    store = world()
    rows = [i for i, q in enumerate(training_questions(params))
            if (found := store.question(q)) is not None and found.hops == 2]

    class TwoHopSampler(QuestionSampler):
        def __init__(self, n_rows: int, seed: int, epoch: int = 0, position: int = 0) -> None:
            super().__init__(len(rows), seed, epoch, position)

        def next_batch(self, k: int) -> list[int]:
            return [rows[i] for i in super().next_batch(k)]

    original = local.QuestionSampler
    local.QuestionSampler = TwoHopSampler
    try:
        yield len(rows)
    finally:
        local.QuestionSampler = original


def permuted_within_groups(scores, group_ids: list[str], seed: int):
    """`scores` with each group's values permuted among its members (a seeded permutation derived from the
    scores, so a resumed step permutes as the killed one did); a flat group stays flat."""
    import torch

    out = scores.clone()
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(scores.numpy().tobytes()))
    members: dict[str, list[int]] = {}
    for i, group in enumerate(group_ids):
        members.setdefault(group, []).append(i)
    for index in members.values():
        order = torch.randperm(len(index), generator=generator)
        out[index] = scores[[index[j] for j in order.tolist()]]
    return out


@contextlib.contextmanager
def shuffled_advantages(seed: int):
    """The trainer's advantages computed from scores permuted within each group (`permuted_within_groups`)."""
    from pipeline.train.local import trainer

    original = trainer.step_advantages
    trainer.step_advantages = lambda scores, mask, group_ids: original(
        permuted_within_groups(scores, group_ids, seed), mask, group_ids)
    try:
        yield
    finally:
        trainer.step_advantages = original


def answer_variance_groups(trajectories: Path, upto: int) -> dict[int, int]:
    """Per step <= `upto`, the groups (a question's G trajectories) whose answer reward is not all equal."""
    groups: dict[tuple[int, str], list[float]] = {}
    for line in trajectories.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        if row["step"] <= upto:
            groups.setdefault((row["step"], row["uid"]), []).append(float((row["reward"] or {}).get("answer", 0.0)))
    out = {step: 0 for step in range(1, upto + 1)}
    for (step, _), values in groups.items():
        out[step] += int(max(values) - min(values) > 1e-9)
    return out


def record_task(seed: int, task: str, content: dict[str, Any]) -> None:
    write_json(seed_out(seed) / f"task_{task}.json", {"task": task, "seed": seed, **content})


class Task:
    """One task of the plan for one seed: its params, environment server and evaluation helpers."""

    def __init__(self, name: str, seed: int) -> None:
        from pipeline.train.local.models import load_tokenizer

        self.name, self.seed = name, seed
        self.port = free_port()
        arm = name if name in ("shuffled_advantage", "warmup_continued") else "grpo"
        self.params = arm_params(seed, arm, self.port)
        self.tokenizer = load_tokenizer(self.params.agent.model, self.params.root)
        self.out = seed_out(seed)
        self.timings: dict[str, float] = {}

    def timed(self, key: str, fn, *a, **kw):
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            self.timings[key] = round(self.timings.get(key, 0.0) + time.perf_counter() - t, 1)

    def evaluate(self, env, rows_by_ds, model_dir: Path, name: str) -> None:
        saved = self.out / f"{name}.json"
        if saved.is_file():
            return
        result = self.timed(f"eval_{name}_s", evaluate_served, model_dir, self.tokenizer, env, rows_by_ds,
                            eval_params_of(self.params), name)
        write_json(saved, result)
        log.info("seed %d %s: F1 %.1f EM %.1f answered %.2f (%.0f s)", self.seed, name, 100 * result["f1_mean"],
                 100 * result["em_mean"], result["answered_mean"], result["seconds"])


def train(params, **kw):
    from pipeline.train.local.backend import train_local
    from pipeline.train.plan import TrainPlan

    return train_local(TrainPlan.from_params(params), **kw)


def checkpoint_root(params) -> Path:
    return params.path(params.paths.checkpoint_dir)


def latest_step(params) -> int:
    from pipeline.train import checkpoint as ckpt

    folder = ckpt.latest_checkpoint(checkpoint_root(params))
    return ckpt.TrainerState.read(folder).step if folder else 0


def run_warmup(task: Task, env, rows_by_ds) -> None:
    """The seed's data, rules, warm-up and its evaluation; the warm-up checkpoint copied for the shuffled arm."""
    from pipeline.environment.simulated.hops_world import world
    from pipeline.train.local.backend import WARMUP_DIR

    p = task.params
    if not (task.out / "trivial_rules.json").is_file():
        hops_rules_file(knowledge_store(p), world(), [r for rs in rows_by_ds.values() for r in rs],
                        training_questions(p), p.environment.max_tokens, task.out / "trivial_rules.json")
    task.timed("warmup_s", train, p, max_steps=0)
    shuffled = WORK / f"seed{task.seed}" / "shuffled_advantage"
    if not (shuffled / "checkpoints").exists():
        tmp = shuffled.with_name(".tmp-shuffled")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(WORK / f"seed{task.seed}" / "grpo", tmp, ignore=shutil.ignore_patterns("cache"))
        shutil.rmtree(shuffled, ignore_errors=True)
        os.replace(tmp, shuffled)
    task.evaluate(env, rows_by_ds, checkpoint_root(p) / WARMUP_DIR / "model", "grpo_step0")


def wait_for(path: Path, what: str) -> None:
    """Block until `path` exists (the other worker's part of the plan), logging every 5 minutes."""
    waited = 0
    while not path.exists():
        if waited % 300 == 0:
            log.info("waiting for %s (%s)", what, path.relative_to(ROOT))
        time.sleep(10)
        waited += 10


def run_arm(task: Task, env, rows_by_ds) -> None:
    """GRPO or the shuffled-advantage run from the warm-up: the early stop after 3 steps, the health gate, the
    final checkpoint's evaluation, steps.csv and rollouts."""
    from pipeline.errors import TrainingUnhealthy
    from pipeline.train import checkpoint as ckpt
    from pipeline.train.local.step_metrics import steps_csv_path

    p, seed, arm = task.params, task.seed, task.name
    prefix = "" if arm == "grpo" else f"{arm}_"
    early = task.out / "early_stop.json"
    breach: dict[str, Any] = {}
    shuffle = shuffled_advantages(seed) if arm == "shuffled_advantage" else contextlib.nullcontext()
    with two_hop_questions(p) as pool, shuffle:
        try:
            if latest_step(p) < EARLY_STEPS:
                task.timed("train_s", train, p, max_steps=EARLY_STEPS - latest_step(p))
            if arm == "grpo" and not early.is_file():
                reports = p.path(p.paths.reports_dir) / "train" / "trajectories.jsonl"
                counts = answer_variance_groups(reports, EARLY_STEPS)
                write_json(early, {"stopped": not any(counts.values()), "groups_with_answer_variance": counts,
                                   "rule": f"stop when no group of GRPO steps 1-{EARLY_STEPS} has answer variance"})
            wait_for(early, "GRPO's early-stop verdict")
            if not json.loads(early.read_text(encoding="utf-8"))["stopped"]:
                task.timed("train_s", train, p)
        except TrainingUnhealthy as exc:  # the result is the checkpoint the gate kept
            breach = {"message": str(exc), "kept_step": latest_step(p)}
            log.warning("seed %d %s: %s", seed, arm, exc)
    done = latest_step(p)
    reports = p.path(p.paths.reports_dir)
    shutil.copy(steps_csv_path(reports), task.out / f"{prefix}steps.csv")
    keep_rollouts(reports, task.out / f"{prefix}rollouts.jsonl.gz")
    record_task(seed, arm, {"steps_done": done, "training_questions_2hop": pool, "health_breach": breach or None,
                            "timing_s": task.timings})
    name = f"grpo_step{done}" if arm == "grpo" else arm
    task.evaluate(env, rows_by_ds, ckpt.latest_checkpoint(checkpoint_root(p)) / "model", name)
    record_task(seed, arm, {"steps_done": done, "training_questions_2hop": pool, "health_breach": breach or None,
                            "evaluated": name, "timing_s": task.timings})


def run_continued(task: Task, env, rows_by_ds) -> None:
    """The warm-up on as many more demonstrations as GRPO sampled, on as many more questions as it saw."""
    from pipeline.train.local.backend import WARMUP_DIR

    grpo = json.loads((task.out / "task_grpo.json").read_text(encoding="utf-8"))
    p, w, t = task.params, task.params.train.warmup, task.params.train
    sampled = grpo["steps_done"] * t.batch_size * t.group_size
    w.steps = w.steps + -(-sampled // w.batch_size)
    w.demonstrations = (w.demonstrations or w.steps * w.batch_size) + grpo["steps_done"] * t.batch_size
    task.timed("warmup_continued_s", train, p, max_steps=0)
    task.evaluate(env, rows_by_ds, checkpoint_root(p) / WARMUP_DIR / "model", "warmup_continued")
    record_task(task.seed, "warmup_continued", {"warmup_steps": w.steps, "demonstrations": w.demonstrations,
                                                "grpo_samples": sampled, "timing_s": task.timings})


def run_transfer(task: Task) -> None:
    """The PopQA chains on every final checkpoint of the seed (warm-up, GRPO, shuffled, warmup_continued)."""
    from pipeline.train import checkpoint as ckpt
    from pipeline.train.local.backend import WARMUP_DIR

    p = task.params
    transfer = transfer_rows(p, TRANSFER_LIMIT)
    hops_rules_file(transfer.kb, transfer.store, transfer.rows, [], p.environment.max_tokens,
                    task.out / "transfer_rules.json")
    seed_work = WORK / f"seed{task.seed}"
    models = {"transfer_warmup": seed_work / "grpo" / "checkpoints" / "agent" / WARMUP_DIR / "model",
              "transfer_grpo": ckpt.latest_checkpoint(seed_work / "grpo" / "checkpoints" / "agent") / "model",
              "transfer_shuffled_advantage": ckpt.latest_checkpoint(
                  seed_work / "shuffled_advantage" / "checkpoints" / "agent") / "model",
              "transfer_warmup_continued": seed_work / "warmup_continued" / "checkpoints" / "agent" / WARMUP_DIR
              / "model"}
    for name, model_dir in models.items():
        task.evaluate(transfer.env, {"popqa_chains": transfer.rows}, model_dir, name)
    record_task(task.seed, "transfer", {"timing_s": task.timings})


def ready(task: str, seed: int) -> bool:
    """Whether the task's inputs exist (its dependencies finished)."""
    out = seed_out(seed)
    needs = {"warmup": [], "grpo": ["grpo_step0.json"], "shuffled_advantage": ["grpo_step0.json"],
             "warmup_continued": ["task_grpo.json"],
             "transfer": ["task_grpo.json", "task_shuffled_advantage.json", "task_warmup_continued.json"]}[task]
    return all((out / n).is_file() for n in needs)


def finished(task: str, seed: int) -> bool:
    out = seed_out(seed)
    marker = {"warmup": "grpo_step0.json"}.get(task, f"task_{task}.json")
    if task in ARMS:
        return (out / marker).is_file() and "evaluated" in json.loads((out / marker).read_text(encoding="utf-8"))
    return (out / marker).is_file()


def claim(task: str, seed: int, worker: str) -> bool:
    """Take the task: an atomic mkdir; a claim whose worker process is gone is taken over."""
    folder = WORK / "claims" / f"{task}-seed{seed}"
    folder.parent.mkdir(parents=True, exist_ok=True)
    try:
        folder.mkdir()
    except FileExistsError:
        owner = folder / "pid"
        pid = int(owner.read_text() or 0) if owner.is_file() else 0
        if pid == os.getpid():
            return True
        try:
            os.kill(pid, 0) if pid else None
            if pid:
                return False  # its worker is alive
        except ProcessLookupError:
            log.info("taking over %s from worker pid %d (gone)", folder.name, pid)
    (folder / "pid").write_text(str(os.getpid()))
    (folder / "worker").write_text(worker)
    return True


def run_task(name: str, seed: int) -> None:
    import asyncio

    from pipeline.environment.client import EnvironmentClient
    from pipeline.environment.servers import serve_environment
    from pipeline.environment.spec import ServerSpec

    seed_out(seed).mkdir(parents=True, exist_ok=True)
    task = Task(name, seed)
    p = task.params
    if name == "warmup":
        build_data(p)
    data = WORK / f"seed{seed}" / "warmup_continued" / "data"
    if name == "warmup_continued" and not data.exists():  # the seed's data stages' outputs, as GRPO's
        shutil.copytree(WORK / f"seed{seed}" / "grpo" / "data", data)
    rows_by_ds = heldout_rows(p)
    server = ServerSpec(environment=p.environment, root=p.root, cache_dir=p.path(p.paths.cache_dir))
    if name == "transfer":
        run_transfer(task)
        return
    with serve_environment(server):
        env = EnvironmentClient(eval_params_of(p).environment)
        try:
            {"warmup": run_warmup, "grpo": run_arm, "shuffled_advantage": run_arm,
             "warmup_continued": run_continued}[name](task, env, rows_by_ds)
        finally:
            asyncio.run(env.aclose())


def worker(name: str) -> None:
    """Take the plan's next open task whose inputs exist until every task is finished."""
    while True:
        open_tasks = [(t, s) for t, s in tasks() if not finished(t, s)]
        if not open_tasks:
            log.info("worker %s: every task of the plan is finished", name)
            return
        for t, s in open_tasks:
            if ready(t, s) and claim(t, s, name):
                log.info("worker %s: %s seed %d", name, t, s)
                run_task(t, s)
                break
        else:
            time.sleep(20)


def micro() -> None:
    """Shrink the plan to the `--micro` size (see `main`), everything under `.cache/hops2-micro/`."""
    global OUT, WORK, SEEDS, TRANSFER_LIMIT
    WORK = ROOT / ".cache" / "hops2-micro"
    OUT, SEEDS, TRANSFER_LIMIT = WORK / "results", (1,), 3
    SETTINGS["train"].update(steps=4, batch_size=2, mini_batch_size=2)
    SETTINGS["train"]["warmup"] = {"steps": 2}
    SETTINGS["evaluate"]["rows_per_dataset"] = 3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", help="run as this worker (a name) until the plan's tasks are done")
    parser.add_argument("--report", action="store_true", help="write learning.json's hops2 block from the files")
    parser.add_argument("--micro", action="store_true",
                        help="the same tasks at a micro size (seed 1, 4 steps of 2 x 6, 2 warm-up steps, 3 "
                             "held-out questions), files under .cache/hops2-micro/: checks the code, not the plan")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.micro:
        micro()
        args.report = False
    if args.worker:
        worker(args.worker)
    if args.report or not (args.worker or args.micro):
        from learning_report import write_report

        result = write_report(ROOT / "benchmarks" / "results", [])
        log.info("hops2: %s", json.dumps(result.get("hops2"), indent=1)[:4000])


if __name__ == "__main__":
    main()
