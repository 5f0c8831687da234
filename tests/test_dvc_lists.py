"""dvc.yaml's `deps:` code entries and `params:` lists are what scripts/dvc_lists.py writes from the code.

tests/test_dvc_deps.py and tests/test_dvc_params.py say what is wrong with a list; this test says the whole
file is current, so the fix is one command. The writer is checked on a copy of dvc.yaml with one dep removed
and one param added: it restores the file byte for byte, and `--check` fails on the copy first.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from dvc_closure import ROOT

spec = importlib.util.spec_from_file_location("dvc_lists", ROOT / "scripts" / "dvc_lists.py")
dvc_lists = sys.modules["dvc_lists"] = importlib.util.module_from_spec(spec)  # its dataclass looks itself up
spec.loader.exec_module(dvc_lists)


def test_dvc_yaml_is_current() -> None:
    stale = dvc_lists.diff(ROOT / "dvc.yaml")
    assert not stale, (
        "dvc.yaml's deps/params lists differ from what the code imports and reads; rewrite them with "
        "`python scripts/dvc_lists.py` and commit dvc.yaml:\n" + "\n".join(stale)
    )


def _edited(text: str) -> str:
    """dvc.yaml with the train stage's `pipeline/reward.py` dep removed and `mlflow.trace_evaluation`
    (which only evaluate reads) added to its params."""
    lines = text.split("\n")
    stage = lines.index("  train:")
    dep = lines.index("      - pipeline/reward.py", stage)
    params = lines.index("    params:", stage)
    assert dep < params < lines.index("  merge:")
    lines.insert(params + 1, "      - mlflow.trace_evaluation")
    del lines[dep]
    return "\n".join(lines)


def test_the_writer_restores_a_removed_dep_and_drops_an_added_param(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    current = (ROOT / "dvc.yaml").read_text(encoding="utf-8")
    copy = tmp_path / "dvc.yaml"
    copy.write_text(_edited(current), encoding="utf-8")

    assert dvc_lists.main(["--check", "--dvc-yaml", str(copy)]) == 1
    printed = capsys.readouterr().out
    assert "+      - pipeline/reward.py" in printed
    assert "-      - mlflow.trace_evaluation" in printed
    assert copy.read_text(encoding="utf-8") == _edited(current)  # --check writes nothing

    assert dvc_lists.main(["--dvc-yaml", str(copy)]) == 0
    assert copy.read_text(encoding="utf-8") == current
    assert dvc_lists.main(["--check", "--dvc-yaml", str(copy)]) == 0
