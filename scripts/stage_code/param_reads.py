"""Which params keys a dvc.yaml stage's code reads: a static analysis of its reachable functions.

DVC reruns a stage when a listed param changes, so a stage must list every key its code reads (else a changed
result is "up to date") and no key it does not (else editing `mlflow.trace_evaluation` reruns training). The
truth is computed:

- **Reachable code.** From the function the stage's `promptr1` verb calls (`pipeline.cli.STAGE_COMMANDS`),
  every function, method, class and module-level constant of the stage's import closure
  (`closure.stage_closure`) whose name the reachable code mentions, by name (a method by its attribute
  name, whatever the object: an over-approximation that never misses a call, a callback or a property).
  The CLI's own stage path is not a root: its layout check only refuses to start and its closing key figure
  only prints, neither changes an output.
- **Reads.** Within reachable code, a name is a params node when it is a parameter or variable annotated
  `Params` or a section model (`EnvironmentConfig` → `environment`, `ServerConfig` → `environment.server`,
  …), an alias of one (`env = params.environment`, `x = env.model_copy(...)`), an attribute that a class
  declares or sets to one (`self.cfg = cfg`, a dataclass field `environment: EnvironmentConfig`), or the
  result of a repo function annotated to return one. Attribute chains on nodes are keys (`params.train.lr`);
  a property or method of a section model reads what its body reads (`env.url` → base_url, host, port).
- **Whole reads.** A section read as a whole (`model_dump`, `getattr` with a computed name, passed to a
  library function or to a repo function whose parameter is not annotated as a section, returned unannotated,
  put in a container) reads every key below it. `getattr` over a literal tuple of names reads those names;
  `param_value` reads the `$a.b` keys of pipeline/train/verl/overrides.yaml (DATA_READERS). `flatten`
  (pipeline.config) and `training_params` (pipeline.train.mlflow_record) are MLflow's params view of a run: they
  show keys and change no output, so they are
  not counted (DISPLAY_ONLY).

Limits: code that another process imports by name is not followed (verl's agent-loop workers: the keys
`pipeline.train.verl.worker_client.LoopSettings.from_params_file` reads are among train's anyway, but a new reader there
would be missed); a key overwritten in a copy (`model_copy(update=…)`) and read back counts as read (errs
towards listing it). tests/test_dvc_params.py checks the result against the running code where that is cheap.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

from .closure import ROOT, stage_closure
from .code_index import (
    NODES,
    Index,
    Key,
    Unit,
    annotation_keys,
    build_index,
    dotted,
    leaves,
    parse_key,
    reachable,
)

DISPLAY_ONLY = frozenset({"flatten", "training_params"})
"""Repo functions whose reads only feed MLflow's display of a run: not followed, not counted."""
PASS_THROUGH = frozenset({"isinstance", "id", "type", "repr", "bool"})
"""Builtins that take a section without reading its keys."""


def _verl_override_keys() -> set[Key]:
    """The `$a.b` params pipeline/train/verl/overrides.yaml names (read through `param_value`)."""
    import yaml

    table = yaml.safe_load(
        (ROOT / "pipeline" / "train" / "verl" / "overrides.yaml").read_text(encoding="utf-8")
    )
    return {parse_key(v[1:]) for v in table.values() if isinstance(v, str) and v.startswith("$")}


DATA_READERS = {"param_value": _verl_override_keys}
"""Repo functions that read the keys a data file names (`getattr` by name): their reads are that file's keys."""
WHOLE_METHODS = frozenset(
    {"model_dump", "model_dump_json", "__dict__", "__iter__", "items", "keys", "values"}
)
"""Pydantic/dict members that read every key of the section they are called on."""


# --------------------------------------------------------------------------------------------- reads
@dataclass
class Reads:
    keys: set[Key] = field(default_factory=set)  # leaf keys read
    whole: dict[Key, list[str]] = field(default_factory=dict)  # section read whole → where and why

    def add_whole(self, key: Key, where: str) -> None:
        self.whole.setdefault(key, []).append(where)
        self.keys |= leaves(key)


SECTION_FILES = ("sections.py", "environment.py")
"""The files of pipeline/config/ whose section models have public properties or methods."""


