"""The Prompt-R1 double-constrained reward (method.md, "Double-constrained reward"), in two presets.

    R_fmt = min(eps, alpha * sum_{t<T} M_t + beta * A_p + gamma * A_n + delta * C_f)
    R_ans = max over gold answers of token-F1(normalize(answer), normalize(gold))
    R     = -k + R_fmt + R_ans   if R_fmt == k   (k = eps)
            -k + R_fmt           otherwise

Presets are a registry: `@register_preset(name, coefficients)` on one scoring function
`(turns, gold_answers, coefficients) -> RewardBreakdown` adds one (`reward.preset`'s Literal in
`pipeline.config` must then name it). Any non-null coefficient in `RewardConfig` overrides the preset's.

- `paper` (the default) follows method.md. The indicators come from the protocol's parser
  (`ParsedTurn.valid_intermediate` = M_t, `has_answer_tags` = A_p, `answer_nonempty` = A_n,
  `complete_final` = C_f), so our parse rules live in one place (`pipeline.agent.protocol.parse_turn`).
  M_t is summed over turns 1..T-1; the last turn is the final one whatever it holds. R_ans is
  `pipeline.metrics.token_f1`, the function evaluation reports, computed even when gated out so logs show
  how good gated-out answers were. The gate compares with an absolute tolerance of 1e-9 and then snaps
  R_fmt to k: a sum equal to eps mathematically may land one ulp short (.7 + .2 + .1 = 0.9999999999999999).
  R_fmt moves in steps of one coefficient (>= 1e-6, enforced), so the tolerance admits no partial format.
- `released` reproduces exactly the reward of the authors' public code (QwenQKing/Prompt-R1,
  `promptr1_agent/src/reward_score/qa_em_and_format.py`, `compute_score_format_answer`), re-implemented
  from their rules. Their trainer (`AgentRewardManager`) decodes prompt + response with special tokens
  kept, cuts it at the first pad token (`<|endoftext|>`) and appends the eos (`<|im_end|>`) if missing;
  their function reads the assistant blocks `<|im_start|>assistant\\n(.*?)<|im_end|>` of that text.
  `released_view` renders our turns as that text in their Qwen3 layout (whatever our policy's template):
  a block holds the turn text as our rollout records it, `<think>\\n` opener + generated text, which is
  what their block holds (their environment wrapper ends every reply with `<|im_start|>assistant\\n
  <think>\\n`); between blocks, their user block. Their loop answers every call, even on its last allowed
  turn, so a trajectory whose last turn carries a call (`<interaction_prompt>…</interaction_prompt>`, as
  their environment detects one) ends, in their text, with a block holding only `<think>\\n`; we render
  it. `released_score` applies their rules to any such string: all blocks but the last are intermediate,
  their tag counts and anchored regexes (`$` also matches before one final newline), first-match answer
  extraction with `strip()`, plain SQuAD F1, the sum accumulated in their order (intermediate blocks, then
  beta, gamma, delta) and the exact float gate `min(R_fmt, 1.0) == 1.0`, total `(-1.0 + R_fmt) + R_ans`.

Where the presets parse differently (paper: method.md via `parse_turn`; released: their code):

| rule                  | paper                         | released                          | why (released) |
|-----------------------|-------------------------------|-----------------------------------|----------------|
| text parsed           | each turn's text              | assistant blocks of the rendered  | their regex on |
|                       |                               | chat; a literal `<|im_end|>` ends | the decoded    |
|                       |                               | a block, `<|endoftext|>` the      | text           |
|                       |                               | whole text                        |                |
| last turn carries a   | the final turn (no A_p, A_n,  | an intermediate turn; the final   | their loop     |
| call                  | C_f)                          | block is the `<think>\\n` opener  | answers it     |
|                       |                               | alone                             |                |
| whitespace around a   | ignored                       | none before `<think>`; at most    | `^…$`, no      |
| turn                  |                               | one newline after the last tag    | strip          |
| empty think or prompt | M_t = 0                       | M_t = 1                           | `(.*?)`        |
| (M_t)                 |                               |                                   |                |
| answer tags in an     | M_t = 0                       | allowed (only the counts of       | counts of four |
| intermediate turn     |                               | think/interaction tags and the    | tags only      |
|                       |                               | anchors matter)                   |                |
| empty or blank        | A_p = 1, A_n = 0, C_f         | A_p = A_n = C_f = 0               | A_p needs      |
| `<answer>`            | possible                      |                                   | content        |
| repeated tags in the  | C_f needs each tag once;      | C_f regex may span repeats; the   | no counts;     |
| final turn            | answer = first closed pair    | first `<answer>(.*?)</answer>`    | first match    |
|                       |                               | match decides A_p (an empty one   |                |
|                       |                               | hides the rest)                   |                |
| text between          | C_f = 0 (whitespace only)     | C_f = 1 (any text, interaction    | lazy `(.*?)`   |
| `</think>` and        |                               | tags included)                    |                |
| `<answer>`            |                               |                                   |                |
| gate R_fmt == k       | abs diff <= 1e-9, then        | exact float `==`                  | their code     |
|                       | snapped                       |                                   |                |
| R_ans                 | `token_f1`; a side            | only under A_p; plain SQuAD; 0    | `cal_f1_score` |
|                       | normalising to nothing is     | when a side normalises to nothing |                |
|                       | compared lower-cased          |                                   |                |

Neither preset reads the environment's replies: `released_view` leaves the reply out of the user block
(their regex would read a reply that itself holds `<|im_start|>assistant\\n…<|im_end|>`), so the reward is
a function of the agent's text only.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from pipeline.config import RewardConfig
from pipeline.metrics import normalize_answer, token_f1
from pipeline.types import ParsedTurn, RewardBreakdown, Trajectory

GATE_TOLERANCE = 1e-9
"""Absolute tolerance of the `paper` gate test R_fmt == k (see the module docstring)."""

_MIN_COEFFICIENT = 1e-6


@dataclass(frozen=True)
class RewardCoefficients:
    """Weights of the format reward and its cap (method.md symbols)."""

    alpha: float
    """Weight of each valid intermediate turn (M_t)."""
    beta: float
    """Weight of a parseable `<answer>…</answer>` in the final turn (A_p)."""
    gamma: float
    """Weight of a non-empty answer (A_n)."""
    delta: float
    """Weight of a complete final turn `<think>…</think><answer>…</answer>` (C_f)."""
    eps: float
    """Cap of R_fmt; also k, the offset and the gate threshold."""

    def validate(self) -> RewardCoefficients:
        for name in ("alpha", "beta", "gamma", "delta"):
            value = getattr(self, name)
            if value < 0 or 0 < value < _MIN_COEFFICIENT:
                raise ValueError(f"reward coefficient {name}={value}: must be 0 or >= {_MIN_COEFFICIENT}")
        if self.eps <= 0:
            raise ValueError(f"reward cap eps={self.eps}: must be > 0")
        return self


Scorer = Callable[[Sequence[ParsedTurn], Sequence[str], RewardCoefficients], RewardBreakdown]
"""A preset's reward: (turns, gold answers, coefficients) -> the breakdown."""

