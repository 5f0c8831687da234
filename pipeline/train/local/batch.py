"""Trajectories as padded tensors and their log-probs under a model (used by GRPO and the format warm-up).

Design decisions:
- **Layout as verl's:** prompts left-padded, responses right-padded, explicit position ids; `response_mask`
  is 1 on agent tokens only (environment tokens and padding are context).
- **Logits on response positions only** (`logits_to_keep`), so the 49k-vocabulary head is not applied to the
  long Prompt-R1 prompt. Log-probs are `logit[token] - logsumexp(logits)` (no full log-softmax tensor) at
  the given temperature, as verl's actor computes them.
- The sampler's own log-probs ride along (`sampling_log_probs`) only when every trajectory carries them; they
  are diagnostics (the trainer recomputes old log-probs with this same forward).
- **Shared prompts are read once** (`shared_prompt_log_probs`, the GRPO update's and reference's forward when
  `train.share_prompt_forward` is on). The G trajectories of a question start with the same prompt (~430 of
  their ~700 tokens in the default profile), and the padded layout reads it G times and pads every response
  to the longest. Here each distinct prompt is one forward (its KV cache kept, with its autograd graph),
  then each response is one unpadded forward over that cache; the gradient reaching the prompt's keys and
  values from every response flows back through the one prompt forward. Same log-probs and gradients as
  the padded forward up to float rounding (tests/test_train_shared_prompt.py); logits only at agent-token
  positions (environment tokens and padding get 0, which the loss masks out).
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
    prompt_lists: tuple[tuple[int, ...], ...] = ()
    """Each row's prompt ids, unpadded (what `shared_prompt_log_probs` groups rows by)."""
    response_lengths: tuple[int, ...] = ()
    """Each row's response length (tokens before the padding)."""

    def to(self, device: torch.device) -> RolloutBatch:
        moved = None if self.sampling_log_probs is None else self.sampling_log_probs.to(device)
        return RolloutBatch(self.input_ids.to(device), self.attention_mask.to(device),
                            self.position_ids.to(device), self.responses.to(device),
                            self.response_mask.to(device), self.num_tokens, moved, self.prompt_lists,
                            self.response_lengths)

    @property
    def shared_num_tokens(self) -> int:
        """Tokens `shared_prompt_log_probs` reads: each distinct prompt once, every response once."""
        return sum(len(p) for p in set(self.prompt_lists)) + sum(self.response_lengths)


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
                        int(attention.sum()), sampled, tuple(tuple(t.prompt_ids) for t in trajectories),
                        tuple(len(t.response_ids) for t in trajectories))


class EntropySum:
    """Running sum of the policy's token entropy over the agent tokens a forward read (verl's `actor/entropy`:
    the entropy of the full next-token distribution at each response position, not of the sampled token).
    Computed from the same logits the log-probs use, without gradient."""

    def __init__(self) -> None:
        self.total, self.count = 0.0, 0

    def add(self, logits: torch.Tensor, lse: torch.Tensor, keep: torch.Tensor | None = None) -> None:
        """Add the entropies of `logits` (..., V) with their logsumexp `lse` (...) where `keep` is true."""
        with torch.no_grad():
            probs = torch.exp(logits.detach() - lse.detach().unsqueeze(-1))
            entropy = lse.detach() - (probs * logits.detach()).sum(-1)
            if keep is not None:
                entropy = entropy[keep]
            self.total += float(entropy.sum())
            self.count += int(entropy.numel())

    @property
    def mean(self) -> float:
        """Mean entropy per agent token in nats; NaN when no token was read."""
        return self.total / self.count if self.count else float("nan")


def response_log_probs(model: torch.nn.Module, batch: RolloutBatch, temperature: float,
                       entropy: EntropySum | None = None) -> torch.Tensor:
    """(B, R) log-probs of the response tokens under `model` at `temperature` (verl's convention); with
    `entropy`, the agent tokens' entropies are added to it."""
    r = batch.responses.shape[1]
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                position_ids=batch.position_ids, use_cache=False, logits_to_keep=r + 1)
    logits = _scaled(out.logits[:, :-1, :].float(), temperature)
    picked = logits.gather(-1, batch.responses.unsqueeze(-1)).squeeze(-1)
    lse = torch.logsumexp(logits, dim=-1)
    if entropy is not None:
        entropy.add(logits, lse, batch.response_mask.bool())
    return picked - lse


