"""Which repo files each dvc.yaml stage runs: its verb's import closure, the CLI's stage path, the modules it
launches by name, and the package data files that code names.

DVC reruns a stage only when a listed dep or param changes, so both lists are computed from the code, not
written by hand: scripts/dvc_lists.py writes them into dvc.yaml, tests/test_dvc_deps.py checks a stage's deps
cover these files, tests/test_dvc_params.py reads the params that code reads. The analysis reads the CLI's
stage table (`pipeline.cli.STAGE_COMMANDS`), so it sits above the package's entry points and lives here with
the script, not in the package.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import yaml

from .folders import hashed_files

ROOT = Path(__file__).resolve().parents[2]
CODE_PACKAGES = ("pipeline", "flows")


def module_file(name: str) -> Path | None:
    """The file of a dotted module name inside the repo (package → its __init__.py), or None if outside."""
    if name.split(".")[0] not in CODE_PACKAGES:
        return None
    base = ROOT.joinpath(*name.split("."))
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    return None


def imported_modules(path: Path) -> set[str]:
    """Dotted names a file imports, at any depth of its body (lazy imports included)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    else:
        package = package.removesuffix(".__init__")
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                anchor = parts[: len(parts) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)  # `from pkg import submodule`
    return names


def with_parents(name: str) -> list[str]:
    """`a.b.c` → `a`, `a.b`, `a.b.c`: importing a module runs every parent package's __init__ first."""
    parts = name.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def import_closure(module: str) -> set[Path]:
    """Repo files executed when `module` is imported and its functions run (lazy imports followed)."""
    seen: set[Path] = set()
    todo = [module]
    while todo:
        for name in with_parents(todo.pop()):
            path = module_file(name)
            if path is None or path in seen:
                continue
            seen.add(path)
            todo.extend(imported_modules(path))
    return seen


def verb_modules() -> dict[str, set[str]]:
    """`promptr1` stage verb → the repo modules that implement it.

    `pipeline.cli.STAGE_COMMANDS` maps each verb to a command that either names its `module:function`
    (`command.target`) or, for commands with arguments of their own, imports its module lazily in its body.
    """
    import inspect
    import textwrap

    from pipeline.cli import STAGE_COMMANDS

    verbs: dict[str, set[str]] = {}
    for verb, command in STAGE_COMMANDS.items():
        target = getattr(command, "target", None)
        if target:
            verbs[verb] = {target.split(":")[0]}
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(command)))
        verbs[verb] = {
            n.module
            for n in ast.walk(body)
            if isinstance(n, ast.ImportFrom) and n.module and module_file(n.module)
        }
    return verbs


def render(text: str, params: dict, item: str | None) -> str:
    """DVC's `${paths.x}` / `${item}` templating, enough for dvc.yaml's use of it."""

    def lookup(match: re.Match) -> str:
        key = match.group(1)
        if key == "item":
            return item or ""
        value = params
        for part in key.split("."):
            value = value[part]
        return str(value)

    return re.sub(r"\$\{([^}]+)\}", lookup, text)


def stages() -> list[tuple[str, str, list[str]]]:
    """(stage name, verb, rendered deps) for every stage of dvc.yaml (a foreach stage: its first item)."""
    params = yaml.safe_load((ROOT / "params.yaml").read_text(encoding="utf-8"))
    dvc = yaml.safe_load((ROOT / "dvc.yaml").read_text(encoding="utf-8"))
    out = []
    for name, stage in dvc["stages"].items():
        item = None
        if "foreach" in stage:
            items = (
                render(stage["foreach"], params, None)
                if isinstance(stage["foreach"], str)
                else stage["foreach"]
            )
            item = yaml.safe_load(items)[0] if isinstance(items, str) else items[0]
            stage = stage["do"]
        deps = [
            render(next(iter(d)) if isinstance(d, dict) else d, params, item) for d in stage.get("deps", [])
        ]
        verb = render(stage["cmd"], params, item).split()[1]
        out.append((name, verb, deps))
    return out


CLI_STAGE_PATH = ("main", "_load", "_load_runnable", "_run", "_run_stage", "_put_back_refused")
"""The functions of pipeline/cli.py every stage command runs through before and after its own module."""

