"""The learning experiment: does our GRPO teach the agent to use an environment that knows the answers?

    python benchmarks/bench_learning.py --mode hops --seed 1         # one seed of the hops mode, with its controls
    python benchmarks/bench_learning.py --mode terse --seed 1        # one seed of the terse mode, with its controls
    python benchmarks/bench_learning.py --mode question --seed 1     # the existing mode (answer extraction)
    python benchmarks/bench_learning.py --report                     # learning.json/.png/_steps.csv from the files

Two modes of the knowledgeable environment (`environment.knowledge.mode`): `question`
(pipeline/environment/simulated/knowledge.py: the verbatim question is the best request, the answer sits in a fixed
template; a two-line rule scores F1 100, so what GRPO can improve there is answer extraction) and `terse`
(pipeline/environment/simulated/terse.py: at most 8 words per request, so most questions must be restated; replies hold
the answer beside two distractors), where what must improve is the request.

What one seed runs, all through the pipeline's own code (the steps `dvc exp run -S profile=learn` runs):
1. the data stages for the learn profile into a work folder under `.cache/`;
2. the format warm-up (`train_local` with `max_steps=0`), then GRPO (`train_local` resuming its own
   checkpoint), evaluated greedily on the fixed held-out rows at step 0, half-way and the last step
   (`pipeline.evaluation.systems.run_agent_with_environment`, what the evaluate stage runs);
3. the controls on the same rows (`--controls`): `trivial_rule` (pipeline/evaluation/trivial_rules.py, no
   agent, asked the seed's own environment: the environment knows the seed's training sample as well as the
   held-out rows, so its key words and distractors differ from seed to seed), `zero_advantage` (the same
   GRPO steps from the same warm-up checkpoint with every advantage zeroed:
   sampling, the KL term and weight decay alone), `warmup_live_replies` (the warm-up with the environment's
   live replies in its demonstrations, no GRPO).
The `hops` mode (profile learn-hops: pipeline/environment/simulated/hops.py, 2-hop questions need a second request naming
the first reply's entity) runs the same steps with its own controls and checks:
- after the warm-up (live-reply re-ask demonstrations), the pre-check: the warm-up model sampled
  `PRECHECK_SAMPLES` times on `PRECHECK_QUESTIONS` training 2-hop questions; the seed stops with
  `warmup_precheck`'s message unless 10-60% of the samples earn answer reward (`precheck.json`);
- `trivial_rule` is every rule of pipeline/evaluation/hops_rules.py, per hop, with its two references;
- `warmup_continued`: the warm-up run for as many more demonstrations as GRPO sampled trajectories
  (train.steps x batch_size x group_size) on as many more questions as GRPO saw, no GRPO;
- `transfer_*.json`: GRPO's last step, the warm-up and `warmup_continued` on 2-hop chains composed from
  PopQA's facts (benchmarks/hops_transfer.py), asked the same rules over those facts in-process, and the
  hops rules on them.
Every evaluation is saved per question under `benchmarks/results/learning/<mode>/seed<N>/` (F1, EM, format,
whether the request was answered, the prediction), with the run's `steps.csv`, its training rollouts
(`rollouts.jsonl.gz`) and `run.json`; `--report`
(benchmarks/learning_report.py) pools the seeds found there into `learning.json`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

RESULTS = ROOT / "benchmarks" / "results"
LEARNING = RESULTS / "learning"
CONTROLS = ("trivial_rule", "zero_advantage", "warmup_live_replies", "warmup_continued")
DEFAULT_CONTROLS = {"hops": ("trivial_rule", "warmup_continued"),
                    "terse": ("trivial_rule", "zero_advantage", "warmup_live_replies"),
                    "question": ("trivial_rule", "zero_advantage", "warmup_live_replies")}
"""What one seed runs when `--controls` is not given. In `hops` the warm-up already has live replies (its
re-ask demonstrations), so it is the live-reply control itself, and `warmup_continued` replaces
`zero_advantage` (which equals the warm-up by construction)."""
log = logging.getLogger("bench_learning")


def free_port() -> int:
    """A free even port for the environment server whose next port, the agent server's (`evaluate.agent_port`
    left null: environment.port + 1), is free too. Even ports make the pairs disjoint: a run started while
    another's agent server is not up yet never takes that port for its environment."""
    while True:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))  # Linux hands bind() odd ports: the pair starts one below
            port = probe.getsockname()[1] & ~1
        with socket.socket() as env, socket.socket() as agent:
            try:
                env.bind(("127.0.0.1", port))
                agent.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port


