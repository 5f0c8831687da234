"""Stage `merge` (`promptr1 merge`): training checkpoints → one Hugging Face model in `paths.model_dir`.

The entry only: `run_merge` resolves the `MergePlan` from params once and hands it to
`pipeline.train.merge.merge_checkpoint`, where the merge itself lives (verl's merger or the local LoRA /
full fine-tune checkpoint, verified against the trained weights, published atomically with its model card).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.train.merge import merge_checkpoint
from pipeline.train.merge_plan import MergePlan

if TYPE_CHECKING:
    from pipeline.config import Params
    from pipeline.train.merge import MergeReport


def run_merge(params: Params) -> MergeReport:
    """Merge the newest checkpoint into `paths.model_dir`; returns the report."""
    return merge_checkpoint(MergePlan.from_params(params))