REFUSAL_GUARDS = (
    "pipeline.checks.layout",
    "flows.override_guard",
    "pipeline.refused_experiment",
    "pipeline.disk_space",
)
"""Modules the CLI runs before a stage only to refuse it (the layout check, a killed flow's overrides) or once
it failed (putting back what a refused `dvc exp run` changed, wording a full disk): they change no output, so
they are not deps of every stage (editing the GPU layout rules must not rerun sampling)."""


def cli_modules() -> set[str]:
    """Repo modules the CLI runs for every stage and that can shape what it writes: cli.py's module-level
    imports and those inside the functions of CLI_STAGE_PATH (the params loading, logging, the closing key
    figure), not other commands' imports and not REFUSAL_GUARDS."""
    tree = ast.parse((ROOT / "pipeline" / "cli.py").read_text(encoding="utf-8"))
    nodes = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
    for fn in tree.body:
        if isinstance(fn, ast.FunctionDef) and fn.name in CLI_STAGE_PATH:
            nodes += [n for n in ast.walk(fn) if isinstance(n, ast.Import | ast.ImportFrom)]
    names: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    names = {n for n in names if not n.startswith(REFUSAL_GUARDS)}
    return {n for n in names if module_file(n)}


def stage_closure(verb: str) -> set[Path]:
    """Repo files `promptr1 <verb>` executes: the CLI's stage path, then the verb's own module."""
    # Not cli.py itself: it only dispatches (a new option or another command's help text must not rerun
    # training), and its other commands' lazy imports (`ask`, `flow …`) are not run by this verb.
    modules = verb_modules()[verb] | cli_modules()
    return set().union(*(import_closure(m) for m in modules))


RUN_BY_NAME = {
    "pipeline.environment.servers": ("pipeline.environment.llama_server",),
    "pipeline.train.verl.overrides": ("pipeline.train.verl.agent_loop", "pipeline.train.verl.reward"),
    "pipeline.serving.agent_model": ("pipeline.serving.model_code",),
}
"""Modules a stage's code runs without importing them (launcher → launched): llama.cpp's server started with
`python -m`, verl's agent loop and reward function (agent_loop.yaml's `_target_`, the reward file's path) that
verl's workers import, the pyfunc's model code MLflow loads from its file. The import closure does not see
them; a stage whose closure holds the launcher depends on the launched modules' closures too."""


def with_launched(files: set[Path]) -> set[Path]:
    """`files` and the closures of the modules they launch by name (RUN_BY_NAME), transitively."""
    files = set(files)
    launched: set[str] = set()
    while more := {
        name
        for launcher, names in RUN_BY_NAME.items()
        if module_file(launcher) in files
        for name in names
        if name not in launched
    }:
        launched |= more
        files |= set().union(*(import_closure(name) for name in more))
    return files


@functools.cache
def _strings(path: Path) -> frozenset[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    return frozenset(
        n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
    )


def package_data() -> list[Path]:
    """The files below the code packages that are not Python (templates, tables) and that DVC hashes."""
    return sorted(p for package in CODE_PACKAGES for p in hashed_files(ROOT / package) if p.suffix != ".py")


def names(module: Path, data: Path) -> bool:
    """Whether a module names a data file in a string: its file name when they share a folder
    (`Path(__file__).with_name("prompt_r1_template.txt")`, `files(package).joinpath("paper_results.yaml")`),
    else its repo path (`"pipeline/train/verl/overrides.yaml"`)."""
    path = str(data.relative_to(ROOT))
    return any(
        (s == data.name and module.parent == data.parent) or s == path or s.endswith(f"/{path}")
        for s in _strings(module)
    )


def named_data(files: set[Path]) -> set[Path]:
    """The package data files the modules among `files` name: the code reads them without importing them, so
    a stage that runs the module depends on them."""
    modules = [p for p in files if p.suffix == ".py"]
    return {data for data in package_data() if any(names(m, data) for m in modules)}


@functools.cache
def stage_files(verb: str) -> frozenset[Path]:
    """Every repo file `promptr1 <verb>` runs or reads as package data: its closure, what it launches by
    name, and the data files that code names."""
    files = with_launched(stage_closure(verb))
    return frozenset(files | named_data(files))