def learn_params(workdir: Path, args: argparse.Namespace, port: int):
    """The learn profile with every output under `workdir`, the mode, seed, steps and held-out size of `args`."""
    from pipeline.config import load_params

    paths = {name: str(workdir / sub) for name, sub in (
        ("sampled_dir", "data/sampled"), ("rl_dir", "data/rl"), ("reports_dir", "reports"),
        ("checkpoint_dir", "checkpoints/agent"), ("model_dir", "models/agent"), ("cache_dir", "cache"))}
    overrides: dict[str, Any] = {"profile": "learn-hops" if args.mode == "hops" else "learn", "paths": paths,
                                 "seed": args.seed, "environment": {"port": port, "knowledge": {"mode": args.mode}}}
    if args.steps is not None:
        overrides["train"] = {"steps": args.steps}
    if args.rows_per_dataset is not None:
        overrides["evaluate"] = {"rows_per_dataset": args.rows_per_dataset}
    if getattr(args, "warmup_steps", None) is not None:
        overrides.setdefault("train", {})["warmup"] = {"steps": args.warmup_steps}
    params = load_params(ROOT / "params.yaml", overrides)
    params.environment.knowledge.sources = [str(workdir / "data/rl/train.parquet"), str(workdir / "data/rl/eval")]
    return params


def build_data(params) -> None:
    from pipeline.stages.build import run_build
    from pipeline.stages.sample import run_sample
    from pipeline.stages.validate import run_validate

    for dataset in params.data.train_datasets:
        run_sample(params, dataset)
    run_validate(params)
    run_build(params)


def heldout_rows(params):
    from pipeline.evaluation.plan import EvaluatePlan
    from pipeline.stages.evaluate import load_eval_rows

    held = params.model_copy(deep=True)
    held.root = params.root
    held.data.ood_eval_datasets = []
    return load_eval_rows(EvaluatePlan.for_evaluate(held))


def evaluate_agent(model_dir: Path, tokenizer, env, rows_by_ds, params, label: str) -> dict[str, Any]:
    """Greedy held-out answers of the model in `model_dir`, per question: F1, EM, format (the `released`
    gate), whether an interaction request was answered (`knowledge_replies.answered`), the prediction; and the
    means."""
    import torch
    from transformers import AutoModelForCausalLM

    from pipeline.agent.policy import TransformersPolicy
    from pipeline.evaluation.systems import run_agent_with_environment

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    policy = TransformersPolicy(model, tokenizer, seed=params.seed)
    start = time.perf_counter()
    answers = run_agent_with_environment(policy, env, rows_by_ds, params.agent, params.evaluate, label)
    return evaluation_record(answers, rows_by_ds, params, time.perf_counter() - start)


