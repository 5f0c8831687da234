"""Write dvc.yaml's `deps:` code entries and `params:` lists from the code; `--check` only reports.

    python scripts/dvc_lists.py            rewrite dvc.yaml in place
    python scripts/dvc_lists.py --check    write nothing, print the diff, exit 1 if dvc.yaml is not current

The truth is what tests/test_dvc_deps.py and tests/test_dvc_params.py check against, computed by the same
helpers: a stage's code deps are its verb's import closure plus the CLI's stage path
(`dvc_closure.stage_closure`) and the modules that code runs by name in another process (RUN_BY_NAME), one
file per line, sorted; its params are the keys its code reads (`param_reads.stage_reads`), leaf by leaf, a
section whole only where the stage reads every key of it and the section is not one of LEAF_ONLY_SECTIONS. The helpers stay in tests/ beside the tests that use them (they are
test scaffolding, importing the package and its `Params` tree); this script puts tests/ on `sys.path`.

The rewrite is line-based and touches only the items of each stage's `deps:` and `params:` blocks, so
comments, outs, plots, `foreach` and `${...}` templating stay as written. In `deps:`, entries outside
pipeline/ and flows/ (data, `profiles`) keep their place; the entries under pipeline/ and flows/ become one
sorted block where the first of them stood: the closure's `.py` files plus the non-code files kept there
(`.txt` templates, `.yaml` tables, which the code reads but does not import). In `params:`, entries that are
still exact keep their order (and comments); keys read but not listed are appended, sorted.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from code_index import NODES, Key, dotted, leaves, parse_key
from dvc_closure import CODE_PACKAGES, import_closure, module_file, stage_closure
from param_reads import stage_reads

LEAF_ONLY_SECTIONS = ("environment", "mlflow", "paths")
"""Top-level sections no stage lists whole: they hold keys for every stage (tests/test_dvc_params.py)."""

STAGE = re.compile(r"^  (?P<name>[\w-]+):\s*(#.*)?$")
BLOCK = re.compile(r"^(?P<indent> +)(?P<kind>deps|params):\s*$")
ITEM = re.compile(r"^(?P<indent> +)- (?P<value>.*?)(?P<comment>\s+#.*)?$")
CMD = re.compile(r"^ +cmd: promptr1 (?P<verb>[\w-]+)")


@dataclass
class Item:
    """One entry of a `deps:` or `params:` list, as written."""

    value: str
    """The entry without its comment (`pipeline/paths.py`, `train.lr`, `path:` for a mapping)."""
    lines: list[str] = field(default_factory=list)
    """Its lines in dvc.yaml: the `- ` line, then any deeper lines (a mapping's keys)."""


RUN_BY_NAME = {
    "pipeline.environment.servers": ("pipeline.environment.llama_server",),
    "pipeline.train.verl.overrides": ("pipeline.train.verl.agent_loop", "pipeline.train.verl.reward"),
    "pipeline.serving.agent_model": ("pipeline.serving.model_code",),
}
"""Modules a stage's code runs without importing them (launcher → launched): llama.cpp's server started with
`python -m`, verl's agent loop and reward function (agent_loop.yaml's `_target_`, the reward file's path) that
verl's workers import, the pyfunc's model code MLflow loads from its file. The import closure does not see
them; a stage whose closure holds the launcher depends on the launched modules' closures too."""


@functools.cache
def code_deps(verb: str) -> tuple[str, ...]:
    """The repo files `promptr1 <verb>` runs (its closure and what it launches by name), relative, sorted."""
    files = set(stage_closure(verb))
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
    return tuple(sorted(str(p.relative_to(ROOT)) for p in files))


@functools.cache
def param_reads(verb: str) -> frozenset[Key]:
    """The params leaf keys `promptr1 <verb>` reads."""
    return frozenset(stage_reads(verb).keys)


def _is_code_package(value: str) -> bool:
    return value.split("/")[0] in CODE_PACKAGES


def _is_code(value: str) -> bool:
    """A module or a package folder (its files are the closure's business), not a data file the code reads."""
    return _is_code_package(value) and Path(value).suffix in ("", ".py")


def _line(indent: str, value: str) -> str:
    return f"{indent}- {value}"


def _data_files(folder: str) -> list[str]:
    """The files below a package folder that are not Python (tables and templates its code reads)."""
    return sorted(
        str(p.relative_to(ROOT))
        for p in (ROOT / folder).rglob("*")
        if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts
    )


def new_deps(items: list[Item], verb: str, indent: str) -> list[Item]:
    """Non-code deps where they are; the code block (closure files and pipeline/ data files) sorted in place.

    A package folder listed whole becomes its closure files plus the data files below it, so a table such as
    pipeline/train/verl/overrides.yaml stays a dep."""
    block = [Item(path, [_line(indent, path)]) for path in code_deps(verb)]
    block += [item for item in items if _is_code_package(item.value) and not _is_code(item.value)]
    listed = {item.value for item in block}
    folders = [item.value for item in items if _is_code(item.value) and (ROOT / item.value).is_dir()]
    data = {path for folder in folders for path in _data_files(folder)} - listed
    block += [Item(path, [_line(indent, path)]) for path in sorted(data)]
    block.sort(key=lambda item: item.value)
    rest = [item for item in items if not _is_code_package(item.value)]
    first = next((i for i, item in enumerate(items) if _is_code_package(item.value)), None)
    at = (
        sum(1 for item in items[:first] if not _is_code_package(item.value))
        if first is not None
        else next((i for i, item in enumerate(rest) if item.value == "profiles"), len(rest))
    )
    return rest[:at] + block + rest[at:]


def _listable(key: Key) -> bool:
    """A key a stage may list: a params key, and not a section every stage has keys of."""
    return (
        key in NODES
        and key != ()
        and not (len(key) == 1 and NODES[key] is not None and key[0] in LEAF_ONLY_SECTIONS)
    )


def new_params(items: list[Item], verb: str, indent: str) -> list[Item]:
    """Entries that are still exact in their order, then the keys read but not listed, sorted (comment lines and
    other params files' entries are kept as they are)."""
    reads = param_reads(verb)
    kept: list[Item] = []
    covered: set[Key] = set()
    for item in items:
        if not item.value or item.value.startswith("#") or item.value.endswith(":"):
            kept.append(item)  # a comment line, or another params file's entry: not a key of params.yaml
            continue
        key = parse_key(item.value)
        if not _listable(key) or not leaves(key) <= reads or leaves(key) & covered:
            continue
        kept.append(item)
        covered |= leaves(key)
    added: list[Key] = []
    for key in sorted(reads - covered):
        if key in covered:
            continue
        # The widest section around the key that the stage reads whole and that lists nothing yet.
        section = next(
            key[:i]
            for i in range(1, len(key) + 1)
            if _listable(key[:i]) and leaves(key[:i]) <= reads and not leaves(key[:i]) & covered
        )
        added.append(section)
        covered |= leaves(section)
    return kept + [Item(dotted(k), [_line(indent, dotted(k))]) for k in sorted(added, key=dotted)]


def _items(lines: list[str], start: int, indent: int) -> tuple[list[Item], int]:
    """The list items after a `deps:`/`params:` line at `indent`, and the index of the line after them."""
    items: list[Item] = []
    at = start
    while at < len(lines):
        line = lines[at]
        depth = len(line) - len(line.lstrip())
        if not line.strip() or depth <= indent:
            break
        match = ITEM.match(line)
        if match and depth == indent + 2:
            items.append(Item(match["value"], [line]))
        elif items:  # a mapping entry's keys, or a comment line below an item
            items[-1].lines.append(line)
        else:  # a comment line above the first item
            items.append(Item("", [line]))
        at += 1
    return items, at


def regenerate(text: str) -> str:
    """dvc.yaml's text with every stage's code deps and params lists written from the code."""
    lines = text.split("\n")
    out: list[str] = []
    verb = None
    at = 0
    while at < len(lines):
        line = lines[at]
        if STAGE.match(line):
            verb = None
        if match := CMD.match(line):
            verb = match["verb"]
        block = BLOCK.match(line)
        if not block or verb is None:
            out.append(line)
            at += 1
            continue
        items, end = _items(lines, at + 1, len(block["indent"]))
        item_indent = " " * (len(block["indent"]) + 2)
        rewrite = new_deps if block["kind"] == "deps" else new_params
        out.append(line)
        out += [text for item in rewrite(items, verb, item_indent) for text in item.lines]
        at = end
    return "\n".join(out)


def diff(path: Path) -> list[str]:
    """The unified diff from dvc.yaml at `path` to its regenerated text (empty when it is current)."""
    text = path.read_text(encoding="utf-8")
    return list(
        difflib.unified_diff(
            text.splitlines(),
            regenerate(text).splitlines(),
            str(path),
            f"{path} (from the code)",
            lineterm="",
        )
    )


def write(path: Path) -> bool:
    """Rewrite dvc.yaml at `path` in place; whether anything changed."""
    text = path.read_text(encoding="utf-8")
    new = regenerate(text)
    if new != text:
        path.write_text(new, encoding="utf-8")
    return new != text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; print the diff, exit 1 if stale")
    parser.add_argument("--dvc-yaml", type=Path, default=ROOT / "dvc.yaml", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.check:
        lines = diff(args.dvc_yaml)
        print("\n".join(lines) if lines else f"{args.dvc_yaml} is current")
        return 1 if lines else 0
    print(f"{args.dvc_yaml}: {'rewritten' if write(args.dvc_yaml) else 'already current'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
