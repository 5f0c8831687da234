"""The local GRPO backend: transformers + PyTorch on CPU or one GPU, against a live environment.

One step (`LocalTrainer.step`) reads top to bottom:
1. draw `batch_size` questions from `data/rl/train.parquet` (seeded shuffle per epoch; the position is
   saved in checkpoints, so a resume draws the questions the killed run would have drawn next);
2. roll out G trajectories per question with the core rollout (`pipeline.agent.rollout`, the same code
   evaluation and `promptr1 ask` use) against the environment, scored by `pipeline.reward`;
3. GRPO update (`pipeline.train.grpo`: verl's advantage, clipped loss, low-var KL, token-mean), over
   PPO mini-batches of `mini_batch_size` questions, in micro-batches of `micro_batch_size` trajectories;
4. metrics to MLflow and `reports/train/steps.csv` under verl's names; checkpoint every `save_every`.

Design decisions:
- **old_log_prob is recomputed by the training forward, not taken from the sampler.** The sampler's
  log-probs come from a different code path (KV-cache decoding, temperature/top-p processing), so their
  ratio to the training forward is not exactly 1 even before any update, and PPO clipping would act on
  numerical noise. verl recomputes them for the same reason. The recompute is free in the common
  on-policy case: for the first mini-batch of the first PPO epoch no parameter has changed since
  sampling, so `old_log_prob = log_prob.detach()` is exact. Only later mini-batches/epochs need an extra
  no-grad forward, done before the first optimizer step. The sampler's log-probs are still requested
  and their gap to the recomputed ones is logged (`training/rollout_logprob_diff_*`) as a sanity check.
- **Layout as verl's:** prompts left-padded, responses right-padded, explicit position ids; the model is
  asked for logits on response positions only (`logits_to_keep`), so the 49k-vocabulary head is not
  applied to the long Prompt-R1 prompt. Log-probs are `logit[token] - logsumexp(logits)` (no full
  log-softmax tensor) at temperature `agent.temperature`, as verl's actor does.
- **Micro-batches are sorted by length** within a mini-batch to cut padding; the loss is normalised by
  the mini-batch's agent-token count, so the split does not change the gradient.
- **Reference policy:** full fine-tune → a frozen copy of the base weights, or of the weights right after
  the format warm-up when `train.warmup.steps > 0` (as R1's reference is its SFT'd model; kept in
  `<checkpoint_dir>/warmup/model` for resumes); LoRA → the same model with adapters disabled (no second copy
  in memory; warm-up + LoRA is refused for that reason).
- **Format warm-up** (`pipeline.train.warmup`, off when `train.warmup.steps` is 0): supervised steps on
  Prompt-R1 demonstrations before GRPO step 1, with its own optimizer; a `step_0` checkpoint with
  `warmup_done` follows it, so a resumed run does not repeat it. Its metrics go to MLflow (`warmup/*`) and
  `reports/train/warmup.csv`; steps.csv's `step` stays the GRPO step.
- **The environment server is started once** for the whole run (`environment_server(params)`), reused if
  one already answers.
- Timing: the rollout alternates batched generation rounds with rounds of concurrent environment calls,
  so its wall time splits cleanly: `timing_s/gen` = generation wall time, `timing_s/env` = the rest of
  the rollout (environment rounds), `timing_s/rollout` = both (what verl calls `timing_s/gen`, which
  includes the agent loop's tool/environment calls). `timing_s/update` covers the reference forward, any
  old-log-prob recompute and all forward/backward/optimizer work; `timing_s/step` everything.
- Sampling is seeded per step (`seed`, step number): a resumed run draws the same questions and samples
  with the same generator state as the killed run would have.
"""

from __future__ import annotations

import copy
import logging
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, get_args

import numpy as np
import pandas as pd
import torch

from pipeline.config import Params
from pipeline.errors import BudgetExceeded, DataError, UserError
from pipeline.train import checkpoint as ckpt
from pipeline.train.grpo import GRPOObjective, grpo_advantages, grpo_loss
from pipeline.types import PromptItem, StopReason, Trajectory

log = logging.getLogger(__name__)

STEPS_CSV = "train/steps.csv"
WARMUP_DIR = "warmup"
"""Folder under the checkpoint dir holding the weights right after the format warm-up (the KL reference)."""
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ---------------------------------------------------------------------------------------------------- data


def prompt_item_from_row(row: dict[str, Any], index: int) -> PromptItem:
    """One row of the verl RL parquet (data/rl/train.parquet) → a PromptItem."""
    extra = row.get("extra_info") or {}
    reward_model = row.get("reward_model") or {}
    truth = reward_model.get("ground_truth")
    gold = [str(truth)] if isinstance(truth, str) else [str(a) for a in (list(truth) if truth is not None else [])]
    messages = [{"role": str(m["role"]), "content": str(m["content"])} for m in list(row["prompt"])]
    return PromptItem(
        uid=str(extra.get("id") or f"row{index}"),
        messages=messages,
        gold_answers=gold,
        data_source=str(row.get("data_source", "")),
        question=str(extra.get("question") or ""),
    )