def evaluation_record(answers, rows_by_ds, params, seconds: float) -> dict[str, Any]:
    """One evaluation's file: per question F1, EM, format (the reward preset's gate), whether a request was
    answered, the prediction, requests, replies and question; their means; three example conversations."""
    from pipeline.agent.protocol import parse_turn
    from pipeline.environment.simulated.knowledge_replies import answered
    from pipeline.metrics import exact_match, token_f1
    from pipeline.reward import compute_reward

    out: dict[str, Any] = {"f1": {}, "em": {}, "format": {}, "answered": {}, "predictions": {}, "requests": {},
                           "replies": {}, "questions": {},
                           "env_calls": 0, "seconds": seconds, "examples": []}
    for name, rows in rows_by_ds.items():
        f1s, ems, fmts, hits, preds, asks, said = [], [], [], [], [], [], []
        for row, answer in zip(rows, answers[name], strict=True):
            f1s.append(token_f1(answer.prediction, row.answers))
            ems.append(exact_match(answer.prediction, row.answers))
            turns = [parse_turn(t["text"]) for t in answer.trajectory]
            fmts.append(float(compute_reward(turns, row.answers, params.reward).gated))
            replies = [t["environment"]["text"] for t in answer.trajectory if t.get("environment")]
            hits.append(float(any(answered(r) for r in replies)))
            preds.append(answer.prediction)
            asks.append([t.interaction_prompt for t in turns if t.interaction_prompt])
            said.append(replies)
            out["env_calls"] += answer.usage.calls
            if len(out["examples"]) < 3:
                out["examples"].append({"question": row.question, "golds": row.answers,
                                        "turns": [t["text"] for t in answer.trajectory], "replies": replies,
                                        "prediction": answer.prediction})
        out["f1"][name], out["em"][name], out["format"][name] = f1s, ems, fmts
        out["answered"][name], out["predictions"][name], out["requests"][name] = hits, preds, asks
        out["replies"][name] = said
        out["questions"][name] = [row.question for row in rows]
    for key in ("f1", "em", "format", "answered"):
        values = [v for vs in out[key].values() for v in vs]
        out[f"{key}_mean"] = sum(values) / len(values)
    return out


def knowledge_store(params):
    """The knowledge base the seed's environment server answers from (its sources, overlap and mode)."""
    from pipeline.environment.simulated.knowledge import load_facts
    from pipeline.environment.simulated.knowledge_server import knowledge_base

    k = params.environment.knowledge
    return knowledge_base(load_facts(k.sources), k.min_overlap, k.mode)


def backfill_replies(args: argparse.Namespace) -> None:
    """Add `replies` to evaluation files written before they were kept (`--backfill-replies`): the seed's
    store is rebuilt (its data stages are deterministic per seed) and every stored request is asked again
    through the server's own reply code (`trivial_rules.ask`, the same `max_tokens` cut); the environment is
    deterministic, so these are the replies the agent got. Files that already hold `replies` are left alone."""
    from pipeline.evaluation.trivial_rules import ask

    out = LEARNING / args.mode / f"seed{args.seed}"
    work = ROOT / ".cache" / f"bench_learning_{args.mode}_rules"
    shutil.rmtree(work, ignore_errors=True)
    params = learn_params(work / "grpo", args, free_port())
    build_data(params)
    kb = knowledge_store(params)
    for path in sorted(out.glob("*.json")):
        content = json.loads(path.read_text(encoding="utf-8"))
        if "requests" not in content or "replies" in content:
            continue
        content["replies"] = {name: [[ask(kb, r, params.environment.max_tokens) for r in asks] for asks in per_q]
                              for name, per_q in content["requests"].items()}
        write_json(path, content)
        log.info("%s: replies added (%d questions)", path.name, sum(len(v) for v in content["replies"].values()))


def write_json(path: Path, content: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(content, indent=1) + "\n", encoding="utf-8")


def trivial_rules(params, rows_by_ds, out: Path) -> None:
    """The trivial rules (and the informed ceiling) on the held-out rows, asked the mode's own reply code."""
    from pipeline.evaluation import trivial_rules as tr

    k = params.environment.knowledge
    kb = knowledge_store(params)
    rules = tr.evaluate_rules(kb, rows_by_ds, params.environment.max_tokens, {**tr.RULES, **tr.INFORMED_RULES})
    write_json(out, {"mode": k.mode, "trivial": list(tr.RULES), "rules": rules,
                     "informed": {n: (tr.INFORMED_RULES[n][1].__doc__ or "").split(".")[0] for n in
                                  tr.INFORMED_RULES}})
    for name, r in rules.items():
        log.info("rule %-28s F1 %5.1f  answered %.2f", name, 100 * r["f1_mean"], r["answered_mean"])


