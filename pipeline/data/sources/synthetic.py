"""Generated sources: `hops`, the 1-hop and 2-hop questions of a made-up world (no Hub, no mirror file).

The world and its questions are `pipeline.environment.simulated.hops_world`'s (the same code builds the store the
`hops` environment answers from, so every question is answerable there). Held-out: `HELDOUT` questions in the
repeating order 1-hop, 2-hop, 2-hop (any first N keep the one-third mix); training: the rest, one third 1-hop.
The held-out rows play the authors' evaluation file (`eval_file`), so the leakage filter, validation and the
build treat them as the other datasets' evaluation rows.
"""

from __future__ import annotations

from pipeline.data.sources.registry import GeneratedSource, RawRecord, register
from pipeline.environment.simulated.hops_world import WORLD_VERSION, split_questions, world

HELDOUT = 128
"""Held-out questions: the size of the authors' evaluation files (`data.eval_rows`)."""


def hops_rows() -> tuple[list[RawRecord], list[tuple[str, list[str]]]]:
    """(training records, held-out (question, answers)) of the hops world."""
    train, heldout = split_questions(world().questions, HELDOUT)
    records = [
        {
            "id": f"hops-train-{i:04d}",
            "question": q.text,
            "answers": [q.answer],
            "context": "",
            "source_split": "train",
        }
        for i, q in enumerate(train)
    ]
    return records, [(q.text, [q.answer]) for q in heldout]


register(
    "hops",
    "multi_hop_qa",
    trains=True,
    hub=None,
    mirror="generated/hops/train.parquet",
    eval_file="hops.parquet",
    eval_tag="hops-world",
    generated=GeneratedSource(WORLD_VERSION, hops_rows),
    note="generated from a fixed seed (pipeline/environment/simulated/hops_world.py); the learn-hops profile trains on it",
)
