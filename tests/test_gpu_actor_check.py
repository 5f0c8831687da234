"""benchmarks/gpu_actor_check.py end to end on CPU, so the GPU check cannot rot between GPU runs.

The script is run as a user runs it: a subprocess, the `--device cpu --tiny` command benchmarks/README.md
gives. It drives verl's own actor worker (FSDP2 engine, gloo, world size 1) from the smoke-1gpu profile's
composed config through one GRPO update, verl's checkpoint manager, `python -m verl.model_merger`, and the
comparison. The JSON must show an update that ran (finite loss, weights moved), a saved checkpoint, merged
weights equal to the trained ones rounded to bfloat16 with every key present and different from the initial
ones, and the memory rule's estimate for this actor.
"""

from __future__ import annotations

import json
import math
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.config import load_params

REPO_ROOT = Path(__file__).resolve().parents[1]


def cpu_command(out: Path) -> list[str]:
    """The CPU command benchmarks/README.md gives, writing to `out`."""
    text = (REPO_ROOT / "benchmarks" / "README.md").read_text(encoding="utf-8")
    (line,) = [
        ln for ln in text.splitlines() if ln.startswith("python benchmarks/gpu_actor_check.py --device cpu")
    ]
    words = shlex.split(line)
    words[words.index("--out") + 1] = str(out)
    return [sys.executable, *words[1:]]


@pytest.mark.slow
def test_gpu_actor_check_runs_end_to_end_on_cpu(tmp_path):
    out = tmp_path / "check.json"
    done = subprocess.run(
        cpu_command(out), cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, check=False
    )
    assert out.is_file(), done.stderr[-4000:]
    report = json.loads(out.read_text())

    assert report["device"] == "cpu"
    # the memory rule is asked for this actor on the CPU too (its figures are measured on a GPU only)
    memory = report["memory"]
    assert memory["rule_gib"] > 0 and "weights" in memory["rule"]
    assert memory["resident"] is None and memory["peak_update_allocated_gib"] is None
    assert report["actor"]["strategy"] == "fsdp2" and report["actor"]["gradient_checkpointing"] is True
    assert report["model"]["layers"] == 2 and report["model"]["hidden"] == 64
    # the smoke-1gpu profile's batch: questions x samples, its mini-batch (x samples) and micro-batch
    train = load_params(REPO_ROOT / "params.yaml", {"profile": "smoke-1gpu"}).train
    assert report["batch"]["sequences"] == train.batch_size * train.group_size
    assert report["batch"]["mini_batch"] == train.mini_batch_size * train.group_size
    assert report["batch"]["micro_batch"] == train.micro_batch_size

    update = report["update"]
    assert update["ran"] is True and math.isfinite(update["loss"]) and math.isfinite(update["grad_norm"])
    assert update["max_abs_change"] > 0 and update["tensors_changed"] > 0

    checkpoint = report["checkpoint"]
    assert checkpoint["saved"] is True
    assert "model_world_size_1_rank_0.pt" in checkpoint["files"]
    assert "optim_world_size_1_rank_0.pt" in checkpoint["files"]

    compare = report["compare"]
    assert compare["missing"] == [] and compare["unexpected"] == []
    assert compare["keys_merged"] == compare["keys_trained"] > 0
    assert compare["merged_dtypes"] == ["torch.bfloat16"]
    assert compare["max_abs_diff_vs_bf16_rounded"] == 0.0 and compare["equal"] is True
    assert compare["max_abs_diff"] < 1e-2  # bfloat16 rounding of weights of size ~0.02-1
    assert compare["max_abs_diff_vs_initial"] > 0  # the merge holds the update, not the initial weights
    assert report["ok"] is True and done.returncode == 0
