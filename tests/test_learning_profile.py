"""The `learn` profile (profiles/learn.yaml): what the learning experiment promises, held by its params, and the
guards that keep it honest: it never moves the production `champion`, and its format warm-up does not teach
the skill the experiment measures (demonstrations with withheld environment replies)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from pipeline.config import load_params
from pipeline.errors import UserError
from pipeline.stages.register import PRODUCTION_ALIAS, check_production_alias, run_register
from pipeline.train.local.demonstrations import WITHHELD_REPLY, build_demonstrations
from pipeline.train.plan import TrainPlan

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture()
def learn():
    return load_params(REPO_ROOT / "params.yaml", {"profile": "learn"})


def test_learn_profile_is_the_experiment_the_issue_asks_for(learn):
    assert learn.environment.backend == "knowledge"
    assert learn.environment.port != load_params(REPO_ROOT / "params.yaml").environment.port  # never reuse llama.cpp
    assert learn.reward.preset == "released"
    assert learn.train.backend == "local" and learn.train.steps >= 12
    assert learn.agent.model == load_params(REPO_ROOT / "params.yaml").agent.model  # the real SmolLM2 agent
    assert learn.train.warmup.replies == "withheld"
    assert learn.train.warmup.request == "verbatim"  # framing words would put every request over terse's limit
    # held-out = the authors' evaluation rows of the trained datasets; the knowledge server knows both
    assert set(learn.data.id_eval_datasets) <= set(learn.data.train_datasets)
    assert {"data/rl/train.parquet", "data/rl/eval"} <= set(learn.environment.knowledge.sources)
    assert learn.register.alias != PRODUCTION_ALIAS
    assert learn.register.model_name != load_params(REPO_ROOT / "params.yaml").register.model_name


def test_register_refuses_to_move_champion_for_the_learn_profile(learn, tmp_path):
    learn.register.alias = PRODUCTION_ALIAS
    learn.paths.model_dir = str(tmp_path / "missing-model")  # refused before this is even looked at
    with pytest.raises(UserError, match="may not move the production alias"):
        run_register(learn)
    default = load_params(REPO_ROOT / "params.yaml")
    check_production_alias(default.profile, default.register)  # the default profile may


class _CountingEnvironment:
    def __init__(self) -> None:
        self.calls = 0

    async def reply(self, history, prompt):
        from pipeline.types import EnvironmentReply

        self.calls += 1
        return EnvironmentReply(text="the answer is Paris, as my notes say")


@pytest.mark.parametrize("replies", ["environment", "withheld"])
def test_warmup_demonstrations_with_withheld_replies_never_show_the_answer(learn, tiny_llama_dir, replies):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    frame = pd.DataFrame([{
        "data_source": "hotpotqa", "prompt": [{"role": "user", "content": "Question: What is the capital of France?"}],
        "reward_model": {"ground_truth": ["Paris"], "style": "rule"},
        "extra_info": {"id": "q0", "question": "What is the capital of France?"},
    }])
    learn.train.warmup.replies = replies
    env = _CountingEnvironment()
    from pipeline.train.local.questions import prompt_item_from_row

    demos = build_demonstrations(TrainPlan.from_params(learn), frame, tokenizer, env, 1, prompt_item_from_row)
    (demo,) = demos
    env_text = tokenizer.decode([t for t, m in zip(demo.response_ids, demo.response_mask, strict=True) if m == 0])
    agent_text = tokenizer.decode([t for t, m in zip(demo.response_ids, demo.response_mask, strict=True) if m == 1])
    assert agent_text.endswith("<answer>Paris</answer>")
    if replies == "withheld":
        assert env.calls == 0 and WITHHELD_REPLY in env_text and "Paris" not in env_text
    else:
        assert env.calls == 1 and "the answer is Paris" in env_text


def test_learn_hops_extends_learn_and_registers_where_learn_does(learn):
    hops = load_params(REPO_ROOT / "params.yaml", {"profile": "learn-hops"})
    # what the hops experiment changes
    assert hops.environment.knowledge.mode == "hops" and hops.agent.max_turns == 3
    assert hops.reward.preset == "released"
    assert hops.data.train_datasets == hops.data.id_eval_datasets == ["hops"]
    w = hops.train.warmup
    assert (w.replies, w.followup, w.require_followup, w.interaction_turns) == ("environment", "reask", True, 2)
    # what it inherits from learn: its registered model name and alias (never champion), its training settings
    assert (hops.register.model_name, hops.register.alias) == (learn.register.model_name, learn.register.alias)
    assert hops.register.alias != PRODUCTION_ALIAS
    assert hops.train.model_dump(exclude={"warmup"}) == learn.train.model_dump(exclude={"warmup"})
    assert hops.environment.port == learn.environment.port and hops.mlflow.experiment == learn.mlflow.experiment
    hops.paths.model_dir = "missing-model"
    with pytest.raises(UserError, match="may not move the production alias"):
        hops.register.alias = PRODUCTION_ALIAS
        run_register(hops)


def test_profile_extends_merges_over_its_base_and_refuses_loops(tmp_path):
    from pipeline.config.loading import ConfigError

    (tmp_path / "profiles").mkdir()
    (tmp_path / "params.yaml").write_text((REPO_ROOT / "params.yaml").read_text(encoding="utf-8"), encoding="utf-8")
    (tmp_path / "profiles" / "base.yaml").write_text("seed: 7\ntrain:\n  steps: 5\n  lr: 0.5\n", encoding="utf-8")
    (tmp_path / "profiles" / "child.yaml").write_text("extends: base\ntrain:\n  lr: 0.25\n", encoding="utf-8")
    child = load_params(tmp_path / "params.yaml", {"profile": "child"})
    assert (child.seed, child.train.steps, child.train.lr) == (7, 5, 0.25)
    (tmp_path / "profiles" / "base.yaml").write_text("extends: child\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="loops"):
        load_params(tmp_path / "params.yaml", {"profile": "child"})
    (tmp_path / "profiles" / "child.yaml").write_text("extends: [base]\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="must name one profile"):
        load_params(tmp_path / "params.yaml", {"profile": "child"})


def test_every_profile_trains_on_datasets_dvc_samples():
    """`dvc exp run -S profile=<p>` samples p's datasets: DVC expands the sample stage from params.yaml's
    data.sample_datasets (never from a profile), so each profile's train_datasets must have a stage there."""
    import subprocess
    import sys

    from pipeline.config.loading import ConfigError

    listed = subprocess.run([sys.executable, "-m", "dvc", "stage", "list"], cwd=REPO_ROOT, capture_output=True,
                            text=True, check=True)
    sampled = {line.split()[0].split("@", 1)[1] for line in listed.stdout.splitlines() if line.startswith("sample@")}
    assert "hops" in sampled
    for profile in sorted((REPO_ROOT / "profiles").glob("*.yaml")):
        params = load_params(REPO_ROOT / "params.yaml", {"profile": profile.stem})
        assert set(params.data.train_datasets) <= sampled, profile.name
    with pytest.raises(ConfigError, match=r"data\.sample_datasets"):
        load_params(REPO_ROOT / "params.yaml", {"data": {"sample_datasets": ["gsm8k"]}})
