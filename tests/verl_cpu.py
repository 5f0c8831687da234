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

from types import SimpleNamespace
from typing import Any

import torch
from verl.workers.rollout.replica import TokenOutput


class TransformersServerManager:
    """verl's LLM client contract served by an in-process transformers causal LM (greedy, CPU)."""

    def __init__(self, model: Any, tokenizer: Any) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.calls: list[dict[str, Any]] = []

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any],
                       **kwargs: Any) -> TokenOutput:
        if sampling_params.get("temperature", 1.0) != 0:
            raise ValueError("TransformersServerManager is greedy only: set rollout temperature 0")
        self.calls.append({"request_id": request_id, "prompt_ids": list(prompt_ids),
                           "sampling_params": dict(sampling_params)})
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
