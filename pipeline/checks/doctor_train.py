"""`promptr1 doctor` steps 5 and 8-10: the train stage's start checks, one verl step, its merge, and two of its
trajectories (GPU nodes only).

- `resources`: what the train stage checks before it starts anything (`pipeline.train.verl.resources`), on the
  one-step params below: this host's GPUs, the Ray the profile says and which GPUs it owns, free disk for the
  step's checkpoint (estimated from the parameter count), verl's own validation. The Ray is found
  (`train.verl.ray_address` set: the cluster there is probed) or started (`""`: a private Ray started as
  verl's launch starts it, pinned to `train.verl.gpus`, probed and stopped again), so a node whose Ray would
  put verl on the environment's GPUs, or that has no Ray to join, fails here, before the environment server
  loads and the rows are sent.
- `verl step`: one GRPO step through `pipeline.train.verl.backend.run_verl`, the path `promptr1 train`
  runs (same overrides, same environment reuse, same Ray handling), with params changed only where a
  check differs from a run: the smallest batch verl accepts for the profile as one mini-batch
  (`pipeline.checks.layout.smallest_batch`: `paper` 16 questions x 5, not 128 x 5), checkpoints in a temporary
  folder beside `paths.checkpoint_dir` (on the disk the run will use; removed after the merge, and however
  the doctor ends), `save_freq: 1`, no validation, `trainer.total_training_steps=1` and
  `trainer.rollout_data_dir` (verl dumps the step's decoded rollouts as `<step>.jsonl`), its log and
  overrides under `reports/doctor/train/`, and its MLflow run in the experiment `<experiment>-doctor`, so
  the doctor never adds a run to the project's own experiment or a checkpoint to `paths.checkpoint_dir`.
  Its line gives the step's wall time and the watchdog setting its rollout suggests for the profile
  (`watchdog_suggestion`: verl's `timing_s/gen` of the step, scaled from the doctor's batch to the profile's
  as the environment's worst case scales, doubled), as `-S train.verl.watchdog.rollout_s=<s>` to pass to the
  run: the doctor writes no params file, which would change the train stage's params and rerun it.
- `merge`: `pipeline.train.merge.merge_checkpoint` (what the merge stage runs) of that checkpoint into
  `reports/doctor/model` (verl's merger, then the load-and-generate check); the checkpoint folder is removed
  afterwards.
- `trajectories`: two trajectories of the dump, each split into its agent turns (mask 1) and the
  environment's replies (mask 0). verl's dump holds decoded text, not the token mask, so the split is at
  the protocol's `<interaction_response>` blocks with the template text around them (the role words and
  the next `<think>` opener), which is exactly what the agent loop masks with 0 (`ConversationBuilder.
  env_text`, pipeline/train/verl/agent_loop.py): a reply that leaked into a mask-1 segment, or an agent turn
  inside a reply block, shows here as a wrong segment.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.agent.protocol import RESPONSE_CLOSE, RESPONSE_OPEN, THINK_OPENER
from pipeline.checks.doctor_state import BUILD_FIRST, Status, failed, passed, skipped
from pipeline.config import Params
from pipeline.stage_files import TRAIN_FILE

if TYPE_CHECKING:
    from pipeline.checks.doctor_state import Doctor

TRAJECTORIES_SHOWN = 2
SEGMENT_CHARS = 160
"""Characters of each segment printed in the report (the whole text is in the dump)."""


def doctor_dir(reports_dir: Path) -> Path:
    """`<paths.reports_dir>/doctor`: every output of the one-step run stays under it."""
    return reports_dir / "doctor"


def rollout_dir(reports_dir: Path) -> Path:
    return doctor_dir(reports_dir) / "rollout"


def one_step_params(params: Params, checkpoint_dir: Path) -> Params:
    """`params` for one verl step of the smallest batch, saved to `checkpoint_dir`, every other output under
    reports/doctor/ (module docstring)."""
    from pipeline.checks.layout import smallest_batch
    from pipeline.train.plan import TrainPlan
    from pipeline.train.verl.config import compose_plan

    p = params.model_copy(deep=True)
    p.root = params.root
    base = doctor_dir(params.path(params.paths.reports_dir)).resolve()
    p.paths.reports_dir = str(base)
    p.paths.checkpoint_dir = str(checkpoint_dir.resolve())
    p.paths.model_dir = str(base / "model")
    p.mlflow.experiment = f"{params.mlflow.experiment}-doctor"
    v = p.train.verl
    v.save_freq, v.test_freq, v.val_before_train = 1, -1, False
    ours = {
        "trainer.total_training_steps": "1",
        "trainer.rollout_data_dir": str((base / "rollout").resolve()),
    }
    kept = [
        o for o in v.extra_overrides if o.split("=", 1)[0].lstrip("+") not in ours
    ]  # a profile's own step count
    v.extra_overrides = [*kept, *(f"{key}={value}" for key, value in ours.items())]
    p.train.batch_size = p.train.mini_batch_size = smallest_batch(compose_plan(TrainPlan.from_params(p)))
    return p


def checkpoint_folder(doc: Doctor) -> Path:
    """The one-step run's temporary checkpoint folder, made on first use beside `paths.checkpoint_dir` (the
    disk a run saves to) and removed when the doctor ends, whatever step it stops at."""
    if doc.checkpoint_dir is None:
        parent = doc.params.path(doc.params.paths.checkpoint_dir).parent
        parent.mkdir(parents=True, exist_ok=True)
        doc.checkpoint_dir = Path(tempfile.mkdtemp(prefix="doctor-", dir=parent))
        doc.stack.callback(shutil.rmtree, doc.checkpoint_dir, ignore_errors=True)
    return doc.checkpoint_dir


def step_resources(doc: Doctor) -> tuple[Status, str, dict[str, Any]]:
    from pipeline.disk_space import free_bytes
    from pipeline.placement import gpus_of_environment, gpus_of_training
    from pipeline.train.plan import TrainPlan
    from pipeline.train.verl.config import compose_plan
    from pipeline.train.verl.resources import (
        checkpoint_estimate,
        probe_private_ray,
        probe_ray_cluster,
        resource_problems,
    )

    params = doc.params
    if params.train.backend != "verl":
        return skipped("train.backend=local: no verl stage to start")
    if not doc.gpus:
        return skipped("needs a GPU: none on this machine")
    plan = TrainPlan.from_params(one_step_params(params, checkpoint_folder(doc)))
    run = compose_plan(plan)
    address = params.train.verl.ray_address
    probe = probe_ray_cluster(address) if address else probe_private_ray(plan.train)
    ray = (f"Ray at {address!r} found" if address else "private Ray started and stopped") + (
        f": CUDA devices {probe.owned_here() or 'none'} on this host, {probe.gpus:g} GPU(s) in all; "
        f"environment on {gpus_of_environment(plan.environment) or 'no GPU here'}, "
        f"training on {gpus_of_training(plan.train)}"
    )
    estimate = checkpoint_estimate(plan, run)
    free = free_bytes(plan.checkpoint_dir)
    figures: dict[str, Any] = {
        "ray_address": address,
        "ray_devices_here": probe.owned_here(),
        "ray_gpus": probe.gpus,
        "ray_nodes": len(probe.nodes),
        "checkpoint_gib": round(estimate[0] / 2**30, 1) if estimate else None,
        "free_gib": round(free / 2**30, 1),
        "checkpoint_dir": str(plan.checkpoint_dir),
    }
    problems = resource_problems(plan, run, probe)
    if problems:
        return failed(
            f"{ray}; but {problems[0]}" + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""),
            problems=problems,
            **figures,
        )
    disk = (
        f"checkpoint ~{figures['checkpoint_gib']} GiB fits in {figures['free_gib']} GiB free"
        if estimate
        else "checkpoint size not estimated (no parameter count offline)"
    )
    return passed(f"{ray}; {disk}; verl's validation passes", **figures)


def _verl_skip_reason(doc: Doctor) -> str | None:
    params = doc.params
    if params.train.backend != "verl":
        return "train.backend=local: no verl step (the local backend trains with `promptr1 train`)"
    if not doc.gpus:
        return "needs a GPU: none on this machine"
    if not (params.path(params.paths.rl_dir) / TRAIN_FILE).is_file():
        return f"{BUILD_FIRST} (no {params.paths.rl_dir}/{TRAIN_FILE})"
    if doc.environment_url is None:
        return "no environment server (the environment step did not pass)"
    return None


def step_verl(doc: Doctor) -> tuple[Status, str, dict[str, Any]]:
    import mlflow

    from pipeline.config.specs import tracking_spec
    from pipeline.tracking import runs as tracking
    from pipeline.train import checkpoint as ckpt
    from pipeline.train.plan import TrainPlan
    from pipeline.train.verl.backend import run_verl

    reason = _verl_skip_reason(doc)
    if reason:
        return skipped(reason)
    p = one_step_params(doc.params, checkpoint_folder(doc))
    shutil.rmtree(rollout_dir(doc.reports_dir), ignore_errors=True)
    p.environment.base_url = (
        doc.environment_url
    )  # the server the environment step holds: run_verl reuses it
    store = tracking_spec(p)
    tracking.configure(store)
    started = time.perf_counter()
    with mlflow.start_run(run_name=f"doctor-{p.profile}") as run:
        run_verl(TrainPlan.from_params(p), tracking.tracking_uri(store), run)
    seconds = time.perf_counter() - started
    suggestion = watchdog_suggestion(doc.params, p.train.batch_size * p.train.group_size,
                                     p.path(p.paths.reports_dir) / "train" / "verl.log")
    actor = ckpt.latest_verl_step(p.path(p.paths.checkpoint_dir))
    dumps = sorted(rollout_dir(doc.reports_dir).glob("*.jsonl"))
    batch, group = p.train.batch_size, p.train.group_size
    figures = {
        "checkpoint": str(actor) if actor else None,
        "rollout_dumps": [d.name for d in dumps],
        "log": str(p.path(p.paths.reports_dir) / "train" / "verl.log"),
        "batch_size": batch,
        "trajectories": batch * group,
        "step_s": round(seconds, 1),
        **(suggestion or {}),
    }
    if actor is None:
        return failed(
            f"verl ran but saved no global_step_N/actor under {p.paths.checkpoint_dir}: see {figures['log']}",
            **figures,
        )
    if not dumps:
        return failed(
            f"verl saved {actor.parent.name} but dumped no rollout data into {rollout_dir(doc.reports_dir)} "
            "(trainer.rollout_data_dir)",
            **figures,
        )
    watchdog = (f"; its rollout ({suggestion['rollout_measured_s']:g} s) suggests `-S "
                f"train.verl.watchdog.rollout_s={suggestion['suggested_rollout_s']:g}` for the profile's "
                f"{suggestion['profile_conversations']} conversations a step" if suggestion else "")
    return passed(
        f"1 step of {batch} questions x {group} = {batch * group} trajectories (one mini-batch) in "
        f"{seconds:.0f} s saved {actor.parent.name}/actor; rollouts dumped to {dumps[-1].name}{watchdog}",
        **figures,
    )


def watchdog_suggestion(params: Params, conversations: int, verl_log: Path) -> dict[str, Any] | None:
    """The `train.verl.watchdog.rollout_s` the doctor's step suggests for the profile's steps: verl's
    `timing_s/gen` on the step's line in `verl_log` (`conversations` trajectories), scaled to the profile's
    batch (`pipeline.train.verl.watchdog.suggested_rollout_s`); None when the log holds no such line."""
    from pipeline.train.verl.health_gate import TRAINING_KEY, parse_step_line
    from pipeline.train.verl.watchdog import suggested_rollout_s

    measured = None
    if verl_log.is_file():
        for line in verl_log.read_text(encoding="utf-8", errors="replace").splitlines():
            parsed = parse_step_line(line)
            if parsed is not None and TRAINING_KEY in parsed[1] and "timing_s/gen" in parsed[1]:
                measured = parsed[1]["timing_s/gen"]
    if measured is None:
        return None
    profile = params.train.batch_size * params.train.group_size
    suggested = suggested_rollout_s(measured, conversations, profile, params.environment, params.agent.max_turns)
    return {"rollout_measured_s": round(measured, 1), "profile_conversations": profile,
            "suggested_rollout_s": suggested}


def step_merge(doc: Doctor) -> tuple[Status, str, dict[str, Any]]:
    from pipeline.train.merge import merge_checkpoint
    from pipeline.train.merge_plan import MergePlan

    if doc.status("verl step") != "pass":
        return skipped("no verl checkpoint (the verl step did not run)")
    p = one_step_params(doc.params, checkpoint_folder(doc))
    report = merge_checkpoint(MergePlan.from_params(p))
    shutil.rmtree(checkpoint_folder(doc))  # the one-step checkpoint has served its purpose
    return passed(
        f"{report.checkpoint} merged into {p.paths.model_dir}: generated {report.generated_tokens} tokens "
        f"({report.sample!r}); checkpoint folder removed",
        source=report.source,
        step=report.step,
        generated_tokens=report.generated_tokens,
        sample=report.sample,
    )


_ENV_SEGMENT = re.compile(
    r"\s*(?:user|human)?\s*"
    + re.escape(RESPONSE_OPEN)
    + r".*?"
    + re.escape(RESPONSE_CLOSE)
    + r"\s*(?:(?:assistant|model)\s*)?(?:"
    + re.escape(THINK_OPENER)
    + r")?",
    re.DOTALL | re.IGNORECASE,
)
"""The decoded mask-0 text after an agent turn (`ConversationBuilder.env_text` with special tokens skipped):
the end of the assistant turn and the user role word, the reply block, the next assistant header and the
`<think>` opener."""


def masked_segments(output: str) -> list[dict[str, Any]]:
    """A decoded response split into agent text (mask 1) and environment text (mask 0), in order; the
    segments' texts join back to `output`."""
    segments: list[dict[str, Any]] = []
    position = 0
    for match in _ENV_SEGMENT.finditer(output):
        if match.start() > position:
            segments.append({"mask": 1, "text": output[position : match.start()]})
        segments.append({"mask": 0, "text": match.group(0)})
        position = match.end()
    if position < len(output):
        segments.append({"mask": 1, "text": output[position:]})
    return segments


