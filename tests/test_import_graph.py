"""Imports point one way: no two modules of pipeline/ or flows/ import each other, directly or round a loop,
and no import climbs back up the layers.

The layers, top down: the entry points (`pipeline/cli.py`, `flows/`); the stage modules, the other commands
and the node checks (`pipeline/stages/`, `pipeline/commands/`, `pipeline/checks/`); everything else (the
libraries and the package root's leaves). A module may import its own layer or a lower one, never a higher:
a library that imported a stage would make the stage's dvc.yaml deps, and its readers, follow it back up.
Every import counts (module level, inside a function, under `TYPE_CHECKING`, relative): a shared piece moves
down to a module both import, it is not hidden in a function. tests/import_graph.py builds the graph.

Within the library layer two more rules: the training backends (pipeline/train/local/, pipeline/train/verl/)
import nothing of each other, and the shared part of pipeline/train/ imports neither, so either backend
reads, moves and tests on its own; and a few libraries do not reach sideways into a sibling (SIDEWAYS: the
agent and tracking import nothing from evaluation/, the environment nothing from pipeline.weights).
Within the stage layer, chains stay short: the node checks and the other commands import no stage module
(NO_STAGE); what a check or a command shares with a stage lives in a library both import.
"""

from __future__ import annotations

from pathlib import Path

from import_graph import cycles, import_graph

ROOT = Path(__file__).resolve().parents[1]


def _write_tree(root: Path, files: dict[str, str]) -> None:
    """A synthetic checkout: each relative path of `files` written with its text."""
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def _shown(found: list[list[str]]) -> str:
    return "\n".join(" -> ".join(cycle) for cycle in found)


ENTRY_LAYER = ("pipeline.cli", "flows")
STAGE_LAYER = ("pipeline.stages", "pipeline.commands", "pipeline.checks")


def layer(module: str) -> int:
    """2: an entry point; 1: a stage, command or node check; 0: a library or a leaf."""
    def within(prefixes: tuple[str, ...]) -> bool:
        return any(module == p or module.startswith(p + ".") for p in prefixes)

    return 2 if within(ENTRY_LAYER) else 1 if within(STAGE_LAYER) else 0


def climbing(graph: dict[str, set[str]]) -> list[str]:
    """`a -> b` for every import of a module in a higher layer than the importer's."""
    return sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets if layer(b) > layer(a))


def test_the_code_has_no_import_cycles() -> None:
    found = cycles(import_graph(ROOT))
    assert not found, f"import cycles (break each by moving the shared piece down):\n{_shown(found)}"


def test_no_import_climbs_back_up() -> None:
    found = climbing(import_graph(ROOT))
    assert not found, "imports of a higher layer (move the shared piece down):\n" + "\n".join(found)


def test_a_library_importing_a_stage_climbs(tmp_path: Path) -> None:
    """The layer rule itself: a library importing a stage module (lazily) and a stage importing the CLI climb;
    a stage importing a library, a check importing a stage and the CLI importing a stage do not."""
    files = {
        "pipeline/__init__.py": "",
        "pipeline/cli.py": "def train():\n    from pipeline.stages import train\n",
        "pipeline/stages/__init__.py": "",
        "pipeline/stages/train.py": "from pipeline.train.local import backend as local\n\ndef f():\n    import pipeline.cli\n",
        "pipeline/checks/__init__.py": "",
        "pipeline/checks/doctor.py": "from pipeline.stages.train import f\n",
        "pipeline/train/__init__.py": "",
        "pipeline/train/local/backend.py": "def g():\n    from pipeline.stages.train import f\n",
    }
    _write_tree(tmp_path, files)
    assert climbing(import_graph(tmp_path)) == ["pipeline.stages.train -> pipeline.cli",
                                                "pipeline.train.local.backend -> pipeline.stages.train"]


def test_a_cycle_through_lazy_typing_and_relative_imports_is_found(tmp_path: Path) -> None:
    """The checker itself: two modules that import each other only inside a function and under
    TYPE_CHECKING, through a relative import, are a cycle; a module importing a name of the package is not."""
    package = tmp_path / "pipeline"
    package.mkdir()
    (package / "__init__.py").write_text("VERSION = 1\n")
    (package / "a.py").write_text("def f():\n    from pipeline import b\n\n    return b\n")
    (package / "b.py").write_text(
        "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from . import a\n"
    )
    (package / "c.py").write_text("from pipeline import VERSION\nfrom pipeline.a import f\n")

    graph = import_graph(tmp_path)

    assert graph == {
        "pipeline": set(),
        "pipeline.a": {"pipeline.b"},
        "pipeline.b": {"pipeline.a"},
        "pipeline.c": {"pipeline", "pipeline.a"},
    }
    assert cycles(graph) == [["pipeline.a", "pipeline.b", "pipeline.a"]]
    assert _shown(cycles(graph)) == "pipeline.a -> pipeline.b -> pipeline.a"


