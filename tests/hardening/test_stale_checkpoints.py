"""A param change sets the old checkpoints aside (renamed beside the DVC output), never deletes them at
once; at most `train.keep_stale_checkpoints` such folders are kept, oldest removed first.

Real checkpoint folders on disk (a `trainer_state.json` of another training config, weights stand-ins);
the full path through a real tiny training run is tests/test_train_local.py's
`test_changed_training_params_start_afresh_instead_of_reusing_the_old_model`.
"""

from __future__ import annotations

import json
from pathlib import Path

from helpers import output_paths

from pipeline.config import load_params
from pipeline.train import checkpoint as ckpt
from pipeline.train.local.resume import discard_stale_checkpoints, stale_folders, training_config
from pipeline.train.plan import TrainPlan

ROOT = Path(__file__).resolve().parents[2]


def _params(project: Path, keep: int):
    overrides = {"paths": output_paths(project), "train": {"keep_stale_checkpoints": keep}}
    return load_params(ROOT / "params.yaml", overrides)


def _old_run(params, marker: str) -> None:
    """A checkpoint folder trained with another seed, a weights stand-in naming the run, and its steps.csv."""
    root = params.path(params.paths.checkpoint_dir)
    step = ckpt.step_dir(root, 1)
    step.mkdir(parents=True)
    config = {**training_config(TrainPlan.from_params(params)), "seed": params.seed + 1}
    (step / ckpt.STATE_FILE).write_text(json.dumps({"step": 1, "config": config}))
    (step / "model.safetensors").write_text(marker)
    (root / ckpt.LATEST).write_text("step_1")
    steps_csv = params.path(params.paths.reports_dir) / "train" / "steps.csv"
    steps_csv.parent.mkdir(parents=True, exist_ok=True)
    steps_csv.write_text(f"step,reward\n1,{marker}\n")


def test_old_runs_are_set_aside_and_only_the_newest_kept(tmp_path):
    params = _params(tmp_path, keep=2)
    root = params.path(params.paths.checkpoint_dir)
    assert discard_stale_checkpoints(TrainPlan.from_params(params)) is None  # nothing there: nothing to do

    aside = []
    for run in ("run-a", "run-b", "run-c"):
        _old_run(params, run)
        aside.append(discard_stale_checkpoints(TrainPlan.from_params(params)))
        assert not root.exists()  # the run starts afresh
        assert not (params.path(params.paths.reports_dir) / "train" / "steps.csv").exists()

    kept = stale_folders(root)
    assert kept == aside[1:] and not aside[0].exists()  # run-a, the oldest, went once a third came
    for folder, run in zip(kept, ("run-b", "run-c"), strict=True):
        assert folder.parent == root.parent and folder.name.startswith("agent.stale-")
        assert tmp_path in folder.parents  # beside the output, inside the project
        assert (folder / "step_1" / "model.safetensors").read_text() == run
        assert run in (folder / "steps.csv").read_text()
        assert (folder / ".gitignore").read_text() == "*\n"


def test_current_checkpoint_is_left_alone(tmp_path):
    params = _params(tmp_path, keep=1)
    _old_run(params, "same")
    state = ckpt.step_dir(params.path(params.paths.checkpoint_dir), 1) / ckpt.STATE_FILE
    state.write_text(json.dumps({"step": 1, "config": training_config(TrainPlan.from_params(params))}))
    assert discard_stale_checkpoints(TrainPlan.from_params(params)) is None
    assert state.is_file() and stale_folders(params.path(params.paths.checkpoint_dir)) == []


def test_keep_zero_removes_as_before(tmp_path):
    params = _params(tmp_path, keep=0)
    _old_run(params, "gone")
    assert discard_stale_checkpoints(TrainPlan.from_params(params)) is None
    root = params.path(params.paths.checkpoint_dir)
    assert not root.exists() and stale_folders(root) == []


def test_the_knowledge_mode_is_part_of_what_the_weights_depend_on(tmp_path):
    """A checkpoint trained against the `question` knowledge mode is stale for a `terse` run (and back)."""
    project = tmp_path / "project"
    project.mkdir()
    base = {"paths": output_paths(project), "environment": {"backend": "knowledge"}}
    question = load_params(ROOT / "params.yaml", base)
    terse = load_params(ROOT / "params.yaml", {**base, "environment": {"backend": "knowledge",
                                                                        "knowledge": {"mode": "terse"}}})
    a, b = training_config(TrainPlan.from_params(question)), training_config(TrainPlan.from_params(terse))
    assert a["environment"]["knowledge"]["mode"] == "question"
    assert b["environment"]["knowledge"]["mode"] == "terse"
    assert a != b
