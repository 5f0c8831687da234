"""`agent.max_turn_tokens` reaches every conversation loop through the one serialised `AgentConfig`.

Changed in params, the turn length is what the local training loop generates under, what verl's agent loop
asks its server for (the `prompt_r1` block verl carries to its workers), and, as
`evaluate.agent_max_turn_tokens` (`config.evaluated_agent`), what evaluation and the registered pyfunc model
generate under. A serialised agent block that lacks a key is an error naming it: no loop falls back to a
default of its own.

Real parts: the tiny random Llama (conftest `tiny_llama_dir`, SmolLM2's tokenizer) as the agent, the local
trainer's own rollout, verl's trainer config composed from our overrides and the loop instantiated as verl's
worker does, the pyfunc loaded from the model config the register stage logs, and the fault-injecting test
server (`echo: …`) as the environment. verl's LLM server is a recording stand-in that answers at once.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch
from helpers import REPO_ROOT, tiny_overrides, verl_agent_loop, write_train_parquet
from omegaconf import OmegaConf, open_dict

from pipeline.config import load_params
from pipeline.train.plan import TrainPlan

TURN_TOKENS = 7
"""`agent.max_turn_tokens` here: neither params.yaml's 96 nor any loop's own default."""
EVAL_TURN_TOKENS = 5
"""`evaluate.agent_max_turn_tokens` here: the evaluated and registered agent's turn length."""


@pytest.fixture()
def params(tmp_path, tiny_llama_dir, env_server):
    overrides = tiny_overrides(tmp_path, tiny_llama_dir, env_server)
    overrides["profile"] = "paper"  # verl's model is a Hugging Face directory; the paper profile trains one
    overrides["agent"].update(max_turn_tokens=TURN_TOKENS, max_response_tokens=200, max_prompt_tokens=1024)
    overrides["evaluate"] = {"agent_max_turn_tokens": EVAL_TURN_TOKENS}
    write_train_parquet(tmp_path / "data/rl/train.parquet")
    return load_params(REPO_ROOT / "params.yaml", overrides)


def test_the_local_training_loop_generates_turns_of_agent_max_turn_tokens(params):
    from pipeline.environment.client import EnvironmentClient
    from pipeline.train.local.models import load_policy_models
    from pipeline.train.local.questions import QuestionSampler, load_training_set
    from pipeline.train.local.trainer import LocalTrainer

    plan = TrainPlan.from_params(params)
    models = load_policy_models(plan.require_agent_model(), plan.agent, plan.train, None, torch.device("cpu"))
    frame = load_training_set(plan.train_file)
    trainer = LocalTrainer(plan, models, frame, torch.device("cpu"), QuestionSampler(len(frame), params.seed))
    env = EnvironmentClient(plan.environment)
    try:
        trajectories = trainer.rollout(env, trainer.draw_items(), 1)
    finally:
        asyncio.run(env.aclose())
    lengths = [len(turn.agent_token_ids) for t in trajectories for turn in t.turns]
    # a random model writes no tags, so its first turn runs to the limit (unless it samples an end token)
    assert max(lengths) == TURN_TOKENS and all(n <= TURN_TOKENS for n in lengths), lengths


class RecordingServer:
    """verl's LLM server client stand-in: records each request's token limit, answers one closed turn."""

    def __init__(self, tokenizer: Any):
        self.ids = tokenizer.encode(
            "A turn longer than the limit.</think>\n<answer>Paris</answer>", add_special_tokens=False
        )
        self.max_tokens: list[int] = []

    async def generate(
        self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any], **kwargs: Any
    ) -> Any:
        from verl.workers.rollout.replica import TokenOutput

        self.max_tokens.append(sampling_params["max_tokens"])
        return TokenOutput(token_ids=self.ids, log_probs=[-0.5] * len(self.ids), num_preempted=0)


def verl_loop(config, tokenizer, server):
    return verl_agent_loop(config, server, tokenizer)


def test_verl_loop_reads_the_serialised_agent_config(params, tiny_llama_dir):
    from transformers import AutoTokenizer
    from verl_cpu import compose_verl

    from pipeline.train.verl.overrides import build_overrides
    from pipeline.train.verl.worker_client import LoopSettings

    overrides = build_overrides(TrainPlan.from_params(params))
    lacking = compose_verl(overrides)
    with open_dict(lacking):  # a block written by something else: no default fills the gap
        del lacking.prompt_r1.agent["max_turn_tokens"]
    with pytest.raises(ValueError, match="prompt_r1.agent lacks max_turn_tokens"):
        LoopSettings.from_trainer_config(lacking)

    config = compose_verl(overrides)
    assert OmegaConf.to_container(config.prompt_r1.agent) == params.agent.model_dump(mode="json")
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama_dir))
    server = RecordingServer(tokenizer)
    out = asyncio.run(
        verl_loop(config, tokenizer, server).run(
            {"temperature": 1.0, "top_p": 1.0, "logprobs": True},
            raw_prompt=np.array([{"role": "user", "content": "Question: capital of France?"}], dtype=object),
            reward_model={"ground_truth": np.array(["Paris"], dtype=object), "style": "rule"},
            extra_info={"id": "q1", "index": 0},
            data_source="hotpotqa",
            agent_name="prompt_r1",
            index=0,
        )
    )
    assert server.max_tokens == [TURN_TOKENS]
    assert sum(out.response_mask) == TURN_TOKENS  # the loop keeps what the limit allows of a longer turn


def pyfunc_context(params, agent_dir: Path, tmp_path: Path, **agent_changes: Any):
    """The pyfunc's load context from what the register stage logs (`_agent_model_config`)."""
    from mlflow.pyfunc import PythonModelContext

    from pipeline.stages.register import _agent_model_config, environment_json

    env_file = tmp_path / "environment.json"
    env_file.write_text(json.dumps(environment_json(params)))
    config = _agent_model_config(params)
    config.update(agent_engine="transformers", cache_dir=str(tmp_path / "cache"))
    config["agent"].update(agent_changes)
    for key in [k for k, v in agent_changes.items() if v is None]:
        del config["agent"][key]
    return PythonModelContext(
        artifacts={"agent": str(agent_dir), "environment": str(env_file)}, model_config=config
    )


def test_the_registered_pyfunc_serves_the_evaluated_agent_config(params, tiny_llama_dir, tmp_path):
    from pipeline.serving.agent_model import PromptR1Agent

    with pytest.raises(ValueError, match="model_config agent lacks max_turn_tokens"):
        PromptR1Agent().load_context(pyfunc_context(params, tiny_llama_dir, tmp_path, max_turn_tokens=None))

    model = PromptR1Agent()
    model.load_context(pyfunc_context(params, tiny_llama_dir, tmp_path))
    # the evaluated agent (config.evaluated_agent): params' agent with evaluation's turn length
    assert model.agent_cfg == params.agent.model_copy(update={"max_turn_tokens": EVAL_TURN_TOKENS})
    out = model.predict(None, pd.DataFrame({"question": ["What is the capital of France?"]}))
    turns = json.loads(out["trajectory"][0])
    assert turns and turns[0]["agent_tokens"] == EVAL_TURN_TOKENS, turns
