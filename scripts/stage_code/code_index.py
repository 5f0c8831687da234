"""The code a stage runs, by unit, and the params tree it reads: the index param_reads.py walks.

A unit is a module-level function, class (its body and dunder methods) or constant, or a method; `reachable`
follows names from a stage's entry function through the stage's import closure, over-approximating (a method
by its name, whatever the object) so that no call, callback or property is missed.
"""

from __future__ import annotations

import ast
import functools
import typing
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel

from pipeline.config import Params

from .closure import module_file

Key = tuple[str, ...]


# --------------------------------------------------------------------------------------------- the params tree
def _model_of(annotation: object) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        if model := _model_of(arg):
            return model
    return None


def _tree() -> tuple[dict[Key, type[BaseModel] | None], dict[str, set[Key]]]:
    """Every key of Params (→ its model, None for a leaf) and every section model's keys (by class name)."""
    nodes: dict[Key, type[BaseModel] | None] = {(): Params}
    classes: dict[str, set[Key]] = {"Params": {()}}

    def walk(model: type[BaseModel], key: Key) -> None:
        for name, info in model.model_fields.items():
            if info.exclude:  # Params.root: set by load_params, not a key of params.yaml
                continue
            sub = _model_of(info.annotation)
            nodes[(*key, name)] = sub
            if sub is not None:
                classes.setdefault(sub.__name__, set()).add((*key, name))
                walk(sub, (*key, name))

    walk(Params, ())
    return nodes, classes


NODES, SECTION_KEYS = _tree()


def leaves(key: Key) -> set[Key]:
    """The leaf keys at or below `key`."""
    return {k for k, model in NODES.items() if model is None and k[: len(key)] == key}


def dotted(key: Key) -> str:
    return ".".join(key)


def parse_key(text: str) -> Key:
    return tuple(text.split(".")) if text else ()


# --------------------------------------------------------------------------------------------- code units
@dataclass
class Unit:
    """A function, method, class (its body and dunder methods) or module-level assignment of a file."""

    file: Path
    name: str
    nodes: list[ast.AST]
    cls: str | None = None  # the class a method belongs to
    method: bool = False  # reached through an attribute (`obj.name`), not a bare name


@dataclass
class Index:
    units: dict[str, list[Unit]] = field(default_factory=dict)  # short name → units
    functions: dict[str, list[ast.FunctionDef | ast.AsyncFunctionDef]] = field(default_factory=dict)
    self_attrs: dict[tuple[str, str], set[Key]] = field(default_factory=dict)  # (class, attribute) → keys
    field_attrs: dict[str, set[Key]] = field(default_factory=dict)  # a class field annotated as a section
    tables: dict[str, list[str]] = field(default_factory=dict)  # module-level dict → the function names in it
    defined_in: dict[Path, set[ast.AST]] = field(default_factory=dict)  # file → the functions it defines

    methods: dict[str, list[Unit]] = field(default_factory=dict)  # method name → units
    module_aliases: dict[Path, set[str]] = field(default_factory=dict)  # file → names bound to modules

    def add(self, unit: Unit) -> None:
        (self.methods if unit.method else self.units).setdefault(unit.name, []).append(unit)


def annotation_keys(node: ast.AST | None) -> set[Key]:
    """Keys a type annotation names: `Params`, `EnvironmentConfig | None`, `"ServerConfig"` …"""
    if node is None:
        return set()
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        try:
            return annotation_keys(ast.parse(node.value, mode="eval").body)
        except SyntaxError:
            return set()
    if isinstance(node, ast.Name):
        return set(SECTION_KEYS.get(node.id, set()))
    if isinstance(node, ast.Attribute):
        return set(SECTION_KEYS.get(node.attr, set()))
    if isinstance(node, ast.BinOp):
        return annotation_keys(node.left) | annotation_keys(node.right)
    if isinstance(node, ast.Subscript):
        return annotation_keys(node.slice)
    if isinstance(node, ast.Tuple):
        return set().union(*(annotation_keys(e) for e in node.elts))
    return set()


def _registrars(tree: ast.Module) -> dict[str, str]:
    """Decorator factories that put the function they decorate into a module-level table
    (`SERVER_LAUNCHERS[backend] = fn`): factory name → table name."""
    out: dict[str, str] = {}
    for fn in tree.body:
        if isinstance(fn, ast.FunctionDef):
            for node in ast.walk(fn):
                if isinstance(node, ast.Assign):
                    for target in node.targets:
                        if isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name):
                            out[fn.name] = target.value.id
    return out


