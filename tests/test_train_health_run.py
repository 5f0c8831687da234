"""A real micro run of the local backend that trips the training health gate, end to end through the CLI.

The tiny random Llama (conftest `tiny_llama_dir`) never writes the protocol's tags, so every trajectory of every
group scores the same (-1.5): a run with no GRPO signal at all, the zero-variance collapse (every update skipped).
Judging a 6-step run (min_steps 1) with a grace period of 1 step and a window of 2, the gate judges step 3 first
and stops there. Asserted: the one line, exit 1, the
MLflow train run tagged and FAILED, the kept checkpoint (step_2: step 3 would have been saved, save_every 1,
but is judged first), and register refusing the run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml

from pipeline.config import deep_merge, load_params
from pipeline.train import checkpoint as ckpt

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.mark.slow
def test_micro_run_trips_the_gate_keeps_the_healthy_checkpoint_and_is_never_registered(tmp_path, tiny_llama_dir):
    import mlflow
    from fault_server import FaultServer
    from helpers import tiny_overrides, write_train_parquet

    from pipeline.errors import UserError
    from pipeline.stages.register import run_register

    write_train_parquet(tmp_path / "data/rl/train.parquet")
    with FaultServer() as server:
        overrides = tiny_overrides(tmp_path, tiny_llama_dir, server.url, steps=6, save_every=1, keep_checkpoints=2,
                                   health={"min_steps": 1, "grace_steps": 1, "window": 2})
        params_file = tmp_path / "params.yaml"
        params_file.write_text(yaml.safe_dump(deep_merge(yaml.safe_load((REPO_ROOT / "params.yaml").read_text()),
                                                         overrides)))
        t0 = time.perf_counter()
        result = subprocess.run([sys.executable, "-m", "pipeline.cli", "train", "--params", str(params_file)],
                                cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
                                capture_output=True, text=True, timeout=300, check=False)
        wall = time.perf_counter() - t0

    gate_lines = [line for line in result.stderr.splitlines() if "training health gate" in line]
    print(f"micro run: {wall:.1f} s, exit {result.returncode}: {gate_lines}")
    assert result.returncode == 1, result.stderr[-3000:]
    assert len(gate_lines) == 1, result.stderr[-3000:]
    assert gate_lines[0].startswith("error: training health gate: zero_variance_share 1 breaches 0.95 at step 3 (")
    assert gate_lines[0].endswith("training stopped, kept checkpoint step_2 (the last saved at or before the last "
                                  "healthy step)")
    assert "Traceback" not in result.stderr

    root = tmp_path / "checkpoints/agent"
    assert ckpt.complete_steps(root) == [1, 2] and ckpt.latest_checkpoint(root) == root / "step_2"
    steps = pd.read_csv(tmp_path / "reports/train/steps.csv")
    assert steps["step"].tolist() == [1, 2, 3]  # the breaching step is logged, not checkpointed
    assert steps["critic/score/zero_variance_group_frac"].eq(1.0).all()
    logged = [json.loads(x)["step"] for x in (tmp_path / "reports/train/trajectories.jsonl").read_text().splitlines()]
    assert logged == [1] * 4 + [2] * 4 + [3] * 4  # the breaching step's trajectories too, to see why

    params = load_params(params_file)
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow.set_tracking_uri(store)
    client = mlflow.MlflowClient(tracking_uri=store, registry_uri=store)  # this run's registry, whatever was set before
    parent = json.loads((tmp_path / "reports/mlflow_run.json").read_text())["run_id"]
    (train_run,) = client.search_runs([client.get_run(parent).info.experiment_id],
                                      f"tags.mlflow.parentRunId = '{parent}' and tags.stage = 'train'")
    assert train_run.info.status == "FAILED"
    assert train_run.data.tags["health.breach"] == "zero_variance_share"
    assert train_run.data.tags["health.breach_step"] == "3"
    assert train_run.data.tags["health.breach_threshold"] == "0.95"

    # register never sees it as a candidate: refused before anything is logged
    (tmp_path / "models/agent").mkdir(parents=True)
    ci = {"mean": 30.0, "low": 29.0, "high": 31.0}
    (tmp_path / "reports/eval").mkdir(parents=True)
    (tmp_path / "reports/eval/metrics.json").write_text(json.dumps({"mode": "ours", "rows_per_dataset": 4, "averages": {
        "prompt_r1": {"id": {m: ci for m in ("em", "f1", "ssim")}, "ood": {m: ci for m in ("em", "f1", "ssim")}}}}))
    with pytest.raises(UserError, match=r"health\.breach=zero_variance_share at step 3"):
        run_register(params)
    assert client.search_registered_models() == []
    assert not (tmp_path / "reports/promotion.json").exists()
