"""Policy backends: what generates the agent's turns, given token ids.

`Policy` is the one interface the rollout needs: token ids in, `Generation`s (sampled token ids, their
log-probs if asked, text, why it stopped) out. Two backends, chosen by who runs the agent:

- `TransformersPolicy`: the model in this process (training with the local backend, `promptr1 ask`,
  evaluation on CPU). It runs its own small sampling loop over a KV cache rather than `model.generate`,
  because the rollout needs, per row: its own token limit (the response budget clips each trajectory's last
  turn differently), stop strings checked on the decoded text of the generated tokens only, the sampled
  tokens' log-probs, and finished rows dropped from the batch (their cache rows too). Prompts are
  left-padded; position ids come from the attention mask, so padding changes nothing.
  Log-probs are `log_softmax(logits / T)` at the sampled token (T = temperature, or 1 for greedy), before
  top-p filtering: the quantity verl's actor recomputes for the PPO ratio.
- `OpenAICompletionsPolicy` (pipeline/agent/completions_policy.py): an agent served behind an OpenAI-compatible `/v1/completions` endpoint (vLLM
  at evaluation time on GPU nodes; llama.cpp's server here). Prompts go as token-id lists where the server
  accepts them (vLLM) and as the detokenised text otherwise (llama.cpp's server takes strings only and
  answers an id list with HTTP 500; the first refusal followed by a successful text request switches to
  text for the rest of the session). OpenAI servers drop the stop string from the text, so it
  is put back (the protocol parser needs the closing tag), and a natural end is marked with the end-of-turn
  token so the conversation builder does not close the turn twice. Returned ids are the agent tokenizer's
  encoding of the returned text (evaluation), or, when log-probs are asked for (training rollouts through
  llama.cpp, pipeline.train.local.rollout_engine), the ids the server lists as sampled (`logprobs.content`)
  followed by the stop string's encoding, whenever they decode to exactly the returned text.

Both keep the stop string *in* the output (ids and text), and an end-of-sequence token in the ids when the
model emitted one: every generated token is an agent action (mask 1).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

from pipeline.paths import display_path

FinishReason = Literal["stop", "eos", "length"]

logger = logging.getLogger(__name__)


@dataclass
class Generation:
    """One generated agent turn."""

    token_ids: list[int]
    """Sampled ids, including the stop string's tokens or the end-of-sequence token when one ended it."""
    logprobs: list[float] | None
    """Log-prob of each sampled id under the sampling policy (aligned with token_ids), when asked for."""
    text: str
    """Decoded text without special tokens (the stop string included)."""
    finish_reason: FinishReason = "length"
    """'stop' (a stop string), 'eos' (end-of-sequence / end-of-turn token) or 'length' (token limit)."""


@runtime_checkable
class Policy(Protocol):
    """What the rollout needs from an agent backend."""

    tokenizer: Any

    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int | Sequence[int],
        temperature: float,
        top_p: float,
        stop: list[str],
        return_logprobs: bool,
    ) -> list[Generation]:
        """One generation per prompt, in order. `max_new_tokens` is one limit or one per prompt;
        temperature 0 means greedy."""
        ...


def _limits(max_new_tokens: int | Sequence[int], n: int) -> list[int]:
    if isinstance(max_new_tokens, int):
        return [max_new_tokens] * n
    limits = [int(x) for x in max_new_tokens]
    if len(limits) != n:
        raise ValueError(f"max_new_tokens has {len(limits)} limits for {n} prompts")
    return limits


def _eos_ids(tokenizer: Any, model_eos: int | Sequence[int] | None) -> list[int]:
    """The model's end-of-sequence ids plus the chat template's end-of-turn token."""
    from pipeline.agent.protocol import ConversationBuilder

    ids: list[int] = []
    try:
        builder = ConversationBuilder(tokenizer)
        ids = builder.stop_token_ids(model_eos if model_eos is not None else ())
    except (ValueError, TypeError, AttributeError):  # no usable chat template: the model's eos only
        logger.debug("no usable chat template; stopping on the model's eos ids only", exc_info=True)
        if isinstance(model_eos, int):
            ids = [model_eos]
        elif model_eos:
            ids = [int(i) for i in model_eos]
    return ids


