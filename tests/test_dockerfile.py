"""The Dockerfile and the install route, parsed with Docker's own parser (the `dockerfile` package): no
Docker engine needed.

Checks what a broken image would get wrong silently: base images and Python version, a non-root user,
the entrypoint, that every version pin in its `pip install` steps is its constraints file's, that the GPU
image installs through scripts/install-gpu.sh (docs/gpu.md's route) with the set verl 0.9.1 declares in its
own package metadata, that pyproject.toml's ranges admit both the CPU and the GPU set, and that the project
is installed the way the README says.
"""

from __future__ import annotations

import fnmatch
import re
import shlex
import tomllib
from dataclasses import dataclass, field
from importlib.metadata import requires, version
from pathlib import Path

import dockerfile
import pytest
from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
PROJECT_REF = re.compile(r"^\.(\[(?P<extras>[\w,\s-]+)\])?$")
SCRIPTS = REPO / "scripts"
FLAGS_WITH_VALUE = {"--index-url", "-i", "--extra-index-url", "-r", "--requirement", "-c", "--constraint",
                    "-f", "--find-links", "--target", "-t"}


@dataclass
class PipInstall:
    requirements: list[Requirement] = field(default_factory=list)
    project_extras: list[set[str]] = field(default_factory=list)
    """One entry per install of the project itself (`.`, `-e .`, `".[gpu]"`)."""
    index_urls: list[str] = field(default_factory=list)
    constraints: list[str] = field(default_factory=list)
    """Constraint files (`-c`, `--constraint`), in order."""
    no_build_isolation: list[str] = field(default_factory=list)
    """Requirements installed with `--no-build-isolation`."""


@dataclass
class Stage:
    name: str
    base: str
    commands: list = field(default_factory=list)

    def last(self, cmd: str):
        found = [c for c in self.commands if c.cmd == cmd]
        return found[-1] if found else None

    def pip_installs(self) -> PipInstall:
        out = PipInstall()
        for command in self.commands:
            if command.cmd == "RUN":
                parse_pip(" ".join(command.value), out)
        return out


