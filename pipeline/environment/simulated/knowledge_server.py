"""The knowledgeable environment's server: the knowledge base `environment.knowledge.mode` names, served.

The three modes (`question`: pipeline/environment/simulated/knowledge.py, `terse`: pipeline/environment/simulated/terse.py,
`hops`: pipeline/environment/simulated/hops.py) each build on `knowledge.KnowledgeBase`; choosing one needs all three,
so the choice lives here, above them, with the command that serves it. The HTTP side (`/v1/models`,
`/v1/chat/completions`) is `knowledge.make_server`, the same for every mode. Started and stopped by
`pipeline.environment.servers` (backend `knowledge`) like llama.cpp:
    python -m pipeline.environment.simulated.knowledge_server --source data/rl/train.parquet --source data/rl/eval \\
        --host 127.0.0.1 --port 8765 --served-name knowledge-base --min-overlap 0.6
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.environment.simulated.hops import HopsKnowledgeBase
from pipeline.environment.simulated.knowledge import KnowledgeBase, load_facts, make_server
from pipeline.environment.simulated.terse import TerseKnowledgeBase

if TYPE_CHECKING:
    from pipeline.config import EnvironmentConfig

logger = logging.getLogger(__name__)


def knowledge_base(
    facts: Iterable[tuple[str, Sequence[str]]], min_overlap: float = 0.6, mode: str = "question"
) -> KnowledgeBase:
    """The knowledge base of `environment.knowledge.mode`: `question` (pipeline/environment/simulated/knowledge.py),
    `terse` (pipeline/environment/simulated/terse.py: a request length limit, matching on key words, replies with
    distractors) or `hops` (pipeline/environment/simulated/hops.py: one subject per request, single-hop facts of a
    made-up world)."""
    if mode == "hops":
        return HopsKnowledgeBase(facts, min_overlap)
    if mode == "terse":
        return TerseKnowledgeBase(facts, min_overlap)
    if mode != "question":
        raise ValueError(f"environment.knowledge.mode={mode!r}: expected question, terse or hops")
    return KnowledgeBase(facts, min_overlap)


def knowledge_command(cfg: EnvironmentConfig, root: Path) -> list[str]:
    """The command that serves `cfg.knowledge` on `cfg.host:cfg.port` (sources resolved against `root`)."""
    sources: list[str] = []
    for source in cfg.knowledge.sources:
        path = Path(source)
        sources += ["--source", str(path if path.is_absolute() else root / path)]
    return [
        sys.executable,
        "-m",
        "pipeline.environment.simulated.knowledge_server",
        *sources,
        "--min-overlap",
        str(cfg.knowledge.min_overlap),
        "--mode",
        cfg.knowledge.mode,
        "--served-name",
        cfg.served_name,
        "--host",
        cfg.host,
        "--port",
        str(cfg.port),
    ]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Serve a knowledge base as an OpenAI-compatible environment."
    )
    parser.add_argument("--source", action="append", required=True, help="Parquet/JSONL file or folder")
    parser.add_argument("--min-overlap", type=float, default=0.6)
    parser.add_argument(
        "--mode",
        choices=["question", "terse", "hops"],
        default="question",
        help="terse: pipeline/environment/simulated/terse.py's request limit and distractors; "
        "hops: pipeline/environment/simulated/hops.py's one-subject look-ups",
    )
    parser.add_argument("--served-name", default="knowledge-base")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8765)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    kb = knowledge_base(load_facts(args.source), args.min_overlap, args.mode)
    server = make_server(kb, args.host, args.port, args.served_name)
    logger.info(
        "knowledge environment (%s mode): %d questions, min_overlap %g, serving %r at http://%s:%d/v1",
        args.mode,
        len(kb),
        args.min_overlap,
        args.served_name,
        args.host,
        server.server_address[1],
    )
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
