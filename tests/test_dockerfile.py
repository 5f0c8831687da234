"""The Dockerfile, parsed with Docker's own parser (the `dockerfile` package): no Docker engine needed.

Checks what a broken image would get wrong silently: base images and Python version, a non-root user,
the entrypoint, and that every version pin in its `pip install` steps is pyproject.toml's, and that the
project is installed the way the README says.
"""

from __future__ import annotations

import fnmatch
import re
import shlex
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import dockerfile
import pytest
from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
PROJECT_REF = re.compile(r"^\.(\[(?P<extras>[\w,\s-]+)\])?$")
FLAGS_WITH_VALUE = {"--index-url", "-i", "--extra-index-url", "-r", "--requirement", "-c", "--constraint",
                    "-f", "--find-links", "--target", "-t"}


@dataclass
class PipInstall:
    requirements: list[Requirement] = field(default_factory=list)
    project_extras: list[set[str]] = field(default_factory=list)
    """One entry per install of the project itself (`.`, `-e .`, `".[gpu]"`)."""
    index_urls: list[str] = field(default_factory=list)


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


def parse_pip(shell: str, out: PipInstall) -> PipInstall:
    """Collect requirements, project installs and index URLs from every `pip install` in a shell line."""
    for segment in re.split(r"&&|;|\|\||\n", shell):
        tokens = shlex.split(segment, comments=True)
        if "pip" not in tokens or "install" not in tokens:
            continue
        args = tokens[tokens.index("install", tokens.index("pip")) + 1:]
        i = 0
        while i < len(args):
            arg = args[i]
            if arg in FLAGS_WITH_VALUE:
                if arg in ("--index-url", "-i", "--extra-index-url"):
                    out.index_urls.append(args[i + 1])
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
            i += 1
    return out


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


def test_every_pin_in_the_dockerfile_is_pyprojects():
    declared = pyproject_requirements()
    for target in stages():
        for req in target.pip_installs().requirements:
            name = canonicalize_name(req.name)
            if name in declared:
                assert req.specifier == declared[name].specifier, f"{target.name}: {req} vs pyproject {declared[name]}"


def test_gpu_stack_pins_are_installed_explicitly():
    declared = pyproject_requirements()
    pinned = {canonicalize_name(r.name): r for r in stage("gpu-build").pip_installs().requirements}
    for name in ("torch", "transformers", "verl", "vllm"):
        assert str(declared[name].specifier).startswith("=="), f"pyproject must pin {name}"
        assert pinned[name].specifier == declared[name].specifier
    cpu_pins = {canonicalize_name(r.name): r for r in stage("cpu").pip_installs().requirements}
    assert cpu_pins["torch"].specifier == declared["torch"].specifier


def test_project_installed_with_declared_extras():
    extras = set(pyproject()["project"]["optional-dependencies"])
    gpu_installs = stage("gpu-build").pip_installs().project_extras
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
    for req in readme.requirements:
        name = canonicalize_name(req.name)
        if name in declared:
            assert req.specifier == declared[name].specifier, f"README pins {req}, pyproject {declared[name]}"
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
                       'CMAKE_ARGS=x pip install -e ".[gpu,dev]" vllm==0.31.0', PipInstall())
    assert [str(r) for r in parsed.requirements] == ["torch==2.13.0", "vllm==0.31.0"]
    assert parsed.project_extras == [{"gpu", "dev"}]
    assert parsed.index_urls == ["https://download.pytorch.org/whl/cpu"]


def test_readme_install_commands_are_found():
    text = (
        "Set up:\n\n```bash\npython -m venv .venv && . .venv/bin/activate\n"
        "$ pip install --extra-index-url https://download.pytorch.org/whl/cpu \\\n  -e \".[dev]\"\n```\n"
        "GPU nodes: `pip install -e .[gpu]`\n```\npip install -e '.[gpu]'  # then\n```\n"
    )
    parsed = readme_installs(text)
    assert parsed.project_extras == [{"dev"}, {"gpu"}]
    assert parsed.index_urls == ["https://download.pytorch.org/whl/cpu"]
