"""The import graph of the project's code and its cycles, read from the source with `ast`.

Test scaffolding, not part of the package (tests/ is on pytest's path; tests import it as `import_graph`).
Every import counts: at module level, inside functions and under `TYPE_CHECKING`, absolute or relative.
A lazy import still ties the two modules together (one cannot be read, moved or tested without the other),
so hiding an import in a function does not break a cycle here.

Resolution: `import a.b` is an import of the deepest project module it names (`a.b`, else `a`);
`from pkg import name` is an import of `pkg.name` when that is a module, else of `pkg`. Names outside the
scanned packages (the standard library, third-party packages) are left out, and so is a module's import of
itself.
"""

from __future__ import annotations

import ast
from pathlib import Path

CODE_PACKAGES = ("pipeline", "flows")
"""The top-level packages whose modules make up the graph."""


def module_files(root: Path, packages: tuple[str, ...] = CODE_PACKAGES) -> dict[str, Path]:
    """Dotted module name → its file, for every `.py` file under `root/<package>` (a package's
    `__init__.py` is the package itself)."""
    modules: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _imported_names(module: str, path: Path) -> set[tuple[str, str]]:
    """What one file's import statements name, anywhere in its body, relative ones made absolute: per name,
    (the module it is when that exists, else the name whose deepest project module it is). `import a.b` gives
    (`a.b`, `a.b`); `from pkg import name` gives (`pkg.name`, `pkg`)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[tuple[str, str]] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update((alias.name, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                anchor = parts[: len(parts) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            names.update((f"{base}.{alias.name}", base) for alias in node.names)
    return names


def _resolve(exact: str, fallback: str, modules: dict[str, Path]) -> str | None:
    """`exact` when it is a project module, else the deepest project module `fallback` lies in, else None."""
    if exact in modules:
        return exact
    name = fallback
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(root: Path, packages: tuple[str, ...] = CODE_PACKAGES) -> dict[str, set[str]]:
    """Module → the project modules it imports (module docstring: what counts and how names resolve)."""
    modules = module_files(root, packages)
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        targets = {_resolve(exact, fallback, modules) for exact, fallback in _imported_names(module, path)}
        graph[module] = {t for t in targets if t is not None and t != module}
    return graph


def _components(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for succ in successors:
                if succ not in graph:
                    continue
                if succ not in index:
                    index[succ] = low[succ] = len(index)
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph[succ]))))
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return sorted(found)


def _shortest_cycle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A shortest cycle through the component's first module, staying inside the component (breadth first)."""
    inside = set(component)
    start = component[0]
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for succ in sorted(graph[node] & inside):
                if succ == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if succ not in came_from:
                    came_from[succ] = node
                    following.append(succ)
        frontier = following
    raise AssertionError(f"{component} is not strongly connected")


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One import cycle per group of modules that import each other (a strongly connected component), as a
    closed path `[a, b, ..., a]` from the group's first module in name order; empty when the graph has none.
    A group may hold more cycles than the one shown: breaking it is what the empty result asks for."""
    return [_shortest_cycle(graph, component) for component in _components(graph)]
