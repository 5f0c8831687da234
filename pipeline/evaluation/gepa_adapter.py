"""What GEPA calls during the gepa stage (pipeline/stages/gepa.py): our adapter, proposer, recorder and logger.

GEPA's protocols, implemented on our `EnvironmentClient`: the adapter answers each row as the `env_only`
baseline does (`systems.env_only_prompt`) and scores it with the answer reward's token F1; the proposer
sends GEPA's own reflection prompt through a second client; the recorder keeps the score history; the
logger sends GEPA's lines to `logging`. In their own module so the stage stays readable.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pipeline.evaluation.systems import env_only_prompt
from pipeline.metrics import token_f1

if TYPE_CHECKING:
    from pipeline.environment.client import EnvironmentClient

log = logging.getLogger("pipeline.stages.gepa")  # GEPA's lines under the stage's logger

COMPONENT = "instruction"
"""The one text component GEPA evolves: what the env_only prompt appends to the question."""


@dataclass(frozen=True)
class TaskExample:
    """One training row as GEPA sees it (its `DataInst`)."""

    uid: str
    dataset: str
    question: str
    answers: tuple[str, ...]


class EnvironmentInstructionAdapter:
    """GEPA's adapter: a candidate instruction → the environment answers each row as in `env_only`."""

    propose_new_texts = None
    """Part of GEPA's adapter protocol: None = proposals come from the optimiser's proposer."""

    def __init__(self, env: EnvironmentClient) -> None:
        self.env = env

    async def _answers(self, batch: list[TaskExample], instruction: str) -> list[str]:
        replies = await asyncio.gather(*(self.env.reply([], env_only_prompt(ex.question, instruction))
                                         for ex in batch))
        return ["" if r.error else r.text.strip() for r in replies]

    def evaluate(self, batch: list[TaskExample], candidate: dict[str, str], capture_traces: bool = False) -> Any:
        from gepa import EvaluationBatch

        predictions = asyncio.run(self._answers(batch, candidate[COMPONENT]))
        scores = [token_f1(p, list(ex.answers)) for p, ex in zip(predictions, batch, strict=True)]
        traces = None
        if capture_traces:
            traces = [{"question": ex.question, "dataset": ex.dataset, "prediction": p, "gold": list(ex.answers),
                       "score": s} for ex, p, s in zip(batch, predictions, scores, strict=True)]
        return EvaluationBatch(outputs=predictions, scores=scores, trajectories=traces)

    def make_reflective_dataset(self, candidate: dict[str, str], eval_batch: Any,
                                components_to_update: list[str]) -> dict[str, list[dict[str, Any]]]:
        records = [{
            "Inputs": {"question": t["question"]},
            "Generated Outputs": t["prediction"] or "(empty reply)",
            "Feedback": (f"Token F1 against the gold answer {t['score']:.2f} (1.0 is perfect). Gold answer(s): "
                         + " | ".join(t["gold"]) + ". Short answers that match the gold's words score best."),
        } for t in eval_batch.trajectories]
        return {name: records for name in components_to_update}


class ReflectionProposer:
    """GEPA's proposal step with its own reflection prompt (`InstructionProposalSignature`), sent through an
    `EnvironmentClient`; the new instruction is cut to `gepa.max_instruction_chars` (small models ramble)."""

    def __init__(self, client: EnvironmentClient, max_chars: int) -> None:
        self.client = client
        self.max_chars = max_chars

    def _complete(self, prompt: str | list[dict[str, Any]]) -> str:
        text = prompt if isinstance(prompt, str) else "\n\n".join(str(m.get("content", "")) for m in prompt)
        reply = asyncio.run(self.client.reply([], text))
        return "" if reply.error else reply.text

    def __call__(self, candidate: dict[str, str], reflective_dataset: Any,
                 components_to_update: list[str]) -> dict[str, str]:
        from gepa.strategies.instruction_proposal import InstructionProposalSignature

        out = {}
        for name in components_to_update:
            proposed = InstructionProposalSignature.run(self._complete, {
                "current_instruction_doc": candidate[name],
                "dataset_with_feedback": list(reflective_dataset[name]), "prompt_template": None,
            })["new_instruction"].strip()[: self.max_chars]
            if proposed:  # an empty proposal is no proposal (GEPA then skips the iteration)
                out[name] = proposed
        return out


@dataclass
class HistoryRecorder:
    """GEPA callback: every proposal (accepted or not) and every candidate scored on the val slice."""

    proposals: list[dict[str, Any]] = field(default_factory=list)
    val_scores: list[dict[str, Any]] = field(default_factory=list)
    metric_calls: int = 0
    bar: Any = None
    """The stage's progress report (`pipeline.progress`), counted in metric calls."""

    def on_budget_updated(self, event: dict[str, Any]) -> None:
        used = int(event["metric_calls_used"])
        if self.bar is not None and used > self.metric_calls:
            self.bar.set_postfix(proposals=len(self.proposals),
                                 accepted=sum(p["accepted"] for p in self.proposals))
            self.bar.update(used - self.metric_calls)
        self.metric_calls = used

    def on_proposal_end(self, event: dict[str, Any]) -> None:
        self.proposals.append({"iteration": event["iteration"],
                               "instruction": event["new_instructions"].get(COMPONENT, ""), "accepted": False})

    def on_candidate_accepted(self, event: dict[str, Any]) -> None:
        self._close_proposal(event["iteration"], accepted=True, new_score=event["new_score"])

    def on_candidate_rejected(self, event: dict[str, Any]) -> None:
        self._close_proposal(event["iteration"], accepted=False, new_score=event["new_score"],
                             old_score=event["old_score"], reason=event["reason"])

    def on_valset_evaluated(self, event: dict[str, Any]) -> None:
        # GEPA attaches its budget hook after scoring the seed, so the seed's calls are its val rows.
        calls = self.metric_calls if event["iteration"] else int(event["num_examples_evaluated"])
        self.val_scores.append({"iteration": event["iteration"], "candidate": event["candidate_idx"],
                                "val_score": round(float(event["average_score"]), 4), "metric_calls": calls})

    def _close_proposal(self, iteration: int, **outcome: Any) -> None:
        for p in reversed(self.proposals):
            if p["iteration"] == iteration:
                p.update({k: (round(v, 4) if isinstance(v, float) else v) for k, v in outcome.items()})
                return


class LoggingLogger:
    """GEPA's logger protocol onto `logging` (GEPA would print to stdout). Its per-iteration lines (whole
    proposed instructions, many lines each) are DEBUG (`promptr1 -v`); the stage's summary line is INFO."""

    def log(self, message: str) -> None:
        log.debug("GEPA: %s", message)
