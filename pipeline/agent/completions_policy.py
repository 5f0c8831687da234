"""`OpenAICompletionsPolicy`: the agent served behind an OpenAI-compatible `/v1/completions` endpoint.

Used at evaluation time when the agent runs on a server (vLLM on GPU nodes; llama.cpp's server here); the
design decisions (token-id vs text prompts, stop strings put back, re-encoded ids) are in
pipeline/agent/policy.py's module docstring, beside the in-process backend they mirror.
"""

from __future__ import annotations

import logging
import math
import threading
from typing import Any

from pipeline.agent.policy import FinishReason, Generation, PolicyBackend

logger = logging.getLogger(__name__)


class OpenAICompletionsPolicy(PolicyBackend):
    """An agent behind an OpenAI-compatible `/v1/completions` endpoint (see module docstring)."""

    engine = "llama.cpp"
    """What samples the agent (pipeline.agent.engine): the pipeline serves its agent with llama.cpp's server
    (pipeline.agent.llama_launcher), so a stage records `policy.engine` as what ran instead of deciding again."""

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
        """The server's slots: the most samples of one prompt a request asks for (llama.cpp refuses more)."""
        self.token_prompts = token_prompts
        """True: send id lists; False: send text; None: try ids once, fall back to text on a 4xx."""
        self.timeout_s = timeout_s
        """Seconds one server slot may take over one prompt; a request of several prompts gets this for each
        round of them the server's slots (`concurrency`) must take in turn."""
        self._client = httpx.Client(timeout=timeout_s, headers={"Authorization": f"Bearer {api_key}"})
        self._lock = threading.Lock()
        self.sampling = dict(sampling or {})
        """Extra sampler fields sent with every request (llama.cpp: top_k 0, min_p 0: pipeline.agent.llama_launcher)."""
        self.seed = seed
        """Sampling seed: request r of the k-th `generate` call is sent seed + k * 100003 + r * 1009 (one
        request in the common case; see `batched_requests`), so a run's samples depend on (seed, call, the
        prompts) only. None: the server's own randomness."""
        self._calls = 0
        self.logprob_mismatches = 0
        """Generations whose re-encoded ids did not line up with the server's log-probs (log-probs dropped)."""
        self.reencoded_texts = 0
        """Generations whose server-listed ids did not decode to the returned text (ids re-encoded instead)."""
        self.prompt_tokens = 0
        """Prompt tokens sent over all requests so far (each prompt's length times the samples asked of it)."""
        self.cached_prompt_tokens = 0
        """Of those, how many the server took from its prompt cache: a conversation's next turn finds its earlier
        turns there. With `metrics_url`, the tokens sent less those the server says it evaluated; otherwise
        the reply's `usage.prompt_tokens_details.cached_tokens` (vLLM's sums every prompt of a request)."""
        self.metrics_url: str | None = None
        """llama.cpp's Prometheus endpoint (`/metrics`), read after each request: its reply's `usage` describes
        only the first prompt of a request of several, its `llamacpp:prompt_tokens_total` counts every prompt
        token it evaluated rather than took from a cache. Exact while this policy is the server's only client
        (`pipeline.agent.llama_launcher`)."""
        self._evaluated: float | None = None
        try:
            from pipeline.agent.protocol import ConversationBuilder

            self.end_of_turn_id = ConversationBuilder(tokenizer).end_of_turn_id
        except (ValueError, TypeError, AttributeError):
            self.end_of_turn_id = getattr(tokenizer, "eos_token_id", None)

    def close(self) -> None:
        self._client.close()

    def _generate_all(self, prompts: list[list[int]], limits: list[int], temperature: float, top_p: float,
                      stop: list[str], return_logprobs: bool) -> list[Generation]:
        out: list[Generation | None] = [None] * len(prompts)
        call = self._calls
        self._calls += 1
        for i, limit in enumerate(limits):
            if limit <= 0:
                out[i] = Generation([], [] if return_logprobs else None, "", "length")
        for r, (limit, unique, n) in enumerate(batched_requests(prompts, limits, self.concurrency)):
            seed = None if self.seed is None else self.seed + call * 100_003 + r * 1_009
            body: dict[str, Any] = {"model": self.model, "max_tokens": limit, "temperature": temperature,
                                    "top_p": top_p, "stop": stop or None, **self.sampling}
            if n > 1:
                body["n"] = n
            if seed is not None:
                body["seed"] = seed
            if return_logprobs:
                body["logprobs"] = 1
            reply = self._request([prompts[u[0]] for u in unique], body,
                                  timeout_s=self.timeout_s * max(1, math.ceil(len(unique) * n / self.concurrency)))
            self._count_prompt_tokens(sum(len(prompts[u[0]]) for u in unique) * n, reply.get("usage") or {})
            choices = sorted(reply["choices"], key=lambda c: int(c.get("index") or 0))
            if len(choices) != len(unique) * n:
                raise RuntimeError(f"agent server {self.base_url}: {len(choices)} choices for {len(unique)} prompts "
                                   f"x n={n}")
            for k, positions in enumerate(unique):
                for c, i in enumerate(positions):  # choice index = prompt x n + sample (llama.cpp and vLLM)
                    out[i] = self._generation(choices[k * n + c], stop, return_logprobs)
        assert all(g is not None for g in out)
        return out  # type: ignore[return-value]

    def _count_prompt_tokens(self, sent: int, usage: dict[str, Any]) -> None:
        """Add one request's `sent` prompt tokens, and those of them its server took from a cache."""
        if self.metrics_url is not None:
            evaluated = self._evaluated_total()
            before, self._evaluated = self._evaluated, evaluated
            cached = 0 if before is None or evaluated is None else max(0, sent - int(evaluated - before))
        else:
            cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        with self._lock:
            self.prompt_tokens += sent
            self.cached_prompt_tokens += cached

    def _evaluated_total(self) -> float | None:
        """llama.cpp's count of prompt tokens evaluated since it started (None when unreadable)."""
        import httpx

        try:
            text = httpx.get(self.metrics_url, timeout=10).text  # type: ignore[arg-type]
        except httpx.HTTPError:
            return None
        for line in text.splitlines():
            if line.startswith("llamacpp:prompt_tokens_total "):
                return float(line.split()[1])
        return None

    def start_counting(self) -> None:
        """Read the server's evaluated-token count now, so the next request's cache share can be measured."""
        if self.metrics_url is not None:
            self._evaluated = self._evaluated_total()

    def _request(self, prompts: list[list[int]], body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        import httpx

        url = f"{self.base_url}/completions"
        if self.token_prompts is not False:
            response = self._client.post(url, json={**body, "prompt": prompts}, timeout=timeout_s)
            if response.status_code < 400:
                self.token_prompts = True
                return response.json()
            if self.token_prompts is True:
                response.raise_for_status()
            # Unknown support: llama.cpp's server answers an id list with 500 (its schema takes strings
            # only), vLLM would accept it. Try text; only its success settles the question.
            logger.info("%s refused a token-id prompt (HTTP %d): trying text", url, response.status_code)
        texts = [self.tokenizer.decode(prompt, skip_special_tokens=False) for prompt in prompts]
        response = self._client.post(url, json={**body, "prompt": texts}, timeout=timeout_s)
        try:
            response.raise_for_status()
        except httpx.HTTPStatusError as exc:
            raise RuntimeError(f"agent server {url}: HTTP {response.status_code}: {response.text[:300]}") from exc
        if self.token_prompts is None:
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

    def _generation(self, choice: dict[str, Any], stop: list[str], return_logprobs: bool) -> Generation:
        """One choice of a reply as a `Generation`: the stop string put back, the sampled ids and log-probs."""
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


def batched_requests(prompts: list[list[int]], limits: list[int],
                     slots: int) -> list[tuple[int, list[list[int]], int]]:
    """How one `generate` call's prompts go to the server: (max_tokens, positions of each distinct prompt, n)
    per request, sent one after another.

    Why one request and not one per prompt: a llama.cpp server decodes the sequences of all busy slots in one
    batch, and the floating-point result of a step depends on that batch (which sequences share it, at which
    position each one entered). Requests sent one per prompt enter the server whenever their HTTP call
    arrives, so the same prompts with the same seeds sampled different tokens from run to run, most often
    under load. A request holding every prompt is queued by the server in one piece: the slots are filled,
    and freed slots refilled, at the same decode steps on every run, so the samples depend on the prompts
    and the seed alone.

    The server gives every prompt of a request the request's seed, so identical prompts (a GRPO group's G
    copies) are asked for once with `n` samples (each sample its own seed server-side); `n` is capped by
    the server's slots. Prompts with different token limits, or repeated a different number of times, go
    in separate requests (a rare case: a trajectory near its response budget); each request gets its own
    seed, so no two requests repeat a sample.
    """
    by_limit: dict[int, dict[tuple[int, ...], list[int]]] = {}
    for i, (prompt, limit) in enumerate(zip(prompts, limits, strict=True)):
        if limit > 0:
            by_limit.setdefault(limit, {}).setdefault(tuple(prompt), []).append(i)
    requests: list[tuple[int, list[list[int]], int]] = []
    for limit, groups in by_limit.items():
        left = [list(positions) for positions in groups.values()]
        while left:
            n = max(1, min(min(len(p) for p in left), slots))
            requests.append((limit, [p[:n] for p in left], n))
            left = [p[n:] for p in left if len(p) > n]
    return requests


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
