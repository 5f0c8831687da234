"""Put back what `dvc exp run` changed in the workspace when a stage refuses the experiment's params.

`dvc exp run -S train.lr=abc` (a workspace experiment, DVC's default) rewrites the params files before any stage
runs, the whole YAML in its own layout (flow lists become block lists, `null` becomes empty, long strings are
re-wrapped), then removes the first stage's outputs just before running its command: `sources`' are the
git-tracked data/sources/*.json. Every stage command validates the params first (pipeline/cli.py), so the first
stage refuses within seconds; without this module the workspace kept the refused value, the reformatted files
and lost the tracked outputs. What `put_back_refused_experiment` does, only while DVC runs this stage for a
workspace experiment of this project (`DVC_EXP_NAME` set, `DVC_ROOT` this project, DVC's workspace executor
refs `refs/exps/exec/EXEC_MERGE` and `EXEC_BASELINE` present):

- **Removed files come back from the experiment's start.** EXEC_MERGE is the workspace as the experiment
  started (a stash commit: uncommitted edits and the `-S` values included). A git-tracked file it holds that
  the workspace now lacks was removed by DVC during this command: its bytes and mode are written back.
- **Only the refused keys are put back**, to their value at EXEC_BASELINE (the commit the experiment started
  from), or removed where the baseline lacks them. DVC keeps no copy of a params file as it was before its
  edit, so the baseline is the only earlier value there is; the message says which value was put back.
- **The layout comes back too.** When nothing else differs from the baseline, the baseline's bytes are written:
  byte for byte what the clean workspace held. Otherwise the other differences (a user's own uncommitted edits,
  accepted `-S` values) are merged into the baseline's text with `git merge-file`: ours is the baseline's text,
  theirs the file as DVC wrote it, their common base the baseline as DVC would have written it with the refused
  values (DVC's own `apply_overrides` on a copy), so each hunk is exactly one of those edits. A merge that
  conflicts, or whose values differ from what is wanted, gives way to DVC's layout (its own YAML round trip)
  with the refused keys set to the baseline's nodes as written there. Every written file is checked by its
  parsed values first.
"""

from __future__ import annotations

import copy
import os
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pipeline.paths import display_path

EXEC_MERGE = "refs/exps/exec/EXEC_MERGE"
EXEC_BASELINE = "refs/exps/exec/EXEC_BASELINE"
PARAMS_FILES = ("params.yaml", "profiles/*.yaml")
"""The files `pipeline.config.load_params` reads, as globs under the project root."""
DVC_SCRATCH = ".dvc/tmp/"
"""DVC's own scratch folder: the stash commit carries its `repro.dat` (the run's arguments), deleted after use."""
_MISSING = object()


@dataclass
class PutBack:
    """What was put back: per params file the refused keys and their baseline values, and the removed files."""

    keys: dict[str, dict[str, Any]] = field(default_factory=dict)
    """File (project-relative) → refused key → the value put back (`_MISSING`: the key was removed)."""
    files: list[str] = field(default_factory=list)
    """Git-tracked files written back from the experiment's start (project-relative)."""
    unchanged: list[str] = field(default_factory=list)
    """Params files whose refused keys could not be put back (named in the sentence)."""

    def sentence(self) -> str:
        """One sentence for the error line: what the workspace got back."""
        parts = []
        for rel, keys in self.keys.items():
            shown = ", ".join(f"{k} ({_shown(v)})" for k, v in keys.items())
            parts.append(f"{shown} in {rel}, as committed")
        if self.files:
            folders = ", ".join(sorted({f"{Path(f).parent.as_posix()}/" for f in self.files}))
            parts.append(f"{folders} ({len(self.files)} tracked files DVC removed before this stage)")
        said = "put back what `dvc exp run` changed: " + "; ".join(parts) if parts else ""
        if self.unchanged:
            said += ("; " if said else "") + f"{', '.join(self.unchanged)} still hold the refused values"
        return said


