"""verl's FSDP checkpoint path, run for real on CPU: the path the paper profile takes after training.

A worker process (torch.distributed over gloo, world size 1, a device mesh named as verl names it) wraps a
tiny Llama with verl's own `apply_fsdp2`, trains two AdamW steps and saves each with verl's
`FSDPCheckpointManager`, writing the tracker file as verl's trainer does. Then:
- our checkpoint lookup (`latest_verl_step`, what `promptr1 merge` reads) agrees with verl's own
  (`find_latest_ckpt_path`, what `trainer.resume_mode=auto` reads);
- a fresh FSDP actor loads the checkpoint through the same manager (verl's resume) and has the trained
  weights, optimizer steps and logits back;
- `promptr1 merge` (`run_merge`, backend verl) runs `python -m verl.model_merger merge --backend fsdp` and
  its verification passes; every merged tensor is the trained actor's rounded to bfloat16 (verl's merger
  always writes bfloat16), and its logits match the trained actor's within bfloat16 rounding;
- a checkpoint without its model shard makes the merge fail loudly and leaves the previous model in place.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from demo_project import free_port
from safetensors.torch import load_file

from pipeline.config import load_params
from pipeline.layout import assert_runnable
from pipeline.train import checkpoint as ckpt
from pipeline.train.merge import MergeVerificationError, probe_input, probe_logits, run_merge

REPO_ROOT = Path(__file__).resolve().parents[1]

WORKER = r'''
import json, os, sys

import torch
import torch.distributed as dist

model_dir, root, port, out, repo = sys.argv[1:6]
sys.path.insert(0, repo)
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
dist.init_process_group("gloo", rank=0, world_size=1)

from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoModelForCausalLM, AutoTokenizer
from verl.utils.checkpoint.checkpoint_manager import get_checkpoint_tracker_filename
from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager
from verl.utils.fsdp_utils import apply_fsdp2

from pipeline.train.merge import probe_input, probe_logits

# verl's create_device_mesh (workers/engine/fsdp/utils.py) with the device "cpu": one dimension, "fsdp".
mesh = init_device_mesh("cpu", mesh_shape=(1,), mesh_dim_names=["fsdp"])
tokenizer = AutoTokenizer.from_pretrained(model_dir)


def fsdp_actor():
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    apply_fsdp2(model, {"mesh": mesh}, {})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    manager = FSDPCheckpointManager(model=model, optimizer=optimizer, lr_scheduler=None, processing_class=tokenizer)
    return model, optimizer, manager


def full(tensor):  # a DTensor shard (FSDP2) or a plain tensor
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


model, optimizer, manager = fsdp_actor()
batch = tokenizer(["Question: who wrote Hamlet? <search>author of Hamlet</search>"], return_tensors="pt")
for step in (1, 2):
    model.train()
    model(**batch, labels=batch["input_ids"]).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    manager.save_checkpoint(os.path.join(root, f"global_step_{step}", "actor"), global_step=step)
    with open(get_checkpoint_tracker_filename(root), "w") as f:  # as verl's trainer does after a save
        f.write(str(step))
expected = probe_logits(model, probe_input(tokenizer))
torch.save(expected, os.path.join(out, "expected_logits.pt"))
torch.save({name: full(t).detach().clone() for name, t in model.state_dict().items()},
           os.path.join(out, "trained_state.pt"))

fresh, fresh_optimizer, fresh_manager = fsdp_actor()
fresh_manager.load_checkpoint(os.path.join(root, "global_step_2", "actor"))
weights = max(float((full(a) - full(b)).abs().max())
              for a, b in zip(model.parameters(), fresh.parameters(), strict=True))
steps = sorted({int(s["step"]) for s in fresh_optimizer.state_dict()["state"].values()})
logits = float((probe_logits(fresh, probe_input(tokenizer)) - expected).abs().max())
with open(os.path.join(out, "resume.json"), "w") as f:
    json.dump({"weights_max_diff": weights, "optimizer_steps": steps, "logits_max_diff": logits}, f)
dist.destroy_process_group()
'''


def merge_params(tmp: Path, model_dir: Path):
    return load_params(REPO_ROOT / "params.yaml", {
        "paths": {"checkpoint_dir": str(tmp / "ckpt"), "model_dir": str(tmp / "models/agent"),
                  "reports_dir": str(tmp / "reports"), "rl_dir": str(tmp / "rl")},
        "agent": {"model": str(model_dir)},
        "train": {"backend": "verl", "verl": {"nnodes": 1, "n_gpus_per_node": 1, "rollout_tp": 1}},
    })


@pytest.mark.slow
def test_verl_fsdp_checkpoint_resumes_and_merges_on_cpu(tmp_path, tiny_llama_dir):
    from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path

    root = tmp_path / "ckpt"
    proc = subprocess.run(
        [sys.executable, "-c", WORKER, str(tiny_llama_dir), str(root), str(free_port()), str(tmp_path),
         str(REPO_ROOT)], capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]

    actor = root / "global_step_2" / "actor"
    for name in ("model_world_size_1_rank_0.pt", "optim_world_size_1_rank_0.pt",
                 "extra_state_world_size_1_rank_0.pt", "fsdp_config.json", "huggingface/config.json"):
        assert (actor / name).is_file(), name
    # The stage's disk check (pipeline/train/memory.py) estimates what verl's checkpoint manager just wrote.
    from pipeline.train import memory

    written = sum((actor / f"{part}_world_size_1_rank_0.pt").stat().st_size for part in ("model", "optim", "extra_state"))
    estimate = memory.checkpoint_bytes(memory.parameter_count(str(tiny_llama_dir))[0],
                                       save_contents=["model", "optimizer", "extra"], model_dtype="fp32", lora=False)
    assert abs(written - estimate) / estimate < 0.05, (written, estimate)
    # Resume: our lookup and verl's find the same checkpoint; verl's manager restores it exactly.
    assert ckpt.latest_verl_step(root) == actor
    assert Path(find_latest_ckpt_path(str(root))) / "actor" == actor
    resumed = json.loads((tmp_path / "resume.json").read_text())
    assert resumed == {"weights_max_diff": 0.0, "optimizer_steps": [2], "logits_max_diff": 0.0}

    # Merge: verl's model merger, then our verification, into models/agent.
    params = merge_params(tmp_path, tiny_llama_dir)
    assert_runnable(params)
    report = run_merge(params)
    out = tmp_path / "models/agent"
    assert report.source == "verl" and report.step == 2 and report.generated_tokens >= 1
    assert list(out.glob("*.safetensors")) and (out / "README.md").is_file()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(out))
    assert tokenizer.chat_template
    # verl's merger writes bfloat16 (fsdp_model_merger.py): every tensor is the trained one, rounded so.
    trained = torch.load(tmp_path / "trained_state.pt")
    written = load_file(str(next(out.glob("*.safetensors"))))
    assert set(written) <= set(trained) and len(written) >= len(trained) - 1  # lm_head may be tied
    for name, tensor in written.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, trained[name].bfloat16()), name
    merged = probe_logits(AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32),
                          probe_input(tokenizer))
    expected = torch.load(tmp_path / "expected_logits.pt")
    assert float((merged - expected).abs().max()) < 0.05  # bfloat16 weights, float32 activations
    base = probe_logits(AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir)), probe_input(tokenizer))
    assert float((base - merged).abs().max()) > 1e-3, "the merge ignored the trained weights"

    # A newer checkpoint without its model shard: the merge fails loudly, the verified model stays.
    broken = root / "global_step_3" / "actor"
    shutil.copytree(actor, broken, ignore=shutil.ignore_patterns("model_world_size_*"))
    (root / "latest_checkpointed_iteration.txt").write_text("3")
    assert ckpt.latest_verl_step(root) == broken
    with pytest.raises(MergeVerificationError, match="merger failed"):
        run_merge(params)
    assert json.loads((out / "merge_report.json").read_text())["step"] == 2
    assert not list(out.parent.glob(".agent.tmp-*"))
