"""Can one environment call finish in time? The reply budget against `environment.timeout_s`, from the
environment section alone.

`EnvironmentClient.reply` gives every request `environment.timeout_s` (pipeline/environment/client.py,
`asyncio.timeout` around each request), and a reply that comes back empty after `finish_reason: length` (a
reasoning model, GPT-OSS, spent `max_tokens` thinking) is asked once more, at once, with
`max_tokens × length_retry_factor` under the same per-request timeout. That retry is the longest call the
run makes: if the server cannot decode that many tokens within `timeout_s`, every such retry times out, is
retried with backoff, and counts as a failure; once more than `max_failure_rate` (5%) of the last
`failure_window` calls failed, `EnvironmentUnhealthy` stops training. With GPT-OSS's default (medium)
reasoning on the math rows of `val_before_train`, long replies are likely, so this fails in the first hour.

The rule: `ceil(max_tokens × length_retry_factor) / decode_tokens_per_s <= timeout_s`, where
`environment.decode_tokens_per_s` is a *declared* figure: the slowest per-request decode speed expected
from the environment server at the load the run puts on it (every agent-loop worker's client keeps up to
`environment.concurrency` requests in flight). A profile states it next to the model and the server it
describes, so the arithmetic is visible and `promptr1 check` refuses a combination that cannot finish instead
of the run discovering it; `promptr1 doctor`'s rows step measures the speed (completion tokens / seconds of
its replies) and applies the same rule to the measured figure. Prompt prefill and queueing are not counted: the
declared speed must be low enough to absorb them.

Also refused: a GPT-OSS environment with `reasoning_effort` unset. The server then reasons at medium, which
is what makes empty replies after `finish_reason: length` likely; the profile must choose.

`layout_problems` (pipeline/checks/layout.py) adds these problems to its own, so `promptr1 check`, every stage and
the flow refuse them before anything starts.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeline.config import EnvironmentConfig

GPT_OSS_MARKER = "gpt-oss"
"""GPT-OSS model references (Hub `openai/gpt-oss-20b`, a served name `gpt-oss-20b`) contain this."""

Problem = tuple[tuple[str, ...], str]
"""(the param keys that decide it, what is wrong): pipeline.checks.layout wraps each into a LayoutProblem."""


def is_gpt_oss(env: EnvironmentConfig) -> bool:
    """Whether the environment is a GPT-OSS model (harmony format, reasoning effort)."""
    return any(GPT_OSS_MARKER in ref.lower() for ref in (env.model, env.served_name))


def longest_reply_tokens(env: EnvironmentConfig) -> int:
    """The largest completion one request may ask for: the length retry's `max_tokens × length_retry_factor`."""
    return math.ceil(env.max_tokens * env.length_retry_factor)


def longest_reply_seconds(env: EnvironmentConfig, tokens_per_s: float) -> float:
    """Seconds the longest reply (`longest_reply_tokens`) takes at `tokens_per_s`: what the rule compares with
    `environment.timeout_s`, for the declared speed (`promptr1 check`) or a measured one (`promptr1 doctor`)."""
    return longest_reply_tokens(env) / tokens_per_s


def reply_budget_problems(env: EnvironmentConfig) -> list[Problem]:
    """Every reason a call to environment `env` cannot finish within its timeout (see module docstring)."""
    problems: list[Problem] = []
    tokens = longest_reply_tokens(env)
    needed_s = longest_reply_seconds(env, env.decode_tokens_per_s)
    if needed_s > env.timeout_s:
        problems.append((
            ("environment.timeout_s", "environment.max_tokens", "environment.length_retry_factor",
             "environment.decode_tokens_per_s"),
            (f"the length retry asks for {env.max_tokens} x {env.length_retry_factor:g} = {tokens} tokens, "
             f"{needed_s:.0f} s at the declared {env.decode_tokens_per_s:g} tokens/s, longer than the "
             f"{env.timeout_s:g} s timeout of one call: every such retry would time out and count as a failure. "
             f"Raise timeout_s to >= {math.ceil(needed_s)}, or lower max_tokens or length_retry_factor")))
    if is_gpt_oss(env) and env.reasoning_effort is None:
        problems.append((
            ("environment.reasoning_effort",),
            (f"{env.model} is a GPT-OSS model and reasoning_effort is unset, so it reasons at medium and long "
             "replies end empty after finish_reason=length: choose low, medium or high")))
    return problems