REWARD_PRESETS: dict[str, RewardCoefficients] = {}
"""Each preset's default coefficients."""
PRESET_SCORERS: dict[str, Scorer] = {}
"""Each preset's scoring function."""


def register_preset(name: str, coefficients: RewardCoefficients) -> Callable[[Scorer], Scorer]:
    """Decorator: add the decorated scoring function as preset `name` (selected with `reward.preset`)."""
    def add(scorer: Scorer) -> Scorer:
        REWARD_PRESETS[name] = coefficients.validate()
        PRESET_SCORERS[name] = scorer
        return scorer
    return add


def coefficients_for(cfg: RewardConfig | None) -> RewardCoefficients:
    """The preset named by `cfg.preset` with every non-null coefficient of `cfg` applied on top."""
    cfg = cfg or RewardConfig()
    try:
        base = REWARD_PRESETS[cfg.preset]
    except KeyError as exc:
        raise ValueError(f"unknown reward preset {cfg.preset!r}; known: {sorted(REWARD_PRESETS)}") from exc
    overrides = {k: getattr(cfg, k) for k in ("alpha", "beta", "gamma", "delta", "eps") if getattr(cfg, k) is not None}
    return replace(base, **overrides).validate()


def compute_reward(
    turns: Sequence[ParsedTurn], gold_answers: Sequence[str], cfg: RewardConfig | None = None
) -> RewardBreakdown:
    """The double-constrained reward of one trajectory and all its parts, under `cfg.preset`."""
    cfg = cfg or RewardConfig()
    coefficients = coefficients_for(cfg)
    return PRESET_SCORERS[cfg.preset](turns, list(gold_answers), coefficients)


