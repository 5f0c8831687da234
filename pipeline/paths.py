"""How the pipeline shows a path to a person: relative to the project, never this machine's layout.

A floor module (no pipeline imports), so that every layer, from the data stages to the environment
servers, prints paths the same way: logs, reports and error messages stay the same on every machine.
"""

from __future__ import annotations

import os
from pathlib import Path


def display_path(path: str | Path, root: Path) -> str:
    """`path` relative to the project root when inside it, else relative to it with `..` (never absolute)."""
    path = Path(path)
    try:
        return path.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return os.path.relpath(path.resolve(), root.resolve())


CACHE_VARIABLE = "PROMPTR1_CACHE_DIR"


def default_cache_dir() -> Path:
    """The user's cache of things derived from installed models (GGUF exports and conversions), shared by
    projects: `$PROMPTR1_CACHE_DIR`, else `$XDG_CACHE_HOME/promptr1`, else `~/.cache/promptr1`."""
    if os.environ.get(CACHE_VARIABLE):
        return Path(os.environ[CACHE_VARIABLE])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "promptr1"
