"""scripts/install-gpu.sh's flash-attn compile settings, derived by the script itself from faked machine facts.

The script reads the GPU's compute capability from `$NVIDIA_SMI` and the memory from `$MEMINFO` and
`$CGROUP_MEMORY_MAX`; the tests point those at files written here (an executable that answers nvidia-smi's
query, a meminfo, a cgroup limit) and run the real script with bash:
- `--print-build-env` prints the derived FLASH_ATTN_CUDA_ARCHS / TORCH_CUDA_ARCH_LIST / MAX_JOBS;
- the install route itself runs with `PYTHON` set to a recording stand-in for the interpreter (no GPU
  stack can be installed here), so the test sees the environment the flash-attn build would get.
`PYTHON` is always the stand-in, so even a script without these features cannot install anything here.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "install-gpu.sh"
GIB_KB = 1024 * 1024


def executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def machine(tmp_path: Path, caps: list[str] | None, mem_available_gib: float, cgroup_max: str = "max",
            driver: str = "580.95.05"):
    """Fake machine facts: nvidia-smi answering `caps` and `driver` (None: no nvidia-smi), meminfo, cgroup
    memory.max, and the recording interpreter."""
    smi = tmp_path / "nvidia-smi"
    if caps is not None:  # answers only the queries the script must ask, one line per GPU
        lines = "".join(f"{c}\\n" for c in caps)
        executable(smi, "#!/bin/sh\ncase \"$*\" in\n"
                        f'  "--query-gpu=compute_cap --format=csv,noheader") printf "{lines}" ;;\n'
                        f'  "--query-gpu=driver_version --format=csv,noheader") printf "{driver}\\n{driver}\\n" ;;\n'
                        "  *) exit 9 ;;\nesac\n")
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal:       {int(mem_available_gib * 2 * GIB_KB)} kB\n"
                       f"MemFree:        1000 kB\nMemAvailable:   {int(mem_available_gib * GIB_KB)} kB\n")
    cgroup = tmp_path / "memory.max"
    cgroup.write_text(cgroup_max + "\n")
    record = tmp_path / "python-calls.log"
    python = executable(tmp_path / "python", (
        "#!/bin/sh\n"
        f'echo "$* | FLASH_ATTN_CUDA_ARCHS=${{FLASH_ATTN_CUDA_ARCHS-}} TORCH_CUDA_ARCH_LIST=${{TORCH_CUDA_ARCH_LIST-}} '
        f'MAX_JOBS=${{MAX_JOBS-}} FLASH_ATTENTION_FORCE_BUILD=${{FLASH_ATTENTION_FORCE_BUILD-}}" >> {record}\n'))
    env = {"PATH": os.environ["PATH"], "NVIDIA_SMI": str(smi), "MEMINFO": str(meminfo),
           "CGROUP_MEMORY_MAX": str(cgroup), "PYTHON": str(python)}
    return env, record


def run_script(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([shutil.which("bash") or "bash", str(SCRIPT), *args], env=env, capture_output=True,
                          text=True, timeout=60, check=False)


def build_env(result: subprocess.CompletedProcess) -> dict[str, str]:
    assert result.returncode == 0, result.stderr
    return dict(line.split("=", 1) for line in result.stdout.splitlines())


@pytest.mark.parametrize(("caps", "archs", "torch_archs"), [
    (["9.0"] * 8, "90", "9.0"),                 # an 8 x H100/H200 node: one target, not flash-attn's four
    (["8.0"], "80", "8.0"),                     # A100
    (["8.6", "8.9"], "80", "8.6;8.9"),          # A10 / L40: flash-attn's sm_80 kernels run on 8.x
    (["10.0"], "100", "10.0"),                  # B200
    (["12.0", "8.0"], "80;120", "8.0;12.0"),    # a mixed node gets both
])
def test_flash_attn_targets_the_node_architecture_only(tmp_path, caps, archs, torch_archs):
    env, _ = machine(tmp_path, caps, mem_available_gib=80)
    got = build_env(run_script(env, "--print-build-env"))
    assert (got["FLASH_ATTN_CUDA_ARCHS"], got["TORCH_CUDA_ARCH_LIST"]) == (archs, torch_archs)


@pytest.mark.parametrize(("available_gib", "cgroup_max", "jobs"), [
    (80, "max", "8"),                           # 80 GiB available / 9 GiB per job
    (40, "max", "4"),
    (4, "max", "1"),                            # less than one job's worth: still 1
    (500, str(20 * 1024**3), "2"),              # a container limited to 20 GiB on a 500 GiB host
    (30, str(200 * 1024**3), "3"),              # a cgroup limit above what is available does not raise it
])
def test_max_jobs_follows_memory(tmp_path, available_gib, cgroup_max, jobs):
    env, _ = machine(tmp_path, ["9.0"], mem_available_gib=available_gib, cgroup_max=cgroup_max)
    assert build_env(run_script(env, "--print-build-env"))["MAX_JOBS"] == jobs


def test_settings_given_beforehand_win_and_need_no_gpu(tmp_path):
    env, _ = machine(tmp_path, None, mem_available_gib=4)
    got = build_env(run_script({**env, "FLASH_ATTN_CUDA_ARCHS": "80;90", "MAX_JOBS": "6"}, "--print-build-env"))
    assert got == {"FLASH_ATTN_CUDA_ARCHS": "80;90", "TORCH_CUDA_ARCH_LIST": "8.0;9.0", "MAX_JOBS": "6"}


@pytest.mark.parametrize(("caps", "message"), [
    (None, "set FLASH_ATTN_CUDA_ARCHS"),          # no nvidia-smi (a docker build): say what to set
    (["7.5"], "no kernels for compute capability 7.5"),
])
def test_unknown_architecture_stops_before_compiling(tmp_path, caps, message):
    env, record = machine(tmp_path, caps, mem_available_gib=80)
    result = run_script(env, "--print-build-env")
    assert result.returncode == 1 and message in result.stderr
    result = run_script(env)
    assert result.returncode != 0 and message in result.stderr
    assert "flash-attn" not in record.read_text()  # the compile was never started


def test_install_route_compiles_flash_attn_with_the_derived_settings(tmp_path):
    env, record = machine(tmp_path, ["9.0", "9.0"], mem_available_gib=40)
    result = run_script(env)
    assert result.returncode == 0, result.stderr
    calls = record.read_text().splitlines()
    (flash,) = [c for c in calls if "--no-build-isolation flash-attn" in c]
    assert flash.endswith("| FLASH_ATTN_CUDA_ARCHS=90 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=4 "
                          "FLASH_ATTENTION_FORCE_BUILD=TRUE"), flash
    assert calls[-1].startswith("scripts/check_pins.py constraints/gpu.txt")


def test_flash_attn_build_never_asks_the_network_for_a_wheel(tmp_path):
    """flash-attn's setup.py downloads a prebuilt wheel (urllib, no timeout) unless FLASH_ATTENTION_FORCE_BUILD
    is exactly TRUE: the build command sets it, for that command only (no other install step sees it)."""
    env, record = machine(tmp_path, ["9.0"], mem_available_gib=40)
    result = run_script(env)
    assert result.returncode == 0, result.stderr
    calls = record.read_text().splitlines()
    forced = [c for c in calls if c.endswith("FLASH_ATTENTION_FORCE_BUILD=TRUE")]
    assert len(forced) == 1 and "--no-build-isolation flash-attn" in forced[0], calls
    assert len(calls) > 1 and all(c.endswith("FLASH_ATTENTION_FORCE_BUILD=") for c in calls if c not in forced)
    assert "FLASH_ATTENTION_FORCE_BUILD" not in (REPO / "Dockerfile").read_text()  # not global in the image


def test_prebuilt_wheel_is_the_fast_path_without_gpu_or_compile(tmp_path):
    env, record = machine(tmp_path, None, mem_available_gib=4)
    result = run_script({**env, "FLASH_ATTN_WHEEL": "/wheels/flash_attn-2.8.3-cp312-linux_x86_64.whl"})
    assert result.returncode == 0, result.stderr
    text = record.read_text()
    assert "--no-deps /wheels/flash_attn-2.8.3-cp312-linux_x86_64.whl" in text
    assert "--no-build-isolation" not in text


def test_docker_build_passes_the_targets_and_derives_max_jobs():
    text = (REPO / "Dockerfile").read_text()
    build = text[text.index("AS gpu-build"):text.index("AS gpu\n")]
    assert 'ARG FLASH_ATTN_CUDA_ARCHS="80;90"' in build  # a build has no GPU to ask: A100 + H100/H200
    assert 'FLASH_ATTN_CUDA_ARCHS="${FLASH_ATTN_CUDA_ARCHS}"' in build and 'MAX_JOBS="${MAX_JOBS}"' in build
    assert "MAX_JOBS=8" not in build  # no fixed job count (8 jobs x ~9 GB)


def test_driver_older_than_cuda_13_needs_is_refused_before_installing(tmp_path):
    env, record = machine(tmp_path, ["9.0"], mem_available_gib=80, driver="570.172.08")
    result = run_script(env)
    assert result.returncode != 0
    assert "NVIDIA driver 570.172.08 is older than 580" in result.stderr
    assert not record.exists()  # nothing was installed


def test_docs_state_the_driver_requirement_and_the_fast_path():
    text = (REPO / "docs" / "gpu.md").read_text()
    install = text[text.index("## 2. Install"):text.index("## 3.")]
    assert "driver >= 580" in install and "CUDA 13" in install
    assert "FLASH_ATTN_WHEEL" in install and "fast path" in install
    assert "FLASH_ATTN_CUDA_ARCHS" in install and "MAX_JOBS" in install and "--print-build-env" in install
    assert "FLASH_ATTENTION_FORCE_BUILD=TRUE" in install
    # the compile time is not measured yet: every figure of it is called an estimate
    for text in (install, SCRIPT.read_text()):
        for line in [line for line in text.splitlines() if "minutes" in line]:
            assert "estimate" in line.lower(), line
