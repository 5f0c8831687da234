"""verl's FSDP2 checkpoint path, run for real on CPU at 2 ranks: the path the GPU profiles take after training.

The profiles pin `strategy: fsdp2` for the actor and the reference (pipeline/train/verl/overrides.yaml);
this is that strategy, at a world size above one so each rank holds only a shard. Two processes
(`torch.multiprocessing.spawn`, torch.distributed over gloo, a device mesh named as verl names it) build a
tiny Llama as verl's FSDP engine builds the fsdp2 actor, train two AdamW steps on their own batches and
save each with verl's `FSDPCheckpointManager` (`tests/verl_cpu.py: fsdp_checkpoint_worker`). Then:
- each rank's file holds a shard (half the rows of a sharded weight), so the merge has to concatenate;
- our checkpoint lookup (`latest_verl_step`, what `promptr1 merge` reads) agrees with verl's own
  (`find_latest_ckpt_path`, what `trainer.resume_mode=auto` reads);
- a fresh 2-rank FSDP2 actor loads the checkpoint through the same manager (verl's resume) and has the
  trained weights, optimizer steps and logits back;
- `promptr1 merge` (`run_merge`, backend verl) runs `python -m verl.model_merger merge --backend fsdp`,
  which concatenates the 2 shards, and its verification passes; every merged tensor is the trained
  actor's rounded to bfloat16 (verl's merger always writes bfloat16), and its logits match the trained
  actor's within bfloat16 rounding;
- a checkpoint without its model shards makes the merge fail loudly and leaves the previous model in place.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from demo_project import free_port
from safetensors.torch import load_file
from verl_cpu import fsdp_checkpoint_worker

from pipeline.checks.layout import assert_runnable
from pipeline.config import load_params
from pipeline.stages.merge import run_merge
from pipeline.train import checkpoint as ckpt
from pipeline.train.merge import MergeVerificationError, probe_input, probe_logits

REPO_ROOT = Path(__file__).resolve().parents[1]

WORLD_SIZE = 2


def merge_params(tmp: Path, model_dir: Path):
    return load_params(REPO_ROOT / "params.yaml", {
        "paths": {"checkpoint_dir": str(tmp / "ckpt"), "model_dir": str(tmp / "models/agent"),
                  "reports_dir": str(tmp / "reports"), "rl_dir": str(tmp / "rl")},
        "agent": {"model": str(model_dir)},
        "train": {"backend": "verl", "verl": {"nnodes": 1, "n_gpus_per_node": 1, "rollout_tp": 1}},
    })


@pytest.mark.slow
def test_verl_fsdp2_checkpoint_of_2_ranks_resumes_and_merges_on_cpu(tmp_path, tiny_llama_dir):
    from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path

    root = tmp_path / "ckpt"
    torch.multiprocessing.spawn(fsdp_checkpoint_worker, nprocs=WORLD_SIZE, join=True, args=(
        WORLD_SIZE, str(tiny_llama_dir), str(root), free_port(), str(tmp_path)))

    actor = root / "global_step_2" / "actor"
    for rank in range(WORLD_SIZE):
        for kind in ("model", "optim", "extra_state"):
            assert (actor / f"{kind}_world_size_{WORLD_SIZE}_rank_{rank}.pt").is_file(), (kind, rank)
    assert json.loads((actor / "fsdp_config.json").read_text())["world_size"] == WORLD_SIZE
    assert (actor / "huggingface/config.json").is_file()
    # Each rank saved a shard: the merger must concatenate them (fsdp_model_merger.py, Shard placement).
    trained = torch.load(tmp_path / "trained_state.pt")
    shards = [torch.load(actor / f"model_world_size_{WORLD_SIZE}_rank_{r}.pt", weights_only=False)
              for r in range(WORLD_SIZE)]
    name = "model.embed_tokens.weight"
    local = [shard[name].to_local() for shard in shards]
    assert [t.shape[0] for t in local] == [trained[name].shape[0] // WORLD_SIZE] * WORLD_SIZE
    assert torch.equal(torch.cat(local), trained[name])
    # The stage's disk check (pipeline/train/verl/memory.py) estimates what verl's checkpoint manager just wrote.
    from pipeline.train.verl import memory

    written = sum((actor / f"{part}_world_size_{WORLD_SIZE}_rank_{r}.pt").stat().st_size
                  for part in ("model", "optim", "extra_state") for r in range(WORLD_SIZE))
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