class QuestionSampler:
    """Draws questions in a seeded shuffled order, epoch after epoch; its position is checkpointable."""

    def __init__(self, n_rows: int, seed: int, epoch: int = 0, position: int = 0) -> None:
        if n_rows <= 0:
            raise DataError("the training set is empty")
        self.n_rows, self.seed, self.epoch, self.position = n_rows, seed, epoch, position
        self._order = self._permutation(epoch)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.n_rows)

    def restore(self, epoch: int, position: int) -> None:
        """Go back to a saved position (e.g. the start of a step that could not finish)."""
        self.epoch, self.position = epoch, position
        self._order = self._permutation(epoch)

    def next_batch(self, k: int) -> list[int]:
        out: list[int] = []
        while len(out) < k:
            if self.position >= self.n_rows:
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            take = min(k - len(out), self.n_rows - self.position)
            out.extend(int(i) for i in self._order[self.position : self.position + take])
            self.position += take
        return out


def load_training_set(params: Params) -> pd.DataFrame:
    path = params.path(params.paths.rl_dir) / "train.parquet"
    if not path.is_file():
        raise DataError(f"{path}: training set missing; run `promptr1 build` (dvc repro build) first")
    frame = pd.read_parquet(path)
    missing = {"prompt", "reward_model", "data_source"} - set(frame.columns)
    if missing:
        raise DataError(f"{path}: missing columns {sorted(missing)} (expected verl's RLHFDataset schema)")
    return frame


# ---------------------------------------------------------------------------------------------------- model


def pick_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def load_tokenizer(ref: str, root: Path):
    from transformers import AutoTokenizer

    from pipeline.modelref import resolve_model

    resolved = resolve_model(ref, root)
    return AutoTokenizer.from_pretrained(resolved.directory, **resolved.from_pretrained_kwargs())


def load_causal_lm(ref: str, root: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    from pipeline.modelref import resolve_model

    resolved = resolve_model(ref, root)
    return AutoModelForCausalLM.from_pretrained(resolved.directory, dtype=dtype,
                                                **resolved.from_pretrained_kwargs())


def apply_lora(model, params: Params):
    from peft import LoraConfig, get_peft_model

    lora = params.train.lora
    config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                        target_modules=list(lora.target_modules), task_type="CAUSAL_LM")
    return get_peft_model(model, config)


@dataclass
class PolicyModels:
    """The trainable policy, how to get reference log-probs, and the tokenizer."""

    model: torch.nn.Module
    reference: torch.nn.Module | None
    """Frozen base copy (full fine-tune); None with LoRA (adapters disabled instead)."""
    tokenizer: Any
    lora: bool

    def reference_context(self):
        """Context in which `reference_model` computes the reference policy."""
        from contextlib import nullcontext

        return self.model.disable_adapter() if self.lora else nullcontext()

    @property
    def reference_model(self) -> torch.nn.Module:
        return self.model if self.lora else self.reference  # type: ignore[return-value]

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def num_parameters(self) -> int:
        """Parameters of the policy network (base weights, plus adapters with LoRA)."""
        return sum(p.numel() for p in self.model.parameters())


def load_policy_models(params: Params, resume_from: Path | None, device: torch.device) -> PolicyModels:
    """Base model from params (GGUF, HF dir or Hub id), optionally LoRA, weights from `resume_from`."""
    dtype = DTYPES[params.agent.dtype]
    root = params.root
    lora = params.train.lora.enabled
    tokenizer = load_tokenizer(params.agent.model, root)
    base = load_causal_lm(params.agent.model, root, dtype)
    if lora:
        if resume_from is not None:
            from peft import PeftModel

            model = PeftModel.from_pretrained(base, str(resume_from / "adapter"), is_trainable=True)
        else:
            model = apply_lora(base, params)
        reference = None
    else:
        reference = copy.deepcopy(base)
        model = base
        if resume_from is not None:
            load_full_weights(model, resume_from / "model", params.agent.model)
        reference.requires_grad_(False)
        reference.eval()
        reference.to(device)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.to(device)
    if params.train.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        if hasattr(model, "enable_input_require_grads"):
            model.enable_input_require_grads()
    return PolicyModels(model=model, reference=reference, tokenizer=tokenizer, lora=lora)