def _member_reads() -> dict[tuple[str, str], tuple[Path, ast.FunctionDef]]:
    """(section model class, property/method) → its file and definition (one of SECTION_FILES)."""
    members: dict[tuple[str, str], tuple[Path, ast.FunctionDef]] = {}
    for name in SECTION_FILES:
        path = ROOT / "pipeline" / "config" / name
        tree = ast.parse(path.read_text(encoding="utf-8"))
        members.update(
            ((cls.name, fn.name), (path, fn))
            for cls in tree.body
            if isinstance(cls, ast.ClassDef)
            for fn in cls.body
            if isinstance(fn, ast.FunctionDef) and not fn.name.startswith("_")
        )
    return members


MEMBERS = _member_reads()


class FunctionReads:
    """The keys one unit reads (flow-insensitive: every alias anywhere in the unit counts everywhere)."""

    def __init__(self, unit: Unit, index: Index, reads: Reads, self_keys: set[Key] | None = None) -> None:
        self.unit, self.index, self.reads = unit, index, reads
        self.env: dict[str, set[Key]] = {}
        self.parents: dict[int, ast.AST] = {}
        for root in unit.nodes:
            for node in ast.walk(root):
                for child in ast.iter_child_nodes(node):
                    self.parents[id(child)] = node
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                    args = node.args
                    for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs]:
                        if keys := annotation_keys(arg.annotation):
                            self.env.setdefault(arg.arg, set()).update(keys)
                elif (
                    isinstance(node, ast.AnnAssign)
                    and isinstance(node.target, ast.Name)
                    and (keys := annotation_keys(node.annotation))
                ):
                    self.env.setdefault(node.target.id, set()).update(keys)
        if self_keys:
            self.env["self"] = set(self_keys)
        for _ in range(3):  # aliases of aliases
            for root in unit.nodes:
                for node in ast.walk(root):
                    if (
                        isinstance(node, ast.Assign | ast.AnnAssign | ast.NamedExpr)
                        and node.value is not None
                    ):
                        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                        keys = self.resolve(node.value, record=False)
                        for target in targets:
                            if keys and isinstance(target, ast.Name):
                                self.env.setdefault(target.id, set()).update(keys)
                            elif (
                                keys
                                and isinstance(target, ast.Attribute)
                                and _is_self(target.value)
                                and unit.cls
                            ):
                                index.self_attrs.setdefault((unit.cls, target.attr), set()).update(keys)
                        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Tuple):
                            for target in node.targets:  # `t, a = params.train, params.agent`
                                if isinstance(target, ast.Tuple) and len(target.elts) == len(node.value.elts):
                                    for name, value in zip(target.elts, node.value.elts, strict=True):
                                        keys = self.resolve(value, record=False)
                                        if keys and isinstance(name, ast.Name):
                                            self.env.setdefault(name.id, set()).update(keys)

    def where(self, node: ast.AST) -> str:
        path = self.unit.file
        shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
        return f"{shown}:{getattr(node, 'lineno', '?')}"

    def resolve(self, node: ast.AST, record: bool = True) -> set[Key]:
        """The params keys an expression evaluates to (empty: not a params node)."""
        if isinstance(node, ast.Name):
            return set(self.env.get(node.id, set()))
        if isinstance(node, ast.Attribute):
            return self._attribute(node.value, node.attr, node, record)
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr == "model_copy":
                return self.resolve(func.value, record)
            if isinstance(func, ast.Name) and func.id == "getattr" and len(node.args) >= 2:
                name = node.args[1]
                if isinstance(name, ast.Constant) and isinstance(name.value, str):
                    return self._attribute(node.args[0], name.value, node, record)
                if isinstance(name, ast.Name) and (attrs := self._loop_constants(name.id)):
                    return set().union(*(self._attribute(node.args[0], a, node, record) for a in attrs))
                return set()
            name = (
                func.id
                if isinstance(func, ast.Name)
                else func.attr
                if isinstance(func, ast.Attribute)
                else ""
            )
            return set().union(*(annotation_keys(fn.returns) for fn in self.index.functions.get(name, [])))
        if isinstance(node, ast.IfExp):
            return self.resolve(node.body, record) | self.resolve(node.orelse, record)
        if isinstance(node, ast.BoolOp):
            return set().union(*(self.resolve(v, record) for v in node.values))
        if isinstance(node, ast.NamedExpr):
            return self.resolve(node.value, record)
        return set()

    def _loop_constants(self, name: str) -> list[str]:
        """The strings a loop variable takes when it runs over a literal tuple or list of them."""
        for root in self.unit.nodes:
            for node in ast.walk(root):
                if (
                    isinstance(node, ast.For | ast.comprehension)
                    and isinstance(node.target, ast.Name)
                    and node.target.id == name
                    and isinstance(node.iter, ast.Tuple | ast.List)
                    and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.iter.elts)
                ):
                    return [e.value for e in node.iter.elts]
        return []

    def _attribute(self, base: ast.AST, attr: str, node: ast.AST, record: bool) -> set[Key]:
        keys = self.resolve(base, record)
        if not keys and _is_self(base):
            return set(self.index.self_attrs.get((self.unit.cls or "", attr), set()))
        if not keys and isinstance(base, ast.Name):  # an object of a class with a section-typed field
            return set(self.index.field_attrs.get(attr, set()))
        out: set[Key] = set()
        for key in keys:
            model = NODES[key]
            if model is not None and attr in model.model_fields and (*key, attr) in NODES:
                out.add((*key, attr))
            elif model is not None and record and (model.__name__, attr) in MEMBERS:
                path, definition = MEMBERS[(model.__name__, attr)]
                member = Unit(path, attr, [definition])
                FunctionReads(member, self.index, self.reads, self_keys={key}).run()
            elif model is not None and record and attr in WHOLE_METHODS:
                self.reads.add_whole(key, f"{self.where(node)} ({attr})")
        return out

    def run(self) -> None:
        for root in self.unit.nodes:
            for node in ast.walk(root):
                if not isinstance(node, ast.Name | ast.Attribute | ast.Call):
                    continue
                if isinstance(node, ast.Name | ast.Attribute) and not isinstance(node.ctx, ast.Load):
                    continue
                keys = self.resolve(node, record=isinstance(node, ast.Attribute))
                self.reads.keys |= {k for k in keys if NODES[k] is None}
                sections = {k for k in keys if NODES[k] is not None}
                if sections:
                    self._use(node, sections)

    def _use(self, node: ast.AST, sections: set[Key]) -> None:
        """A section node used as a value: fine when it is aliased, read further, tested for presence or handed
        to a repo function that takes a section; else every key below it is read."""
        if not self._followed(node):
            for key in sections:
                self.reads.add_whole(key, f"{self.where(node)} ({type(self.parents.get(id(node))).__name__})")

    def _followed(self, node: ast.AST) -> bool:
        """Whether the analysis follows where this section value goes (so it need not count it whole)."""
        parent = self.parents.get(id(node))
        grandparent = self.parents.get(id(parent))
        if isinstance(
            parent, ast.Attribute | ast.Assign | ast.AnnAssign | ast.NamedExpr | ast.IfExp | ast.BoolOp
        ):
            return True  # read further, aliased (the alias is followed) or one branch of a value
        if isinstance(parent, ast.If | ast.While | ast.Assert) and parent.test is node:
            return True  # `if models.lora:` asks whether an optional section is there, reads none of its keys
        if isinstance(parent, ast.UnaryOp) and isinstance(parent.op, ast.Not):
            return True
        if isinstance(parent, ast.Compare) and all(isinstance(op, ast.Is | ast.IsNot) for op in parent.ops):
            return True
        if isinstance(parent, ast.Tuple) and isinstance(grandparent, ast.Assign):
            return all(
                isinstance(t, ast.Tuple) for t in grandparent.targets
            )  # `t, a = params.train, params.agent`
        if isinstance(parent, ast.Return):
            return self._returns_section()  # the caller's variable is typed by the return annotation
        if isinstance(parent, ast.Call):
            if isinstance(parent.func, ast.Name) and parent.func.id in (PASS_THROUGH | DISPLAY_ONLY):
                return True
            return parent.func is node or self._handed_to_section_parameter(parent, node)
        if isinstance(parent, ast.keyword) and isinstance(grandparent, ast.Call):
            return self._handed_to_section_parameter(grandparent, node)
        return False

    def _callees(self, name: str) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
        """Repo functions a call by this name may reach: those of the caller's file when it defines one."""
        found = self.index.functions.get(name, [])
        local = [fn for fn in found if fn in self.index.defined_in.get(self.unit.file, set())]
        return local or found

    def _returns_section(self) -> bool:
        return any(
            isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef) and annotation_keys(fn.returns)
            for fn in self.unit.nodes
        )

    def _handed_to_section_parameter(self, call: ast.Call, arg: ast.AST) -> bool:
        """Whether every repo function this call may reach takes `arg` in a parameter annotated as a section."""
        func, args = call.func, list(call.args)
        if isinstance(func, ast.Name) and func.id == "partial" and args:  # functools.partial(f, …)
            func, args = args[0], args[1:]
        if isinstance(func, ast.Subscript) and isinstance(func.value, ast.Name):  # TABLE[key](…)
            names = self.index.tables.get(func.value.id, [])
        elif isinstance(func, ast.Name):
            names = [self.unit.cls or "" if func.id in ("cls", "self") else func.id]
        else:
            names = [func.attr] if isinstance(func, ast.Attribute) else []
        candidates = [fn for name in names for fn in self._callees(name)]
        if not candidates:
            return False
        for fn in candidates:
            params = [*fn.args.posonlyargs, *fn.args.args]
            if params and params[0].arg in ("self", "cls"):
                params = params[1:]
            if arg in args:
                position = args.index(arg)
                target = params[position] if position < len(params) else fn.args.vararg
            else:
                keyword = next(k for k in call.keywords if k.value is arg)
                target = next(
                    (p for p in [*params, *fn.args.kwonlyargs] if p.arg == keyword.arg), fn.args.kwarg
                )
            if target is None or not annotation_keys(target.annotation):
                return False
        return True


