"""Trajectories as padded tensors and their log-probs under a model (used by GRPO and the format warm-up).

Design decisions:
- **Layout as verl's:** prompts left-padded, responses right-padded, explicit position ids; `response_mask`
  is 1 on agent tokens only (environment tokens and padding are context).
- **Logits on response positions only** (`logits_to_keep`), so the 49k-vocabulary head is not applied to the
  long Prompt-R1 prompt. Log-probs are `logit[token] - logsumexp(logits)` (no full log-softmax tensor) at
  the given temperature, as verl's actor computes them.
- The sampler's own log-probs ride along (`sampling_log_probs`) only when every trajectory carries them; they
  are diagnostics (the trainer recomputes old log-probs with this same forward).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pipeline.types import Trajectory


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
