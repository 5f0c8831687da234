"""A full disk ends a stage in one line naming the path, the free space and what was needed.

Fast: the check's own input (free bytes against a checkpoint's size, worked by hand), and real disk-full errors
turned into that line: writes to /dev/full (a real ENOSPC) and a real SQLite store capped by
`max_page_count` (SQLite's real "database or disk is full"), raised the way MLflow's store hid the first error.
Slow: the real `promptr1 train` on a real small file system (a tmpfs mounted in a user namespace, which needs
no root; skipped where the kernel refuses one): the step-2 checkpoint does not fit, then the disk is full before
MLflow can record a run, then a rerun on a larger disk resumes from the kept checkpoint.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from helpers import REPO_ROOT, tiny_overrides, write_train_parquet

from pipeline import disk_space
from pipeline.config import deep_merge
from pipeline.errors import DiskFull

MIB = 1024 * 1024


def test_space_problem_worked_by_hand():
    assert disk_space.format_size(0) == "0 B"
    assert disk_space.format_size(512 * 1024) == "512 KiB"
    assert disk_space.format_size(40 * MIB + MIB // 2) == "40.5 MiB"
    assert disk_space.format_size(3 * 1024 * MIB) == "3.0 GiB"
    assert disk_space.space_problem("checkpoints/agent", 40 * MIB, 40 * MIB, "step 2's checkpoint") is None
    assert disk_space.space_problem("checkpoints/agent", 28 * MIB, 40 * MIB + MIB // 2, "step 2's checkpoint") == (
        "checkpoints/agent: not enough disk space for step 2's checkpoint: it needs ~40.5 MiB, 28.0 MiB free there")


def test_a_checkpoint_that_does_not_fit_is_refused_before_anything_is_written(tmp_path):
    """The free-space check's own input: a size larger than the file system's free space (whatever it is)."""
    free = shutil.disk_usage(tmp_path).free
    wrote = []
    refused = r"^ckpt: not enough disk space for step 2's checkpoint: it needs ~.* free there; free space there$"
    with (pytest.raises(DiskFull, match=refused),
          disk_space.writing(tmp_path / "ckpt", tmp_path, free + 1024 * MIB, "step 2's checkpoint",
                             "free space there")):
        wrote.append(True)
    assert wrote == []


def test_a_write_that_hits_a_full_disk_becomes_one_line_and_its_partial_files_go(tmp_path):
    """/dev/full answers every write with ENOSPC: the block's failure is DiskFull naming the folder, after the
    cleanup removed the half-written files."""
    partial = tmp_path / "ckpt" / ".tmp-step_2-x"
    partial.mkdir(parents=True)
    said = (r"^ckpt: the disk filled while writing step 2's checkpoint \(~1 KiB needed, .* free now that the "
            r"partial write is removed\); advice$")
    with (pytest.raises(DiskFull, match=said) as raised,
          disk_space.writing(tmp_path / "ckpt", tmp_path, 1024, "step 2's checkpoint", "advice",
                             cleanup=lambda: shutil.rmtree(partial)),
          open("/dev/full", "wb") as full):
        full.write(b"weights")
        full.flush()
    assert not partial.exists()
    assert isinstance(raised.value.__cause__, OSError) and raised.value.__cause__.errno == 28


def _full_sqlite(path: Path) -> sqlite3.Connection:
    """A real SQLite file that can hold no more pages: every growing insert fails with SQLITE_FULL."""
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE runs (id INTEGER PRIMARY KEY, status TEXT)")
    db.commit()
    pages = db.execute("PRAGMA page_count").fetchone()[0]
    db.execute(f"PRAGMA max_page_count = {pages}")
    return db


def test_a_full_tracking_store_hiding_the_first_error_is_one_line(tmp_path, monkeypatch):
    """What MLflow did: the stage failed on a full disk, and closing its run failed too, on SQLite's own
    "database or disk is full" (through SQLAlchemy, a ~100-line traceback). The chain is read for the DiskFull
    the stage raised; without one, the SQLite error itself names the store of MLFLOW_TRACKING_URI."""
    import sqlalchemy

    db_file = tmp_path / "mlflow.db"
    db = _full_sqlite(db_file)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{db_file}")

    def close_run_after(first: BaseException) -> BaseException:
        try:
            raise first
        except (DiskFull, ValueError):
            try:
                db.execute("INSERT INTO runs (status) VALUES (?)", ("FAILED" * 10000,))
            except sqlite3.OperationalError as exc:
                try:
                    raise sqlalchemy.exc.OperationalError("INSERT INTO runs", {}, exc) from exc
                except sqlalchemy.exc.OperationalError as wrapped:
                    return wrapped
        raise AssertionError("the capped store accepted the insert")

    own = DiskFull("checkpoints/agent: not enough disk space for step 2's checkpoint")
    assert disk_space.disk_full(close_run_after(own), tmp_path) is own
    line = str(disk_space.disk_full(close_run_after(ValueError("unrelated")), tmp_path))
    assert line.startswith("mlflow.db: the disk is full (") and "database or disk is full" in line, line
    assert line.endswith("free space there and rerun") and "\n" not in line
    assert disk_space.disk_full(ValueError("a bug, not a disk"), tmp_path) is None


def _unshare_tmpfs_works(folder: Path) -> str | None:
    """Why a tmpfs cannot be mounted on `folder` in a user namespace here, or None when it can."""
    if shutil.which("unshare") is None:
        return "no unshare(1)"
    folder.mkdir()
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "mount", "-t", "tmpfs", "-o",
                            "size=1m", "tmpfs", str(folder)], check=False, capture_output=True, text=True,
                           timeout=30)
    return None if probe.returncode == 0 else (probe.stderr or probe.stdout).strip() or "unshare refused"


SCRIPT = textwrap.dedent("""\
    set -u
    mount -t tmpfs -o size="$SMALL_KIB"k tmpfs "$PROJECT" || exit 97
    cp -r "$SOURCE"/. "$PROJECT"/ && cd "$PROJECT"
    train() { "$PYTHON" -m pipeline.cli train --params params.yaml > "$OUT/$1.log" 2>&1; echo $? > "$OUT/$1.rc"; }
    train first
    cp checkpoints/agent/latest "$OUT/latest_after_first"; ls -a checkpoints/agent > "$OUT/listing_after_first"
    cat /dev/zero > filler 2>/dev/null
    train full
    rm filler && mount -o remount,size="$LARGE_KIB"k "$PROJECT"
    train rerun
    cp checkpoints/agent/latest "$OUT/latest_after_rerun"
