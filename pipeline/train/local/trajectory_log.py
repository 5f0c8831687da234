"""What the agent wrote, step by step: `reports/train/trajectories.jsonl`, one line per sampled trajectory.

The curve in steps.csv says *whether* the reward moves; this log says *what* the agent learnt to ask the
environment and answer. Each line: step, question id, gold answers, the turns (think, interaction prompt,
the environment's reply, answer, format flags), stop reason and the reward with its parts (`format`,
`answer`, `total`) — enough to rescore the same trajectories under another reward preset
(benchmarks/bench_reward_presets.py). Like the steps log, a resumed run first drops the lines of steps after
its checkpoint, so a step killed mid-way is never counted twice. Written with one `write` per step and
flushed, so a kill leaves whole lines. Every string of a line passes `redact_secrets` first (the replies
are untrusted: a server echoing the API key must not put it in a DVC output); nothing else is altered.

`log_step_traces` shows the same trajectories in MLflow: the first `mlflow.trace_train_samples` of each step
(with GRPO's item-major order, members of one question's group) become traces of the train run, tagged with
the step, so a user can watch in the Traces tab what the agent learns to ask (`pipeline.tracking.traces`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from pipeline.agent.rollout import trajectory_record
from pipeline.environment.sanitize import redact_value
from pipeline.tracking.traces import flush_traces, log_trajectory_trace
from pipeline.types import Trajectory


class TrajectoryLog:
    """Append-only JSONL of the trajectories of each step (see module docstring)."""

    def __init__(self, path: Path, keep_upto: int) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_file():
            kept = [line for line in path.read_text(encoding="utf-8").splitlines()
                    if line.strip() and json.loads(line).get("step", 0) <= keep_upto]
            path.write_text("".join(f"{line}\n" for line in kept), encoding="utf-8")

    def append(self, step: int, trajectories: Sequence[Trajectory]) -> None:
        lines = []
        for traj in trajectories:
            reward = asdict(traj.reward) if traj.reward is not None else None
            lines.append(json.dumps(redact_value({
                "step": step, "uid": traj.item.uid, "data_source": traj.item.data_source,
                "gold_answers": list(traj.item.gold_answers), "stop_reason": traj.stop_reason,
                "turns": trajectory_record(traj), "reward": reward,
            }), ensure_ascii=False, default=str))
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write("".join(f"{line}\n" for line in lines))
            handle.flush()


def log_step_traces(step: int, trajectories: Sequence[Trajectory]) -> list[str]:
    """Each trajectory as one MLflow trace of the active run (tags: stage, step, dataset, uid, sample), its
    reward parts as the scores; waits until they are written. Returns the trace ids; none without an active
    run (like the step metrics)."""
    import mlflow

    if mlflow.active_run() is None or not trajectories:
        return []
    ids = []
    for sample, traj in enumerate(trajectories):
        reward = traj.reward
        scores = {"reward": reward.total, "format": reward.format, "answer": reward.answer} if reward else {}
        trace_id = log_trajectory_trace(
            name=f"step {step} · {traj.item.data_source} · {traj.item.uid}",
            tags={"stage": "train", "step": step, "dataset": traj.item.data_source, "uid": traj.item.uid,
                  "sample": sample},
            question=traj.item.question, gold_answers=traj.item.gold_answers, turns=trajectory_record(traj),
            prediction=traj.answer, scores=scores, stop_reason=traj.stop_reason,
            seconds=traj.generation_s + traj.environment_s)
        if trace_id is not None:
            ids.append(trace_id)
    flush_traces()
    return ids
