"""verl's rollout side on CPU for tests: a transformers "server manager" and in-process stand-ins for Ray calls.

verl's agent-loop worker asks its LLM client for one agent turn at a time
(`generate(request_id, prompt_ids=…, sampling_params=…) -> TokenOutput`, the contract vLLM's and SGLang's
servers implement behind `LLMServerClient`). `TransformersServerManager` honours that contract with a
transformers model in this process, so verl's own `AgentLoopWorker` can run our agent loop on CPU.

Design decisions:
- **Independent of our policy code.** Generation uses transformers' `model.generate` (its stop strings,
  its end-of-sequence ids), not `pipeline.agent.policy`, so a test comparing verl's batch with our local
  backend compares two generation paths, as a GPU run compares vLLM with our local rollout.
- **vLLM's semantics for what it returns:** the sampled ids including the token that completed a stop string
  or the end-of-sequence id (`include_stop_str_in_output`, vLLM keeps the stop id in `token_ids`), and each
  sampled token's log-prob under the unscaled distribution (greedy).
- **Greedy only** (temperature 0): tests compare trajectories token for token; sampling would need the two
  backends' random streams to agree, which no real deployment promises either.
- `InProcessActor` gives a plain object Ray's actor-call syntax (`handle.method.remote(...)`, awaited), so
  verl code that expects actor handles (the agent-loop worker's reward-loop workers) can be handed verl's
  real worker class built in this process.
"""

from __future__ import annotations

import asyncio
import uuid
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

if TYPE_CHECKING:  # imported where used: the FSDP rank processes below need none of verl's rollout side
    from verl.workers.rollout.replica import TokenOutput


class TransformersServerManager:
    """verl's LLM client contract served by an in-process transformers causal LM (greedy, CPU)."""

    def __init__(self, model: Any, tokenizer: Any) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.calls: list[dict[str, Any]] = []
        self._one_at_a_time = asyncio.Lock()

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any],
                       **kwargs: Any) -> TokenOutput:
        if sampling_params.get("temperature", 1.0) != 0:
            raise ValueError("TransformersServerManager is greedy only: set rollout temperature 0")
        self.calls.append({"request_id": request_id, "prompt_ids": list(prompt_ids),
                           "sampling_params": dict(sampling_params)})
        # Off the event loop, one request at a time, as a vLLM server generates in a process of its own: run
        # inline, a slow CPU blocked the loop for seconds and other trajectories' environment calls, awaiting
        # on the same loop, hit their timeout although the server had answered ("[environment error: ...]").
        async with self._one_at_a_time:
            return await asyncio.to_thread(self._generate, list(prompt_ids), sampling_params)

    def _generate(self, prompt_ids: list[int], sampling_params: dict[str, Any]) -> TokenOutput:
        prompt = torch.tensor([prompt_ids], dtype=torch.long)
        with torch.no_grad():
            out = self.model.generate(
                input_ids=prompt,
                attention_mask=torch.ones_like(prompt),
                do_sample=False,
                max_new_tokens=int(sampling_params["max_tokens"]),
                eos_token_id=list(sampling_params.get("stop_token_ids") or []) or None,
                stop_strings=list(sampling_params.get("stop") or []) or None,
                tokenizer=self.tokenizer,
                pad_token_id=self.tokenizer.pad_token_id,
                return_dict_in_generate=True,
                output_logits=True,
            )
        from verl.workers.rollout.replica import TokenOutput

        token_ids = out.sequences[0, prompt.shape[1]:].tolist()
        log_probs = None
        if sampling_params.get("logprobs"):
            log_probs = [float(torch.log_softmax(step[0].float(), dim=-1)[token])
                         for step, token in zip(out.logits, token_ids, strict=True)]
        return TokenOutput(token_ids=token_ids, log_probs=log_probs, stop_reason="completed", num_preempted=0)


class InProcessActor:
    """`handle.method.remote(*args)` → the object's own (async) method, awaited by the caller as Ray's would be."""

    def __init__(self, target: Any) -> None:
        self._target = target

    def __getattr__(self, name: str) -> SimpleNamespace:
        return SimpleNamespace(remote=getattr(self._target, name))


def verl_config_dir():
    """verl's packaged Hydra config folder (`ppo_trainer.yaml` and its defaults)."""
    from pathlib import Path

    import verl

    return Path(verl.__file__).parent / "trainer" / "config"


def compose_verl(overrides: list[str]):
    """verl's own `ppo_trainer.yaml` composed with `overrides`, as `python -m verl.trainer.main_ppo` does."""
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(verl_config_dir()), version_base=None):
            return compose(config_name="ppo_trainer", overrides=overrides)
    finally:
        GlobalHydra.instance().clear()


