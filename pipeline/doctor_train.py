"""`promptr1 doctor` steps 7-9: one verl step, its merge, and two of its trajectories (GPU nodes only).

- `verl step`: one GRPO step through `pipeline.train.verl_backend.train_verl`, the path `promptr1 train`
  runs (same overrides, same environment reuse, same Ray handling), with params changed only where a
  check differs from a run: checkpoints under `reports/doctor/checkpoints` (emptied first, so verl's
  `resume_mode: auto` starts at step 0), `save_freq: 1`, no validation, `trainer.total_training_steps=1`
  and `trainer.rollout_data_dir` (verl dumps the step's decoded rollouts as `<step>.jsonl`), its log and
  overrides under `reports/doctor/train/`, and its MLflow run in the experiment `<experiment>-doctor`, so
  the doctor never adds a run to the project's own experiment or a checkpoint to `paths.checkpoint_dir`.
- `merge`: `pipeline.train.merge.run_merge` of that checkpoint into `reports/doctor/model` (verl's merger,
  then the load-and-generate check).
- `trajectories`: two trajectories of the dump, each split into its agent turns (mask 1) and the
  environment's replies (mask 0). verl's dump holds decoded text, not the token mask, so the split is at
  the protocol's `<interaction_response>` blocks with the template text around them (the role words and
  the next `<think>` opener), which is exactly what the agent loop masks with 0 (`ConversationBuilder.
  env_text`, pipeline/train/verl_agent_loop.py): a reply that leaked into a mask-1 segment, or an agent turn
  inside a reply block, shows here as a wrong segment.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.agent.protocol import RESPONSE_CLOSE, RESPONSE_OPEN, THINK_OPENER
from pipeline.config import Params
from pipeline.doctor import BUILD_FIRST, Status, failed, passed, skipped

if TYPE_CHECKING:
    from pipeline.doctor import Doctor

TRAJECTORIES_SHOWN = 2
SEGMENT_CHARS = 160
"""Characters of each segment printed in the report (the whole text is in the dump)."""


def doctor_dir(reports_dir: Path) -> Path:
    """`<paths.reports_dir>/doctor`: every output of the one-step run stays under it."""
    return reports_dir / "doctor"


def rollout_dir(reports_dir: Path) -> Path:
    return doctor_dir(reports_dir) / "rollout"


def one_step_params(params: Params) -> Params:
    """`params` for one verl step whose outputs all stay under reports/doctor/ (module docstring)."""
    p = params.model_copy(deep=True)
    p.root = params.root
    base = doctor_dir(params.path(params.paths.reports_dir)).resolve()
    p.paths.reports_dir = str(base)
    p.paths.checkpoint_dir = str(base / "checkpoints")
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
    return p


def _verl_skip_reason(doc: Doctor) -> str | None:
    params = doc.params
    if params.train.backend != "verl":
        return "train.backend=local: no verl step (the local backend trains with `promptr1 train`)"
    if not doc.gpus:
        return "needs a GPU: none on this machine"
    if not (params.path(params.paths.rl_dir) / "train.parquet").is_file():
        return f"{BUILD_FIRST} (no {params.paths.rl_dir}/train.parquet)"
    if doc.environment_url is None:
        return "no environment server (the environment step did not pass)"
    return None


def step_verl(doc: Doctor) -> tuple[Status, str, dict[str, Any]]:
    import mlflow

    from pipeline import tracking
    from pipeline.train import checkpoint as ckpt
    from pipeline.train.verl_backend import train_verl

    reason = _verl_skip_reason(doc)
    if reason:
        return skipped(reason)
    p = one_step_params(doc.params)
    shutil.rmtree(p.path(p.paths.checkpoint_dir), ignore_errors=True)
    shutil.rmtree(rollout_dir(doc.reports_dir), ignore_errors=True)
    p.environment.base_url = doc.environment_url  # the server step 5 holds: train_verl reuses it
    tracking.configure(p)
    with mlflow.start_run(run_name=f"doctor-{p.profile}") as run:
        train_verl(p, run)
    actor = ckpt.latest_verl_step(p.path(p.paths.checkpoint_dir))
    dumps = sorted(rollout_dir(doc.reports_dir).glob("*.jsonl"))
    figures = {
        "checkpoint": str(actor) if actor else None,
        "rollout_dumps": [d.name for d in dumps],
        "log": str(p.path(p.paths.reports_dir) / "train" / "verl.log"),
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
    return passed(f"1 step saved {actor.parent.name}/actor; rollouts dumped to {dumps[-1].name}", **figures)


def step_merge(doc: Doctor) -> tuple[Status, str, dict[str, Any]]:
    from pipeline.train.merge import run_merge

    if doc.status("verl step") != "pass":
        return skipped("no verl checkpoint (the verl step did not run)")
    p = one_step_params(doc.params)
    report = run_merge(p)
    return passed(
        f"{report.checkpoint} merged into {p.paths.model_dir}: generated {report.generated_tokens} tokens "
        f"({report.sample!r})",
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
