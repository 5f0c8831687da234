"""The DVC experiment a retraining run records (`dvc exp save`), and what git must know for it.

See flows/dvc_steps.py's docstring ("An experiment per run that changed something"); in its own module so
that one stays readable.
"""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Callable
from pathlib import Path

from flows.dvc_steps import run_dvc
from pipeline.errors import UserError

log = logging.getLogger("flows.dvc_steps")  # its lines under the DVC steps' logger


def git_head(root: Path) -> str | None:
    """The project's HEAD commit, or None when it is not a git repo or has no commit yet."""
    try:
        out = subprocess.run(["git", "rev-parse", "--verify", "--quiet", "HEAD"], cwd=root, check=False,
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def git_untracked(root: Path) -> list[str]:
    """Untracked, not ignored files (paths relative to root)."""
    out = subprocess.run(["git", "ls-files", "--others", "--exclude-standard", "-z"], cwd=root, check=False,
                         capture_output=True, text=True, timeout=60)
    return [p for p in out.stdout.split("\0") if p]


def untracked_outputs(root: Path) -> list[str]:
    """Untracked files an experiment must hold: dvc.lock, DVC's .gitignore files, git-tracked stage outputs.

    Outputs with `cache: false` (metrics, plots, reports) live in git, not in the DVC cache; on a first run
    they are new files that `dvc exp save` would otherwise leave out of the experiment.
    """
    from dvc.repo import Repo

    with Repo(str(root)) as repo:
        git_outs = [Path(out.fs_path).resolve() for stage in repo.index.stages for out in stage.outs
                    if not out.use_cache]
    keep = []
    for rel in git_untracked(root):
        path = (root / rel).resolve()
        if rel == "dvc.lock" or path.name == ".gitignore" or any(
                path == out or out in path.parents for out in git_outs):
            keep.append(rel)
    return keep


def save_experiment(root: Path, name: str, *, on_line: Callable[[str], None] | None = None) -> str | None:
    """`dvc exp save -n <name>`: record the workspace (params, dvc.lock, metrics) as a DVC experiment.

    Returns the experiment name, or None (with a warning logged) when the project has no git commit yet.
    """
    if git_head(root) is None:
        log.warning("not recording a DVC experiment: %s has no git commit yet (commit once, then every "
                    "flow run is listed by `dvc exp show`)", root)
        return None
    include = [arg for path in untracked_outputs(root) for arg in ("--include-untracked", path)]
    returncode, tail = run_dvc(["exp", "save", "--name", name, "--force", *include], root, on_line=on_line)
    if returncode != 0:
        raise UserError(f"`dvc exp save` failed (exit code {returncode}):\n{tail}")
    return name
