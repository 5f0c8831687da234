"""What the train stage's MLflow run says besides its curves: its params, its input, its headline figure.

Design decisions:
- **Params on the train run**: the sections the stage reads (dvc.yaml's `train` params: seed, agent,
  environment, reward, train), flattened as on the parent run, so the train run can be compared on its own
  (the parent run keeps every param). Secrets never are params (the environment's key is named by
  `api_key_env`, never held).
- **The input as an MLflow dataset**: `data/rl/train.parquet`, tagged with its DVC md5
  (`tracking.log_dataset_inputs`). The dataset is a light view (data source, question, gold answers as
  JSON): MLflow infers a schema from it, which the nested chat-message columns would not give.
- **How far training got** (`pipeline.train.completion.TrainingProgress`) as `train.progress.*` tags, which the
  register stage reads to refuse a model whose training did not reach its total.
- **The headline figure on the parent run**: the last step's mean reward (`pipeline.tracking.headline`), read back
  from `reports/train/steps.csv`, which both backends write (verl's through `export_steps_csv`).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from pipeline.config import flatten_dict

if TYPE_CHECKING:
    import pandas as pd

    from pipeline.train.completion import TrainingProgress
    from pipeline.train.plan import TrainPlan

TRAIN_SECTIONS = ("seed", "agent", "environment", "reward", "train")
"""The params the train stage reads (dvc.yaml), logged on its run."""


def training_params(plan: TrainPlan) -> dict[str, Any]:
    """The train run's params: `TRAIN_SECTIONS` flattened (`train.lr`, `agent.model`, …), plus the profile."""
    dumped = {name: getattr(plan, name) for name in TRAIN_SECTIONS}
    dumped = {k: v if isinstance(v, int) else v.model_dump(mode="json") for k, v in dumped.items()}
    return {"profile": plan.profile, **flatten_dict(dumped)}


def train_input_frame(path: Any) -> pd.DataFrame:
    """train.parquet as MLflow shows it: data source, question (the prompt's last message), golds as JSON."""
    import pandas as pd

    frame = pd.read_parquet(path, columns=["data_source", "prompt", "reward_model"])
    return pd.DataFrame({
        "data_source": frame["data_source"].astype(str),
        "question": [str(list(p)[-1]["content"]) for p in frame["prompt"]],
        "gold_answers": [json.dumps([str(g) for g in list(r["ground_truth"])], ensure_ascii=False)
                         for r in frame["reward_model"]],
    })


def log_training_record(plan: TrainPlan, progress: TrainingProgress | None = None) -> None:
    """Into the active train run: its params, its input dataset and, when given, how far training got (the
    `train.progress.*` tags register reads); onto the parent: the last step's reward."""
    import mlflow

    from pipeline.tracking import runs as tracking
    from pipeline.tracking.headline import LAST_REWARD_METRIC, last_step_reward
    items = [(k, "" if v is None else str(v)[:500]) for k, v in training_params(plan).items()]
    for i in range(0, len(items), 100):
        mlflow.log_params(dict(items[i : i + 100]))
    train_file = plan.train_file
    if train_file.is_file():
        tracking.log_dataset_inputs({"train": (train_input_frame(train_file), train_file)}, context="training")
    if progress is not None:
        mlflow.set_tags(progress.tags())
    reward = last_step_reward(plan.steps_csv)
    if reward is not None:
        tracking.log_parent_metrics({LAST_REWARD_METRIC: reward})