def _shown(value: Any) -> str:
    """A put-back value as YAML writes it (`1.0e-05`, `[a, b]`), or `removed`."""
    if value is _MISSING:
        return "removed"
    return yaml.safe_dump(value, default_flow_style=True, width=1 << 16).strip().removesuffix("...").strip()


def put_back_refused_experiment(root: Path, refused: Sequence[str]) -> PutBack | None:
    """Undo a workspace `dvc exp run`'s edits that this stage refuses (module docstring); None when this stage
    does not run for a workspace experiment of `root` (a plain command, `dvc repro`, a `--temp` or queued run)."""
    root = root.resolve()
    dvc_root = os.environ.get("DVC_ROOT")
    if not os.environ.get("DVC_EXP_NAME") or not dvc_root or Path(dvc_root).resolve() != root:
        return None
    start, baseline = _rev(root, EXEC_MERGE), _rev(root, EXEC_BASELINE)
    if start is None or baseline is None:
        return None
    done = PutBack(files=_restore_removed(root, start))
    for path in sorted({p for pattern in PARAMS_FILES for p in root.glob(pattern) if p.is_file()}):
        rel = display_path(path, root)
        base_text = _blob(root, baseline, rel)
        if base_text is None:
            continue
        current = path.read_bytes()
        keys = refused_changes(yaml.safe_load(current) or {}, yaml.safe_load(base_text) or {}, refused)
        if not keys:
            continue
        text = put_back_text(current, base_text, keys)
        if text is None:
            done.unchanged.append(rel)
            continue
        _write(path, text, path.stat().st_mode)
        done.keys[rel] = {".".join(k): v for k, v in keys.items()}
    return done


def _git(root: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, check=False)


def _rev(root: Path, ref: str) -> str | None:
    found = _git(root, "rev-parse", "--verify", "--quiet", ref)
    return found.stdout.decode().strip() if found.returncode == 0 else None


def _blob(root: Path, rev: str, rel: str) -> bytes | None:
    found = _git(root, "show", f"{rev}:./{rel}")  # relative to the project, wherever the git root is
    return found.stdout if found.returncode == 0 else None


def _restore_removed(root: Path, start: str) -> list[str]:
    """Write back each git-tracked file of `start` that the workspace lacks; return their paths."""
    listing = _git(root, "ls-tree", "-r", "-z", start).stdout.decode("utf-8", "surrogateescape")
    restored = []
    for entry in filter(None, listing.split("\0")):
        meta, rel = entry.split("\t", 1)
        mode, kind, sha = meta.split()
        if kind != "blob" or mode not in ("100644", "100755") or rel.startswith(DVC_SCRATCH):
            continue
        if (root / rel).exists():
            continue
        _write(root / rel, _git(root, "cat-file", "blob", sha).stdout, int(mode, 8))
        restored.append(rel)
    return restored


def _lookup(data: Any, key: tuple[str, ...]) -> Any:
    for part in key:
        if not isinstance(data, dict) or part not in data:
            return _MISSING
        data = data[part]
    return data


def _key_in(current: dict, baseline: dict, dotted: str) -> tuple[str, ...]:
    """The longest prefix of `dotted` that is a mapping key in either file (a refused `train.lr.float` of a
    union type is the key `train.lr`; an index in a list stops at the list)."""
    key: list[str] = []
    for part in dotted.split("."):
        here = [d for d in (_lookup(current, tuple(key)), _lookup(baseline, tuple(key))) if isinstance(d, dict)]
        if not any(part in d for d in here):
            break
        key.append(part)
    return tuple(key)


def refused_changes(current: dict, baseline: dict, refused: Sequence[str]) -> dict[tuple[str, ...], Any]:
    """Refused key → its baseline value (`_MISSING`: absent there), for each refused key this file changed."""
    changed = {}
    for dotted in refused:
        key = _key_in(current, baseline, dotted)
        if key and _lookup(current, key) != _lookup(baseline, key):
            changed[key] = _lookup(baseline, key)
    return changed


