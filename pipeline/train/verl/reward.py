"""verl's `reward.custom_reward_function` entry point: the Prompt-R1 reward for one trajectory.

verl 0.9.1's reward loop calls `compute_score(data_source, solution_str, ground_truth, extra_info, **kw)`
with `kw` = `reward.custom_reward_function.reward_kwargs` (our preset and coefficients, written by
`pipeline.train.verl.overrides.build_overrides`). It returns a dict: `score` is the reward, every other key is
logged by verl as reward extra info (`format`, `answer`, `gated`, each indicator, the number of agent turns).

Where the turns come from:
- `extra_info["prompt_r1_turns"]`, the exact texts of the agent's turns that our agent loop put in its
  `extra_fields` (verl merges those into `extra_info`). This is the normal path.
- Otherwise `solution_str` (the decoded response, special tokens skipped) is split back into turns at the
  `<interaction_response>…</interaction_response>` blocks. Decoding leaves the chat template's role words
  ("user", "assistant") around those blocks; they are stripped, and each turn gets the `<think>\\n` opener
  the template supplied. This fallback is best effort: it can differ from the agent loop's own turns when
  the template's markers are not special tokens.

The file is loaded by path (verl's `load_extern_object`), so it imports everything from the installed
`pipeline` package and holds no logic of its own beyond the two points above.
"""

from __future__ import annotations

import re
from typing import Any

from pipeline.agent.protocol import RESPONSE_CLOSE, RESPONSE_OPEN, THINK_OPEN, THINK_OPENER, parse_turn
from pipeline.config import RewardConfig
from pipeline.reward import compute_reward, reward_parts
from pipeline.types import ParsedTurn

TURNS_FIELD = "prompt_r1_turns"
"""extra_info key with the agent turns' texts (set by the agent loop's extra_fields)."""
_ENV_BLOCK = re.compile(re.escape(RESPONSE_OPEN) + r".*?" + re.escape(RESPONSE_CLOSE), re.DOTALL)
_LEADING_ROLE = re.compile(r"^\s*(?:assistant|model)\s*\n", re.IGNORECASE)
_TRAILING_ROLE = re.compile(r"\n\s*(?:user|human)\s*$", re.IGNORECASE)


def split_trajectory_text(solution_str: str) -> list[ParsedTurn]:
    """Agent turns recovered from a decoded multi-turn response (see the module docstring)."""
    segments = _ENV_BLOCK.split(solution_str or "")
    turns: list[ParsedTurn] = []
    for index, segment in enumerate(segments):
        if index > 0:
            segment = _LEADING_ROLE.sub("", segment)
        if index < len(segments) - 1:
            segment = _TRAILING_ROLE.sub("", segment.rstrip())
        segment = segment.strip("\n")
        if index == len(segments) - 1 and index > 0 and not segment.strip():
            continue  # the response ended right after an environment reply
        if not segment.lstrip().startswith(THINK_OPEN):
            segment = THINK_OPENER + segment
        turns.append(parse_turn(segment))
    return turns


def as_answer_list(truth: Any) -> list[str]:
    """A gold answer value from parquet (str, list, numpy array, None) as a list of strings."""
    if truth is None:
        return []
    if isinstance(truth, str):
        return [truth]
    if hasattr(truth, "tolist"):
        truth = truth.tolist()
    if isinstance(truth, list | tuple):
        return [str(t) for t in truth if t is not None]
    return [str(truth)]


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict[str, Any] | None = None,
    *,
    preset: str = "paper",
    alpha: float | None = None,
    beta: float | None = None,
    gamma: float | None = None,
    delta: float | None = None,
    eps: float | None = None,
    **_: Any,
) -> dict[str, float]:
    """The double-constrained reward of one trajectory and its parts (verl's reward function contract)."""
    cfg = RewardConfig(preset=preset, alpha=alpha, beta=beta, gamma=gamma, delta=delta, eps=eps)
    texts = (extra_info or {}).get(TURNS_FIELD)
    if texts is not None:
        if hasattr(texts, "tolist"):
            texts = texts.tolist()
        turns = [parse_turn(t) for t in texts]
    else:
        turns = split_trajectory_text(solution_str)
    breakdown = compute_reward(turns, as_answer_list(ground_truth), cfg)
    return {**reward_parts(breakdown), "num_agent_turns": float(len(turns))}
