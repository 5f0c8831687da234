"""Artifacts between machines: the repo's own `.dvc/config` (named default remote `storage`) carries a stage
output from one checkout to a fresh clone through a local-directory remote, with real git and DVC.

Two routes, as docs/gpu.md describes them: the committed URL (a directory beside the clone, shared by
checkouts on one machine) and a per-machine URL in the uncommitted `.dvc/config.local`.
"""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
PAYLOAD = "checkpoint bytes \u2713 " * 200


def run(args: list[str], cwd: Path) -> str:
    env = {**os.environ, "DVC_NO_ANALYTICS": "1", "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@localhost",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@localhost"}
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, f"{args}: {proc.stdout}\n{proc.stderr}"
    return proc.stdout


def dvc(cwd: Path, *args: str) -> str:
    return run([sys.executable, "-m", "dvc", *args], cwd)


def make_project(root: Path) -> Path:
    """A git + DVC project with the repo's .dvc/config and one stage whose output is DVC-cached."""
    root.mkdir(parents=True)
    run(["git", "init", "-q", "-b", "main"], root)
    dvc(root, "init", "-q")
    shutil.copy(REPO_ROOT / ".dvc" / "config", root / ".dvc" / "config")
    (root / "make.py").write_text(
        "from pathlib import Path\n"
        f"Path('models/agent').mkdir(parents=True, exist_ok=True)\n"
        f"Path('models/agent/weights.txt').write_text({PAYLOAD!r}, encoding='utf-8')\n",
        encoding="utf-8")
    dvc(root, "stage", "add", "-q", "-n", "merge", "-d", "make.py", "-o", "models/agent",
        f"{Path(sys.executable).as_posix()} make.py")
    dvc(root, "repro", "-q")
    run(["git", "add", "-A"], root)
    run(["git", "commit", "-q", "-m", "stage"], root)
    return root


def test_repo_config_names_one_default_remote():
    config = configparser.ConfigParser()
    config.read(REPO_ROOT / ".dvc" / "config")
    remotes = [s for s in config.sections() if s.startswith("'remote ")]
    assert remotes == ["'remote \"storage\"'"]
    assert config["core"]["remote"] == "storage"
    assert not Path(config[remotes[0]]["url"]).is_absolute()  # no machine paths in the repo


def test_output_pushed_from_one_checkout_is_pulled_into_a_fresh_clone(tmp_path):
    source = make_project(tmp_path / "work" / "project")
    dvc(source, "push", "-q")
    # The committed URL resolves beside the clone (../dvc-storage relative to the project).
    assert any((tmp_path / "work" / "dvc-storage").rglob("*")), "nothing pushed beside the clone"

    clone = tmp_path / "work" / "clone"
    run(["git", "clone", "-q", str(source), str(clone)], tmp_path)
    assert not (clone / "models" / "agent").exists()
    dvc(clone, "pull", "-q")
    assert (clone / "models" / "agent" / "weights.txt").read_text(encoding="utf-8") == PAYLOAD
    assert "up to date" in dvc(clone, "status").lower()


def test_another_machine_sets_its_remote_url_locally(tmp_path):
    """A per-machine URL (`dvc remote modify --local`) overrides the committed one without a commit."""
    source = make_project(tmp_path / "workstation" / "project")
    shared = tmp_path / "shared-storage"
    dvc(source, "remote", "modify", "--local", "storage", "url", str(shared))
    dvc(source, "push", "-q")
    assert any(shared.rglob("*")) and not (tmp_path / "workstation" / "dvc-storage").exists()
    assert run(["git", "status", "--porcelain"], source) == ""  # config.local is not versioned

    node = tmp_path / "gpu-node" / "project"
    node.parent.mkdir()
    run(["git", "clone", "-q", str(source), str(node)], tmp_path)
    with pytest.raises(AssertionError):  # without its own URL the node looks beside its clone: nothing there
        dvc(node, "pull", "-q")
    dvc(node, "remote", "modify", "--local", "storage", "url", str(shared))
    dvc(node, "pull", "-q")
    assert (node / "models" / "agent" / "weights.txt").read_text(encoding="utf-8") == PAYLOAD