def reward_for_trajectory(traj: Trajectory, cfg: RewardConfig | None = None) -> RewardBreakdown:
    """`compute_reward` over a rolled-out trajectory's parsed turns and its item's gold answers."""
    return compute_reward([t.parsed for t in traj.turns], traj.item.gold_answers, cfg)


def reward_parts(breakdown: RewardBreakdown, prefix: str = "") -> dict[str, float]:
    """Flat, numeric view of a breakdown (for verl's reward_extra_info, MLflow metrics, tables)."""
    parts = {
        "score": breakdown.total,
        "format": breakdown.format,
        "answer": breakdown.answer,
        "gated": float(breakdown.gated),
        "valid_intermediate_turns": float(breakdown.valid_intermediate_turns),
        "answer_tags": breakdown.answer_tags,
        "answer_nonempty": breakdown.answer_nonempty,
        "complete_final": breakdown.complete_final,
    }
    return {f"{prefix}{k}": v for k, v in parts.items()}


# ------------------------------------------------------------------------------------------ paper (method.md)
def format_reward(turns: Sequence[ParsedTurn], coefficients: RewardCoefficients) -> tuple[float, int, float, float, float]:
    """`paper`: (R_fmt before the gate snap, sum M_t, A_p, A_n, C_f) for one trajectory."""
    if not turns:
        return 0.0, 0, 0.0, 0.0, 0.0
    *intermediate, final = turns
    valid = sum(1 for t in intermediate if t.valid_intermediate)
    a_p = float(final.has_answer_tags)
    a_n = float(final.answer_nonempty)
    c_f = float(final.complete_final)
    c = coefficients
    raw = c.alpha * valid + c.beta * a_p + c.gamma * a_n + c.delta * c_f
    return min(c.eps, raw), valid, a_p, a_n, c_f


def answer_reward(turns: Sequence[ParsedTurn], gold_answers: Sequence[str]) -> float:
    """`paper`: token F1 of the final turn's answer, max over gold answers (0 without an answer)."""
    if not turns or turns[-1].answer is None:
        return 0.0
    return token_f1(turns[-1].answer, list(gold_answers))


@register_preset("paper", RewardCoefficients(alpha=0.25, beta=0.3, gamma=0.4, delta=0.3, eps=1.5))
def paper_reward(
    turns: Sequence[ParsedTurn], gold_answers: Sequence[str], c: RewardCoefficients
) -> RewardBreakdown:
    """method.md's reward over the protocol parser's flags."""
    r_fmt, valid, a_p, a_n, c_f = format_reward(turns, c)
    r_ans = answer_reward(turns, gold_answers)
    k = c.eps
    gated = math.isclose(r_fmt, k, rel_tol=0.0, abs_tol=GATE_TOLERANCE)
    if gated:
        r_fmt = k
    total = -k + r_fmt + r_ans if gated else -k + r_fmt
    return RewardBreakdown(total=total, format=r_fmt, answer=r_ans, gated=gated,
                           valid_intermediate_turns=valid, answer_tags=a_p, answer_nonempty=a_n, complete_final=c_f)


