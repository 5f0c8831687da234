"""`Params` ends at the stage: only the entries and the plans' constructors see the whole params.

The stage entries (`pipeline/stages/`), the other commands (`pipeline/commands/`), the node checks
(`pipeline/checks/`), the CLI, the flows and the config package itself may import `Params`; so may the plan
modules (`pipeline/{data,train,evaluation}/plan.py`, `pipeline/train/merge_plan.py`), whose constructors turn the
params into a plan once.
Every other module takes its own typed spec or config section, so a reader sees what a service depends on
from its signature. No plan dataclass keeps the whole `Params` in a field either.

Imports are counted wherever they are: module level, inside functions and under `TYPE_CHECKING`.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ALLOWED_DIRS = ("pipeline/stages/", "pipeline/commands/", "pipeline/checks/", "pipeline/config/", "flows/")
ALLOWED_FILES = ("pipeline/cli.py", "pipeline/data/plan.py", "pipeline/train/plan.py", "pipeline/train/merge_plan.py",
                 "pipeline/evaluation/plan.py")


def imports_params(tree: ast.AST) -> list[int]:
    """Line numbers where a module imports `Params` from the project's config (or names `config.Params`)."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pipeline.config"):
            lines += [node.lineno for alias in node.names if alias.name == "Params"]
        elif isinstance(node, ast.Attribute) and node.attr == "Params":
            lines.append(node.lineno)
    return lines


def params_importers(root: Path) -> dict[str, list[int]]:
    """Every module of `pipeline/` and `flows/` outside the allowed places that imports `Params`."""
    found = {}
    for package in ("pipeline", "flows"):
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if rel.startswith(ALLOWED_DIRS) or rel in ALLOWED_FILES:
                continue
            if lines := imports_params(ast.parse(path.read_text(encoding="utf-8"), filename=rel)):
                found[rel] = lines
    return found


def plan_fields_holding_params(root: Path) -> list[str]:
    """`file:Class.field` for every annotated class field whose type mentions `Params`, in every module but the
    config package and the node checks (the doctor's shared state is a check's own context): plans (the
    plan modules' and a stage's own, like the gepa stage's) and services alike."""
    found = []
    for path in sorted((root / "pipeline").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(("pipeline/config/", "pipeline/checks/")):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
            for item in cls.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    names = {n.id for n in ast.walk(item.annotation) if isinstance(n, ast.Name)}
                    text = ast.unparse(item.annotation).replace("'", "").replace('"', "")
                    if "Params" in names or "Params" in [t.strip() for t in text.split("|")]:
                        found.append(f"{rel}:{cls.name}.{item.target.id}")
    return found


def test_only_entries_and_plan_constructors_import_params():
    found = params_importers(ROOT)
    assert not found, (
        "these modules import Params; give them the typed spec or config section they read instead:\n  "
        + "\n  ".join(f"{rel} (line {', '.join(map(str, lines))})" for rel, lines in found.items())
    )


def test_no_plan_holds_params():
    assert not plan_fields_holding_params(ROOT)


def test_the_rule_catches_a_service_that_imports_params(tmp_path):
    """The check can fail: a library module importing Params inside a function, or under TYPE_CHECKING, is named;
    a stage module and a plan module are not."""
    files = {
        "pipeline/environment/client.py": "def f():\n    from pipeline.config import Params\n",
        "pipeline/tracking/runs.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from pipeline.config.loading import Params\n",
        "pipeline/stages/train.py": "from pipeline.config import Params\n",
        "pipeline/train/plan.py": "from pipeline.config import Params\n",
        "flows/retrain.py": "import pipeline.config\nX = pipeline.config.Params\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert params_importers(tmp_path) == {"pipeline/environment/client.py": [2], "pipeline/tracking/runs.py": [3]}


def test_the_rule_catches_a_plan_field_holding_params(tmp_path):
    files = {
        "pipeline/data/plan.py": "class SamplePlan:\n    steps: int\n",
        "pipeline/train/plan.py": "class TrainPlan:\n    params: 'Params'\n    steps: int\n",
        "pipeline/stages/gepa.py": "class GepaPlan:\n    source: Params | None\n",
        "pipeline/checks/doctor_state.py": "class Doctor:\n    params: Params\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert plan_fields_holding_params(tmp_path) == ["pipeline/stages/gepa.py:GepaPlan.source",
                                                    "pipeline/train/plan.py:TrainPlan.params"]
