"""A refused `dvc exp run -S` loses nothing: a real `dvc exp run` in a clean clone of this repository, then in
the same clone with a user's own uncommitted edit (slow: two real DVC runs, ~7 s each on 2 cores).

DVC rewrites params.yaml in its own layout before any stage runs and removes the `sources` stage's git-tracked
outputs (data/sources/*.json) before its command; the stage refuses `train.lr=abc` and puts back what DVC
changed (pipeline/refused_experiment.py): the clean clone is byte for byte as before, and in the edited one
the user's `seed` edit survives in the user's own layout while the refused key gets its committed value.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from flows.dvc_steps import subprocess_env

REPO = Path(__file__).resolve().parents[1]
GIT = ["git", "-c", "user.name=t", "-c", "user.email=t@example.invalid", "-c", "commit.gpgsign=false"]


def _tracked(root: Path) -> dict[str, bytes | None]:
    """Every git-tracked file's bytes (None: missing from the workspace)."""
    names = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, text=True, check=True)
    return {n: (root / n).read_bytes() if (root / n).is_file() else None for n in names.stdout.split("\0") if n}


def _exp_run(root: Path, *sets: str) -> tuple[subprocess.CompletedProcess[str], float]:
    env = {**subprocess_env(), "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.invalid",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.invalid"}
    args = [a for s in sets for a in ("-S", s)]
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "dvc", "exp", "run", *args], cwd=root, env=env, check=False,
                          capture_output=True, text=True, timeout=300)
    return done, time.monotonic() - start


@pytest.mark.slow
def test_a_refused_exp_run_puts_back_the_params_and_the_removed_outputs(tmp_path):
    clone = tmp_path / "clone"
    subprocess.run([*GIT, "clone", "-q", str(REPO), str(clone)], check=True, capture_output=True)
    sources = sorted(n for n in _tracked(clone) if n.startswith("data/sources/"))
    assert len(sources) >= 10, sources  # the fingerprints the `sources` stage writes and git tracks

    before = _tracked(clone)
    done, seconds = _exp_run(clone, "train.lr=abc")
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    # refused by the first stage, within seconds, naming the key and what came back
    assert output.count("Running stage") == 1 and "Running stage 'sources'" in output, output
    assert seconds < 60, (seconds, output)
    # byte for byte as before: params.yaml (DVC had rewritten 90 lines of it) and every tracked output
    after = _tracked(clone)
    assert [n for n in before if after[n] != before[n]] == []
    status = subprocess.run(["git", "status", "--porcelain"], cwd=clone, capture_output=True, text=True, check=True)
    assert status.stdout == "", status.stdout
    (line,) = [x for x in output.splitlines() if x.startswith("error: ")]
    assert "train.lr: Input should be a valid number" in line, line
    assert "put back what `dvc exp run` changed: train.lr (1.0e-05) in params.yaml, as committed" in line, line
    assert f"data/sources/ ({len(sources)} tracked files DVC removed before this stage)" in line, line

    # A user's own uncommitted edit of another key survives, in the user's layout; only train.lr is put back.
    params = clone / "params.yaml"
    edited = params.read_text().replace("\nseed: 42\n", "\nseed: 7\n", 1)
    assert edited != params.read_text()
    params.write_text(edited)
    before = _tracked(clone)
    done, _ = _exp_run(clone, "train.lr=abc")
    output = done.stdout + done.stderr
    assert done.returncode != 0 and "train.lr (1.0e-05) in params.yaml" in output, output
    assert params.read_text() == edited
    after = _tracked(clone)
    assert [n for n in before if after[n] != before[n]] == []


BASE = b"""# what the user wrote
seed: 42
profile: default
paths:
  data: data
train:
  lr: 1.0e-5     # paper: 1e-6
  steps: 2       # next to lr
  batch: 4
  group: 2
  mods: [a, b]
  size: 8
"""


@pytest.mark.parametrize(("edit", "sets", "refused", "expected"), [
    # the user's seed edit and the refused lr are far apart: the user's own text comes back whole
    ((b"seed: 42", b"seed: 7"), ["train.lr=abc"], ["train.lr"], BASE.replace(b"seed: 42", b"seed: 7")),
    # the refused list gets its committed flow style back, the edit survives
    ((b"seed: 42", b"seed: 7"), ["train.mods=[x,1]"], ["train.mods"], BASE.replace(b"seed: 42", b"seed: 7")),
    # an edit on the line next to the refused key cannot be merged: DVC's layout, the committed `1.0e-5` as written
    ((b"steps: 2 ", b"steps: 3 "), ["train.lr=abc"], ["train.lr"],
     BASE.replace(b"steps: 2 ", b"steps: 3 ").replace(b"mods: [a, b]", b"mods:\n  - a\n  - b")),
    # a refused new key is removed; the accepted -S value stays (as DVC leaves an experiment's params)
    ((b"seed: 42", b"seed: 42"), ["train.steps=5", "+train.foo=1"], ["train.foo"],
     BASE.replace(b"steps: 2 ", b"steps: 5 ")),
], ids=["far", "list", "adjacent", "new-key"])
def test_put_back_text_keeps_the_users_layout_where_it_can(tmp_path, edit, sets, refused, expected):
    """The params text as `dvc exp run -S` rewrote it (DVC's own `apply_overrides` on the user's edited file),
    put back: the refused keys take their committed values, everything else is the user's."""
    import yaml
    from dvc.utils.hydra import apply_overrides

    from pipeline.refused_experiment import put_back_text, refused_changes

    params = tmp_path / "params.yaml"
    params.write_bytes(BASE.replace(*edit))
    apply_overrides(str(params), sets)
    rewritten = params.read_bytes()
    keys = refused_changes(yaml.safe_load(rewritten), yaml.safe_load(BASE), refused)
    assert put_back_text(rewritten, BASE, keys) == expected
