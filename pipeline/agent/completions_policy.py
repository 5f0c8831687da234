"""`OpenAICompletionsPolicy`: the agent served behind an OpenAI-compatible `/v1/completions` endpoint.

Used at evaluation time when the agent runs on a server (vLLM on GPU nodes; llama.cpp's server here); the
design decisions (token-id vs text prompts, stop strings put back, re-encoded ids) are in
pipeline/agent/policy.py's module docstring, beside the in-process backend they mirror.
"""

from __future__ import annotations

import logging
import math
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pipeline.agent.policy import FinishReason, Generation, PolicyBackend

logger = logging.getLogger(__name__)


class OpenAICompletionsPolicy(PolicyBackend):
    """An agent behind an OpenAI-compatible `/v1/completions` endpoint (see module docstring)."""

    engine = "llama.cpp"
    """What samples the agent (pipeline.agent.engine): the pipeline serves its agent with llama.cpp's server
    (pipeline.agent.served), so a stage records `policy.engine` as what ran instead of deciding again."""

    def __init__(
        self,
        base_url: str,
        model: str,
        tokenizer: Any,
        *,
        api_key: str = "sk-local-no-key",
        timeout_s: float = 300.0,
        concurrency: int = 8,
        token_prompts: bool | None = None,
        sampling: dict[str, Any] | None = None,
        seed: int | None = None,
    ):
        import httpx

        self.base_url = base_url.rstrip("/")
        self.model = model
        self.tokenizer = tokenizer
        self.concurrency = concurrency
        self.token_prompts = token_prompts
        """True: send id lists; False: send text; None: try ids once, fall back to text on a 4xx."""
        self._client = httpx.Client(timeout=timeout_s, headers={"Authorization": f"Bearer {api_key}"})
        self._lock = threading.Lock()
        self.sampling = dict(sampling or {})
        """Extra sampler fields sent with every request (llama.cpp: top_k 0, min_p 0: pipeline.agent.served)."""
        self.seed = seed
        """Sampling seed: request i of the k-th `generate` call is sent seed + k * 100003 + i, so a run's
        samples depend on (seed, call, position) only, not on which request the server finishes first.
        None: the server's own randomness."""
        self._calls = 0
        self.logprob_mismatches = 0
        """Generations whose re-encoded ids did not line up with the server's log-probs (log-probs dropped)."""
        self.reencoded_texts = 0
        """Generations whose server-listed ids did not decode to the returned text (ids re-encoded instead)."""
        self.prompt_tokens = 0
        """Prompt tokens the server reported reading, over all requests so far."""
        self.cached_prompt_tokens = 0
        """Of those, how many it took from its prompt cache (`usage.prompt_tokens_details.cached_tokens`, as
        llama.cpp and vLLM report it): a conversation's next turn finds its earlier turns there."""
        try:
            from pipeline.agent.protocol import ConversationBuilder

            self.end_of_turn_id = ConversationBuilder(tokenizer).end_of_turn_id
        except (ValueError, TypeError, AttributeError):
            self.end_of_turn_id = getattr(tokenizer, "eos_token_id", None)

    def close(self) -> None:
        self._client.close()

    def _generate_all(self, prompts: list[list[int]], limits: list[int], temperature: float, top_p: float,
                      stop: list[str], return_logprobs: bool) -> list[Generation]:
        if self.seed is None:
            seeds: list[int | None] = [None] * len(prompts)
        else:
            seeds = [self.seed + self._calls * 100_003 + i for i in range(len(prompts))]
        self._calls += 1
        with ThreadPoolExecutor(max_workers=max(1, min(self.concurrency, len(prompts)))) as pool:
            return list(pool.map(lambda args: self._one(*args, temperature, top_p, stop, return_logprobs),
                                 zip(prompts, limits, seeds, strict=True)))

    def _request(self, prompt: list[int], body: dict[str, Any]) -> dict[str, Any]:
        import httpx

        url = f"{self.base_url}/completions"
        if self.token_prompts is not False:
            response = self._client.post(url, json={**body, "prompt": prompt})
            if response.status_code < 400:
                with self._lock:
                    self.token_prompts = True
                return response.json()
            if self.token_prompts is True:
                response.raise_for_status()
            # Unknown support: llama.cpp's server answers an id list with 500 (its schema takes strings
            # only), vLLM would accept it. Try text; only its success settles the question.
            logger.info("%s refused a token-id prompt (HTTP %d): trying text", url, response.status_code)
        text = self.tokenizer.decode(prompt, skip_special_tokens=False)
        response = self._client.post(url, json={**body, "prompt": text})
        try:
            response.raise_for_status()
        except httpx.HTTPStatusError as exc:
            raise RuntimeError(f"agent server {url}: HTTP {response.status_code}: {response.text[:300]}") from exc
        if self.token_prompts is None:
            with self._lock:
                self.token_prompts = False
        return response.json()

    def _sampled_ids(self, choice: dict[str, Any], server_text: str) -> tuple[list[int], list[float]] | None:
        """The sampled token ids and log-probs the server listed (llama.cpp: `logprobs.content[*].id`), if
        they decode to the text it returned; None otherwise (then the text is re-encoded).

        llama.cpp lists the tokens up to where a stop string began and holds back the stop string's own
        tokens; when a stop string began inside a token the list and the text disagree, and the
        re-encoded text is used instead (counted in `reencoded_texts`)."""
        content = (choice.get("logprobs") or {}).get("content")
        if not content or not all(isinstance(c, dict) and "id" in c for c in content):
            return None
        ids = [int(c["id"]) for c in content]
        # Compared without special tokens (llama.cpp's text leaves control tokens out) and without U+FFFD (a
        # token holding part of a UTF-8 character is rendered as a replacement character by one side only).
        decoded = self.tokenizer.decode(ids, skip_special_tokens=True)
        if decoded.replace("\ufffd", "") != server_text.replace("\ufffd", ""):
            with self._lock:
                self.reencoded_texts += 1
            return None
        lps = [float(c["logprob"]) if isinstance(c.get("logprob"), (int, float)) else math.nan for c in content]
        return ids, lps

    def _one(
        self, prompt: list[int], limit: int, seed: int | None, temperature: float, top_p: float, stop: list[str],
        return_logprobs: bool,
    ) -> Generation:
        if limit <= 0:
            return Generation([], [] if return_logprobs else None, "", "length")
        body: dict[str, Any] = {"model": self.model, "max_tokens": limit, "temperature": temperature,
                                "top_p": top_p, "stop": stop or None, **self.sampling}
        if seed is not None:
            body["seed"] = seed
        if return_logprobs:
            body["logprobs"] = 1
        reply = self._request(prompt, body)
        usage = reply.get("usage") or {}
        with self._lock:
            self.prompt_tokens += int(usage.get("prompt_tokens") or 0)
            self.cached_prompt_tokens += int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        choice = reply["choices"][0]
        text: str = choice.get("text") or ""
        server_text = text
        finish = choice.get("finish_reason") or "length"
        reason: FinishReason = "length"
        matched = None
        if finish == "stop":
            said = choice.get("stop_reason")  # vLLM names the matched stop string; llama.cpp does not
            matched = said if isinstance(said, str) and said in stop else _restore_stop(text, stop)
            if matched is not None:
                text, reason = text + matched, "stop"
            else:
                reason = "eos"
        sampled = self._sampled_ids(choice, server_text) if return_logprobs else None
        if sampled is not None:
            # The ids the server sampled (llama.cpp's `logprobs.content`), then the stop string the server cut
            # off, in the tokenizer's encoding (what the model writes when it closes a tag).
            ids, logprobs = sampled
            if matched is not None:
                tail = list(self.tokenizer.encode(matched, add_special_tokens=False))
                ids, logprobs = ids + tail, logprobs + [math.nan] * len(tail)
        else:
            ids = list(self.tokenizer.encode(text, add_special_tokens=False))
            logprobs = None
        if reason == "eos" and self.end_of_turn_id is not None:
            ids.append(int(self.end_of_turn_id))
            if logprobs is not None:
                # The end-of-turn id is ours: the server reports no log-prob for it. NaN = unknown (a 0.0 here
                # once read as a 6-16 nat gap to the policy's own log-prob in training's diagnostics).
                logprobs.append(math.nan)
        if return_logprobs and logprobs is None:
            server = _token_logprobs(choice.get("logprobs") or {})
            server = [float(x) if isinstance(x, (int, float)) and math.isfinite(x) else math.nan for x in server]
            if reason == "eos" and self.end_of_turn_id is not None:
                server.append(math.nan)
            if len(server) == len(ids):
                logprobs = server
            else:  # the text re-encoded differently from what was sampled (or a stop string cut a token)
                with self._lock:
                    self.logprob_mismatches += 1
                logger.debug("server returned %d log-probs for %d re-encoded tokens; log-probs dropped",
                             len(server), len(ids))
        return Generation(token_ids=ids, logprobs=logprobs, text=text, finish_reason=reason)


def _token_logprobs(logprobs: dict[str, Any]) -> list[Any]:
    """The sampled tokens' log-probs in either shape servers send: OpenAI's legacy `token_logprobs` (vLLM)
    or a `content` list of {token, logprob, ...} (llama.cpp's server)."""
    if logprobs.get("token_logprobs") is not None:
        return list(logprobs["token_logprobs"])
    return [entry.get("logprob") for entry in logprobs.get("content") or []]


def _restore_stop(text: str, stop: list[str]) -> str | None:
    """Which stop string the server cut off: the closing tag whose opener is left unclosed at the end."""
    best: tuple[int, str] | None = None
    for s in stop:
        if not s.startswith("</"):
            continue
        opener = "<" + s[2:]
        at = text.rfind(opener)
        if at >= 0 and s not in text[at:] and (best is None or at > best[0]):
            best = (at, s)
    return best[1] if best else None