def training_questions(params) -> list[str]:
    """The questions of the seed's training file (`data/rl/train.parquet`), in its order."""
    import pandas as pd

    frame = pd.read_parquet(params.path(params.paths.rl_dir) / "train.parquet", columns=["extra_info"])
    return [str((extra or {}).get("question") or "") for extra in frame["extra_info"]]


def hops_rules_file(kb, store, rows, training: list[str], max_tokens: int | None, out: Path) -> dict[str, Any]:
    """Every hops rule and reference (pipeline/evaluation/hops_rules.py) on `rows`, per hop, written to `out`."""
    from pipeline.evaluation import hops_rules as hr

    rules = hr.evaluate_hops_rules(kb, store, rows, training, max_tokens)
    write_json(out, {"mode": "hops", "trivial": list(hr.TRIVIAL), "references": list(hr.REFERENCES),
                     "rules": rules})
    for name, r in rules.items():
        log.info("rule %-26s %s", name, {g: round(100 * sum(v) / len(v), 1) for g, v in r["f1"].items() if v})
    return rules


def precheck(model_dir: Path, tokenizer, env, params, out: Path, questions: int | None = None) -> Any:
    """The warm-up pre-check (pipeline/train/local/warmup.py `warmup_precheck`): the model in `model_dir` sampled
    `PRECHECK_SAMPLES` times (the training temperature) on the first `PRECHECK_QUESTIONS` training 2-hop
    questions; each sample's answer reward (`released`: answer F1 when the format gate holds). Written to
    `out` with the verdict; the caller stops the seed when it is not ok."""
    import asyncio

    import pandas as pd
    import torch
    from transformers import AutoModelForCausalLM

    from pipeline.agent.policy import TransformersPolicy
    from pipeline.agent.rollout import RolloutSettings, rollout
    from pipeline.environment.simulated.hops_world import world
    from pipeline.progress import progress
    from pipeline.reward import reward_for_trajectory
    from pipeline.train.local.demonstrations import question_of
    from pipeline.train.local.questions import prompt_item_from_row
    from pipeline.train.local.warmup import PRECHECK_QUESTIONS, PRECHECK_SAMPLES, warmup_precheck

    frame = pd.read_parquet(params.path(params.paths.rl_dir) / "train.parquet")
    items = [prompt_item_from_row(row, i) for i, row in enumerate(frame.to_dict("records"))]
    store = world()
    items = [it for it in items if (q := store.question(question_of(it))) is not None and q.hops == 2]
    items = items[:questions or PRECHECK_QUESTIONS]
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    policy = TransformersPolicy(model, tokenizer, seed=params.seed)
    with progress(total=len(items) * PRECHECK_SAMPLES, desc="warm-up pre-check", unit="sample") as bar:
        trajs = asyncio.run(rollout(policy, env, items, RolloutSettings.sampled(params.agent),
                                    group_size=PRECHECK_SAMPLES, return_logprobs=False, reward_fn=None,
                                    progress=bar))
    parts = [reward_for_trajectory(t, params.reward) for t in trajs]
    rewards = [p.answer if p.gated else 0.0 for p in parts]
    verdict = warmup_precheck(rewards)
    write_json(out, {"ok": verdict.ok, "share": verdict.share, "earned": verdict.earned, "samples": verdict.samples,
                     "message": verdict.message, "questions": [it.question for it in items],
                     "answer_rewards": rewards,
                     "requests": [[t.parsed.interaction_prompt for t in tr.turns if t.parsed.interaction_prompt]
                                  for tr in trajs]})
    log.info("%s", verdict.message)
    return verdict