def shell_commands(shell: str) -> list[list[str]]:
    """A shell line's simple commands as token lists, split at `&&`, `||`, `;`, `|` outside quotes (a quoted
    value such as FLASH_ATTN_CUDA_ARCHS="80;90" stays one token)."""
    shell = re.sub(r"\\[ \t]*(\n|$)", " ", shell).replace("\n", " ; ")  # line continuations, then lines
    lexer = shlex.shlex(shell, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    try:
        for token in lexer:
            if token in {"&&", "||", ";", "|", "&", ";;"}:
                commands.append([])
            else:
                commands[-1].append(token)
    except ValueError:  # one line of a multi-line shell construct (the install script is read line by line)
        return [segment.split() for segment in re.split(r"&&|;|\|\|", shell)]
    return [c for c in commands if c]


def parse_pip(shell: str, out: PipInstall) -> PipInstall:
    """Collect requirements, project installs and index URLs from every `pip install` in a shell line."""
    for tokens in shell_commands(shell):
        if "pip" not in tokens or "install" not in tokens:
            continue
        args = tokens[tokens.index("install", tokens.index("pip")) + 1:]
        isolated = "--no-build-isolation" not in args
        i = 0
        while i < len(args):
            arg = args[i]
            if arg in FLAGS_WITH_VALUE:
                if arg in ("--index-url", "-i", "--extra-index-url"):
                    out.index_urls.append(args[i + 1])
                if arg in ("-c", "--constraint"):
                    out.constraints.append(args[i + 1])
                i += 2
                continue
            if arg in ("-e", "--editable"):
                i += 1
                continue
            if arg.startswith("-"):
                i += 1
                continue
            project = PROJECT_REF.match(arg)
            if project:
                extras = project.group("extras") or ""
                out.project_extras.append({e.strip() for e in extras.split(",") if e.strip()})
            else:
                out.requirements.append(Requirement(arg))
                if not isolated:
                    out.no_build_isolation.append(canonicalize_name(out.requirements[-1].name))
            i += 1
    return out


def install_script() -> PipInstall:
    """The `pip install` steps of scripts/install-gpu.sh (its `pip_install` helper adds the constraints)."""
    text = (SCRIPTS / "install-gpu.sh").read_text()
    (constraints,) = re.findall(r"^CONSTRAINTS=(\S+)$", text, flags=re.MULTILINE)
    out = PipInstall()
    for line in text.splitlines():
        line = line.strip()
        if line.startswith(("#", "pip_install()")) or "$FLASH_ATTN_WHEEL" in line:
            continue
        parse_pip(re.sub(r"\bpip_install\b", f"pip install --constraint {constraints}", line), out)
    return out


def constraint_pins(name: str) -> dict[str, Requirement]:
    lines = (REPO / "constraints" / name).read_text().splitlines()
    reqs = [Requirement(text) for line in lines if (text := line.split("#")[0].strip())]
    return {canonicalize_name(r.name): r for r in reqs}


def exact(req: Requirement) -> str:
    (spec,) = req.specifier
    assert spec.operator == "==", f"{req} is not an exact pin"
    return spec.version


def stages() -> list[Stage]:
    commands = dockerfile.parse_file(str(REPO / "Dockerfile"))
    global_args: dict[str, str] = {}
    result: list[Stage] = []
    for command in commands:
        if command.cmd == "ARG" and not result:
            key, _, default = command.value[0].partition("=")
            global_args[key] = default
        elif command.cmd == "FROM":
            image = re.sub(r"\$\{(\w+)\}", lambda m: global_args[m.group(1)], command.value[0])
            name = command.value[2] if len(command.value) > 2 and command.value[1].upper() == "AS" else ""
            result.append(Stage(name=name, base=image))
        elif result:
            result[-1].commands.append(command)
    return result


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def pyproject_requirements() -> dict[str, Requirement]:
    project = pyproject()["project"]
    reqs = list(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        reqs.extend(extra)
    return {canonicalize_name(r.name): r for r in map(Requirement, reqs)}


def stage(name: str) -> Stage:
    (found,) = [s for s in stages() if s.name == name]
    return found


def test_targets_and_base_images():
    all_stages = stages()
    assert [s.name for s in all_stages] == ["cpu", "gpu-build", "gpu"]  # gpu last: the default target
    cpu, build, gpu = all_stages
    assert re.fullmatch(r"python:3\.1[12]-slim", cpu.base)
    assert re.fullmatch(r"nvidia/cuda:[\d.]+-devel-ubuntu24\.04", build.base)
    assert re.fullmatch(r"nvidia/cuda:[\d.]+-runtime-ubuntu24\.04", gpu.base)
    assert build.base.split(":")[1].split("-")[0] == gpu.base.split(":")[1].split("-")[0]  # same CUDA
    # Ubuntu 24.04's python3 is 3.12; the slim image's tag is the other version; pyproject admits both.
    requires = SpecifierSet(pyproject()["project"]["requires-python"])
    assert "3.12" in requires and cpu.base.split(":")[1].removesuffix("-slim") in requires


@pytest.mark.parametrize("name", ["cpu", "gpu"])
def test_runs_as_a_created_non_root_user(name):
    target = stage(name)
    user = target.last("USER").value[0]
    assert user not in ("root", "0")
    assert any(c.cmd == "RUN" and re.search(rf"useradd\b.*\b{user}\b", " ".join(c.value))
               for c in target.commands)


def test_gpu_entrypoint_is_the_cli_and_cpu_runs_the_default_profile():
    gpu = stage("gpu")
    assert gpu.last("ENTRYPOINT").json and list(gpu.last("ENTRYPOINT").value) == ["promptr1"]
    assert "promptr1" in pyproject()["project"]["scripts"]
    cpu = stage("cpu")
    assert cpu.last("ENTRYPOINT") is None
    assert cpu.last("CMD").json and list(cpu.last("CMD").value) == ["dvc", "repro"]


@pytest.mark.parametrize("name", ["cpu", "gpu"])
def test_images_switch_telemetry_off_as_the_entry_points_do(name):
    """Every image process starts quiet, `dvc` itself too (it runs before any `promptr1` entry point calls
    `quiet_telemetry`): each runtime image sets all of pipeline/runtime.py's TELEMETRY_OFF, with its values."""
    from pipeline.runtime import TELEMETRY_OFF

    env: dict[str, str] = {}
    for command in stage(name).commands:
        if command.cmd == "ENV":
            env.update(zip(command.value[::2], command.value[1::2], strict=True))
    wrong = {key: env.get(key) for key, value in TELEMETRY_OFF.items() if env.get(key) != value}
    assert not wrong, f"Dockerfile stage {name}: telemetry variables missing or different from TELEMETRY_OFF: {wrong}"


@pytest.mark.parametrize(("name", "constraints"), [("cpu", "cpu.txt"), ("gpu-build", "gpu.txt")])
def test_every_pin_in_the_dockerfile_is_its_constraints_files(name, constraints):
    installs = stage(name).pip_installs()
    if name == "gpu-build":
        installs = install_script()
    pinned = constraint_pins(constraints)
    assert installs.project_extras and installs.constraints
    assert set(installs.constraints) == {f"constraints/{constraints}"}
    for req in installs.requirements:
        name_ = canonicalize_name(req.name)
        if name_ in pinned and req.specifier:  # unpinned: the constraints file decides
            assert req.specifier == pinned[name_].specifier, f"{name}: {req} vs constraints {pinned[name_]}"
    if name == "cpu":  # the CPU wheel, installed first from the CPU index, is the pinned torch
        (torch,) = [r for r in installs.requirements if canonicalize_name(r.name) == "torch"]
        assert torch.specifier == pinned["torch"].specifier
        assert any(url.rstrip("/").endswith("/cpu") for url in installs.index_urls)


def test_gpu_image_installs_through_the_script_in_two_steps():
    build = stage("gpu-build")
    assert any(c.cmd == "RUN" and "scripts/install-gpu.sh" in " ".join(c.value) for c in build.commands)
    assert not build.pip_installs().requirements  # no second, diverging route in the Dockerfile
    script = install_script()
    assert {"gpu"} in script.project_extras
    assert script.no_build_isolation == ["flash-attn"]  # step 2, after torch is installed by step 1
    text = (SCRIPTS / "install-gpu.sh").read_text()
    assert text.index('-e ".[gpu]"') < text.index("--no-build-isolation flash-attn") < text.index("check_pins.py")
    assert "gpu.txt" in text and "scripts/install-gpu.sh" in (REPO / "docs" / "gpu.md").read_text()


def verl_extra_pins(extra: str) -> dict[str, str]:
    """Exact pins verl's installed package metadata declares for one of its extras."""
    pins = {}
    for text in requires("verl") or []:
        req = Requirement(text)
        if req.marker and req.marker.evaluate({"extra": extra}) and str(req.specifier).startswith("=="):
            pins[canonicalize_name(req.name)] = exact(req)
    return pins


def test_gpu_constraints_are_the_set_verl_declares():
    gpu = {name: exact(req) for name, req in constraint_pins("gpu.txt").items()}
    declared = verl_extra_pins("vllm")
    assert {"torch", "transformers", "vllm"} <= set(declared)
    for name, pinned in declared.items():
        assert gpu.get(name) == pinned, f"verl[vllm] pins {name}=={pinned}; constraints/gpu.txt {gpu.get(name)}"
    (flash_extra,) = [e for e in _verl_extras() if e.startswith("flash-attn-")]
    assert gpu["flash-attn"] == verl_extra_pins(flash_extra)["flash-attn"]
    assert f"torch{declared['torch'].replace('.', '')[:3]}" in flash_extra  # the wheel's torch is ours


def _verl_extras() -> set[str]:
    from importlib.metadata import metadata

    return set(metadata("verl").get_all("Provides-Extra") or [])


def test_cpu_ci_runs_the_verl_the_gpu_nodes_get():
    cpu, gpu = constraint_pins("cpu.txt"), constraint_pins("gpu.txt")
    declared = pyproject_requirements()
    assert exact(cpu["verl"]) == exact(gpu["verl"]) == version("verl") == exact(declared["verl"])
    assert exact(cpu["torch"]) == "2.13.0"  # the CPU wheel at hand; any other torch pulls CUDA packages


@pytest.mark.parametrize("constraints", ["cpu.txt", "gpu.txt"])
def test_pyproject_admits_each_pinned_set(constraints):
    """The base dependencies must not make either set uninstallable (e.g. a pin of torch 2.13.0 would)."""
    project = pyproject()["project"]
    base = {canonicalize_name(r.name): r for r in map(Requirement, project["dependencies"])}
    if constraints == "gpu.txt":
        base.update({canonicalize_name(r.name): r for r in map(Requirement, project["optional-dependencies"]["gpu"])})
    for name, pin in constraint_pins(constraints).items():
        if name in base:
            assert base[name].specifier.contains(exact(pin)), f"pyproject {base[name]} excludes {pin}"


def test_this_environment_is_one_pinned_set():
    """What CI (or a GPU node) installed is constraints/cpu.txt's set or constraints/gpu.txt's, exactly."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("check_pins", SCRIPTS / "check_pins.py")
    check_pins = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check_pins)
    results = {name: check_pins.mismatches(str(REPO / "constraints" / name)) for name in ("cpu.txt", "gpu.txt")}
    assert [] in results.values(), results


def test_check_pins_fails_on_a_wrong_or_missing_package(tmp_path):
    import subprocess
    import sys

    wrong = tmp_path / "wrong.txt"
    wrong.write_text(f"torch=={version('torch')}  # right\npytest==0.0.1\nno-such-package-xyz==1.0\n")
    result = subprocess.run([sys.executable, str(SCRIPTS / "check_pins.py"), str(wrong)], capture_output=True,
                            text=True, check=False, timeout=60)
    assert result.returncode == 1
    assert "pytest " in result.stderr and "no-such-package-xyz not installed" in result.stderr
    assert "torch" not in result.stderr


def test_project_installed_with_declared_extras():
    extras = set(pyproject()["project"]["optional-dependencies"])
    gpu_installs = install_script().project_extras
    assert any("gpu" in e for e in gpu_installs)
    cpu_installs = stage("cpu").pip_installs().project_extras
    assert cpu_installs and all(e <= extras for e in [*gpu_installs, *cpu_installs])
    deps = [canonicalize_name(Requirement(d).name) for d in pyproject()["project"]["dependencies"]]
    assert "llama-cpp-python" in deps  # the llama.cpp server reaches both images as a main dependency
    assert any("llama-cpp-python" in d and "server" in d for d in pyproject()["project"]["dependencies"])


def readme_installs(text: str | None = None) -> PipInstall | None:
    """`pip install` commands in the README's code blocks (None when there is no README yet)."""
    if text is None:
        readme = REPO / "README.md"
        if not readme.is_file():
            return None
        text = readme.read_text()
    out = PipInstall()
    for block in re.findall(r"```[^\n]*\n(.*?)```", text, flags=re.DOTALL):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip().removeprefix("$ ")
            if re.search(r"\bpip install\b", line) and not line.startswith("#"):
                try:
                    parse_pip(line, out)
                except (ValueError, InvalidRequirement):
                    continue  # prose or a placeholder in a code block, not an install command
    return out


def test_install_matches_the_readme():
    declared = pyproject_requirements()
    extras = set(pyproject()["project"]["optional-dependencies"])
    cpu = stage("cpu").pip_installs()
    readme = readme_installs()
    if readme is None or not readme.project_extras:
        # No README (yet): hold the Dockerfile to pyproject alone, the documented `pip install -e ".[dev]"`.
        assert "dev" in extras
        return
    readme_extras = set().union(*readme.project_extras)
    assert readme_extras <= extras, f"README installs undeclared extras {readme_extras - extras}"
    cpu_pins = constraint_pins("cpu.txt")
    for req in readme.requirements:
        name = canonicalize_name(req.name)
        if name in cpu_pins:
            assert req.specifier == cpu_pins[name].specifier, f"README pins {req}, constraints {cpu_pins[name]}"
        elif name in declared:
            assert req.specifier == declared[name].specifier, f"README pins {req}, pyproject {declared[name]}"
    for constraints in readme.constraints:  # the README's set-up is the CPU one
        assert constraints == "constraints/cpu.txt"
    # The image installs the project as the README does, minus extras for development/GPU nodes.
    for image_extras in cpu.project_extras:
        assert image_extras <= readme_extras | {"gpu"}
    for url in readme.index_urls:
        if "pytorch" in url and url.rstrip("/").endswith("/cpu"):
            assert url in cpu.index_urls, f"README installs torch from {url}; the cpu image must too"


def test_dockerignore_keeps_sources_and_drops_state():
    patterns = [p.strip() for p in (REPO / ".dockerignore").read_text().splitlines()
                if p.strip() and not p.startswith("#")]

    def ignored(path: str) -> bool:
        return any(fnmatch.fnmatch(path, p) or path.startswith(p.rstrip("/") + "/") for p in patterns)

    for needed in ["pyproject.toml", "README.md", "pipeline/cli.py", "flows/retrain.py", "dvc.yaml",
                   "params.yaml", "profiles/paper.yaml", "prefect.yaml", ".dvc/config"]:
        assert not ignored(needed), needed
    for state in [".venv/bin/python", "data/sampled/x.parquet", "checkpoints/agent/latest",
                  "models/agent/config.json", "mlflow.db", ".dvc/cache/files", ".git/HEAD"]:
        assert ignored(state), state


def test_parse_pip_reads_flags_extras_and_pins():
    parsed = parse_pip('pip install --index-url https://download.pytorch.org/whl/cpu "torch==2.13.0" && '
                       'CMAKE_ARGS=x pip install -c constraints/gpu.txt -e ".[gpu,dev]" vllm==0.24.0 && '
                       'pip install --no-build-isolation flash-attn', PipInstall())
    assert [str(r) for r in parsed.requirements] == ["torch==2.13.0", "vllm==0.24.0", "flash-attn"]
    assert parsed.project_extras == [{"gpu", "dev"}]
    assert parsed.index_urls == ["https://download.pytorch.org/whl/cpu"]
    assert parsed.constraints == ["constraints/gpu.txt"]
    assert parsed.no_build_isolation == ["flash-attn"]


def test_readme_install_commands_are_found():
    text = (
        "Set up:\n\n```bash\npython -m venv .venv && . .venv/bin/activate\n"
        "$ pip install --extra-index-url https://download.pytorch.org/whl/cpu \\\n  -e \".[dev]\"\n```\n"
        "GPU nodes: `pip install -e .[gpu]`\n```\npip install -e '.[gpu]'  # then\n```\n"
    )
    parsed = readme_installs(text)
    assert parsed.project_extras == [{"dev"}, {"gpu"}]
    assert parsed.index_urls == ["https://download.pytorch.org/whl/cpu"]


def test_cpu_image_builds_llama_cpp_for_its_cpu_before_the_project():
    """The CPU image compiles llama.cpp's bindings and server with the README's script (no AMX), and does it
    before installing the project, whose install would otherwise take the registry's portable AVX2 server
    wheel (`xllamacpp`) and compile the bindings with AMX."""
    cpu = stage("cpu")
    runs = [(i, " ".join(c.value)) for i, c in enumerate(cpu.commands) if c.cmd == "RUN"]
    script = [i for i, text in runs if "scripts/install-llama-cpp.sh" in text]
    project = [i for i, text in runs if re.search(r"pip install .*-e \.", text)]
    assert script and project and script[0] < project[0]
    copied = [" ".join(c.value) for c in cpu.commands[: script[0]] if c.cmd == "COPY"]
    assert any("scripts/install-llama-cpp.sh" in c for c in copied) and any("pyproject.toml" in c for c in copied)