@dataclass
class _BatchRows:
    """What one generation batch has sampled so far, per prompt (indexed as the prompts)."""

    limits: list[int]
    """Each prompt's token limit."""
    tokens: list[list[int]]
    """Ids sampled so far."""
    logps: list[list[float]]
    """Their log-probs, when asked for."""
    reasons: list[FinishReason]
    """Why each prompt's generation stopped ('length' until another reason ends it)."""
    done: list[bool]
    """Whether each prompt's generation has stopped (a limit of 0 stops it before the first token)."""

    @classmethod
    def start(cls, limits: list[int]) -> _BatchRows:
        n = len(limits)
        return cls(limits=limits, tokens=[[] for _ in range(n)], logps=[[] for _ in range(n)],
                   reasons=["length"] * n, done=[limit <= 0 for limit in limits])

    def add(self, i: int, token: int, logp: float | None) -> None:
        """Prompt `i`'s next sampled token (and its log-prob when asked for)."""
        self.tokens[i].append(token)
        if logp is not None:
            self.logps[i].append(logp)

    def finish_if_ended(self, i: int, eos: set[int], stop: list[str], window: int, tokenizer: Any) -> None:
        """Mark prompt `i` done when its last token is an end-of-sequence token, its decoded tail (`window`
        tokens) holds a stop string, or it reached its limit."""
        if self.tokens[i][-1] in eos:
            self.done[i], self.reasons[i] = True, "eos"
        elif stop and any(s in tokenizer.decode(self.tokens[i][-window:]) for s in stop):
            self.done[i], self.reasons[i] = True, "stop"
        elif len(self.tokens[i]) >= self.limits[i]:
            self.done[i] = True


class PolicyBackend:
    """The shared front of the policy backends: argument normalisation, then one call per backend."""

    tokenizer: Any

    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int | Sequence[int],
        temperature: float = 1.0,
        top_p: float = 1.0,
        stop: list[str] | None = None,
        return_logprobs: bool = False,
    ) -> list[Generation]:
        """One generation per prompt, in order (see `Policy.generate`)."""
        limits = _limits(max_new_tokens, len(prompts))
        if not prompts:
            return []
        return self._generate_all(prompts, limits, temperature, top_p, list(stop or []), return_logprobs)

    def _generate_all(self, prompts: list[list[int]], limits: list[int], temperature: float, top_p: float,
                      stop: list[str], return_logprobs: bool) -> list[Generation]:
        raise NotImplementedError


