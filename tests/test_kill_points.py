"""The kill-point finders of tests/kill_points.py see through links: /proc reports resolved paths (a process's
cwd, its open files), while the tests hold the paths they were given, such as a `../shared` that is a link."""

from __future__ import annotations

import os
import subprocess
import sys

from kill_points import reached_sampling, stage_pids


def test_reached_sampling_and_stage_pids_resolve_linked_paths(tmp_path):
    real_mirror, real_project = tmp_path / "real_mirror", tmp_path / "real_project"
    (real_mirror / "raw").mkdir(parents=True)
    real_project.mkdir()
    (tmp_path / "mirror").symlink_to(real_mirror)
    (tmp_path / "project").symlink_to(real_project)
    mirror, project = tmp_path / "mirror", tmp_path / "project"
    (mirror / "raw" / "train.parquet").write_bytes(b"rows")

    # A stand-in stage process: `promptr1 sample hotpotqa` in its argv, the project as its cwd, a source open.
    code = "import sys, time; f = open(sys.argv[1], 'rb'); print('open', flush=True); time.sleep(60)"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(mirror / "raw" / "train.parquet"), "promptr1", "sample", "hotpotqa"],
        cwd=project,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "open"
        assert os.readlink(f"/proc/{proc.pid}/cwd") == str(real_project)  # what /proc reports: resolved
        assert reached_sampling(project, mirror)(proc.pid)
        assert stage_pids(project, "sample@hotpotqa") == [proc.pid]
        assert stage_pids(project, "sample@gsm8k") == []
    finally:
        proc.kill()
        proc.wait(timeout=10)
