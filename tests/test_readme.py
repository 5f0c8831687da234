"""The README stays a newcomer's page: short, its Layout section names every package and module that exists,
and its test command is the one CI runs.

The Layout rule, strict and simple: the section's code block has one group per package, a line starting at
column 0 with the package's folder (`pipeline/train/`) followed by its indented continuation lines; each
module of that package (`name.py`, `__init__.py` aside) must be named in its group, and a group may name no
module that does not exist. A new module without a Layout line, or a removed one still listed, fails here.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MAX_LINES = 220
CODE_ROOTS = ("pipeline", "flows")


def readme() -> str:
    return (REPO / "README.md").read_text(encoding="utf-8")


def section(text: str, title: str) -> str:
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, flags=re.MULTILINE | re.DOTALL)
    assert match, f"README.md has no '## {title}' section"
    return match.group(1)


def layout_groups(text: str) -> dict[str, set[str]]:
    """Package folder (`pipeline/agent`) → the module file names its group in the Layout block names."""
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", section(text, "Layout"), flags=re.MULTILINE | re.DOTALL)
    assert blocks, "README.md's Layout section has no code block"
    groups: dict[str, set[str]] = {}
    current: set[str] | None = None
    for line in blocks[0].splitlines():
        if line[:1] not in ("", " "):  # a line at column 0 opens a group (or ends the one before)
            folder = line.split()[0].rstrip(",")
            current = groups.setdefault(folder.rstrip("/"), set()) if folder.endswith("/") else None
        if current is not None:
            current.update(re.findall(r"\b(\w+\.py)\b", line))
    return groups


def packages(repo: Path) -> dict[str, set[str]]:
    """Each package folder under pipeline/ and flows/ → its module file names."""
    found: dict[str, set[str]] = {}
    for root in CODE_ROOTS:
        for init in sorted((repo / root).rglob("__init__.py")):
            folder = init.parent
            found[folder.relative_to(repo).as_posix()] = {p.name for p in folder.glob("*.py")} - {
                "__init__.py"
            }
    return found


def layout_problems(text: str, repo: Path) -> list[str]:
    groups, existing = layout_groups(text), packages(repo)
    problems = []
    for package, modules in sorted(existing.items()):
        if package not in groups:
            problems.append(f"package {package}/ has no line of its own (a line starting `{package}/`)")
            continue
        missing = sorted(modules - groups[package])
        if missing:
            problems.append(f"{package}/ lines do not name " + ", ".join(f"{package}/{m}" for m in missing))
    for package, named in sorted(groups.items()):
        if package.startswith(CODE_ROOTS) and package in existing:
            stale = sorted(named - existing[package])
            if stale:
                problems.append(f"{package}/ lines name modules that do not exist: " + ", ".join(stale))
    return problems


def test_readme_is_short():
    lines = len(readme().splitlines())
    assert lines <= MAX_LINES, f"README.md has {lines} lines (at most {MAX_LINES}): move details to docs/"


def test_layout_names_every_package_and_module():
    problems = layout_problems(readme(), REPO)
    assert not problems, "README.md's Layout section:\n  " + "\n  ".join(problems)


def test_layout_rule_catches_a_new_and_a_removed_module(tmp_path):
    """The rule itself: a module that exists but is not named, and one named but gone, are both reported."""
    (tmp_path / "pipeline" / "train").mkdir(parents=True)
    (tmp_path / "flows").mkdir()
    for name in [
        "pipeline/__init__.py",
        "pipeline/cli.py",
        "pipeline/doctor.py",
        "pipeline/train/__init__.py",
        "pipeline/train/stage.py",
        "flows/__init__.py",
        "flows/retrain.py",
    ]:
        (tmp_path / name).write_text("")
    text = (
        "## Layout\n\n```\npipeline/      the package\n  cli.py       `promptr1`\n"
        "pipeline/train/  stage.py, health.py\nflows/   retrain.py\n```\n"
    )
    assert layout_problems(text, tmp_path) == [
        "pipeline/ lines do not name pipeline/doctor.py",
        "pipeline/train/ lines name modules that do not exist: health.py",
    ]
    without_flows = text.replace("flows/   retrain.py\n", "")
    assert (
        layout_problems(without_flows, tmp_path)[0]
        == "package flows/ has no line of its own (a line starting `flows/`)"
    )


def test_readme_test_command_is_what_ci_runs():
    """.ci/run runs the README's test command: the same pytest over the whole suite, output options aside."""
    blocks = re.findall(r"^```bash\n(.*?)^```", section(readme(), "Test"), flags=re.MULTILINE | re.DOTALL)
    commands = [line for block in blocks for line in block.splitlines() if line and not line.startswith("#")]
    assert commands == ["pytest"], f"README's Test section should hold the one test command, found {commands}"
    ci = (REPO / ".ci" / "run").read_text()
    after = ci.split("# --- test", 1)[1]
    (line,) = [ln for ln in after.splitlines()[1:] if ln.strip() and not ln.startswith("#")]
    words = shlex.split(line)
    assert words[:3] == ["python", "-m", "pytest"], f".ci/run's test line is {line!r}"
    # Only options that change what is printed: no marker filter, no file or keyword selection.
    extra = [
        w for w in words[3:] if not (w in ("-q", "-p", "no:cacheprovider") or w.startswith("--durations="))
    ]
    assert not extra, f".ci/run passes {extra} that the README's `pytest` does not"


@pytest.mark.parametrize(
    "page", ["docs/design.md", "docs/results.md", "docs/data.md", "benchmarks/README.md"]
)
def test_readme_links_each_detail_page(page):
    assert f"]({page})" in readme(), f"README.md does not link {page}"


@pytest.mark.slow
def test_the_documented_mlflow_ui_command_runs_with_telemetry_off(tmp_path):
    """The README's `mlflow ui` command, run as written (on a free port) in a project folder: its server has
    MLflow's telemetry variable set, and the UI's telemetry endpoint answers that UI telemetry is off."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import time
    import urllib.request

    from demo_project import free_port

    (command,) = {m for m in re.findall(r"`([^`]*mlflow ui [^`]*)`", readme())}
    port = free_port()
    ci = {"PYTEST_CURRENT_TEST", "CI", "GITHUB_ACTIONS"}  # MLflow turns telemetry off by itself under these
    env = {k: v for k, v in os.environ.items() if k not in ci and k != "MLFLOW_DISABLE_TELEMETRY"}
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    server = subprocess.Popen(["bash", "-c", f"{command} --port {port}"], cwd=tmp_path, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline, answer = time.monotonic() + 90, None
        while time.monotonic() < deadline and server.poll() is None:
            try:
                url = f"http://127.0.0.1:{port}/ajax-api/3.0/mlflow/ui-telemetry"
                with urllib.request.urlopen(url, timeout=2) as response:
                    answer = json.loads(response.read())
                break
            except OSError:
                time.sleep(0.5)
        environ = Path(f"/proc/{server.pid}/environ").read_bytes().split(b"\0")
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)
    assert b"MLFLOW_DISABLE_TELEMETRY=true" in environ, command
    assert answer is not None and answer["disable_ui_telemetry"] is True, answer