def shared_prompt_log_probs(model: torch.nn.Module, batch: RolloutBatch, temperature: float,
                            entropy: EntropySum | None = None) -> torch.Tensor:
    """(B, R) log-probs of the agent's response tokens, each distinct prompt read once (module docstring).

    Same values as `response_log_probs` on agent tokens (response_mask 1); 0 on environment tokens and padding.
    Differentiable: call it under `torch.no_grad()` for reference / old log-probs, without for the update.
    With `entropy`, the agent tokens' entropies are added to it.
    """
    if not batch.prompt_lists:
        raise ValueError("shared_prompt_log_probs needs a batch from collate() (no prompt_lists)")
    b, r_max = batch.responses.shape
    device = batch.responses.device
    mask = batch.response_mask.bool()
    members: dict[tuple[int, ...], list[int]] = {}
    for row, prompt in enumerate(batch.prompt_lists):
        members.setdefault(prompt, []).append(row)

    rows: list[int] = []
    cols: list[int] = []
    values: list[torch.Tensor] = []
    for prompt, group in members.items():
        p = len(prompt)
        prompt_out = model(input_ids=torch.tensor([prompt], dtype=torch.long, device=device), use_cache=True,
                           logits_to_keep=1)
        first_logits = _scaled(prompt_out.logits[0, -1].float(), temperature)  # predicts response token 0
        first_lse = torch.logsumexp(first_logits, dim=-1)
        kv = [(layer.keys, layer.values) for layer in prompt_out.past_key_values.layers]
        del prompt_out
        for row in group:
            r = batch.response_lengths[row]
            if r == 0:
                continue
            tokens = batch.responses[row, :r]
            if mask[row, 0]:
                rows.append(row)
                cols.append(0)
                values.append((first_logits[tokens[0]] - first_lse).unsqueeze(0))
                if entropy is not None:
                    entropy.add(first_logits, first_lse)
            agent = torch.nonzero(mask[row, 1:r]).flatten() + 1  # response positions 1.. that are agent tokens
            if r == 1 or agent.numel() == 0:
                continue
            values.append(_log_probs_over_prompt_cache(model, tokens, agent, kv, p, temperature, entropy))
            rows.extend([row] * agent.numel())
            cols.extend(agent.tolist())
    result = torch.zeros((b, r_max), dtype=torch.float32, device=device)
    if not values:
        return result
    index = (torch.tensor(rows, device=device), torch.tensor(cols, device=device))
    return result.index_put(index, torch.cat(values))


def _log_probs_over_prompt_cache(model: torch.nn.Module, tokens: torch.Tensor, agent: torch.Tensor,
                                 kv: list[tuple[torch.Tensor, torch.Tensor]], prompt_len: int, temperature: float,
                                 entropy: EntropySum | None) -> torch.Tensor:
    """Log-probs of one response's agent tokens at positions `agent` (1..), read in one forward over its prompt's
    KV cache `kv`; with `entropy`, their entropies are added to it."""
    from transformers import DynamicCache

    r = len(tokens)
    # Feed tokens 0..r-2 after the prompt: the logits at input position j-1 predict response token j.
    out = model(input_ids=tokens[: r - 1].unsqueeze(0), past_key_values=DynamicCache(ddp_cache_data=kv),
                position_ids=torch.arange(prompt_len, prompt_len + r - 1, device=tokens.device).unsqueeze(0),
                use_cache=True, logits_to_keep=agent - 1)
    logits = _scaled(out.logits[0].float(), temperature)
    picked = logits.gather(-1, tokens[agent].unsqueeze(-1)).squeeze(-1)
    lse = torch.logsumexp(logits, dim=-1)
    if entropy is not None:
        entropy.add(logits, lse)
    return picked - lse


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Logits at `temperature` (verl's convention: 0 = greedy and 1 leave them as they are)."""
    return logits / temperature if temperature > 0 and temperature != 1.0 else logits