# ------------------------------------------------------------------------------- released (the authors' code)
# Their literals: the Qwen3 ChatML markers and tags their regexes and environment wrapper hard-code. Kept
# here rather than taken from `pipeline.agent.protocol`, which may change; theirs do not.
RELEASED_OPENER = "<think>\n"
"""What their environment wrapper puts at the start of every assistant block after a reply."""
_HEADER = "<|im_start|>assistant\n"
_EOS = "<|im_end|>"
_PAD = "<|endoftext|>"
_USER_BLOCK = "\n<|im_start|>user\n<interaction_response>\n\n</interaction_response><|im_end|>\n"
_BLOCK = re.compile(r"<\|im_start\|>assistant\n(.*?)<\|im_end\|>", re.DOTALL)
_CALL = re.compile(r"<interaction_prompt>(.*?)</interaction_prompt>", re.DOTALL)
_INTERMEDIATE_TAGS = ("<think>", "</think>", "<interaction_prompt>", "</interaction_prompt>")
_INTERMEDIATE = re.compile(
    r"^<think>(.*?)</think>(\s*)<interaction_prompt>(.*?)</interaction_prompt>$", re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_COMPLETE = re.compile(r"^<think>(.*?)</think>(.*?)<answer>(.*?)</answer>$", re.DOTALL)


def released_view(turn_texts: Sequence[str]) -> str:
    """The text their reward function receives for these agent turns (see the module docstring).

    Each turn text is one assistant block; blocks are separated by their user block (the reply left out);
    a last turn carrying a call is followed by a block holding only their opener. Like their reward
    manager, the text is cut at the first pad token and closed with the eos when it does not end with it.
    """
    texts = [t if isinstance(t, str) else "" for t in turn_texts]
    if texts and _CALL.search(texts[-1]):
        texts.append(RELEASED_OPENER)
    view = (_EOS + _USER_BLOCK).join(_HEADER + t for t in texts).split(_PAD)[0]
    return view if view.endswith(_EOS) else view + _EOS


def released_f1(prediction: str, gold_answers: Sequence[str]) -> float:
    """Their token F1: SQuAD normalisation on both sides, multiset overlap, max over golds from 0."""
    pred = normalize_answer(prediction).split()
    best = 0.0
    for gold in gold_answers:
        gold_tokens = normalize_answer(gold).split()
        same = sum((Counter(pred) & Counter(gold_tokens)).values())
        if same:
            precision, recall = same / len(pred), same / len(gold_tokens)
            best = max(best, 2 * precision * recall / (precision + recall))
    return best


def released_score(solution: str, gold_answers: Sequence[str], c: RewardCoefficients) -> RewardBreakdown:
    """Their `compute_score_format_answer` on any solution string, as a breakdown."""
    blocks = _BLOCK.findall(solution or "")
    r_fmt, valid, a_p, a_n, c_f, r_ans = 0.0, 0, 0.0, 0.0, 0.0, 0.0
    if blocks:
        for block in blocks[:-1]:
            if all(block.count(tag) == 1 for tag in _INTERMEDIATE_TAGS) and _INTERMEDIATE.search(block):
                r_fmt += c.alpha
                valid += 1
        last = blocks[-1]
        first = _ANSWER.search(last)
        answer = first.group(1).strip() if first else ""
        if answer:  # A_p needs the first match non-empty; A_n re-reads the same match, so it holds too
            r_fmt += c.beta
            r_fmt += c.gamma
            a_p = a_n = 1.0
            if _COMPLETE.search(last):
                r_fmt += c.delta
                c_f = 1.0
            r_ans = released_f1(answer, gold_answers)
    r_fmt = min(r_fmt, c.eps)
    gated = r_fmt == c.eps
    total = -c.eps + r_fmt + r_ans if gated else -c.eps + r_fmt
    return RewardBreakdown(total=total, format=r_fmt, answer=r_ans, gated=gated,
                           valid_intermediate_turns=valid, answer_tags=a_p, answer_nonempty=a_n, complete_final=c_f)


@register_preset("released", RewardCoefficients(alpha=0.4, beta=0.25, gamma=0.25, delta=0.1, eps=1.0))
def released_reward(
    turns: Sequence[ParsedTurn], gold_answers: Sequence[str], c: RewardCoefficients
) -> RewardBreakdown:
    """The authors' released reward on the view their trainer has of these turns."""
    return released_score(released_view([t.text for t in turns]), gold_answers, c)
