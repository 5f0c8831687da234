"""How the tests themselves are written: one slow convention, no test module importing another, no assertion
that cannot fail.

- Slow tests carry `@pytest.mark.slow` (or a module `pytestmark`); no `_slow` file names and no `tests/slow/`
  folder, so `pytest -m "not slow"` is the one way to leave them out.
- Shared code lives in conftest.py or a helper module (helpers.py, demo_project.py, fault_server.py,
  kill_points.py, verl_cpu.py); a test module importing another runs its module-level set-up and ties the two.
- `assert x if cond else True` passes whenever `cond` is false: such an assertion is written as
  `assert not cond or x`, which says the same and can fail.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def module_paths(root: Path = TESTS) -> list[Path]:
    return sorted(p for p in root.rglob("test_*.py") if "fixtures" not in p.relative_to(root).parts)


def imported_modules(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def convention_problems(root: Path = TESTS) -> list[str]:
    problems = []
    if (root / "slow").is_dir():
        problems.append("tests/slow/: mark slow tests with @pytest.mark.slow instead of a folder")
    for path in module_paths(root):
        where = path.relative_to(root.parent).as_posix()
        if path.stem.endswith("_slow"):
            problems.append(f"{where}: a `_slow` file name; mark the tests @pytest.mark.slow instead")
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for name in sorted(n for n in imported_modules(tree) if n.startswith("test_")):
            problems.append(
                f"{where} imports the test module {name}: move what it shares to tests/helpers.py"
            )
        for node in ast.walk(tree):
            if isinstance(node, ast.Assert) and isinstance(node.test, ast.IfExp):
                branches = (node.test.body, node.test.orelse)
                if any(isinstance(b, ast.Constant) and b.value for b in branches):
                    problems.append(
                        f"{where}:{node.lineno}: an assertion with a constant true branch cannot fail"
                    )
    return problems


def test_tests_follow_the_conventions():
    problems = convention_problems()
    assert not problems, "\n".join(problems)


def test_each_convention_is_caught(tmp_path):
    (tmp_path / "tests" / "slow").mkdir(parents=True)
    (tmp_path / "tests" / "test_a.py").write_text("from test_b import helper\nassert 1 if x else True\n")
    (tmp_path / "tests" / "test_b_slow.py").write_text("import test_a\n")
    assert convention_problems(tmp_path / "tests") == [
        "tests/slow/: mark slow tests with @pytest.mark.slow instead of a folder",
        "tests/test_a.py imports the test module test_b: move what it shares to tests/helpers.py",
        "tests/test_a.py:2: an assertion with a constant true branch cannot fail",
        "tests/test_b_slow.py: a `_slow` file name; mark the tests @pytest.mark.slow instead",
        "tests/test_b_slow.py imports the test module test_a: move what it shares to tests/helpers.py",
    ]