def _module_aliases(tree: ast.Module) -> set[str]:
    """Names a file binds to repo modules (`import pipeline.x as y`, `from pipeline.tracking import runs as tracking`)."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.asname or alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.update(
                alias.asname or alias.name
                for alias in node.names
                if module_file(f"{node.module}.{alias.name}") is not None
                and module_file(f"{node.module}.{alias.name}").stem in (alias.name, "__init__")
            )
    return out


def _field_init(cls: ast.ClassDef) -> ast.FunctionDef | None:
    """The `__init__` a class without one gets from its annotated fields (dataclass, NamedTuple, pydantic),
    so that `Plan(env=params.environment)` hands the section to a field annotated to hold it."""
    if any(isinstance(n, ast.FunctionDef) and n.name == "__init__" for n in cls.body):
        return None
    fields = [n for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]
    if not fields:
        return None
    args = [ast.arg(arg="self"), *(ast.arg(arg=n.target.id, annotation=n.annotation) for n in fields)]
    signature = ast.arguments(posonlyargs=[], args=args, kwonlyargs=[], kw_defaults=[], defaults=[])
    return ast.FunctionDef(name="__init__", args=signature, body=[], decorator_list=[], type_params=[])


@functools.cache
def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def build_index(files: set[Path]) -> Index:
    index = Index()
    for path in sorted(files):
        tree = _parse(path)
        registrars = _registrars(tree)
        index.module_aliases[path] = _module_aliases(tree)
        for node in tree.body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                index.add(Unit(path, node.name, [node]))
                index.functions.setdefault(node.name, []).append(node)
                index.defined_in.setdefault(path, set()).add(node)
                for (
                    decorator
                ) in node.decorator_list:  # `@register_launcher("vllm")`: reached through its table
                    factory = decorator.func if isinstance(decorator, ast.Call) else decorator
                    if isinstance(factory, ast.Name) and factory.id in registrars:
                        index.tables.setdefault(registrars[factory.id], []).append(node.name)
                        index.add(Unit(path, registrars[factory.id], [node]))
            elif isinstance(node, ast.ClassDef):
                body = [n for n in node.body if not isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
                dunders = [
                    n
                    for n in node.body
                    if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name.startswith("__")
                ]
                index.add(
                    Unit(path, node.name, [*node.decorator_list, *node.bases, *body, *dunders], node.name)
                )
                for item in node.body:
                    if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                        if not item.name.startswith("__"):  # dunders: part of the class's own unit
                            index.add(Unit(path, item.name, [item], node.name, method=True))
                        index.functions.setdefault(
                            node.name if item.name == "__init__" else item.name, []
                        ).append(item)
                        index.defined_in.setdefault(path, set()).add(item)
                    elif (
                        isinstance(item, ast.AnnAssign)
                        and isinstance(item.target, ast.Name)
                        and node.name not in SECTION_KEYS  # the section models are the tree itself
                        and (keys := annotation_keys(item.annotation))
                    ):
                        index.self_attrs.setdefault((node.name, item.target.id), set()).update(keys)
                        index.field_attrs.setdefault(item.target.id, set()).update(keys)
                if node.name not in index.functions and (init := _field_init(node)):
                    index.functions[node.name] = [init]  # a dataclass/NamedTuple: its generated __init__
                    index.defined_in.setdefault(path, set()).add(init)
            elif isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if isinstance(node.value, ast.Dict):
                    for target in targets:
                        if isinstance(target, ast.Name):
                            index.tables[target.id] = [
                                v.id for v in node.value.values if isinstance(v, ast.Name)
                            ]
                for target in targets:
                    for name in ast.walk(target):
                        if isinstance(name, ast.Name):
                            index.add(Unit(path, name.id, [node]))
    return index


def mentioned(unit: Unit, index: Index) -> list[Unit]:
    """Units a unit's code may run: bare names reach module-level functions, classes and constants;
    `obj.name` reaches every method of that name, and a module's function when `obj` is a module."""
    aliases = index.module_aliases.get(unit.file, set())
    out: list[Unit] = []
    for root in unit.nodes:
        for node in ast.walk(root):
            if isinstance(node, ast.Name):
                out += index.units.get(node.id, [])
            elif isinstance(node, ast.Attribute):
                out += index.methods.get(node.attr, [])
                if isinstance(node.value, ast.Name) and node.value.id in aliases:
                    out += index.units.get(node.attr, [])
    return out


def reachable(
    index: Index, roots: set[str], skip: frozenset[str] = frozenset()
) -> dict[int, tuple[Unit, Unit | None]]:
    """Units reachable from the root names: id → (unit, the unit that first mentioned it)."""
    out: dict[int, tuple[Unit, Unit | None]] = {}
    todo: list[tuple[Unit, Unit | None]] = [(u, None) for name in roots for u in index.units.get(name, [])]
    while todo:
        unit, via = todo.pop()
        if id(unit) in out or unit.name in skip:
            continue
        out[id(unit)] = (unit, via)
        todo.extend((u, unit) for u in mentioned(unit, index))
    return out