def load_full_weights(model: torch.nn.Module, folder: Path, base_ref: str) -> None:
    """Load a full fine-tune's safetensors from `folder` into `model` (refuses a foreign checkpoint)."""
    from safetensors.torch import load_file

    state = {}
    for shard in sorted(folder.glob("*.safetensors")):
        state.update(load_file(str(shard)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    # Tied embeddings are saved once; anything else missing means a foreign checkpoint.
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise UserError(f"{folder}: checkpoint does not fit {base_ref} "
                        f"(missing {sorted(set(missing) - tied)[:3]}, unexpected {unexpected[:3]})")


def write_weights(models: PolicyModels, folder: Path) -> None:
    """Save the trainable state into a checkpoint folder: `model/` or `adapter/`, plus `tokenizer/`."""
    if models.lora:
        models.model.save_pretrained(str(folder / "adapter"))
    else:
        models.model.save_pretrained(str(folder / "model"), safe_serialization=True)
    models.tokenizer.save_pretrained(str(folder / "tokenizer"))


# ---------------------------------------------------------------------------------------------------- batches


@dataclass
class RolloutBatch:
    """Trajectories as padded tensors, verl-style: [left-padded prompt | right-padded response]."""

    input_ids: torch.Tensor
    """(B, P+R)"""
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    responses: torch.Tensor
    """(B, R) response token ids (pad beyond each response's length)."""
    response_mask: torch.Tensor
    """(B, R) float: 1 on agent tokens, 0 on environment tokens and padding."""
    num_tokens: int
    """Non-padding tokens (prompt + response) in the batch: what a forward pass really processes."""
    sampling_log_probs: torch.Tensor | None = None
    """(B, R) the sampler's log-probs, when every trajectory carries them (diagnostics only)."""

    def to(self, device: torch.device) -> RolloutBatch:
        moved = None if self.sampling_log_probs is None else self.sampling_log_probs.to(device)
        return RolloutBatch(self.input_ids.to(device), self.attention_mask.to(device),
                            self.position_ids.to(device), self.responses.to(device),
                            self.response_mask.to(device), self.num_tokens, moved)


def collate(trajectories: Sequence[Trajectory], pad_id: int) -> RolloutBatch:
    """Pad a list of trajectories into one RolloutBatch."""
    p_max = max(len(t.prompt_ids) for t in trajectories)
    r_max = max(1, max(len(t.response_ids) for t in trajectories))
    b = len(trajectories)
    input_ids = torch.full((b, p_max + r_max), pad_id, dtype=torch.long)
    attention = torch.zeros((b, p_max + r_max), dtype=torch.long)
    response_mask = torch.zeros((b, r_max), dtype=torch.float32)
    for i, t in enumerate(trajectories):
        p, r = len(t.prompt_ids), len(t.response_ids)
        if len(t.response_mask) != r:
            raise ValueError(f"trajectory {t.item.uid}: response_mask has {len(t.response_mask)} entries "
                             f"for {r} response tokens")
        input_ids[i, p_max - p : p_max] = torch.tensor(t.prompt_ids, dtype=torch.long)
        attention[i, p_max - p : p_max] = 1
        if r:
            input_ids[i, p_max : p_max + r] = torch.tensor(t.response_ids, dtype=torch.long)
            attention[i, p_max : p_max + r] = 1
            response_mask[i, :r] = torch.tensor(t.response_mask, dtype=torch.float32)
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    sampled = None
    if all(t.response_logprobs is not None and len(t.response_logprobs) == len(t.response_ids)
           for t in trajectories):
        sampled = torch.zeros((b, r_max), dtype=torch.float32)
        for i, t in enumerate(trajectories):
            if t.response_logprobs:
                sampled[i, : len(t.response_logprobs)] = torch.tensor(t.response_logprobs, dtype=torch.float32)
    return RolloutBatch(input_ids, attention, position_ids, input_ids[:, p_max:].clone(), response_mask,
                        int(attention.sum()), sampled)


def response_log_probs(model: torch.nn.Module, batch: RolloutBatch, temperature: float) -> torch.Tensor:
    """(B, R) log-probs of the response tokens under `model` at `temperature` (verl's convention)."""
    r = batch.responses.shape[1]
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                position_ids=batch.position_ids, use_cache=False, logits_to_keep=r + 1)
    logits = out.logits[:, :-1, :].float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    picked = logits.gather(-1, batch.responses.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def masked_stats(values: torch.Tensor, mask: torch.Tensor) -> tuple[float, float, float]:
    """(mean, max, min) of `values` where mask is set; zeros when nothing is."""
    sel = values[mask.bool()]
    if sel.numel() == 0:
        return 0.0, 0.0, 0.0
    return float(sel.mean()), float(sel.max()), float(sel.min())


# ---------------------------------------------------------------------------------------------------- trainer


@dataclass
class UpdateResult:
    metrics: dict[str, float]
    tokens: int
    """Non-padding tokens through the policy forward+backward (all PPO epochs)."""
    policy_s: float
    """Wall time of the policy forward/backward/optimizer work alone (for throughput)."""


class LocalTrainer:
    """Holds the policy, optimizer and data position; `step()` runs one GRPO iteration."""

    def __init__(self, params: Params, models: PolicyModels, frame: pd.DataFrame, device: torch.device,
                 sampler: QuestionSampler) -> None:
        self.params = params
        self.cfg = params.train
        self.models = models
        self.frame = frame
        self.device = device
        self.sampler = sampler
        self.objective = GRPOObjective.from_config(self.cfg)
        self.optimizer = torch.optim.AdamW(models.trainable_parameters(), lr=self.cfg.lr,
                                           weight_decay=self.cfg.weight_decay)
        self.temperature = params.agent.temperature if params.agent.temperature > 0 else 1.0
        self._policy = None

    # -- rollout -----------------------------------------------------------------------------------
    def policy(self):
        if self._policy is None:
            from pipeline.agent.policy import TransformersPolicy

            self._policy = TransformersPolicy(self.models.model, self.models.tokenizer, self.device)
        return self._policy

    def draw_items(self) -> list[PromptItem]:
        rows = self.sampler.next_batch(self.cfg.batch_size)
        records = self.frame.iloc[rows].to_dict("records")
        return [prompt_item_from_row(r, i) for r, i in zip(records, rows, strict=True)]

    def rollout(self, env, items: list[PromptItem], step: int) -> list[Trajectory]:
        from pipeline.agent.rollout import run_rollout
        from pipeline.reward import reward_for_trajectory

        a = self.params.agent
        policy = self.policy()
        # Sampling depends on (seed, step) only, so a resumed run samples what the killed one would have.
        policy.generator.manual_seed(self.params.seed * 1_000_003 + step)
        self.models.model.eval()
        with torch.no_grad():
            trajectories = run_rollout(
                policy, env, items, group_size=self.cfg.group_size, max_turns=a.max_turns,
                max_turn_tokens=a.max_turn_tokens, max_response_tokens=a.max_response_tokens,
                env_reply_max_chars=a.env_reply_max_chars, temperature=a.temperature, top_p=a.top_p,
                return_logprobs=True, reward_fn=partial(reward_for_trajectory, cfg=self.params.reward),
                progress=False, max_prompt_tokens=a.max_prompt_tokens,
            )
        if len(trajectories) != len(items) * self.cfg.group_size:
            raise RuntimeError(f"rollout returned {len(trajectories)} trajectories for {len(items)} questions "
                               f"x G={self.cfg.group_size}")
        for t in trajectories:
            if t.reward is None:
                t.reward = reward_for_trajectory(t, self.params.reward)
        return trajectories

    # -- update ------------------------------------------------------------------------------------
    def micro_batches(self, trajectories: Sequence[Trajectory], indices: Sequence[int]) -> list[list[int]]:
        """Split a mini-batch into micro-batches of similar length (less padding)."""
        ordered = sorted(indices, key=lambda i: len(trajectories[i].prompt_ids) + len(trajectories[i].response_ids))
        size = self.cfg.micro_batch_size
        return [ordered[k : k + size] for k in range(0, len(ordered), size)]

    def update(self, trajectories: list[Trajectory], advantages: torch.Tensor) -> UpdateResult:
        """GRPO update over PPO epochs × mini-batches; returns the averaged actor metrics."""
        g = self.cfg.group_size
        pad_id = self.models.tokenizer.pad_token_id
        n_items = len(trajectories) // g
        per_mini = self.cfg.mini_batch_size
        mini_batches = [list(range(q * g, min(q + per_mini, n_items) * g)) for q in range(0, n_items, per_mini)]
        plan = [self.micro_batches(trajectories, mb) for mb in mini_batches]
        batches: dict[tuple[int, int], RolloutBatch] = {}
        ref_lp: dict[tuple[int, int], torch.Tensor] = {}
        old_lp: dict[tuple[int, int], torch.Tensor] = {}
        need_old = {m for m in range(len(plan)) if m > 0 or self.cfg.ppo_epochs > 1}
        timings = {"timing_s/ref": 0.0, "timing_s/old_log_prob": 0.0}
        diffs: list[float] = []

        self.models.model.eval()
        for m, micros in enumerate(plan):
            for k, idx in enumerate(micros):
                batch = collate([trajectories[i] for i in idx], pad_id).to(self.device)
                batches[(m, k)] = batch
                with torch.no_grad():
                    if self.cfg.use_kl_loss:
                        t0 = time.perf_counter()
                        with self.models.reference_context():
                            ref_lp[(m, k)] = response_log_probs(self.models.reference_model, batch,
                                                                self.temperature)
                        timings["timing_s/ref"] += time.perf_counter() - t0
                    if m in need_old:
                        t0 = time.perf_counter()
                        old_lp[(m, k)] = response_log_probs(self.models.model, batch, self.temperature)
                        timings["timing_s/old_log_prob"] += time.perf_counter() - t0

        self.models.model.train()
        agg: dict[str, list[float]] = {}
        tokens = 0
        t_policy = time.perf_counter()
        for _epoch in range(self.cfg.ppo_epochs):
            for m, micros in enumerate(plan):
                mb_tokens = sum(batches[(m, k)].response_mask.sum() for k in range(len(micros)))
                mb_tokens = int(mb_tokens)
                mb_size = sum(len(idx) for idx in micros)
                if mb_tokens == 0:
                    continue
                self.optimizer.zero_grad(set_to_none=True)
                sums: dict[str, float] = {}
                for k, idx in enumerate(micros):
                    batch = batches[(m, k)]
                    log_prob = response_log_probs(self.models.model, batch, self.temperature)
                    old = old_lp[(m, k)] if (m, k) in old_lp else log_prob.detach()
                    adv = torch.zeros_like(log_prob)
                    width = min(adv.shape[1], advantages.shape[1])
                    adv[:, :width] = advantages[idx, :width].to(adv)
                    loss, parts = grpo_loss(log_prob, old, adv, batch.response_mask, self.objective,
                                            ref_log_prob=ref_lp.get((m, k)), batch_num_tokens=mb_tokens,
                                            global_batch_size=mb_size)
                    loss.backward()
                    tokens += batch.num_tokens
                    share = float(batch.response_mask.sum()) / mb_tokens
                    for key, value in parts.items():
                        # losses are already this micro-batch's share; ratios/fractions are weighted here
                        sums[key] = sums.get(key, 0.0) + (value if key in ("actor/pg_loss", "actor/kl_loss")
                                                          else value * share)
                    if _epoch == 0 and batch.sampling_log_probs is not None:
                        gap = (old - batch.sampling_log_probs).abs()[batch.response_mask.bool()]
                        if gap.numel():
                            diffs.extend(gap.tolist())
                grad_norm = torch.nn.utils.clip_grad_norm_(self.models.trainable_parameters(), self.cfg.grad_clip)
                if not torch.isfinite(grad_norm):
                    log.warning("non-finite grad norm %s: skipping this optimizer step", grad_norm)
                    self.optimizer.zero_grad(set_to_none=True)
                else:
                    self.optimizer.step()
                sums["actor/grad_norm"] = float(grad_norm)
                for key, value in sums.items():
                    agg.setdefault(key, []).append(value)
        policy_s = time.perf_counter() - t_policy
        metrics = {k: statistics.fmean(v) for k, v in agg.items()}
        metrics.setdefault("actor/pg_loss", 0.0)
        metrics.setdefault("actor/kl_loss", 0.0)
        metrics.setdefault("actor/grad_norm", 0.0)
        metrics["actor/lr"] = float(self.optimizer.param_groups[0]["lr"])
        metrics["actor/kl_coef"] = self.cfg.kl_loss_coef if self.cfg.use_kl_loss else 0.0
        metrics["actor/num_optimizer_steps"] = float(len(agg.get("actor/grad_norm", [])))
        if diffs:
            metrics["training/rollout_logprob_diff_mean"] = statistics.fmean(diffs)
            metrics["training/rollout_logprob_diff_max"] = max(diffs)
        metrics.update(timings)
        self.models.model.eval()
        return UpdateResult(metrics=metrics, tokens=tokens, policy_s=policy_s)

    # -- one step ----------------------------------------------------------------------------------
    def step(self, env, step: int) -> dict[str, float]:
        t_step = time.perf_counter()
        items = self.draw_items()
        t0 = time.perf_counter()
        trajectories = self.rollout(env, items, step)
        t_rollout = time.perf_counter() - t0

        t0 = time.perf_counter()
        scores = torch.tensor([t.reward.total for t in trajectories], dtype=torch.float32)  # type: ignore[union-attr]
        r_max = max(1, max(len(t.response_ids) for t in trajectories))
        mask = torch.zeros((len(trajectories), r_max))
        for i, t in enumerate(trajectories):
            mask[i, : len(t.response_mask)] = torch.tensor(t.response_mask, dtype=torch.float32)
        group_ids = [f"q{i // self.cfg.group_size}" for i in range(len(trajectories))]
        advantages = grpo_advantages(scores, mask, group_ids)
        update = self.update(trajectories, advantages)
        t_update = time.perf_counter() - t0

        metrics = rollout_metrics(trajectories, scores, advantages, mask)
        metrics.update(update.metrics)
        metrics.update(self.sampler_metrics())
        # The rollout alternates batched generation rounds and environment rounds; the trajectory that
        # lives longest took part in every generation round, so its generation_s is the generation wall.
        gen_wall = max((t.generation_s for t in trajectories), default=0.0)
        metrics["timing_s/rollout"] = t_rollout
        metrics["timing_s/gen"] = gen_wall
        metrics["timing_s/env"] = max(0.0, t_rollout - gen_wall)
        metrics["timing_s/update"] = t_update
        metrics["perf/update_tokens"] = float(update.tokens)
        metrics["perf/update_tokens_per_s"] = update.tokens / update.policy_s if update.policy_s > 0 else 0.0
        metrics["perf/update_policy_s"] = update.policy_s
        metrics["perf/num_params"] = float(self.models.num_parameters())
        metrics["perf/total_num_tokens"] = float(sum(len(t.prompt_ids) + len(t.response_ids)
                                                     for t in trajectories))
        metrics["timing_s/step"] = time.perf_counter() - t_step
        metrics["perf/throughput"] = metrics["perf/total_num_tokens"] / metrics["timing_s/step"]
        return metrics

    def sampler_metrics(self) -> dict[str, float]:
        return {"training/epoch": float(self.sampler.epoch), "training/data_position": float(self.sampler.position)}


def rollout_metrics(trajectories: list[Trajectory], scores: torch.Tensor, advantages: torch.Tensor,
                    mask: torch.Tensor) -> dict[str, float]:
    """Reward, advantage, length, turn, stop-reason and environment metrics of one step's rollouts."""
    rewards = [t.reward for t in trajectories]
    resp_len = [len(t.response_ids) for t in trajectories]
    agent_len = [sum(t.response_mask) for t in trajectories]
    turns = [t.num_turns for t in trajectories]
    adv_mean, adv_max, adv_min = masked_stats(advantages, mask)
    m: dict[str, float] = {
        "critic/score/mean": float(scores.mean()),
        "critic/score/max": float(scores.max()),
        "critic/score/min": float(scores.min()),
        "critic/rewards/mean": float(scores.mean()),
        "critic/advantages/mean": adv_mean,
        "critic/advantages/max": adv_max,
        "critic/advantages/min": adv_min,
        "response_length/mean": statistics.fmean(resp_len),
        "response_length/max": float(max(resp_len)),
        "response_length/min": float(min(resp_len)),
        "response_length/agent_tokens_mean": statistics.fmean(agent_len),
        "prompt_length/mean": statistics.fmean(len(t.prompt_ids) for t in trajectories),
        "num_turns/mean": statistics.fmean(turns),
        "num_turns/max": float(max(turns)),
        "num_turns/min": float(min(turns)),
    }
    parts = {
        "format": lambda r: r.format,
        "answer": lambda r: r.answer,
        "gated": lambda r: float(r.gated),
        "valid_intermediate_turns": lambda r: float(r.valid_intermediate_turns),
        "answer_tags": lambda r: r.answer_tags,
        "answer_nonempty": lambda r: r.answer_nonempty,
        "complete_final": lambda r: r.complete_final,
    }
    for name, get in parts.items():
        m[f"reward/{name}/mean"] = statistics.fmean(float(get(r)) for r in rewards)
    for reason in get_args(StopReason):
        m[f"rollout/stop_{reason}"] = sum(t.stop_reason == reason for t in trajectories) / len(trajectories)
    usage = {"calls": 0.0, "cache_hits": 0.0, "prompt_tokens": 0.0, "completion_tokens": 0.0, "errors": 0.0,
             "retries": 0.0, "cost_usd": 0.0}
    for t in trajectories:
        for key in usage:
            usage[key] += float(getattr(t.usage, key))
    m.update({f"env/{k}": v for k, v in usage.items()})
    m["env/tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    return m


# ---------------------------------------------------------------------------------------------------- steps log


class StepsLog:
    """`reports/train/steps.csv`: one row per finished step, rewritten atomically each step."""

    def __init__(self, path: Path, keep_upto: int) -> None:
        self.path = path
        self.rows: list[dict[str, float]] = []
        if path.is_file() and path.stat().st_size > 0:
            frame = pd.read_csv(path)
            if "step" in frame.columns:
                # Steps after the resumed checkpoint will run again: drop their rows so no step repeats.
                frame = frame[frame["step"] <= keep_upto].drop_duplicates("step", keep="last")
                self.rows = frame.to_dict("records")
        self._write()

    def append(self, step: int, metrics: dict[str, float]) -> None:
        self.rows = [r for r in self.rows if int(r["step"]) != step]
        self.rows.append({"step": step, **metrics})
        self._write()

    def last(self) -> dict[str, float] | None:
        return self.rows[-1] if self.rows else None

    def _write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        frame = pd.DataFrame(self.rows)
        if frame.empty:
            frame = pd.DataFrame(columns=["step"])
        cols = ["step", *sorted(c for c in frame.columns if c != "step")]
        tmp = self.path.with_suffix(".csv.tmp")
        frame[cols].to_csv(tmp, index=False)
        tmp.replace(self.path)


# ---------------------------------------------------------------------------------------------------- entry


def steps_csv_path(params: Params) -> Path:
    return params.path(params.paths.reports_dir) / STEPS_CSV


# Params that do not change what a training step computes: changing them continues the same run.
_RESUMABLE_TRAIN_KEYS = {"steps", "save_every", "keep_checkpoints", "verl", "backend"}


def training_config(params: Params) -> dict[str, Any]:
    """What the trained weights depend on: agent, environment model and sampling, reward, GRPO and
    warm-up settings, the seed, and the md5 of the training set. `train.steps` is left out on purpose:
    raising it continues the same run from its last checkpoint."""
    import hashlib

    env = params.environment
    train_set = params.path(params.paths.rl_dir) / "train.parquet"
    digest = hashlib.md5(train_set.read_bytes()).hexdigest() if train_set.is_file() else "missing"
    return {
        "seed": params.seed,
        "agent": params.agent.model_dump(mode="json"),
        "environment": {"model": env.model, "served_name": env.served_name, "system_prompt": env.system_prompt,
                        "temperature": env.temperature, "max_tokens": env.max_tokens},
        "reward": params.reward.model_dump(mode="json"),
        "train": {k: v for k, v in params.train.model_dump(mode="json").items() if k not in _RESUMABLE_TRAIN_KEYS},
        "train_set_md5": digest,
    }


def _config_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    from pipeline.config import flatten_dict

    a, b = flatten_dict(old), flatten_dict(new)
    return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))


def _usable_checkpoint(params: Params) -> tuple[Path, ckpt.TrainerState] | None:
    """The latest checkpoint if it was trained with the current training config, else None."""
    folder = ckpt.latest_checkpoint(params.path(params.paths.checkpoint_dir))
    if folder is None:
        return None
    state = ckpt.TrainerState.read(folder)
    return (folder, state) if state.config == training_config(params) else None


def training_complete(params: Params) -> bool:
    """True when a checkpoint of the current training config reached train.steps and steps.csv exists."""
    found = _usable_checkpoint(params)
    return found is not None and found[1].step >= params.train.steps and steps_csv_path(params).is_file()


def _discard_stale_checkpoints(params: Params) -> None:
    """Checkpoints trained with other params are removed so the run starts afresh (DVC re-ran train
    because params changed; resuming someone else's run would silently keep the old model). The old
    checkpoint stays in DVC's cache for the commit that produced it."""
    import shutil

    root = params.path(params.paths.checkpoint_dir)
    folder = ckpt.latest_checkpoint(root)
    if folder is None or _usable_checkpoint(params) is not None:
        return
    changed = _config_changes(ckpt.TrainerState.read(folder).config, training_config(params))
    log.warning("%s was trained with other params (%s): starting afresh", root,
                ", ".join(changed[:8]) + (" …" if len(changed) > 8 else ""))
    shutil.rmtree(root)
    steps_csv_path(params).unlink(missing_ok=True)


def _log_mlflow(metrics: dict[str, float], step: int) -> None:
    import mlflow

    if mlflow.active_run() is None:
        return
    clean = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}
    mlflow.log_metrics(clean, step=step)