class TransformersPolicy(PolicyBackend):
    """An in-process transformers causal LM (see module docstring)."""

    engine = "transformers"
    """What samples the agent (pipeline.agent.engine), for a stage to record what ran."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        device: str | None = None,
        *,
        max_batch_size: int = 32,
        eos_token_ids: Sequence[int] | None = None,
        seed: int | None = None,
    ):
        import torch

        self.model = model
        self.tokenizer = tokenizer
        self.device = torch.device(device or next(model.parameters()).device)
        self.max_batch_size = max_batch_size
        gen_cfg = getattr(model, "generation_config", None)
        model_eos = getattr(gen_cfg, "eos_token_id", None) or getattr(model.config, "eos_token_id", None)
        self.eos_token_ids = list(eos_token_ids) if eos_token_ids is not None else _eos_ids(tokenizer, model_eos)
        pad = getattr(gen_cfg, "pad_token_id", None) or getattr(tokenizer, "pad_token_id", None)
        self.pad_token_id = int(pad if pad is not None else (self.eos_token_ids or [0])[0])
        self.generator = torch.Generator(device=self.device)
        self.autocast: str | None = None
        """Generate under torch.autocast in this dtype (`evaluate.autocast`); None: the model's own dtype.
        Set only where nothing depends on generation-time log-probs (evaluation): training rollouts keep the
        model's dtype (the configuration the learning tests and the learn profile were validated in)."""
        if seed is not None:
            self.generator.manual_seed(seed)
        else:
            self.generator.seed()

    @classmethod
    def from_ref(
        cls,
        ref: str,
        root: Path | None = None,
        dtype: str = "float32",
        device: str | None = None,
        **kwargs: Any,
    ) -> TransformersPolicy:
        """Load from a params model reference (`pkg://…` GGUF, dequantised; a local HF dir; a Hub id)."""
        import torch
        from transformers import AutoModelForCausalLM

        from pipeline.modelref import as_resolved, load_tokenizer, pretrained_source

        resolved = as_resolved(ref, root)
        tokenizer = load_tokenizer(resolved)
        directory, extra = pretrained_source(resolved, "model")
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=getattr(torch, dtype), **extra)
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        model.to(device).eval()
        shown = display_path(ref, Path.cwd()) if Path(ref).exists() else ref
        logger.info("agent %s loaded (%s, %s, %.1f M parameters)", shown, dtype, device,
                    sum(p.numel() for p in model.parameters()) / 1e6)
        return cls(model, tokenizer, device, **kwargs)

    def _generate_all(self, prompts: list[list[int]], limits: list[int], temperature: float, top_p: float,
                      stop: list[str], return_logprobs: bool) -> list[Generation]:
        import torch

        # Entered here, in the calling thread: autocast is thread-local and the rollout generates in a worker.
        with torch.autocast(self.device.type, dtype=getattr(torch, self.autocast or "bfloat16"),
                            enabled=self.autocast is not None):
            return self._generate_sorted(prompts, limits, temperature, top_p, stop, return_logprobs)

    def _generate_sorted(self, prompts: list[list[int]], limits: list[int], temperature: float, top_p: float,
                         stop: list[str], return_logprobs: bool) -> list[Generation]:
        out: list[Generation | None] = [None] * len(prompts)
        # Similar lengths together: less padding per micro-batch.
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        was_training = self.model.training
        self.model.eval()
        try:
            for start in range(0, len(order), self.max_batch_size):
                chunk = order[start:start + self.max_batch_size]
                gens = self._generate_batch([prompts[i] for i in chunk], [limits[i] for i in chunk],
                                            temperature, top_p, stop, return_logprobs)
                for i, g in zip(chunk, gens, strict=True):
                    out[i] = g
        finally:
            self.model.train(was_training)
        return [g for g in out if g is not None]

    def _generate_batch(
        self,
        prompts: list[list[int]],
        limits: list[int],
        temperature: float,
        top_p: float,
        stop: list[str],
        return_logprobs: bool,
    ) -> list[Generation]:
        import torch

        n = len(prompts)
        rows = _BatchRows.start(limits)
        if all(rows.done):
            return [Generation([], [] if return_logprobs else None, "", "length") for _ in range(n)]
        ids, mask = self._left_padded(prompts)
        with torch.no_grad():
            self._decode(ids, mask, rows, temperature, top_p, stop, return_logprobs)
        return [
            Generation(
                token_ids=rows.tokens[i],
                logprobs=rows.logps[i] if return_logprobs else None,
                text=self.tokenizer.decode(rows.tokens[i], skip_special_tokens=True),
                finish_reason=rows.reasons[i],
            )
            for i in range(n)
        ]

    def _left_padded(self, prompts: list[list[int]]) -> tuple[Any, Any]:
        """The prompts as one left-padded id tensor and its attention mask, on the model's device."""
        import torch

        n = len(prompts)
        width = max(len(p) for p in prompts)
        ids = torch.full((n, width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for row, p in enumerate(prompts):
            if p:
                ids[row, width - len(p):] = torch.tensor(p, dtype=torch.long)
                mask[row, width - len(p):] = 1
        return ids.to(self.device), mask.to(self.device)

    def _decode(self, ids: Any, mask: Any, rows: _BatchRows, temperature: float, top_p: float, stop: list[str],
                return_logprobs: bool) -> None:
        """Prefill the prompts, then sample one token per live row per step into `rows` until every row is
        done; finished rows leave the batch and the KV cache."""
        import torch

        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        window = max((len(s) for s in stop), default=0) + 8
        eos = set(self.eos_token_ids)
        live = list(range(len(rows.done)))  # batch row -> prompt index, shrinks as rows finish

        # Only the last position's logits are needed: the full (n, width, vocab) tensor costs ~2 s and
        # ~0.6 GB per 8 prompts of 384 tokens with a 49k vocabulary.
        result = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                            logits_to_keep=1)
        cache = result.past_key_values
        logits = result.logits[:, -1, :].float()
        next_pos = positions[:, -1:] + 1
        for _step in range(max(rows.limits)):
            chosen, chosen_logp = self._sample(logits, temperature, top_p)
            keep: list[int] = []
            for b, i in enumerate(live):
                if rows.done[i]:
                    continue
                rows.add(i, int(chosen[b]), float(chosen_logp[b]) if return_logprobs else None)
                rows.finish_if_ended(i, eos, stop, window, self.tokenizer)
                if not rows.done[i]:
                    keep.append(b)
            if not keep:
                break
            if len(keep) < len(live):
                index = torch.tensor(keep, device=self.device)
                cache.batch_select_indices(index)
                chosen, mask, next_pos = chosen[index], mask[index], next_pos[index]
                live = [live[b] for b in keep]
            mask = torch.cat([mask, mask.new_ones((len(live), 1))], dim=1)
            result = self.model(input_ids=chosen[:, None], attention_mask=mask, position_ids=next_pos,
                                past_key_values=cache, use_cache=True)
            cache = result.past_key_values
            logits = result.logits[:, -1, :].float()
            next_pos = next_pos + 1

    def _sample(self, logits: Any, temperature: float, top_p: float) -> tuple[Any, Any]:
        """Next token per row and its log-prob under the temperature-scaled distribution."""
        import torch

        if temperature <= 0:
            chosen = logits.argmax(dim=-1)
            logp = torch.log_softmax(logits, dim=-1).gather(-1, chosen[:, None])[:, 0]
            return chosen, logp
        scaled = logits / temperature
        logp_all = torch.log_softmax(scaled, dim=-1)
        probs = logp_all.exp()
        if top_p < 1.0:
            sorted_probs, sorted_idx = probs.sort(dim=-1, descending=True)
            cumulative = sorted_probs.cumsum(dim=-1)
            drop = cumulative - sorted_probs > top_p  # always keeps the most likely token
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter(-1, sorted_idx, sorted_probs)
        chosen = torch.multinomial(probs, 1, generator=self.generator)[:, 0]
        return chosen, logp_all.gather(-1, chosen[:, None])[:, 0]
