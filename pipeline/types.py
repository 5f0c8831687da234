"""Small data types shared across the pipeline: what a turn, a trajectory and an environment reply are.

These are passed between `data/`, `agent/` (protocol, rollout), `environment/` (the large LLM), `reward.py`,
`train/` and the evaluate stage, so each of those modules can be read and tested on its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

StopReason = Literal["answer", "max_turns", "token_budget", "prompt_too_long", "no_action"]
"""Why a trajectory ended: `answer` (closed <answer> tags), `max_turns` (the turn limit), `token_budget`
(max_response_tokens spent), `prompt_too_long` (the prompt alone exceeds max_prompt_tokens), `no_action`
(a turn with neither a closed <answer> nor a non-empty closed <interaction_prompt>: EOS or the per-turn
token limit came first; added by the agent helper)."""

TRAINED = "prompt_r1"
"""The trained agent with its environment (Prompt-R1): its system name in the evaluation's answers, metrics.json,
the reports, the headline figures and the promotion rule's averages."""


@dataclass
class ParsedTurn:
    """One agent turn split into its Prompt-R1 parts, with the flags the format reward reads.

    Parsing never raises: malformed model output gives None parts and False flags plus `issues`.
    """

    text: str
    """The raw turn text as generated (with the leading `<think>` the template opened, if any)."""
    think: str | None = None
    """Content of the first `<think>…</think>`, stripped; None if absent or unclosed."""
    interaction_prompt: str | None = None
    """Content of `<interaction_prompt>…</interaction_prompt>`, stripped; None if absent."""
    answer: str | None = None
    """Content of `<answer>…</answer>`, stripped; None if absent or unclosed."""
    valid_intermediate: bool = False
    """M_t: non-empty think then non-empty interaction prompt, each tag exactly once, in that order."""
    has_answer_tags: bool = False
    """A_p: a parseable `<answer>…</answer>`."""
    answer_nonempty: bool = False
    """A_n: the answer is non-empty."""
    complete_final: bool = False
    """C_f: exactly `<think>…</think><answer>…</answer>` and nothing else (whitespace aside)."""
    issues: list[str] = field(default_factory=list)
    """Human-readable notes on what was malformed (for trajectory tables and debugging)."""


@dataclass
class EnvironmentReply:
    """The large LLM's answer to one interaction prompt."""

    text: str
    """Reply text (an error note when `error` is set, so the trajectory can still finish)."""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    latency_s: float = 0.0
    cached: bool = False
    """Served from the persistent response cache (no API call made)."""
    retries: int = 0
    error: str | None = None
    """Why the call failed after all retries (timeout, HTTP status, malformed body), else None."""
    cost_usd: float = 0.0
    truncated: bool = False
    """The server stopped at `max_tokens` (`finish_reason: length`): the text may be cut."""
    empty_after_length: bool = False
    """The first answer was empty with `finish_reason: length` and was asked again with a larger budget."""