def train_local(params: Params, run: Any = None, *, max_steps: int | None = None) -> dict[str, float]:
    """Run (or resume) local GRPO training up to `train.steps`; returns the last step's metrics.

    `max_steps` stops after that many new steps in this call (benchmarks, tests); checkpoints and logs
    stay consistent, so a later call continues.
    """
    from tqdm.auto import tqdm

    from pipeline.environment.client import EnvironmentClient
    from pipeline.environment.servers import environment_server

    cfg = params.train
    if cfg.warmup.steps > 0 and cfg.lora.enabled:
        raise UserError("train.warmup with LoRA is not supported (the LoRA KL reference is the base with "
                        "adapters disabled, which would undo the warm-up): set train.warmup.steps: 0 or "
                        "train.lora.enabled: false")
    root = params.path(params.paths.checkpoint_dir)
    _discard_stale_checkpoints(params)
    folder = ckpt.latest_checkpoint(root)
    state = ckpt.TrainerState.read(folder) if folder else None
    start = state.step if state else 0
    warmed = bool(state and state.warmup_done)
    # A run resumed from a GRPO step never warms up (it either did, or ran without warm-up).
    need_warmup = cfg.warmup.steps > 0 and state is None
    steps_log = StepsLog(steps_csv_path(params), keep_upto=start)
    if start >= cfg.steps:
        log.info("training already complete: checkpoint at step %d >= train.steps %d", start, cfg.steps)
        return dict(state.metrics) if state else {}

    torch.manual_seed(params.seed)
    np.random.seed(params.seed)
    device = pick_device()
    frame = load_training_set(params)
    log.info("loading the policy %s (%s)%s", params.agent.model, "LoRA" if cfg.lora.enabled else "full",
             f", resuming from {folder}" if folder else "")
    models = load_policy_models(params, folder, device)
    sampler = QuestionSampler(len(frame), params.seed, state.epoch if state else 0, state.position if state else 0)
    trainer = LocalTrainer(params, models, frame, device, sampler)
    if warmed and models.reference is not None:
        if (root / WARMUP_DIR / "model").is_dir():
            load_full_weights(models.reference, root / WARMUP_DIR / "model", params.agent.model)
            log.info("KL reference: the warmed-up weights in %s", root / WARMUP_DIR)
        else:
            log.warning("%s missing: the KL reference falls back to the base weights", root / WARMUP_DIR)
    if folder is not None:
        trainer.optimizer.load_state_dict(torch.load(folder / "optimizer.pt", weights_only=False))
        ckpt.restore_rng_state(torch.load(folder / "rng.pt", weights_only=False))
        log.info("resumed at step %d (epoch %d, position %d)", start, sampler.epoch, sampler.position)

    def save(step: int, metrics: dict[str, float]) -> None:
        st = ckpt.TrainerState(step=step, epoch=sampler.epoch, position=sampler.position, seed=params.seed,
                               base_model=params.agent.model, lora=cfg.lora.enabled, steps_target=cfg.steps,
                               metrics=metrics, config=training_config(params), warmup_done=warmed)
        ckpt.save_checkpoint(root, st, partial(write_weights, models), trainer.optimizer, keep=cfg.keep_checkpoints)

    last: dict[str, float] = dict(state.metrics) if state else {}
    end = cfg.steps if max_steps is None else min(cfg.steps, start + max_steps)
    with environment_server(params):
        if need_warmup:
            warm_metrics = _run_warmup(params, models, frame, device, root)
            warmed = True
            save(0, warm_metrics)
            if cfg.steps == 0:
                return warm_metrics
        env = EnvironmentClient.from_params(params)
        bar = tqdm(range(start + 1, end + 1), desc="GRPO", unit="step", initial=0, total=end - start)
        try:
            for step in bar:
                position = (sampler.epoch, sampler.position)
                try:
                    metrics = trainer.step(env, step)
                except BudgetExceeded:
                    # Keep every finished step: checkpoint the last one (its questions drawn, not this one's).
                    sampler.restore(*position)
                    if step - 1 > start and (step - 1) % cfg.save_every != 0:
                        save(step - 1, last)
                    raise
                t0 = time.perf_counter()
                if step % cfg.save_every == 0 or step == cfg.steps or step == end:
                    save(step, metrics)
                metrics["timing_s/save"] = time.perf_counter() - t0
                steps_log.append(step, metrics)
                _log_mlflow(metrics, step)
                bar.set_postfix(reward=f"{metrics['critic/score/mean']:.3f}",
                                step_s=f"{metrics['timing_s/step']:.1f}")
                last = metrics
        finally:
            bar.close()
            _close_env(env)
    return last


