"""DVC operations the retraining flow is made of: plan, reproduce one stage, apply overrides, save an experiment.

Design decisions:
- **DVC decides what reruns.** The flow never second-guesses DVC's hashes: a stage task is
  `dvc repro --single-item <stage>` and DVC skips it when nothing changed. `--single-item` because the flow
  already runs the stages in DVC's own dependency order (read from `Repo.index.graph`), so each task does
  exactly one stage's work, retries only that stage, and `--force` forces one stage instead of its whole
  upstream.
- **One cheap plan instead of seven no-op processes.** `stale_stages()` asks DVC (in-process, the same
  `Repo.status()` that `dvc status` prints) which stages are out of date. Every stage before the first stale
  one in run order is up to date and its outputs cannot change during the run, so the flow does not even
  spawn DVC for it; from the first stale stage on, every stage goes through `dvc repro` (DVC then skips the
  ones whose inputs did not change after all).
- **Overrides are `dvc exp run -S` overrides.** `apply_overrides()` calls the very function `dvc exp run
  --set-param` uses (Hydra override grammar, comment-preserving YAML edit, `file.yaml:key=value` for other
  params files), so `-S train.steps=2` means the same thing to the flow and to DVC. The touched files are
  restored byte for byte after the run (`restore_files`), which is what `dvc exp run` gives you too: the
  workspace's params stay yours, the experiment's params live in the experiment.
- **An experiment per run that changed something.** After the stages, `save_experiment()` runs
  `dvc exp save -n <name>`: a git ref holding params.yaml, dvc.lock and metrics as they were for this run, so
  `dvc exp show` lists every scheduled retraining and `dvc exp apply <name>` brings one back. That needs
  one git commit in the project; without it the run is still complete and the flow says why no experiment
  was recorded.
- DVC runs as `python -m dvc` from the interpreter running the flow, with that interpreter's `bin/` first on
  PATH, so stage commands (`promptr1 …`) resolve to the same environment even when it is not activated,
  and with `pipeline.runtime.TELEMETRY_OFF` set unless the caller's environment says otherwise.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from pipeline.errors import UserError
from pipeline.runtime import TELEMETRY_OFF

log = logging.getLogger(__name__)

OUTPUT_TAIL_LINES = 40
STOP_GRACE_S = 30.0
# DVC's git hints after every stage: noise in a flow that records experiments itself.
_HINTS = ("To track the changes with git", "git add ", "To enable auto staging", "dvc config core.autostage",
          "Use `dvc push`")


class StageFailed(UserError):
    """A `dvc repro` of one stage exited non-zero; carries the stage name and the tail of its output."""

    def __init__(self, stage: str, returncode: int, tail: str) -> None:
        self.stage = stage
        self.returncode = returncode
        self.tail = tail
        super().__init__(f"stage {stage!r} failed (dvc exit code {returncode}); last output:\n{tail}")


def subprocess_env() -> dict[str, str]:
    """os.environ with telemetry off and this interpreter's bin/ first on PATH."""
    env = dict(os.environ)
    for key, value in TELEMETRY_OFF.items():
        env.setdefault(key, value)
    bin_dir = str(Path(sys.executable).parent)
    env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    return env


def require_dvc_project(root: Path) -> None:
    """Fail with a clear message unless `root` holds dvc.yaml and a .dvc folder."""
    if not (root / "dvc.yaml").is_file() or not (root / ".dvc").is_dir():
        raise UserError(f"{root} is not a DVC project (needs dvc.yaml and .dvc/; run `dvc init`)")


def stage_group(name: str) -> str:
    """`sample@hotpotqa` → `sample`: foreach items belong to their stage's task.

    DVC addresses stages relative to the caller's working directory (`../proj/dvc.yaml:train`); the
    flow runs stages of the project's root dvc.yaml only, so the file part is dropped.
    """
    return name.rsplit(":", 1)[-1].split("@", 1)[0]


def pipeline_stages(root: Path) -> list[str]:
    """Stage names of dvc.yaml (foreach stages once), upstream before downstream, ties in file order."""
    import networkx as nx
    from dvc.repo import Repo
    from dvc.stage import PipelineStage

    with Repo(str(root)) as repo:
        dvcfile = (root / "dvc.yaml").resolve()
        stages = [s for s in repo.index.stages
                  if isinstance(s, PipelineStage) and Path(s.dvcfile.path).resolve() == dvcfile]
        position = {s.addressing: i for i, s in enumerate(stages)}
        # Edges point from a stage to the stages it depends on: reverse for run order.
        graph = repo.index.graph.reverse(copy=True)
        ordered = nx.lexicographical_topological_sort(graph, key=lambda s: position.get(s.addressing, 1 << 30))
        names: list[str] = []
        for stage in ordered:
            if stage.addressing not in position:
                continue  # .dvc files (imported/added data) are not pipeline stages
            group = stage_group(stage.addressing)
            if group not in names:
                names.append(group)
    return names