def decoded_trajectories(dump: Path, n: int = TRAJECTORIES_SHOWN) -> list[dict[str, Any]]:
    """The first `n` trajectories of a verl rollout dump, with their masked segments."""
    out = []
    for line in dump.read_text(encoding="utf-8").splitlines()[:n]:
        entry = json.loads(line)
        segments = masked_segments(str(entry.get("output", "")))
        out.append(
            {
                "score": entry.get("score"),
                "gts": entry.get("gts"),
                "input_tail": str(entry.get("input", ""))[-200:],
                "segments": [
                    {"mask": s["mask"], "chars": len(s["text"]), "text": s["text"][:SEGMENT_CHARS]}
                    for s in segments
                ],
            }
        )
    return out


def step_trajectories(doc: Doctor) -> tuple[Status, str, dict[str, Any]]:
    if doc.status("verl step") != "pass":
        return skipped("no rollout data (the verl step did not run)")
    dump = max(rollout_dir(doc.reports_dir).glob("*.jsonl"))
    trajectories = decoded_trajectories(dump)
    if len(trajectories) < TRAJECTORIES_SHOWN:
        return failed(
            f"{dump.name} holds {len(trajectories)} trajectories, expected at least {TRAJECTORIES_SHOWN}"
        )
    shapes = ["".join(str(s["mask"]) for s in t["segments"]) for t in trajectories]
    return passed(
        f"{dump.name}: masks by segment {', '.join(shapes)} (1 agent, 0 environment; text in doctor.json)",
        dump=str(dump),
        trajectories=trajectories,
    )
