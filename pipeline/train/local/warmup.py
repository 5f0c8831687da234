"""Format warm-up ("cold start") of the local backend: supervised steps on Prompt-R1 demonstrations.

Why: GRPO learns only from reward differences inside a group. The CPU profile's agent
(SmolLM2-135M-Instruct) never writes the protocol's tags on its own (0 of 48 samples, measured), so every
trajectory scores -k, every advantage is 0 and RL does nothing. The paper's Qwen3-4B follows the format from
the instructions alone. As DeepSeek-R1 does before RL, a few supervised steps on demonstrations in the exact
format teach it; GRPO then starts from a model whose samples earn differing rewards. Off (`train.warmup.steps:
0`) in the paper profile.

The demonstrations come from `pipeline.train.local.demonstrations` (their layout, which rows, which answer, the
follow-up requests, withheld replies). This module runs the supervised steps on them (`run_warmup`) and judges
the warmed-up agent (`warmup_precheck`: on sampled training 2-hop questions, 10-60% of samples must earn answer
reward; otherwise it names the setting to change).

Design decisions:
- **Loss**: mean negative log-likelihood over the agent tokens (mask 1) of the step's demos (token-mean, like
  the GRPO loss), log-probs from the same padded forward the GRPO update uses (`batch.response_log_probs`,
  temperature 1). Environment and template tokens (mask 0) are context only.
- **Own optimizer**: an AdamW with `warmup.lr`, dropped afterwards; GRPO's optimizer starts fresh (its
  moments should not carry the supervised gradients' scale).
- **KL reference = the warmed-up model** (as R1's reference is the SFT'd model, not the raw base): the
  trainer copies the warmed weights into its frozen reference; the weights are also kept in
  `<checkpoint_dir>/warmup/model` (never pruned) so a resumed run rebuilds the same reference. LoRA +
  warm-up is refused: the LoRA reference is the base with adapters disabled, which would undo the warm-up.
- **Once**: the trainer writes a `step_0` checkpoint with `warmup_done` after it; a resumed run never repeats
  it (and a run resumed from a GRPO step never runs it).
- **Logging**: `warmup/loss`, `warmup/step`, `warmup/agent_tokens`, `warmup/step_s` to MLflow and
  `reports/train/warmup.csv`; `steps.csv`'s `step` stays the GRPO step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pandas as pd
import torch

from pipeline.hardware import resolve_autocast
from pipeline.train.local.batch import collate, response_log_probs, shared_prompt_log_probs
from pipeline.train.local.demonstrations import answer_source, build_demonstrations
from pipeline.types import PromptItem, Trajectory

if TYPE_CHECKING:
    from pipeline.train.plan import TrainPlan

log = logging.getLogger(__name__)

PRECHECK_QUESTIONS, PRECHECK_SAMPLES = 24, 4
"""The pre-check samples this many trajectories for each of this many training 2-hop questions."""
PRECHECK_RANGE = (0.10, 0.60)
"""Share of pre-check samples that must earn answer reward: GRPO needs groups with and without it."""


@dataclass(frozen=True)
class PrecheckVerdict:
    """What the pre-check after the warm-up decided."""

    ok: bool
    share: float
    """Share of the samples whose answer earned reward (answer F1 > 0)."""
    earned: int
    samples: int
    message: str
    """One line: the share and, when not `ok`, which warm-up setting to change and which way."""


def warmup_precheck(answer_rewards: list[float], low: float = PRECHECK_RANGE[0],
                    high: float = PRECHECK_RANGE[1]) -> PrecheckVerdict:
    """Judge the warm-up from the answer reward of each pre-check sample (the warmed-up agent sampled
    `PRECHECK_SAMPLES` times on `PRECHECK_QUESTIONS` training 2-hop questions). GRPO learns only from reward
    differences within a group: below `low` almost no group holds an answer that earned reward (nothing to
    reinforce), above `high` the warm-up has already taught most of what GRPO is to be measured on."""
    if not answer_rewards:
        raise ValueError("warm-up pre-check: no samples to judge")
    earned = sum(1 for r in answer_rewards if r > 0)
    share = earned / len(answer_rewards)
    line = (f"warm-up pre-check: {earned} of {len(answer_rewards)} samples ({share:.0%}) on training 2-hop "
            f"questions earn answer reward (wanted {low:.0%}-{high:.0%})")
    if share < low:
        return PrecheckVerdict(False, share, earned, len(answer_rewards), line + (
            "; too few for GRPO to find a reward difference: raise train.warmup.demonstrations (more two-request "
            "demonstrations) or train.warmup.steps"))
    if share > high:
        return PrecheckVerdict(False, share, earned, len(answer_rewards), line + (
            "; the warm-up already does what GRPO is measured on: lower train.warmup.demonstrations (fewer "
            "two-request demonstrations) or train.warmup.steps"))
    return PrecheckVerdict(True, share, earned, len(answer_rewards), line)


def warmup_loss(model: torch.nn.Module, demos: list[Trajectory], pad_id: int, micro_batch_size: int,
                device: torch.device, share_prompts: bool = False) -> tuple[float, int]:
    """Backward the mean NLL over the demos' agent tokens (micro-batched); returns (loss, agent tokens).

    `share_prompts` (`train.share_prompt_forward`): each demo forwarded unpadded, prompt then response over
    its cache (`batch.shared_prompt_log_probs`; the demos' prompts differ, so the gain is the padding and
    the logits at environment tokens: 13.0 -> 11.9 s float32, 6.8 -> 5.8 s bf16 for 2 x 2 demos of
    SmolLM2 on 2 cores)."""
    total_tokens = sum(sum(d.response_mask) for d in demos)
    loss_sum = 0.0
    ordered = sorted(demos, key=lambda d: len(d.prompt_ids) + len(d.response_ids))
    forward = shared_prompt_log_probs if share_prompts else response_log_probs
    for k in range(0, len(ordered), micro_batch_size):
        batch = collate(ordered[k : k + micro_batch_size], pad_id).to(device)
        log_prob = forward(model, batch, temperature=1.0)
        nll = -(log_prob * batch.response_mask).sum() / total_tokens
        nll.backward()
        loss_sum += float(nll.detach())
    return loss_sum, int(total_tokens)


def run_warmup(plan: TrainPlan, model: torch.nn.Module, tokenizer: Any, frame: pd.DataFrame, env: Any,
               device: torch.device, item_from_row: Callable[[dict[str, Any], int], PromptItem],
               log_metrics: Callable[[dict[str, float], int], None] | None = None) -> list[dict[str, float]]:
    """`warmup.steps` supervised steps on demonstrations; returns one metrics row per step."""
    from pipeline.progress import progress

    w, cfg = plan.train.warmup, plan.train
    count = w.demonstrations or w.steps * w.batch_size
    t0 = time.perf_counter()
    demos = build_demonstrations(plan, frame, tokenizer, env, count, item_from_row)
    build_s = time.perf_counter() - t0
    env_calls = sum(d.usage.calls for d in demos)
    golds = sum(d.turns[-1].parsed.answer in [str(g).strip() for g in d.item.gold_answers] for d in demos)
    log.info("format warm-up: %d demonstrations built in %.1fs (%d environment calls, %d cached); answers: %s",
             len(demos), build_s, env_calls, sum(d.usage.cache_hits for d in demos),
             f"{golds} gold stated by a reply, {len(demos) - golds} the last reply's"
             if answer_source(w) == "reply" else "gold")
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=w.lr,
                                  weight_decay=cfg.weight_decay)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    autocast = resolve_autocast(cfg.autocast, device, "train.autocast")
    model.train()
    rows: list[dict[str, float]] = []
    bar = progress(range(1, w.steps + 1), desc="warm-up", unit="step")
    try:
        for step in bar:
            t_step = time.perf_counter()
            batch = [demos[(i + (step - 1) * w.batch_size) % len(demos)] for i in range(w.batch_size)]
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=getattr(torch, autocast or "bfloat16"),
                                enabled=autocast is not None):  # train.autocast, as the GRPO update
                loss, tokens = warmup_loss(model, batch, pad_id, cfg.micro_batch_size, device, cfg.shares_prompts)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            optimizer.step()
            row = {"warmup/step": float(step), "warmup/loss": loss, "warmup/grad_norm": float(grad_norm),
                   "warmup/agent_tokens": float(tokens), "warmup/step_s": time.perf_counter() - t_step}
            if step == 1:
                row.update({"warmup/demonstrations": float(len(demos)), "warmup/build_s": build_s,
                            "warmup/env_calls": float(env_calls), "warmup/gold_answers": float(golds)})
            rows.append(row)
            if log_metrics is not None:
                log_metrics(row, step)
            bar.set_postfix(loss=f"{loss:.3f}")
    finally:
        bar.close()
        model.eval()
    optimizer.zero_grad(set_to_none=True)
    return rows

