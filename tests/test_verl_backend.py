"""The verl backend's generated overrides against verl's own Hydra config (ppo_trainer.yaml), and its launcher.

Composition uses the installed verl 0.9.1's config folder through Hydra's compose API, then verl's own
`validate_config`, so a renamed or retyped key in verl fails here rather than on a GPU cluster.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
from fault_server import FaultServer
from omegaconf import OmegaConf
from verl_cpu import compose_verl

from pipeline.config import load_params
from pipeline.config.specs import tracking_spec
from pipeline.errors import DataError, UserError
from pipeline.train.plan import TrainPlan
from pipeline.train.verl import backend as verl_backend
from pipeline.train.verl.overrides import (
    AGENT_LOOP_CONFIG,
    REWARD_FUNCTION_FILE,
    build_overrides,
    hydra_value,
)
from pipeline.train.verl.steps import Launch, export_steps_csv

REPO_ROOT = Path(__file__).resolve().parents[1]


def run_verl(params, run):
    """`verl_backend.run_verl` as the train stage calls it: the plan and the tracking URI of these params."""
    from pipeline.tracking.runs import tracking_uri

    return verl_backend.run_verl(TrainPlan.from_params(params), tracking_uri(tracking_spec(params)), run)


@pytest.fixture()
def paper_params():
    return load_params(REPO_ROOT / "params.yaml", {"profile": "paper"})


def test_overrides_compose_with_verl_config_and_equal_params(paper_params):
    p = paper_params
    cfg = compose_verl(build_overrides(TrainPlan.from_params(p)))
    arr, actor, rollout = cfg.actor_rollout_ref, cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout

    assert cfg.algorithm.adv_estimator == "grpo"
    assert rollout.n == p.train.group_size == 5
    assert actor.use_kl_loss is True and actor.kl_loss_coef == 0.001 and actor.kl_loss_type == "low_var_kl"
    assert actor.optim.lr == p.train.lr == 1e-6
    assert cfg.data.train_batch_size == 128 and actor.ppo_mini_batch_size == 64
    assert actor.ppo_micro_batch_size_per_gpu == 2
    assert rollout.log_prob_micro_batch_size_per_gpu == 2 and arr.ref.log_prob_micro_batch_size_per_gpu == 2
    assert cfg.data.max_prompt_length == 8192 and cfg.data.max_response_length == 8192
    assert rollout.prompt_length == 8192 and rollout.response_length == 8192  # verl's interpolations resolve
    assert rollout.multi_turn.enable is True and rollout.multi_turn.max_assistant_turns == 5
    assert rollout.name == "vllm" and rollout.tensor_model_parallel_size == 8
    assert rollout.gpu_memory_utilization == 0.6
    assert rollout.agent.agent_loop_config_path == str(AGENT_LOOP_CONFIG)
    assert rollout.agent.default_agent_loop == "prompt_r1"
    assert cfg.reward.custom_reward_function.path == str(REWARD_FUNCTION_FILE)
    assert cfg.reward.custom_reward_function.name == "compute_score"
    assert OmegaConf.to_container(cfg.reward.custom_reward_function.reward_kwargs) == {"preset": "paper"}
    assert cfg.trainer.n_gpus_per_node == 8 and cfg.trainer.nnodes == 1
    assert cfg.trainer.save_freq == 10 and cfg.trainer.test_freq == 10 and cfg.trainer.val_before_train is True
    assert cfg.trainer.total_epochs == 1 and cfg.trainer.resume_mode == "auto"
    assert cfg.trainer.default_local_dir == str((p.root / "checkpoints/agent").resolve())
    assert list(cfg.trainer.logger) == ["console", "mlflow"]
    assert cfg.trainer.use_v1 is False
    assert cfg.data.train_files == str((p.root / "data/rl/train.parquet").resolve())
    assert [Path(f).name for f in cfg.data.val_files] == [f"{d}.parquet" for d in p.eval_datasets]
    assert arr.model.path == "Qwen/Qwen3-4B" and arr.model.enable_gradient_checkpointing is True
    # the block our agent-loop workers read, system prompt (commas, parentheses) intact
    assert cfg.prompt_r1.environment.system_prompt == p.environment.system_prompt
    assert cfg.prompt_r1.environment.served_name == "gpt-oss-20b"
    assert cfg.prompt_r1.agent.max_turns == 5 and cfg.prompt_r1.agent.max_turn_tokens == 1024


def test_composed_config_passes_verl_validation(paper_params):
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    cfg = compose_verl(build_overrides(TrainPlan.from_params(paper_params)))
    assert need_reference_policy(cfg) is True  # KL loss needs the frozen reference
    assert need_critic(cfg) is False  # GRPO: no critic
    validate_config(cfg, use_reference_policy=True, use_critic=False)


def test_every_fsdp_role_runs_the_pinned_fsdp2(paper_params):
    """The strategy the checkpoint test exercises (tests/test_verl_checkpoint.py) is the one verl runs: each
    role's dataclass (what verl's workers build) hands fsdp2 to its FSDP engine config."""
    from verl.utils.config import omega_conf_to_dataclass

    cfg = compose_verl(build_overrides(TrainPlan.from_params(paper_params)))
    arr = cfg.actor_rollout_ref
    assert arr.actor.strategy == arr.ref.strategy == cfg.critic.strategy == "fsdp2"
    # the reference's config as verl's engine_workers.ActorRolloutRefWorker.init_model rewrites it
    ref = OmegaConf.create(OmegaConf.to_container(arr.ref, resolve=True))
    ref.ppo_mini_batch_size = arr.actor.ppo_mini_batch_size
    for old, new in (("log_prob_micro_batch_size", "ppo_micro_batch_size"),
                     ("log_prob_micro_batch_size_per_gpu", "ppo_micro_batch_size_per_gpu"),
                     ("log_prob_use_dynamic_bsz", "use_dynamic_bsz"),
                     ("log_prob_max_token_len_per_gpu", "ppo_max_token_len_per_gpu")):
        ref[new] = ref.pop(old, None)
    for role in (arr.actor, ref):  # (the critic's dataclass would load its model: GRPO never builds one)
        assert omega_conf_to_dataclass(role).engine.strategy == "fsdp2"


def test_driver_offline_variables_reach_every_ray_worker():
    driver = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HOME": "/cache/hf",
              "TIKTOKEN_ENCODINGS_BASE": "/cache/hf/tiktoken-encodings", "HF_DATASETS_OFFLINE": "",
              "PATH": "/usr/bin", "PROMPTR1_ENV_API_KEY": "sk-secret"}
    overrides = verl_backend.offline_runtime_env_overrides(driver)
    env_vars = OmegaConf.to_container(compose_verl(overrides).ray_kwargs.ray_init.runtime_env.env_vars)
    assert env_vars == {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HOME": "/cache/hf",
                        "TIKTOKEN_ENCODINGS_BASE": "/cache/hf/tiktoken-encodings"}


def test_agent_loop_yaml_registers_our_loop():
    entries = OmegaConf.load(AGENT_LOOP_CONFIG)
    assert [e.name for e in entries] == ["prompt_r1"]
    module, _, cls = entries[0]["_target_"].rpartition(".")
    assert getattr(importlib.import_module(module), cls).__name__ == "PromptR1AgentLoop"


def test_reward_coefficients_and_extra_overrides(paper_params):
    p = paper_params
    p.reward.preset = "released"
    p.reward.eps = 2.0
    p.train.lora.enabled = True
    p.train.verl.extra_overrides = ["actor_rollout_ref.rollout.agent.num_workers=16", "trainer.save_freq=5"]
    cfg = compose_verl(build_overrides(TrainPlan.from_params(p)))
    assert OmegaConf.to_container(cfg.reward.custom_reward_function.reward_kwargs) == {
        "preset": "released", "eps": 2.0}
    assert cfg.actor_rollout_ref.rollout.agent.num_workers == 16
    assert cfg.trainer.save_freq == 5  # extra overrides come last and win
    assert cfg.actor_rollout_ref.model.lora_rank == 16
    assert list(cfg.actor_rollout_ref.model.target_modules) == ["q_proj", "k_proj", "v_proj", "o_proj"]


@pytest.mark.parametrize("text", [
    "plain", "it's (a) test, with commas", 'double "quotes"', "back\\slash \\' quote", "ends with \\",
    "no ${interpolation} here", "multi\nline", "",
])
def test_hydra_value_round_trips_any_string(text):
    cfg = compose_verl([f"+prompt_r1.probe={hydra_value(text)}"])
    assert cfg.prompt_r1.probe == text


def test_gguf_agent_is_refused_for_verl():
    params = load_params(REPO_ROOT / "params.yaml")  # default profile: the bundled SmolLM2 GGUF
    with pytest.raises(UserError, match="GGUF"):
        build_overrides(TrainPlan.from_params(params))


def test_preflight_errors(paper_params, tmp_path):
    p = paper_params
    p.root = tmp_path
    run = SimpleNamespace(info=SimpleNamespace(run_id="0" * 32))
    with pytest.raises(DataError, match="train.parquet"):
        run_verl(p, run)
    (tmp_path / "data/rl/eval").mkdir(parents=True)
    (tmp_path / "data/rl/train.parquet").write_bytes(b"")
    p.train.verl.use_v1 = True
    if importlib.util.find_spec("transfer_queue") is None:
        with pytest.raises(UserError, match="TransferQueue"):
            run_verl(p, run)
    p.train.verl.use_v1 = False
    with pytest.raises(DataError, match="no evaluation set"):
        run_verl(p, run)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_launch_failure_becomes_user_error_with_log_tail(paper_params, tmp_path, monkeypatch):
    """The real `python -m verl.trainer.main_ppo` parses every override and passes verl's config validation;
    an unknown `ray.init` argument then stops it before any Ray instance is started or joined. The launcher
    must stream the log and turn the non-zero exit into a UserError carrying the log tail."""
    p = paper_params
    p.root = tmp_path
    (tmp_path / "data/rl/eval").mkdir(parents=True)
    # Parquet files the stage can count rows of (verl's total steps); verl stops before it reads them.
    pd.DataFrame({"x": range(256)}).to_parquet(tmp_path / "data/rl/train.parquet")
    pd.DataFrame({"x": range(4)}).to_parquet(tmp_path / "data/rl/eval/hotpotqa.parquet")
    p.train.verl.ray_address = ""
    p.train.verl.extra_overrides = ["+ray_kwargs.ray_init.promptr1_stop_here=1"]
    run = SimpleNamespace(info=SimpleNamespace(run_id="0" * 32))
    monkeypatch.setenv("TIKTOKEN_ENCODINGS_BASE", str(tmp_path / "encodings"))
    # the agent's weights in a Hugging Face cache (the stage checks them first and hands verl their folder)
    from huggingface_hub import constants

    snapshot = tmp_path / "hub/models--Qwen--Qwen3-4B/snapshots/0123456789abcdef0123456789abcdef01234567"
    snapshot.mkdir(parents=True)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text(snapshot.name)
    (snapshot / "config.json").write_text("{}")
    (snapshot / "model.safetensors").write_bytes(b"w")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    # The stage owns the environment: a server already serving the configured model at the URL is reused.
    with FaultServer(model=p.environment.served_name) as environment, pytest.raises(UserError) as excinfo:
        p.environment.base_url = environment.url
        run_verl(p, run)
    message = str(excinfo.value)
    assert "exit code 1" in message and "promptr1_stop_here" in message  # the tail names the cause
    log_text = (tmp_path / "reports/train/verl.log").read_text()
    assert "All configuration checks passed" in log_text  # our overrides survived the real CLI parser
    # verl hands our MLflow run to every Ray worker through the job's runtime_env
    assert "'MLFLOW_RUN_ID': '" + "0" * 32 + "'" in log_text
    # ... and the offline variables (Ray workers inherit the raylet's environment, not ours)
    assert "'HF_HUB_OFFLINE': '1'" in log_text and "'TRANSFORMERS_OFFLINE': '1'" in log_text
    overrides = (tmp_path / "reports/train/verl_overrides.txt").read_text()
    assert f"actor_rollout_ref.model.path='{snapshot}'" in overrides
    assert f"'TIKTOKEN_ENCODINGS_BASE': '{tmp_path / 'encodings'}'" in log_text
    assert (tmp_path / "reports/train/verl_overrides.txt").read_text().count("\n") > 50


def test_export_steps_csv_from_a_real_mlflow_run(tmp_path, monkeypatch):
    import mlflow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    mlflow.set_tracking_uri(os.environ["MLFLOW_TRACKING_URI"])
    experiment = mlflow.create_experiment("t", artifact_location=(tmp_path / "art").as_uri())
    with mlflow.start_run(experiment_id=experiment) as run:
        for step, score in [(1, -0.5), (2, 0.25)]:
            mlflow.log_metrics({"critic/score/mean": score, "actor/kl_loss": 0.01 * step}, step=step)
    launches = [Launch(run_id=run.info.run_id, resumed_from=0)]
    rows = export_steps_csv(launches, tmp_path / "steps.csv", last_step=2, seen=[1, 2])
    assert rows == 2
    lines = (tmp_path / "steps.csv").read_text().splitlines()
    # verl's critic/score/mean is GRPO's reward: steps.csv and the run also name it reward/mean
    assert lines[0] == "step,actor/kl_loss,critic/score/mean,reward/mean"
    assert lines[1:] == ["1,0.01,-0.5,-0.5", "2,0.02,0.25,0.25"]
    history = mlflow.MlflowClient().get_metric_history(run.info.run_id, "reward/mean")
    assert sorted((m.step, m.value) for m in history) == [(1, -0.5), (2, 0.25)]


def test_tracking_uri_with_credentials_never_reaches_verl_overrides(tmp_path, monkeypatch, params):
    # verl prints its config and we save the overrides as an artifact: a password in the URI must stop
    # the launch before anything is written.
    from types import SimpleNamespace

    from pipeline.errors import UserError

    (tmp_path / "data/rl/eval").mkdir(parents=True)
    (tmp_path / "data/rl/train.parquet").write_bytes(b"")
    (tmp_path / "data/rl/eval/hotpotqa.parquet").write_bytes(b"")
    params.root = tmp_path
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "https://alice:s3cret@mlflow.example/")
    with pytest.raises(UserError, match="credentials"):
        run_verl(params, SimpleNamespace(info=SimpleNamespace(run_id="r1")))
    assert not (tmp_path / "reports/train/verl_overrides.txt").exists()
