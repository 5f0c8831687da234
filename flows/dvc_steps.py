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
- **Overrides are crash-safe through a journal, not a temporary workspace.** Before any params file is
  touched, `apply_overrides` writes the originals (and, once applied, the applied content's hash) to
  `.dvc/tmp/promptr1-overrides.json`, atomically (temporary file, fsync, rename). `restore_files` puts the
  originals back atomically and removes the journal last, so a kill at any moment leaves either the
  originals or a journal; the next flow run calls `recover_overrides` under the workspace lock (a live
  run holds that lock, so a journal found while holding it belongs to a dead run) and restores byte for
  byte before it applies its own. A file edited by hand since the dead run applied its overrides is not
  overwritten: the run stops and says so. A temporary copy of the workspace was the alternative, but the
  flow exists to update *this* workspace's outputs, dvc.lock and experiments: a copy would have to link
  gigabytes of data and checkpoints in and copy the results back, a second place to lose state in.
  `apply_overrides` refuses to run while a journal exists, so no run can stack its overrides on a dead
  run's, and every `promptr1` stage command refuses while a dead run's journal exists
  (flows/override_guard.py), so a plain `dvc repro` cannot run on them either.
- **An experiment per run that changed something** (flows/experiments.py). After the stages, `save_experiment()` runs
  `dvc exp save -n <name>`: a git ref holding params.yaml, dvc.lock and metrics as they were for this run, so
  `dvc exp show` lists every scheduled retraining and `dvc exp apply <name>` brings one back. That needs
  one git commit in the project; without it the run is still complete and the flow says why no experiment
  was recorded.
- DVC runs as `python -m dvc` from the interpreter running the flow, with that interpreter's `bin/` first on
  PATH, so stage commands (`promptr1 …`) resolve to the same environment even when it is not activated,
  and with `pipeline.runtime.TELEMETRY_OFF` set unless the caller's environment says otherwise.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from pipeline.errors import UserError
from pipeline.runtime import TELEMETRY_OFF, stop_process_group

log = logging.getLogger(__name__)

OUTPUT_TAIL_LINES = 40
OVERRIDE_JOURNAL = Path(".dvc") / "tmp" / "promptr1-overrides.json"
STOP_GRACE_S = 30.0
# DVC's git hints after every stage: noise in a flow that records experiments itself.
_HINTS = ("To track the changes with git", "git add ", "To enable auto staging", "dvc config core.autostage",
          "Use `dvc push`")
_DVC_PROGRESS = ("Running stage ", "> ", "Verifying data sources", "Stage '")
_DVC_FAILED = "ERROR: failed to reproduce"
ERROR_LINES, ERROR_LINE_CHARS = 12, 300  # what a failed stage's message keeps of its output (lines, chars each)


class StageFailed(UserError):
    """A `dvc repro` of one stage exited non-zero; carries the stage name and the tail of its output.

    The message is the failed task's Prefect state message: it leads with the stage's own last words (its
    exception or `error: …` line), not DVC's "exited with 1", then a readable `error_excerpt` of the tail.
    """

    def __init__(self, stage: str, returncode: int, tail: str) -> None:
        self.stage = stage
        self.returncode = returncode
        self.tail = tail
        excerpt = error_excerpt(tail)
        cause = next((line for line in reversed(excerpt) if not line.startswith(_DVC_FAILED)), None)
        headline = f"stage {stage!r} failed" + (f": {cause}" if cause else "")
        super().__init__(f"{headline} (dvc exit code {returncode}); last output:\n" + "\n".join(excerpt))


def error_excerpt(tail: str, max_lines: int = ERROR_LINES, max_chars: int = ERROR_LINE_CHARS) -> list[str]:
    """The last `max_lines` meaningful lines of a stage's output, each cut to `max_chars`.

    Dropped: blank lines, DVC's own progress (`Running stage …`, the `> command` echo) and its git hints.
    """
    lines = [line.rstrip() for line in tail.splitlines()]
    kept = [line for line in lines if line.strip() and not line.lstrip().startswith((*_HINTS, *_DVC_PROGRESS))]
    return [line if len(line) <= max_chars else line[: max_chars - 1] + "…" for line in kept[-max_lines:]]


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
            stop_process_group(proc, STOP_GRACE_S, kill_wait_s=10.0)
            raise
    return returncode, "\n".join(tail)


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
    malformed override or an unknown key (Hydra's struct mode: use `+key=value` to add a new key), and
    while a dead run's journal is still there (`recover_overrides` first). The originals are journaled
    before the first file is touched; `restore_files` undoes both.
    """
    from dvc.exceptions import InvalidArgumentError
    from dvc.utils.cli_parse import to_path_overrides
    from dvc.utils.hydra import apply_overrides as dvc_apply_overrides

    items = [o for o in overrides if o.strip()]
    if not items:
        return {}
    journal = root / OVERRIDE_JOURNAL
    if journal.exists():
        raise UserError(f"{OVERRIDE_JOURNAL} holds the params of a run that did not finish: restore them "
                        "first (the next flow run does, or `promptr1 flow restore`)")
    originals: dict[Path, bytes] = {}
    try:
        targets: dict[Path, list[str]] = {}
        for rel_path, path_overrides in to_path_overrides(items).items():
            path = (root / rel_path).resolve()
            if root.resolve() not in path.parents:
                raise UserError(f"override file {rel_path!r} is outside the project")
            if not path.is_file():
                raise UserError(f"override file {rel_path!r} does not exist in {root}")
            targets.setdefault(path, []).extend(path_overrides)
        snapshot = {path: path.read_bytes() for path in targets}
        _write_journal(root, snapshot, items, applied=False)
        originals = snapshot
        for path, path_overrides in targets.items():
            dvc_apply_overrides(str(path), path_overrides)
        _write_journal(root, originals, items, applied=True)
    except InvalidArgumentError as exc:
        restore_files(root, originals)
        cause = f": {exc.__cause__}" if exc.__cause__ else ""
        raise UserError(f"invalid override in {items}{cause}") from exc
    except BaseException:
        restore_files(root, originals)
        raise
    return originals


def restore_files(root: Path, originals: dict[Path, bytes]) -> None:
    """Write back files saved by apply_overrides (byte for byte, atomically), then drop the journal."""
    for path, content in originals.items():
        _write_atomic(path, content)
    (root / OVERRIDE_JOURNAL).unlink(missing_ok=True)


def recover_overrides(root: Path) -> list[Path]:
    """Restore the params files a killed run left overridden (from its journal); return those restored.

    Call it only while holding the workspace lock (flows/run_lock.py): a live run's journal is not a dead
    one's. A file that is neither the original nor what the dead run wrote was edited since: it is left
    as it is and UserError says so, with the journal kept for a person to decide.
    """
    journal = root / OVERRIDE_JOURNAL
    for leftover in journal.parent.glob(f".{journal.name}.*.tmp"):  # a journal write the kill interrupted
        leftover.unlink(missing_ok=True)
    if not journal.is_file():
        return []
    entry = json.loads(journal.read_text(encoding="utf-8"))
    restore: dict[Path, bytes] = {}
    for rel, saved in entry["files"].items():
        path = root / rel
        original = base64.b64decode(saved["original"])
        current = path.read_bytes() if path.is_file() else None
        if current == original:
            continue
        applied = saved.get("applied_sha256")
        if applied and current is not None and hashlib.sha256(current).hexdigest() != applied:
            raise UserError(f"{rel} was edited after a flow run with overrides {entry['overrides']} was killed; "
                            f"its original is in {OVERRIDE_JOURNAL}: restore or keep your edit, then delete "
                            "the journal")
        restore[path] = original
    restore_files(root, restore)
    for rel in entry["files"]:  # temporary files of an atomic write the kill interrupted
        for leftover in (root / rel).parent.glob(f".{Path(rel).name}.*.tmp"):
            leftover.unlink(missing_ok=True)
    if restore:
        log.warning("restored %s: a flow run killed with overrides %s applied left them there",
                    ", ".join(str(p.relative_to(root)) for p in restore), entry["overrides"])
    return list(restore)


def _write_journal(root: Path, originals: dict[Path, bytes], overrides: list[str], *, applied: bool) -> None:
    files = {
        str(path.relative_to(root.resolve())): {
            "original": base64.b64encode(content).decode("ascii"),
            "applied_sha256": hashlib.sha256(path.read_bytes()).hexdigest() if applied else None,
        }
        for path, content in originals.items()
    }
    entry = {"pid": os.getpid(), "overrides": overrides, "files": files}
    _write_atomic(root / OVERRIDE_JOURNAL, json.dumps(entry, indent=1).encode("utf-8"))


def _write_atomic(path: Path, content: bytes) -> None:
    """Write `content` to a temporary file beside `path`, fsync it, rename it over `path` (mode kept)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(content)
            fh.flush()
            os.fsync(fh.fileno())
        if path.exists():
            shutil.copymode(path, tmp)
        else:
            os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)