def _with(data: dict, values: dict[tuple[str, ...], Any]) -> dict:
    """A copy of `data` with each key set to its value, or removed where the value is `_MISSING`."""
    out = copy.deepcopy(data)
    for key, value in values.items():
        node = out
        for part in key[:-1]:
            node = node.setdefault(part, {})
        if value is _MISSING:
            node.pop(key[-1], None)
        else:
            node[key[-1]] = copy.deepcopy(value)
    return out


def put_back_text(current: bytes, base_text: bytes, keys: dict[tuple[str, ...], Any]) -> bytes | None:
    """The file's text with `keys` put back (module docstring: baseline bytes, merged, or DVC's layout)."""
    base, now = yaml.safe_load(base_text) or {}, yaml.safe_load(current) or {}
    wanted = _with(now, keys)
    if wanted == base:
        return base_text
    with tempfile.TemporaryDirectory(prefix="promptr1-put-back-") as tmp:
        refused_values = {key: _lookup(now, key) for key in keys}
        ancestor = _dvc_rewrite(Path(tmp) / "ancestor.yaml", base_text, base, refused_values)
        if ancestor is not None:
            (Path(tmp) / "ours.yaml").write_bytes(base_text)
            (Path(tmp) / "theirs.yaml").write_bytes(current)
            merged = _git(Path(tmp), "merge-file", "-p", "ours.yaml", "ancestor.yaml", "theirs.yaml")
            if merged.returncode == 0 and yaml.safe_load(merged.stdout) == wanted:
                return merged.stdout
        fallback = _dvc_layout_put_back(Path(tmp) / "current.yaml", current, base_text, keys)
        if yaml.safe_load(fallback) == wanted:
            return fallback
    return None


def _dvc_layout_put_back(path: Path, current: bytes, base_text: bytes, keys: dict[tuple[str, ...], Any]) -> bytes:
    """`current` in DVC's layout (its own YAML round trip) with each key set to the baseline's node, written as
    the baseline wrote it (`1.0e-5`, `[a, b]`), or removed."""
    from dvc.utils.serialize import modify_yaml, parse_yaml_for_update

    base = parse_yaml_for_update(base_text.decode("utf-8"), str(path))
    path.write_bytes(current)
    with modify_yaml(str(path)) as data:
        for key, value in keys.items():
            node = data
            for part in key[:-1]:
                node = node.setdefault(part, {})
            if value is _MISSING:
                node.pop(key[-1], None)
            else:
                node[key[-1]] = _lookup(base, key)
    return path.read_bytes()


def _dvc_rewrite(path: Path, text: bytes, data: dict, values: dict[tuple[str, ...], Any]) -> bytes | None:
    """`text` as DVC's `apply_overrides` writes it with `values` set (`_MISSING`: removed): the layout DVC gave the
    file, reproduced from the baseline; None when the values cannot be said as overrides."""
    from dvc.exceptions import InvalidArgumentError
    from dvc.utils.hydra import apply_overrides

    overrides = []
    for key, value in values.items():
        dotted = ".".join(key)
        if value is _MISSING:
            overrides.append(f"~{dotted}")
        else:
            plus = "+" if _lookup(data, key) is _MISSING else ""
            overrides.append(f"{plus}{dotted}={_override_value(value)}")
    path.write_bytes(text)
    try:
        apply_overrides(str(path), overrides)
    except (InvalidArgumentError, ValueError):
        return None
    return path.read_bytes()


def _override_value(value: Any) -> str:
    """`value` in Hydra's override grammar (what `-S key=<this>` parses back to the same value)."""
    if isinstance(value, str):
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ",".join(_override_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_override_value(v)}" for k, v in value.items()) + "}"
    return repr(value)


def _write(path: Path, content: bytes, mode: int) -> None:
    """Write `content` through a temporary file beside `path`, renamed over it (a kill leaves old or new)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(content)
        os.chmod(tmp, mode & 0o777)
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)