class InProcessEnvironment:
    """A knowledge base asked in-process with the server's own reply code (`trivial_rules.ask`, the same
    `max_tokens` cut): the transfer check's PopQA facts, which no server of the profile holds."""

    def __init__(self, kb, max_tokens: int | None) -> None:
        self.kb, self.max_tokens = kb, max_tokens

    async def reply(self, history, prompt: str):
        from pipeline.evaluation.trivial_rules import ask
        from pipeline.types import EnvironmentReply

        return EnvironmentReply(text=ask(self.kb, prompt, self.max_tokens))

    async def aclose(self) -> None:
        return None


def transfer_rows(params, limit: int | None = None):
    """The PopQA transfer check: its world (a `hops` store of the chains' facts), the rows (EvalRow-like:
    question, answers, dataset `popqa_chains`), and the in-process environment answering from it."""
    from types import SimpleNamespace

    from hops_transfer import CHAINS, popqa_chains, read_popqa

    from pipeline.agent.template import render_user_message
    from pipeline.environment.simulated.hops import HopsKnowledgeBase
    from pipeline.types import EvalRow

    store, golds = popqa_chains(read_popqa(params.mirror), seed=0, limit=limit or CHAINS)
    rows = [EvalRow(dataset="popqa_chains", split="ood", index=i, id=f"popqa_chains-{i:03d}", question=q.text,
                    answers=golds[q.text],
                    messages=[{"role": "user", "content": render_user_message(q.text, "hops")}])
            for i, q in enumerate(store.questions)]
    kb = HopsKnowledgeBase([], store=store)
    return SimpleNamespace(store=store, rows=rows, kb=kb,
                           env=InProcessEnvironment(kb, params.environment.max_tokens))


@contextlib.contextmanager
def zeroed_advantages():
    """GRPO's advantages replaced by zeros in the trainer (the zero_advantage control)."""
    import torch

    from pipeline.train.local import trainer

    original = trainer.grpo_advantages
    trainer.grpo_advantages = lambda scores, mask, group_ids, *a, **kw: torch.zeros_like(
        original(scores, mask, group_ids, *a, **kw))
    try:
        yield
    finally:
        trainer.grpo_advantages = original


def keep_rollouts(reports_dir: Path, target: Path) -> None:
    """The run's sampled trajectories (`reports/train/trajectories.jsonl`), gzipped beside its evaluations:
    what the agent asked during training and what the environment answered (`learning_report.rollout_requests`)."""
    import gzip

    from pipeline.stage_files import TRAJECTORIES_FILE

    source = reports_dir / "train" / TRAJECTORIES_FILE
    if source.is_file():
        target.write_bytes(gzip.compress(source.read_bytes(), mtime=0))


def record(out: Path, args, params, rows_by_ds, timings: dict[str, float], t_all: float, done: int,
           eval_steps: list[int], finished: list[str], health_breach: dict[str, Any] | None = None) -> None:
    """run.json: what this seed ran so far (written after each phase, so an interrupted run still reports).
    `health_breach`: the training health gate's line and the step it kept, when it stopped GRPO early."""
    write_json(out / "run.json", {
        "mode": args.mode, "seed": args.seed, "grpo_steps_done": done, "eval_steps": eval_steps,
        "health_breach": health_breach or None,
        "controls_asked": list(args.controls), "finished": finished,
        "command": " ".join(["python benchmarks/bench_learning.py", *sys.argv[1:]]),
        "timing_s": {**{k: round(v, 1) for k, v in timings.items()}, "total_s": round(time.perf_counter() - t_all, 1)},
        "heldout": {"datasets": list(rows_by_ds), "questions": sum(len(r) for r in rows_by_ds.values())},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "params": {"agent": params.agent.model_dump(mode="json"), "reward": params.reward.model_dump(),
                   "train": params.train.model_dump(mode="json", exclude={"verl"}),
                   "environment": {"backend": params.environment.backend, "max_tokens": params.environment.max_tokens,
                                   "knowledge": {"mode": args.mode,
                                                 "min_overlap": params.environment.knowledge.min_overlap}},
                   "evaluate.rows_per_dataset": params.evaluate.rows_per_dataset},
        "notes": args.note or []})


