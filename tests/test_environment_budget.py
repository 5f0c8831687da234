"""The reply budget rule (pipeline/environment/budget.py) as `promptr1 check` applies it, and the GPU profiles'
deliberate environment settings (reasoning effort, timeout, declared decode speed)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pipeline.checks.layout import LayoutError, assert_runnable, layout_problems
from pipeline.config import load_params
from pipeline.environment.budget import longest_reply_tokens, reply_budget_problems

ROOT = Path(__file__).resolve().parents[1]
BUDGET_KEYS = ("environment.timeout_s", "environment.max_tokens", "environment.length_retry_factor",
               "environment.decode_tokens_per_s")
GPU_PROFILES = ("paper", "paper-1node", "smoke-1gpu", "api")


def problems_by_keys(params) -> dict[tuple[str, ...], str]:
    return {p.keys: p.message for p in layout_problems(params)}


def test_a_length_retry_that_cannot_finish_within_the_timeout_is_refused():
    """The paper profile as it was: 2048 x 4 tokens under a 60 s timeout, at the profile's declared speed."""
    params = load_params(ROOT / "params.yaml", {"profile": "paper", "environment": {"timeout_s": 60}})
    message = problems_by_keys(params)[BUDGET_KEYS]
    assert "2048 x 4 = 8192 tokens" in message and "205 s" in message and "timeout_s to >= 205" in message
    with pytest.raises(LayoutError, match="environment.timeout_s"):
        assert_runnable(params)


@pytest.mark.parametrize(("timeout_s", "refused"), [(40.0, False), (39.9, True)])
def test_the_rule_is_tokens_over_speed_against_the_timeout(timeout_s, refused):
    params = load_params(ROOT / "params.yaml", {"environment": {
        "max_tokens": 100, "length_retry_factor": 4.0, "decode_tokens_per_s": 10.0, "timeout_s": timeout_s}})
    assert longest_reply_tokens(params.environment) == 400
    assert (BUDGET_KEYS in problems_by_keys(params)) is refused


def test_a_gpt_oss_environment_must_choose_its_reasoning_effort():
    params = load_params(ROOT / "params.yaml", {"profile": "paper", "environment": {"reasoning_effort": None}})
    assert "reasoning_effort is unset" in problems_by_keys(params)[("environment.reasoning_effort",)]
    # the same model through an API (a paid GPT-OSS endpoint) is judged the same way
    params.environment.backend, params.environment.base_url = "api", "https://x.test/v1"
    assert ("environment.reasoning_effort",) in problems_by_keys(params)
    params.environment.reasoning_effort = "high"
    assert reply_budget_problems(params.environment) == []


@pytest.mark.parametrize("profile", ["default", "learn", *GPU_PROFILES])
def test_shipped_profiles_fit_their_reply_budget(profile):
    overrides = {} if profile == "default" else {"profile": profile}
    params = load_params(ROOT / "params.yaml", overrides)
    env = params.environment
    assert reply_budget_problems(params.environment) == []
    assert longest_reply_tokens(params.environment) / env.decode_tokens_per_s <= env.timeout_s


@pytest.mark.parametrize("profile", GPU_PROFILES)
def test_gpu_profiles_state_their_environment_settings_deliberately(profile):
    """Each GPU profile names reasoning_effort, its decode speed and its timeout itself (not params.yaml's)."""
    environment = yaml.safe_load((ROOT / "profiles" / f"{profile}.yaml").read_text())["environment"]
    assert {"reasoning_effort", "decode_tokens_per_s", "timeout_s"} <= set(environment), profile
    expected = "low" if "gpt-oss" in environment["model"] else None  # GPT-OSS: short thinking; others: none
    assert environment["reasoning_effort"] == expected
