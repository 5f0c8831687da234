"""Functions a reader takes in at once and modules a reader walks through: no function in pipeline/ or flows/
over 60 lines (a def's `end_lineno - lineno + 1`, nested defs counting inside their parent too) and no module
over 400 lines. A longer one is split into steps that each have a name."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 400


def _files(root: Path) -> list[Path]:
    return sorted(p for package in ("pipeline", "flows") for p in (root / package).rglob("*.py"))


def long_functions(root: Path, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """`path:line name (n lines)` for every def over `limit` lines."""
    found = []
    for path in _files(root):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = node.end_lineno - node.lineno + 1
                if n > limit:
                    found.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({n} lines)")
    return found


def long_modules(root: Path, limit: int = MAX_MODULE_LINES) -> list[str]:
    """`path (n lines)` for every module over `limit` lines."""
    return [f"{p.relative_to(root)} ({n} lines)" for p in _files(root)
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > limit]


def test_no_function_over_60_lines() -> None:
    found = long_functions(ROOT)
    assert not found, "functions over 60 lines (split them into named steps):\n" + "\n".join(found)


def test_no_module_over_400_lines() -> None:
    found = long_modules(ROOT)
    assert not found, "modules over 400 lines (split them by what they do):\n" + "\n".join(found)


def test_the_limits_can_fail(tmp_path: Path) -> None:
    """A 61-line function and a 401-line module are found; a 60-line function and a 400-line module are not."""
    (tmp_path / "pipeline").mkdir()
    body = "".join(f"    x{i} = {i}\n" for i in range(59))
    (tmp_path / "pipeline" / "a.py").write_text("def fits():\n" + body + "\n\ndef long():\n" + body + "    x = 1\n")
    (tmp_path / "pipeline" / "b.py").write_text("x = 1\n" * 401)
    (tmp_path / "pipeline" / "c.py").write_text("x = 1\n" * 400)
    assert long_functions(tmp_path) == ["pipeline/a.py:63 long (61 lines)"]
    assert long_modules(tmp_path) == ["pipeline/b.py (401 lines)"]