def run(args: argparse.Namespace) -> None:
    import asyncio

    import mlflow

    from pipeline.config.specs import tracking_spec
    from pipeline.environment.client import EnvironmentClient
    from pipeline.environment.servers import serve_environment
    from pipeline.environment.spec import ServerSpec
    from pipeline.errors import TrainingUnhealthy
    from pipeline.tracking import runs as tracking
    from pipeline.train import checkpoint as ckpt
    from pipeline.train.local.backend import WARMUP_DIR, train_local
    from pipeline.train.local.models import load_tokenizer
    from pipeline.train.local.step_metrics import steps_csv_path
    from pipeline.train.plan import TrainPlan

    t_all = time.perf_counter()
    work = ROOT / ".cache" / f"bench_learning_{args.mode}_{'rules' if args.rules_only else f'seed{args.seed}'}"
    out = LEARNING / args.mode / f"seed{args.seed}"
    if work.exists() and not args.keep:
        shutil.rmtree(work)
    if out.exists() and not args.keep and not args.rules_only:
        shutil.rmtree(out)
    port = free_port()
    params = learn_params(work / "grpo", args, port)
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    build_data(params)
    timings["data_s"] = time.perf_counter() - t0
    rows_by_ds = heldout_rows(params)
    hops = args.mode == "hops"
    if "trivial_rule" in args.controls or args.rules_only:  # against this seed's store (its training sample)
        if hops:
            from pipeline.environment.simulated.hops_world import world

            hops_rules_file(knowledge_store(params), world(), [r for rs in rows_by_ds.values() for r in rs],
                            training_questions(params), params.environment.max_tokens, out / "trivial_rules.json")
        else:
            trivial_rules(params, rows_by_ds, out / "trivial_rules.json")
    if args.rules_only:
        return
    tokenizer = load_tokenizer(params.agent.model, params.root)
    eval_params = params.model_copy(deep=True)
    eval_params.root = params.root
    eval_params.environment.temperature = params.evaluate.env_temperature
    steps = params.train.steps
    eval_steps = sorted({0, steps // 2, steps})
    finished: list[str] = []
    health_breach: dict[str, Any] = {}
    done = 0

    def variant(name: str, **train: Any):
        """The same run in its own work folder (data and, when asked, the warm-up checkpoint copied)."""
        p = learn_params(work / name, args, port)
        for key, value in train.items():
            setattr(p.train.warmup, key, value)
        shutil.copytree(work / "grpo" / "data", work / name / "data", dirs_exist_ok=True)
        p.environment.knowledge.sources = params.environment.knowledge.sources
        return p

    def train(p, **kw):
        """`train_local` on the plan the train stage resolves from `p`."""
        return train_local(TrainPlan.from_params(p), **kw)

    def timed(key: str, fn, *a, **kw):
        t = time.perf_counter()
        result = fn(*a, **kw)
        timings[key] = timings.get(key, 0.0) + time.perf_counter() - t
        return result

    cache_dir = params.path(params.paths.cache_dir)
    server = ServerSpec(environment=params.environment, root=params.root, cache_dir=cache_dir)
    with serve_environment(server), tracking.stage_run(tracking_spec(params), "learning", new_parent=True):
        mlflow.set_tags({"benchmark": "bench_learning", "mode": args.mode, "seed": str(args.seed)})
        env = EnvironmentClient(eval_params.environment)

        def evaluate_at(name: str, model_dir: Path, step: int) -> None:
            saved = out / f"{name}.json"
            if args.keep and saved.is_file():
                return
            result = timed("eval_s", evaluate_agent, model_dir, tokenizer, env, rows_by_ds, eval_params, name)
            write_json(saved, result)
            mlflow.log_metrics({f"heldout/{name.split('_step')[0]}_f1": 100 * result["f1_mean"],
                                f"heldout/{name.split('_step')[0]}_answered": result["answered_mean"]}, step=step)
            log.info("%s: F1 %.1f EM %.1f format %.2f answered %.2f", name, 100 * result["f1_mean"],
                     100 * result["em_mean"], result["format_mean"], result["answered_mean"])

        try:
            root = params.path(params.paths.checkpoint_dir)
            timed("warmup_s", train, params, max_steps=0)
            evaluate_at("grpo_step0", root / WARMUP_DIR / "model", 0)
            if hops and args.precheck != "off" and not (out / "precheck.json").is_file():
                verdict = timed("precheck_s", precheck, root / WARMUP_DIR / "model", tokenizer, env, params,
                                out / "precheck.json", args.precheck_questions)
                if not verdict.ok and args.precheck == "stop":
                    record(out, args, params, rows_by_ds, timings, t_all, done, eval_steps, finished, health_breach)
                    raise SystemExit(verdict.message)
            if "zero_advantage" in args.controls:
                zero = variant("zero_advantage")
                if not zero.path(zero.paths.checkpoint_dir).exists():  # the warm-up checkpoint, before GRPO step 1
                    shutil.copytree(root, zero.path(zero.paths.checkpoint_dir))
            done = ckpt.TrainerState.read(ckpt.latest_checkpoint(root)).step
            evaluated: list[int] = [0]
            for target in eval_steps[1:]:
                if done < target:
                    try:
                        timed("grpo_s", train, params, max_steps=target - done)
                        done = target
                    except TrainingUnhealthy as exc:  # GRPO's result is then the checkpoint the gate kept
                        done = ckpt.TrainerState.read(ckpt.latest_checkpoint(root)).step
                        health_breach.update(message=str(exc), kept_step=done)
                        log.warning("%s: GRPO's result is its step %d", exc, done)
                evaluate_at(f"grpo_step{done}", ckpt.latest_checkpoint(root) / "model", done)
                evaluated.append(done)
                if health_breach:
                    break
            eval_steps[:] = sorted(set(evaluated))
            shutil.copy(steps_csv_path(params.path(params.paths.reports_dir)), out / "steps.csv")
            keep_rollouts(params.path(params.paths.reports_dir), out / "rollouts.jsonl.gz")
            finished.append("grpo")
            record(out, args, params, rows_by_ds, timings, t_all, done, eval_steps, finished, health_breach)
            if "zero_advantage" in args.controls:
                with zeroed_advantages():
                    timed("zero_advantage_s", train, zero, max_steps=steps)
                zero_root = zero.path(zero.paths.checkpoint_dir)
                evaluate_at(f"zero_advantage_step{steps}", ckpt.latest_checkpoint(zero_root) / "model", steps)
                shutil.copy(steps_csv_path(zero.path(zero.paths.reports_dir)), out / "zero_advantage_steps.csv")
                keep_rollouts(zero.path(zero.paths.reports_dir), out / "zero_advantage_rollouts.jsonl.gz")
                finished.append("zero_advantage")
                record(out, args, params, rows_by_ds, timings, t_all, done, eval_steps, finished, health_breach)
            if "warmup_live_replies" in args.controls:
                live = variant("warmup_live_replies", replies="environment")
                timed("warmup_live_s", train, live, max_steps=0)
                evaluate_at("warmup_live_replies", live.path(live.paths.checkpoint_dir) / WARMUP_DIR / "model", 0)
                finished.append("warmup_live_replies")
            if "warmup_continued" in args.controls:
                w, t = params.train.warmup, params.train
                grpo_samples = done * t.batch_size * t.group_size  # the steps GRPO kept (fewer after a breach)
                more = variant("warmup_continued", steps=w.steps + -(-grpo_samples // w.batch_size),
                               demonstrations=(w.demonstrations or w.steps * w.batch_size) + done * t.batch_size)
                timed("warmup_continued_s", train, more, max_steps=0)
                evaluate_at("warmup_continued", more.path(more.paths.checkpoint_dir) / WARMUP_DIR / "model", 0)
                finished.append("warmup_continued")
                record(out, args, params, rows_by_ds, timings, t_all, done, eval_steps, finished, health_breach)
            if hops and not args.no_transfer:
                transfer = transfer_rows(params, args.transfer_limit)
                hops_rules_file(transfer.kb, transfer.store, transfer.rows, [], params.environment.max_tokens,
                                out / "transfer_rules.json")
                models = {"transfer_grpo": ckpt.latest_checkpoint(root) / "model",
                          "transfer_warmup": root / WARMUP_DIR / "model"}
                if "warmup_continued" in args.controls:
                    models["transfer_warmup_continued"] = (
                        more.path(more.paths.checkpoint_dir) / WARMUP_DIR / "model")
                for name, model_dir in models.items():
                    if not (out / f"{name}.json").is_file() or not args.keep:
                        result = timed("transfer_s", evaluate_agent, model_dir, tokenizer, transfer.env,
                                       {"popqa_chains": transfer.rows}, eval_params, name)
                        write_json(out / f"{name}.json", result)
                        log.info("%s: F1 %.1f", name, 100 * result["f1_mean"])
                finished.append("transfer_popqa")
        finally:
            asyncio.run(env.aclose())
    record(out, args, params, rows_by_ds, timings, t_all, done, eval_steps, finished, health_breach)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=["question", "terse", "hops"], default="terse")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--steps", type=int, default=None, help="GRPO steps (default: the learn profile's)")
    parser.add_argument("--rows-per-dataset", type=int, default=None,
                        help="held-out questions per dataset (default: the learn profile's evaluate.rows_per_dataset)")
    parser.add_argument("--controls", default=None,
                        help=f"comma-separated subset of {','.join(CONTROLS)} ('' for none; default: the mode's "
                             f"{DEFAULT_CONTROLS})")
    parser.add_argument("--warmup-steps", type=int, default=None, help="warm-up steps (default: the profile's)")
    parser.add_argument("--precheck", choices=["stop", "warn", "off"], default="stop",
                        help="hops: after the warm-up, stop the seed (stop) or only record (warn) when the "
                             "pre-check fails")
    parser.add_argument("--no-transfer", action="store_true", help="hops: skip the PopQA transfer check")
    parser.add_argument("--precheck-questions", type=int, default=None,
                        help="hops: training 2-hop questions the pre-check samples (default: warmup.PRECHECK_QUESTIONS)")
    parser.add_argument("--transfer-limit", type=int, default=None,
                        help="hops: PopQA chains evaluated (default: hops_transfer.CHAINS)")
    parser.add_argument("--keep", action="store_true", help="resume in the existing work folder")
    parser.add_argument("--rules-only", action="store_true",
                        help="only the trivial rules on the held-out rows (seconds; no agent, no training)")
    parser.add_argument("--backfill-replies", action="store_true",
                        help="add the environment's replies to this seed's evaluation files written without them")
    parser.add_argument("--report", action="store_true",
                        help="only write learning.json/.png/_steps.csv from benchmarks/results/learning/")
    parser.add_argument("--note", action="append", help="a line added to the results' notes (repeatable)")
    args = parser.parse_args()
    chosen = ",".join(DEFAULT_CONTROLS[args.mode]) if args.controls is None else args.controls
    args.controls = [c for c in chosen.split(",") if c]
    unknown = set(args.controls) - set(CONTROLS)
    if unknown:
        parser.error(f"--controls: unknown {sorted(unknown)}; choose from {list(CONTROLS)}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.backfill_replies:
        backfill_replies(args)
    elif not args.report:
        run(args)
    from learning_report import write_report

    result = write_report(RESULTS, args.note or [])
    log.info("held-out F1 (%s mode, seeds %s): warm-up %s -> GRPO %s, gain %s %s; controls %s",
             result["mode"], result["seeds"], result["heldout_f1_warmup"], result["heldout_f1_grpo"],
             result["heldout_f1_gain"], result["heldout_f1_gain_ci"],
             {k: v["heldout_f1"] for k, v in result["controls"].items()})


if __name__ == "__main__":
    main()
