"""A stage's code deps as dvc.yaml entries: a folder where the stage depends on every file DVC hashes in it,
else the files.

DVC tracks a directory dep by the hash of every file below it that .dvcignore leaves in, so a folder entry is
exact only when each of those files is one the stage runs or reads: a README or another stage's table in it
would rerun the stage for nothing. Compiled Python (`__pycache__/`, `*.pyc`) is in .dvcignore, so importing
the code never changes a folder's hash; IGNORED_DIRS and IGNORED_SUFFIXES are those patterns (a subset of
.dvcignore is safe: a file DVC ignores but these do not only keeps a folder from being listed whole).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

IGNORED_DIRS = ("__pycache__",)
IGNORED_SUFFIXES = (".pyc",)
"""What .dvcignore leaves out of a code folder's hash (tests/test_dvc_lists.py checks .dvcignore says so)."""


def hashed_files(folder: Path) -> set[Path]:
    """The files below `folder` that DVC hashes when `folder` is a dep."""
    return {
        p
        for p in folder.rglob("*")
        if p.is_file()
        and p.suffix not in IGNORED_SUFFIXES
        and not any(part in IGNORED_DIRS for part in p.relative_to(folder).parts)
    }


def folder_entries(files: Iterable[Path], roots: Iterable[Path], base: Path) -> list[str]:
    """`files` (below `roots`) as dep entries relative to `base`, sorted: a folder whose hashed files are all
    among `files` stands for them, the largest such folder first; the rest are listed one by one."""
    wanted = set(files)
    out: list[str] = []

    def walk(folder: Path) -> None:
        below = hashed_files(folder)
        if below and below <= wanted:
            out.append(str(folder.relative_to(base)))
            return
        for path in sorted(folder.iterdir()):
            if path.is_dir() and path.name not in IGNORED_DIRS:
                walk(path)
            elif path in wanted:
                out.append(str(path.relative_to(base)))

    for root in roots:
        if root.is_dir():
            walk(root)
    return sorted(out)