""")


@pytest.mark.slow
def test_promptr1_train_on_a_small_disk_ends_in_one_line_and_resumes(tmp_path, tiny_llama_dir, env_server):
    why = _unshare_tmpfs_works(tmp_path / "probe")
    if why is not None:
        pytest.skip(f"no small file system without root here ({why}); the check's input is tested above")
    source, project, out = tmp_path / "source", tmp_path / "project", tmp_path / "out"
    for folder in (source, project, out):
        folder.mkdir()
    write_train_parquet(source / "data/rl/train.parquet")
    # Paths relative to the project, so they point into the small file system once it is mounted there.
    overrides = tiny_overrides(Path("."), tiny_llama_dir, env_server, steps=2, save_every=1, keep_checkpoints=2,
                               health={"enabled": False})
    overrides["mlflow"] = {"tracking_uri": "sqlite:///mlflow.db", "artifact_root": "mlartifacts"}
    raw = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
    (source / "params.yaml").write_text(yaml.safe_dump(deep_merge(raw, overrides)))
    # A checkpoint of the tiny model: its weights and tokenizer (AdamW holds no state: its rewards all tie, so no
    # optimizer step is taken, tests/test_train_local.py); ~16 MiB. MLflow's store and the reports take ~1.2 MiB.
    one_checkpoint = sum(f.stat().st_size for f in tiny_llama_dir.iterdir() if f.is_file())
    small = one_checkpoint + one_checkpoint // 2 + 2 * MIB  # step 1's checkpoint fits, step 2's beside it not
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_TRACKING") and k != "MLFLOW_REGISTRY_URI"}
    env.update(PROJECT=str(project), SOURCE=str(source), OUT=str(out), PYTHON=sys.executable,
               SMALL_KIB=str(small // 1024), LARGE_KIB=str((small + 2 * one_checkpoint) // 1024),
               PYTHONPATH=str(REPO_ROOT))
    done = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", SCRIPT], env=env,
                          check=False, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr

    first = (out / "first.log").read_text()
    assert (out / "first.rc").read_text().strip() == "1", first
    (line,) = [x for x in first.splitlines() if x.startswith("error: ")]
    assert line.startswith("error: checkpoints/agent: not enough disk space for step 2's checkpoint: it needs ~"), line
    assert " MiB free there; free space there, lower train.keep_checkpoints, or point paths.checkpoint_dir at a " \
           "larger disk (step_1 is kept and a rerun resumes from it)" in line, line
    assert "Traceback" not in first, first
    assert (out / "latest_after_first").read_text() == "step_1"
    assert not [n for n in (out / "listing_after_first").read_text().split() if n.startswith(".tmp")]

    full = (out / "full.log").read_text()
    assert (out / "full.rc").read_text().strip() == "1", full
    (line,) = [x for x in full.splitlines() if x.startswith("error: ")]
    assert "the disk is full (" in line and "free there" in line, line
    assert "Traceback" not in full, full

    rerun = (out / "rerun.log").read_text()
    assert (out / "rerun.rc").read_text().strip() == "0", rerun
    assert "resuming from checkpoints/agent/step_1" in rerun, rerun
    assert (out / "latest_after_rerun").read_text() == "step_2"