def always_changed_stages(root: Path) -> set[str]:
    """Stage groups marked `always_changed: true` (e.g. `sources`, which fingerprints external data).

    `dvc status` always reports them as changed, so a plan must run them first and only then ask which
    of the other stages are stale.
    """
    from dvc.repo import Repo
    from dvc.stage import PipelineStage

    with Repo(str(root)) as repo:
        return {stage_group(s.addressing) for s in repo.index.stages
                if isinstance(s, PipelineStage) and s.always_changed}


def stale_stages(root: Path, targets: Sequence[str] | None = None) -> set[str]:
    """Stage groups `dvc status` reports as changed (all stages, or only `targets`, without upstream)."""
    from dvc.repo import Repo

    with Repo(str(root)) as repo:
        # Targets resolve against the process's working directory: name the project's dvc.yaml explicitly.
        paths = [f"{root.resolve() / 'dvc.yaml'}:{t}" for t in targets] if targets else None
        status = repo.status(targets=paths)
    return {stage_group(name) for name in status if not name.endswith(".dvc")}


def run_dvc(
    args: Sequence[str],
    root: Path,
    *,
    on_line: Callable[[str], None] | None = None,
) -> tuple[int, str]:
    """Run `python -m dvc <args>` in `root`, streaming each output line to `on_line`.

    Returns (exit code, the last OUTPUT_TAIL_LINES lines of stdout+stderr).
    """
    cmd = [sys.executable, "-m", "dvc", *args]
    tail: deque[str] = deque(maxlen=OUTPUT_TAIL_LINES)
    # Own process group: if the flow is interrupted or terminated, the whole stage (DVC and the command it
    # runs, e.g. a training process) is stopped with it instead of running on orphaned.
    with subprocess.Popen(cmd, cwd=root, env=subprocess_env(), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=True) as proc:
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                line = line.rstrip("\n")
                tail.append(line)
                if on_line is not None and line.strip() and not line.strip().startswith(_HINTS):
                    on_line(line)
            returncode = proc.wait()
        except BaseException:
            stop_process_group(proc)
            raise
    return returncode, "\n".join(tail)


def stop_process_group(proc: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM the process group of `proc`, SIGKILL it after `grace_s` seconds."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue
    log.warning("stage process group %d did not exit", proc.pid)


def repro_stage(root: Path, stage: str, *, force: bool, on_line: Callable[[str], None] | None = None) -> bool:
    """`dvc repro --single-item [--force] <stage>`; True if DVC executed the stage's command.

    Raises StageFailed with the output's tail on a non-zero exit.
    """
    executed = False

    def watch(line: str) -> None:
        nonlocal executed
        executed = executed or line.startswith("Running stage")
        if on_line is not None:
            on_line(line)

    args = ["repro", "--single-item", *(["--force"] if force else []), stage]
    returncode, tail = run_dvc(args, root, on_line=watch)
    if returncode != 0:
        raise StageFailed(stage, returncode, tail)
    return executed


def apply_overrides(root: Path, overrides: Iterable[str]) -> dict[Path, bytes]:
    """Apply `dvc exp run -S` style overrides in place; return the original bytes of each touched file.

    `key.sub=value` edits params.yaml; `path/file.yaml:key=value` edits that file. Raises UserError for a
    malformed override or an unknown key (Hydra's struct mode: use `+key=value` to add a new key).
    """
    from dvc.exceptions import InvalidArgumentError
    from dvc.utils.cli_parse import to_path_overrides
    from dvc.utils.hydra import apply_overrides as dvc_apply_overrides

    items = [o for o in overrides if o.strip()]
    if not items:
        return {}
    originals: dict[Path, bytes] = {}
    try:
        for rel_path, path_overrides in to_path_overrides(items).items():
            path = (root / rel_path).resolve()
            if root.resolve() not in path.parents:
                raise UserError(f"override file {rel_path!r} is outside the project")
            if not path.is_file():
                raise UserError(f"override file {rel_path!r} does not exist in {root}")
            originals.setdefault(path, path.read_bytes())
            dvc_apply_overrides(str(path), path_overrides)
    except InvalidArgumentError as exc:
        restore_files(originals)
        cause = f": {exc.__cause__}" if exc.__cause__ else ""
        raise UserError(f"invalid override in {items}{cause}") from exc
    except Exception:
        restore_files(originals)
        raise
    return originals


def restore_files(originals: dict[Path, bytes]) -> None:
    """Write back files saved by apply_overrides (byte for byte)."""
    for path, content in originals.items():
        path.write_bytes(content)


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
