"""What the registered agent's LoggedModel page shows: the settings it was trained with and its scores per
evaluation set.

MLflow 3 keeps a logged model apart from its run: its page lists the model's own params, metrics and the
datasets those metrics were measured on, and stays empty unless they are logged against its `model_id`.
`describe_logged_model` logs
- **params**: the `agent` and `train` sections the agent was trained with, flattened (`agent.max_turns`,
  `train.lr`, ...), values as strings cut to MLflow's 6,000-character limit;
- **metrics per evaluation set**: prompt_r1's mean of every metric the set reports (metrics.json
  `per_dataset`), each logged with that set as an MLflow dataset (`mlflow.data.from_pandas` over its
  evaluation file, so the digest is the rows' content), plus its averages per split.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pipeline.types import TRAINED

log = logging.getLogger(__name__)

MAX_PARAM_CHARS = 6000
"""MLflow's limit on a param value."""


def model_params(sections: Mapping[str, Mapping[str, Any]]) -> dict[str, str]:
    """`{"agent": {...}, "train": {...}}` flattened to `section.key[.sub]` → string."""
    from pipeline.config import flatten_dict

    flat = flatten_dict({name: dict(values) for name, values in sections.items()})
    return {key: str(value)[:MAX_PARAM_CHARS] for key, value in flat.items()}


def describe_logged_model(model_id: str | None, params: Mapping[str, str], evaluation: Mapping[str, Any],
                          eval_files: Mapping[str, Path]) -> int:
    """Log `params` and prompt_r1's per-set metrics on the logged model `model_id`; returns how many sets got
    metrics. A set whose evaluation file is missing gets its metrics without a dataset (and a warning)."""
    import mlflow
    import mlflow.data
    import pandas as pd

    if not model_id:
        return 0
    mlflow.log_model_params(dict(params), model_id=model_id)
    logged = 0
    for name, per_system in evaluation.get("per_dataset", {}).items():
        scores = {metric: float(ci["mean"]) for metric, ci in (per_system.get(TRAINED) or {}).items()}
        if not scores:
            continue
        path = eval_files.get(name)
        dataset = None
        if path is not None and path.is_file():
            dataset = mlflow.data.from_pandas(pd.read_parquet(path), source=str(path), name=name)
        else:
            log.warning("register: %s's evaluation file %s is missing: its metrics go on the model without it",
                        name, path)
        mlflow.log_metrics(scores, model_id=model_id, dataset=dataset)
        logged += 1
    averages = evaluation.get("averages", {}).get(TRAINED, {})
    mlflow.log_metrics({f"{split}/{metric}": float(ci["mean"]) for split, per in averages.items()
                        for metric, ci in per.items()}, model_id=model_id)
    return logged