def _run_warmup(params: Params, models: PolicyModels, frame: pd.DataFrame, device: torch.device,
                root: Path) -> dict[str, float]:
    """The format warm-up, then the warmed weights become the frozen KL reference (and are kept on disk)."""
    import os
    import shutil

    from pipeline.environment.client import CACHE_FILE, EnvironmentClient
    from pipeline.train.warmup import WARMUP_CSV, run_warmup, write_warmup_csv

    # Demonstrations see the environment at temperature 0 (deterministic, cached) whatever training uses.
    env_cfg = params.environment.model_copy(update={"temperature": 0.0})
    cache = params.path(params.paths.cache_dir) / CACHE_FILE if env_cfg.cache else None
    env = EnvironmentClient(env_cfg, cache)
    log.info("format warm-up: %d steps x %d demonstrations, lr %g", params.train.warmup.steps,
             params.train.warmup.batch_size, params.train.warmup.lr)
    try:
        rows = run_warmup(params, models.model, models.tokenizer, frame, env, device, prompt_item_from_row,
                          log_metrics=_log_mlflow)
    finally:
        _close_env(env)
    write_warmup_csv(params.path(params.paths.reports_dir) / WARMUP_CSV, rows)
    if models.reference is not None:
        models.reference.load_state_dict(models.model.state_dict())
    tmp = root / f".tmp-{WARMUP_DIR}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    models.model.save_pretrained(str(tmp / "model"), safe_serialization=True)
    shutil.rmtree(root / WARMUP_DIR, ignore_errors=True)
    os.replace(tmp, root / WARMUP_DIR)
    last = dict(rows[-1]) if rows else {}
    last["warmup/total_s"] = sum(r["warmup/step_s"] for r in rows) + rows[0].get("warmup/build_s", 0.0) if rows else 0.0
    return last


def _close_env(env) -> None:
    import asyncio

    try:
        asyncio.run(env.aclose())
    except Exception as exc:  # noqa: BLE001 - closing must not hide the real outcome of training
        log.debug("closing the environment client: %s", exc)