def verl_worker_rollout(config: Any, tokenizer: Any, llm_client: Any, rows: int) -> Any:
    """One rollout step as verl's trainer takes it, minus Ray and the GPU; returns the trainer's DataProto.

    `data.train_files` (our build stage's rows) → verl's RLHFDataset + collate_fn → DataProto with uids →
    `RayPPOTrainer._get_gen_batch`, repeat(n, interleave) → `AgentLoopWorker.generate_sequences` (our
    `prompt_r1` loop, generating through `llm_client`) → verl's `RewardLoopWorker` with our reward function.
    """
    from torch.utils.data import DataLoader
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
    from verl.experimental.reward_loop.reward_loop import RewardLoopWorker
    from verl.protocol import DataProto
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn

    dataset = RLHFDataset(data_files=config.data.train_files, tokenizer=tokenizer, config=config.data)
    batch_dict = next(iter(DataLoader(dataset, batch_size=rows, shuffle=False, collate_fn=collate_fn)))
    batch = DataProto.from_single_dict(batch_dict)
    batch.non_tensor_batch["uid"] = np.array([str(uuid.uuid4()) for _ in range(len(batch))], dtype=object)
    gen_batch = RayPPOTrainer._get_gen_batch(None, batch)  # the trainer's own split (it uses no state)
    gen_batch.meta_info["global_steps"] = 1
    gen_batch = gen_batch.repeat(repeat_times=config.actor_rollout_ref.rollout.n, interleave=True)

    async def one_step():
        # Built inside the running loop, as in their Ray actors: the reward manager keeps the loop it saw.
        reward_worker = RewardLoopWorker(config)
        worker = AgentLoopWorker(config, llm_client=llm_client,
                                 reward_loop_worker_handles=[InProcessActor(reward_worker)])
        return await worker.generate_sequences(gen_batch)

    return asyncio.run(one_step())


# -- verl's FSDP2 actor checkpoint, N gloo ranks on CPU ------------------------------------------------------


def fsdp_checkpoint_worker(rank: int, world_size: int, model_dir: str, root: str, port: int, out: str) -> None:
    """One rank of verl's FSDP2 actor on CPU (run under `torch.multiprocessing.spawn`, one process per rank).

    As verl's FSDP engine builds the `fsdp2` strategy (workers/engine/fsdp/transformer_impl.py): a device mesh
    named "fsdp" over the world (its `create_device_mesh`), then `apply_fsdp2`. The engine's next call,
    `fsdp2_load_full_state_dict` (rank 0's weights broadcast), moves the model to `get_device_id()`, which is
    `torch.cuda.current_device()` on a machine without an accelerator (verl falls back to its CUDA platform),
    so here every rank loads the same pretrained weights itself before sharding. Each rank trains on its own batch (data parallel; FSDP2 averages the gradients) for two AdamW
    steps, saving each with verl's `FSDPCheckpointManager` (one shard per rank) and writing the tracker file
    as verl's trainer does. Then a fresh actor resumes from the last checkpoint through the same manager.
    Rank 0 writes into `out`: the trained full state dict, the trained logits on the merge probe, and the
    resume figures (largest weight and logit difference, the optimizer's step counts).
    """
    import json
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from verl.utils.checkpoint.checkpoint_manager import get_checkpoint_tracker_filename
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager
    from verl.utils.fsdp_utils import apply_fsdp2

    from pipeline.train.merge import probe_input, probe_logits

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        mesh = init_device_mesh("cpu", mesh_shape=(world_size,), mesh_dim_names=["fsdp"])
        tokenizer = AutoTokenizer.from_pretrained(model_dir)

        def fsdp_actor():
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            apply_fsdp2(model, {"mesh": mesh}, {})
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
            manager = FSDPCheckpointManager(model=model, optimizer=optimizer, lr_scheduler=None,
                                            processing_class=tokenizer)
            return model, optimizer, manager

        def full(tensor):  # collective: every rank calls it
            return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor

        model, optimizer, manager = fsdp_actor()
        questions = ["Question: who wrote Hamlet? <search>author of Hamlet</search>",
                     "Question: where is the Eiffel Tower? <search>Eiffel Tower city</search>"]
        batch = tokenizer([questions[rank % len(questions)]], return_tensors="pt")
        for step in (1, 2):
            model.train()
            model(**batch, labels=batch["input_ids"]).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            manager.save_checkpoint(os.path.join(root, f"global_step_{step}", "actor"), global_step=step)
            if rank == 0:
                with open(get_checkpoint_tracker_filename(root), "w") as f:
                    f.write(str(step))
            dist.barrier()
        expected = probe_logits(model, probe_input(tokenizer))
        trained = {name: full(t).detach().clone() for name, t in model.state_dict().items()}

        fresh, fresh_optimizer, fresh_manager = fsdp_actor()
        fresh_manager.load_checkpoint(os.path.join(root, "global_step_2", "actor"))
        weights = max(float((full(a) - full(b)).abs().max())
                      for a, b in zip(model.parameters(), fresh.parameters(), strict=True))
        steps = sorted({int(s["step"]) for s in fresh_optimizer.state_dict()["state"].values()})
        logits = float((probe_logits(fresh, probe_input(tokenizer)) - expected).abs().max())
        if rank == 0:
            torch.save(expected, os.path.join(out, "expected_logits.pt"))
            torch.save(trained, os.path.join(out, "trained_state.pt"))
            with open(os.path.join(out, "resume.json"), "w") as f:
                json.dump({"weights_max_diff": weights, "optimizer_steps": steps, "logits_max_diff": logits}, f)
    finally:
        dist.destroy_process_group()
