"""`promptr1 weights [--check]`: fetch and verify every model the params need, one line per model.

The params decide which models (`RequiredWeights.needed_by`, from the agent, environment and evaluate
sections); `pipeline.weights` fetches and verifies them. A model that is not ready fails the command with every such
model named, so a scheduler can gate a GPU job on `--check`.
"""

from __future__ import annotations

import logging

from pipeline.config import Params
from pipeline.errors import UserError
from pipeline.local_weights import ModelStatus
from pipeline.weights import RequiredWeights, ensure_weights

log = logging.getLogger(__name__)


def required_weights(params: Params) -> RequiredWeights:
    """The models these params need on this machine."""
    return RequiredWeights.needed_by(params.agent, params.environment, params.evaluate, params.root)


def run_weights(params: Params, *, check_only: bool = False) -> list[ModelStatus]:
    """`promptr1 weights [--check]`: log one line per model; raise UserError naming every model not ready."""
    statuses = ensure_weights(required_weights(params), fetch=not check_only)
    for status in statuses:
        log.info("weights: %-20s %-8s %s (%s)", status.key, status.state, status.ref, status.detail)
    bad = [s for s in statuses if not s.ok]
    if bad:
        raise UserError("; ".join(f"{s.key}={s.ref!r} is {s.state}: {s.detail}" for s in bad))
    return statuses