@dataclass
class UsageStats:
    """Running totals of environment usage (per client, per step, per evaluation)."""

    calls: int = 0
    """Requests actually sent (cache hits excluded)."""
    cache_hits: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    errors: int = 0
    """Calls that failed after every retry (the reply is an error note)."""
    retries: int = 0
    truncated: int = 0
    """Replies cut at `max_tokens` (`finish_reason: length`)."""
    empty_after_length: int = 0
    """Empty replies after `finish_reason: length` (a reasoning model spent the budget thinking), each
    retried once with a larger budget; counted whether or not the retry succeeded."""
    latency_s: float = 0.0
    cost_usd: float = 0.0

    def add(self, reply: EnvironmentReply) -> None:
        """Account for one reply."""
        if reply.cached:
            self.cache_hits += 1
        else:
            self.calls += 1
            self.prompt_tokens += reply.prompt_tokens
            self.completion_tokens += reply.completion_tokens
            self.latency_s += reply.latency_s
            self.cost_usd += reply.cost_usd
        self.retries += reply.retries
        self.errors += int(reply.error is not None)
        self.truncated += int(reply.truncated)
        self.empty_after_length += int(reply.empty_after_length)

    def merge(self, other: UsageStats) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def as_dict(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


@dataclass
class Turn:
    """One agent turn and, unless it was the last, the environment's reply to it."""

    parsed: ParsedTurn
    agent_token_ids: list[int]
    """Tokens the policy generated this turn (mask 1)."""
    agent_logprobs: list[float] | None = None
    """Per-token log-probs under the sampling policy, when asked for."""
    env_reply: EnvironmentReply | None = None
    env_token_ids: list[int] = field(default_factory=list)
    """Template + environment reply tokens appended after this turn (mask 0)."""
    generation_s: float = 0.0
    """Wall time of the policy batch that generated this turn (shared by the batch's trajectories)."""
    started_s: float = 0.0
    """When this turn's generation began, in seconds since the rollout started (the trace's timeline)."""
    env_wait_s: float = 0.0
    """Wall time from asking the environment to its reply: queueing for a free connection (the client's
    concurrency limit) plus the request itself (`env_reply.latency_s`)."""


@dataclass
class RewardBreakdown:
    """The double-constrained reward of one trajectory and every part of it (method.md)."""

    total: float
    format: float
    """R_fmt, already capped at eps."""
    answer: float
    """R_ans: max token-F1 against the gold answers (computed even when gated out)."""
    gated: bool
    """True when R_fmt reached the cap, so R_ans counted."""
    valid_intermediate_turns: int
    """sum of M_t over intermediate turns."""
    answer_tags: float
    """A_p"""
    answer_nonempty: float
    """A_n"""
    complete_final: float
    """C_f"""


@dataclass
class PromptItem:
    """One question to roll out: the rendered chat messages plus what scoring needs."""

    uid: str
    messages: list[dict[str, str]]
    """Chat messages given to the agent (the single Prompt-R1 user message)."""
    gold_answers: list[str]
    data_source: str
    question: str = ""


@dataclass(frozen=True)
class EvalRow:
    """One evaluation question, one type on both sides of the `build` stage.

    `data.sources.load_authors_eval` reads it from the authors' evaluation file (what `build` writes to
    `data/rl/eval/<dataset>.parquet`), and the evaluate stage reads it back from that file; both use the
    same fields, so the two readers cannot drift apart.
    """

    dataset: str
    split: str
    """`id` (a dataset the agent trains on) or `ood`."""
    index: int
    """Position of the row in its evaluation file."""
    id: str
    question: str
    """The bare question, without the Prompt-R1 template or a dataset instruction."""
    answers: list[str]
    """The gold answers (`reward_model.ground_truth`)."""
    messages: list[dict[str, str]]
    """The chat prompt as the file holds it (the single Prompt-R1 user message)."""
    has_instruction: bool = False
    """The user message carries its dataset's own instruction (DAPO's wrapper); read from the authors'
    file, where `build` checks that our template reproduces the message."""

    @property
    def prompt_content(self) -> str:
        """The text of the (first) user message: template, question and any dataset instruction."""
        return self.messages[0]["content"]


@dataclass
class Trajectory:
    """A whole multi-turn episode of the agent with the environment."""

    item: PromptItem
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    """All tokens after the prompt: agent turns and environment turns, in order."""
    response_mask: list[int] = field(default_factory=list)
    """1 on agent-generated tokens, 0 on environment/template tokens; same length as response_ids."""
    response_logprobs: list[float] | None = None
    """Sampling log-probs aligned with response_ids (0.0 on masked tokens), when asked for."""
    turns: list[Turn] = field(default_factory=list)
    stop_reason: StopReason = "max_turns"
    reward: RewardBreakdown | None = None
    usage: UsageStats = field(default_factory=UsageStats)
    generation_s: float = 0.0
    environment_s: float = 0.0
    wall_s: float = 0.0
    """This trajectory's own wall time: from the rollout's start to the moment it finished (it shares the
    batch's generation rounds, but stops at its own last turn)."""

    @property
    def answer(self) -> str:
        """The final answer ('' when the agent never gave one)."""
        if self.turns and self.turns[-1].parsed.answer is not None:
            return self.turns[-1].parsed.answer
        return ""

    @property
    def num_turns(self) -> int:
        return len(self.turns)