TRAIN = "pipeline.train"
BACKENDS = (f"{TRAIN}.local", f"{TRAIN}.verl")


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def backend_crossings(graph: dict[str, set[str]]) -> list[str]:
    """`a -> b` for every import from one training backend into the other, and from the shared part of
    pipeline/train/ (its own modules, outside both backends' folders) into either backend."""
    def backend(module: str) -> str | None:
        return next((b for b in BACKENDS if _under(module, b)), None)

    found = []
    for a, targets in graph.items():
        if not _under(a, TRAIN):
            continue
        for b in targets:
            if backend(b) is not None and backend(a) != backend(b):
                found.append(f"{a} -> {b}")
    return sorted(found)


# Libraries that must not reach a sibling: (importer's package, the package it must not import).
SIDEWAYS = (
    ("pipeline.agent", "pipeline.evaluation"),
    ("pipeline.tracking", "pipeline.evaluation"),
    ("pipeline.environment", "pipeline.weights"),
)


# Stage-layer modules that must not import a stage: (importer's package, the package it must not import).
NO_STAGE = (
    ("pipeline.checks", "pipeline.stages"),
    ("pipeline.commands", "pipeline.stages"),
)


def forbidden(graph: dict[str, set[str]], rules: tuple[tuple[str, str], ...]) -> list[str]:
    """`a -> b` for every import from an importer's package into the package `rules` pairs it with."""
    return sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets
                  for low, banned in rules if _under(a, low) and _under(b, banned))


def sideways(graph: dict[str, set[str]]) -> list[str]:
    """`a -> b` for every import SIDEWAYS forbids."""
    return forbidden(graph, SIDEWAYS)


def stage_chains(graph: dict[str, set[str]]) -> list[str]:
    """`a -> b` for every import NO_STAGE forbids."""
    return forbidden(graph, NO_STAGE)


def test_the_training_backends_import_neither_each_other_nor_from_the_shared_part_upward() -> None:
    found = backend_crossings(import_graph(ROOT))
    assert not found, "imports across the training backends (move the shared piece to pipeline/train/):\n" + \
        "\n".join(found)


def test_agent_tracking_and_environment_import_no_sibling_they_must_not() -> None:
    found = sideways(import_graph(ROOT))
    assert not found, "sideways imports between libraries:\n" + "\n".join(found)


def test_checks_and_commands_import_no_stage() -> None:
    found = stage_chains(import_graph(ROOT))
    assert not found, "checks or commands importing a stage (move the shared piece into a library):\n" + \
        "\n".join(found)


def test_each_crossing_rule_can_fail(tmp_path: Path) -> None:
    """The rules themselves, on a synthetic tree: local -> verl, verl -> local and shared -> a backend cross;
    a backend -> shared, a backend -> its own modules and a stage -> both do not. agent -> evaluation,
    tracking -> evaluation and environment -> weights are sideways; evaluation -> agent is not. A check importing a
    stage (inside a function) and a command importing one are stage chains; a check importing a library and a
    stage importing another stage are not."""
    files = {
        "pipeline/__init__.py": "",
        "pipeline/weights.py": "",
        "pipeline/train/__init__.py": "",
        "pipeline/train/plan.py": "from pipeline.train.local import trainer\n",
        "pipeline/train/checkpoint.py": "",
        "pipeline/train/local/__init__.py": "",
        "pipeline/train/local/trainer.py": "from pipeline.train import checkpoint\nfrom pipeline.train.local import grpo\n",
        "pipeline/train/local/grpo.py": "def f():\n    from pipeline.train.verl import backend\n",
        "pipeline/train/verl/__init__.py": "",
        "pipeline/train/verl/backend.py": "from pipeline.train.local.grpo import f\nfrom pipeline.train import plan\n",
        "pipeline/stages/__init__.py": "",
        "pipeline/stages/train.py": "from pipeline.train.local import trainer\nfrom pipeline.train.verl import backend\n",
        "pipeline/agent/__init__.py": "",
        "pipeline/agent/policy.py": "from pipeline.evaluation import systems\n",
        "pipeline/tracking/__init__.py": "",
        "pipeline/tracking/promotion.py": "import pipeline.evaluation.systems\n",
        "pipeline/environment/__init__.py": "",
        "pipeline/environment/servers.py": "from pipeline import weights\n",
        "pipeline/evaluation/__init__.py": "",
        "pipeline/evaluation/systems.py": "from pipeline.agent import policy\n",
        "pipeline/stages/merge.py": "from pipeline.stages import train\n",
        "pipeline/checks/__init__.py": "",
        "pipeline/checks/doctor.py": "from pipeline.train import plan\n\ndef f():\n    from pipeline.stages import merge\n",
        "pipeline/commands/__init__.py": "",
        "pipeline/commands/serve.py": "import pipeline.stages.train\n",
    }
    _write_tree(tmp_path, files)
    graph = import_graph(tmp_path)
    assert backend_crossings(graph) == ["pipeline.train.local.grpo -> pipeline.train.verl.backend",
                                        "pipeline.train.plan -> pipeline.train.local.trainer",
                                        "pipeline.train.verl.backend -> pipeline.train.local.grpo"]
    assert sideways(graph) == ["pipeline.agent.policy -> pipeline.evaluation.systems",
                               "pipeline.environment.servers -> pipeline.weights",
                               "pipeline.tracking.promotion -> pipeline.evaluation.systems"]
    assert stage_chains(graph) == ["pipeline.checks.doctor -> pipeline.stages.merge",
                                   "pipeline.commands.serve -> pipeline.stages.train"]