def _is_self(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id == "self"


def stage_roots(verb: str) -> set[str]:
    """The function names `promptr1 <verb>` calls: a `module:function` row's function, or the names a
    written-out command imports lazily."""
    from pipeline.cli import STAGE_COMMANDS

    command = STAGE_COMMANDS[verb]
    if target := getattr(command, "target", None):
        return {target.split(":")[1]}
    body = ast.parse(textwrap.dedent(inspect.getsource(command)))
    return {
        alias.asname or alias.name
        for node in ast.walk(body)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pipeline")
        for alias in node.names
    }


def code_reads(files: set[Path], roots: set[str]) -> Reads:
    """Every params key the functions named `roots` read, through everything of `files` they reach
    (`profile` always: it picks the profile pipeline.config merges in)."""
    index = build_index(files)
    units = [unit for unit, _ in reachable(index, roots, DISPLAY_ONLY).values()]
    reads = Reads(keys={("profile",)})
    for _ in range(2):  # the first pass collects `self.x = <section>` attributes the second pass resolves
        for unit in units:
            if unit.name in DATA_READERS:
                for key in DATA_READERS[unit.name]():
                    reads.keys |= leaves(key)
                continue
            FunctionReads(unit, index, reads).run()
    return reads


def stage_reads(verb: str) -> Reads:
    """Every params key `promptr1 <verb>` reads."""
    return code_reads(stage_closure(verb), stage_roots(verb))


def uncovered(reads: set[Key], declared: list[str]) -> list[str]:
    """Keys read but not declared (a declared section covers every key below it)."""
    covered = set().union(*(leaves(parse_key(d)) for d in declared))
    return sorted(dotted(k) for k in reads - covered)


def overdeclared(reads: set[Key], declared: list[str]) -> dict[str, list[str]]:
    """Declared keys that are not params keys, or cover keys the code does not read (→ those keys)."""
    out: dict[str, list[str]] = {}
    for d in declared:
        key = parse_key(d)
        if key not in NODES:
            out[d] = ["(no such key in pipeline.config.Params)"]
        elif unread := sorted(dotted(k) for k in leaves(key) - reads):
            out[d] = unread
    return out
