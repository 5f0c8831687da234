"""docs/gpu.md's commands are tests: the two-node commands, read from the file itself, pass the checks the
commands run, and the doctor's steps are listed in the order it runs them.

The paper's layout on two 8-GPU nodes: the environment node runs `promptr1 env start` (which judges the
environment server alone: that node runs no trainer), the training node `promptr1 check`, `promptr1 weights`
and `dvc exp run` with `environment.base_url` pointing at the other node (which needs neither GPT-OSS's
weights nor its harmony file there).
"""

from __future__ import annotations

import itertools
import re
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipeline.checks import layout
from pipeline.cli import ENV_COMMANDS, app
from pipeline.config import deep_merge, load_params, parse_override
from pipeline.environment.harmony import needs_harmony
from pipeline.weights import required_models

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "gpu.md"
PLACEHOLDERS = {"<env-node>": "10.0.0.2", "<head-ip>": "10.0.0.1"}


def bash_lines() -> list[str]:
    """Every command line of the doc's fenced bash blocks (comments dropped, placeholders filled in)."""
    blocks = re.findall(
        r"^\s*```bash\n(.*?)^\s*```", DOC.read_text(encoding="utf-8"), re.DOTALL | re.MULTILINE
    )
    lines = []
    for block in blocks:
        for line in block.splitlines():
            line = line.split(" #", 1)[0].strip()
            if line and not line.startswith("#"):
                for placeholder, value in PLACEHOLDERS.items():
                    line = line.replace(placeholder, value)
                lines.append(line)
    return lines


def documented(prefix: str, containing: str) -> list[list[str]]:
    """The documented commands that start with `prefix` and contain `containing`, as argument lists."""
    return [shlex.split(line) for line in bash_lines() if line.startswith(prefix) and containing in line]


def params_of(argv: list[str]):
    """The params a command's `-S key=value` arguments give (params.yaml plus the profile)."""
    overrides: dict = {}
    for flag, value in itertools.pairwise(argv):
        if flag in ("-S", "--set"):
            overrides = deep_merge(overrides, parse_override(value))
    return load_params(REPO / "params.yaml", overrides)


def test_the_environment_node_command_passes_the_check_env_start_runs():
    [argv] = documented("promptr1 env start", "environment.server.gpus")
    params = params_of(argv)
    assert params.profile == "paper" and params.environment.server.gpus == list(range(8))
    check = getattr(layout, ENV_COMMANDS["start"].check)  # what the CLI runs before cli_start
    check(params)
    # the whole layout, trainer included, is what this node must not judge: it would refuse the command
    assert any("environment.server.gpus" in str(p) for p in layout.layout_problems(params))
    assert all(getattr(layout, command.check) is check for command in ENV_COMMANDS.values())


def test_env_start_still_refuses_a_bad_environment_server():
    # tensor parallel 8 on the 4 devices given: the environment node's own problem
    argv = [
        *documented("promptr1 env start", "environment.server.gpus")[0],
        "-S",
        "environment.server.gpus=[0,1,2,3]",
    ]
    with pytest.raises(layout.LayoutError, match="environment.server.tensor_parallel_size"):
        getattr(layout, ENV_COMMANDS["start"].check)(params_of(argv))


def test_the_training_node_commands_pass_and_need_no_gpt_oss_files():
    checks = documented("promptr1 check", "environment.base_url")
    runs = documented("dvc exp run", "environment.base_url")
    fetches = documented("promptr1 weights", "environment.base_url")
    assert checks and runs and fetches
    for argv in checks:
        result = CliRunner().invoke(app, ["check", "--params", str(REPO / "params.yaml"), *argv[2:]])
        assert result.exit_code == 0, result.output
        assert "vllm at http://10.0.0.2:8000/v1" in result.output
    for argv in runs:
        layout.assert_runnable(params_of(argv))  # what every stage runs first
    for argv in fetches:
        params = params_of(argv)
        assert set(required_models(params.agent, params.environment, params.evaluate)) == {
            "agent.model",
            "evaluate.ssim_model",
        }
        assert not needs_harmony(params.environment)
    # the same profile with the environment served here still needs both
    here = params_of(["-S", "profile=paper"])
    assert "environment.model" in required_models(here.agent, here.environment, here.evaluate)
    assert needs_harmony(here.environment)


def test_the_doctor_section_lists_the_steps_in_the_order_the_doctor_runs_them():
    from pipeline.checks.doctor import steps

    text = DOC.read_text(encoding="utf-8")
    section = text[text.index("## 4. `promptr1 doctor`") : text.index("## 5.")]
    listed = re.findall(r"^\d+\. `([a-z ]+)`", section, re.MULTILINE)
    assert listed == [name for name, _ in steps()]
    # the Ray it checks is started (section 3) before the doctor runs (section 4)
    assert text.index("## 3. Ray") < text.index("## 4. `promptr1 doctor`")


def test_the_documented_ray_starts_give_ray_the_training_devices_only():
    """Each `ray start` of section 3 whose comment names a profile, judged as the stage start judges a joined
    Ray that owns exactly the devices of that command's CUDA_VISIBLE_DEVICES."""
    from pipeline.placement import gpus_of_environment, gpus_of_training
    from pipeline.train.verl.resources import RayNode, RayProbe, ray_gpu_problems

    text = DOC.read_text(encoding="utf-8")
    section = text[text.index("## 3. Ray") : text.index("## 4.")]
    judged, profile = [], None
    for line in re.search(r"```bash\n(.*?)```", section, re.DOTALL).group(1).splitlines():
        if line.startswith("# "):
            first = line[2:].split()[0]
            profile = first if (REPO / "profiles" / f"{first}.yaml").is_file() else None
        elif "ray start" in line and profile is not None:
            devices = re.search(r"CUDA_VISIBLE_DEVICES=([\d,]+) ", line).group(1).split(",")
            assert f"--num-gpus={len(devices)}" in line
            params = params_of(["-S", f"profile={profile}", "-S", "train.verl.ray_address=auto"])
            assert [int(d) for d in devices] == gpus_of_training(params.train)
            owned = RayProbe(
                "auto", float(len(devices)), (RayNode("head", "10.0.0.1", True, tuple(devices)),)
            )
            assert (
                ray_gpu_problems(
                    owned, gpus_of_environment(params.environment), gpus_of_training(params.train)
                )
                == []
            )
            judged.append(profile)
            profile = None
    assert judged == ["paper", "paper-1node"]
