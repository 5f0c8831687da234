"""dvc.yaml's generated tails (code deps, params) are what scripts/dvc_lists.py writes, in the layout it keeps.

tests/test_dvc_deps.py and tests/test_dvc_params.py say what is wrong with a list; this test says the whole
file is current, so the fix is one command. The writer is checked on a copy of dvc.yaml with one dep removed
and one param added: it restores the file byte for byte, and `--check` fails on the copy first. The layout:
each stage reads `cmd`, its outs, its hand-written data deps, then one marker line and the generated lists;
a folder is listed only where the stage needs every file DVC hashes in it; the file stays within 500 lines.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from stage_code.closure import CODE_PACKAGES, ROOT, stage_files
from stage_code.folders import IGNORED_DIRS, IGNORED_SUFFIXES, folder_entries, hashed_files

spec = importlib.util.spec_from_file_location("dvc_lists", ROOT / "scripts" / "dvc_lists.py")
dvc_lists = sys.modules["dvc_lists"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(dvc_lists)

TEXT = (ROOT / "dvc.yaml").read_text(encoding="utf-8")
STAGES = yaml.safe_load(TEXT)["stages"]
MAX_LINES = 500


def test_dvc_yaml_is_current() -> None:
    stale = dvc_lists.diff(ROOT / "dvc.yaml")
    assert not stale, (
        "dvc.yaml's deps/params lists differ from what the code imports and reads; rewrite them with "
        "`python scripts/dvc_lists.py` and commit dvc.yaml:\n" + "\n".join(stale)
    )


def _edited(text: str, generated: bool = True) -> str:
    """dvc.yaml with a hand edit above the train stage's marker (a data dep's comment) and, if `generated`,
    below it: its `pipeline/reward.py` dep removed, `mlflow.trace_evaluation` (which only evaluate reads)
    added to its params."""
    lines = text.split("\n")
    stage = lines.index("  train:")
    end = lines.index("  merge:")
    data = next(i for i in range(stage, end) if lines[i].strip() == '"${paths.rl_dir}/train.parquet",')
    lines[data] += "  # the GRPO questions"
    if generated:
        dep = next(i for i in range(stage, end) if "pipeline/reward.py, " in lines[i])
        params = next(i for i in range(stage, end) if lines[i].startswith("    params: ["))
        lines[dep] = lines[dep].replace("pipeline/reward.py, ", "")
        lines[params] = lines[params].replace("params: [", "params: [mlflow.trace_evaluation, ")
    return "\n".join(lines)


def test_the_writer_restores_a_removed_dep_and_drops_an_added_param(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    copy = tmp_path / "dvc.yaml"
    copy.write_text(_edited(TEXT), encoding="utf-8")

    assert dvc_lists.main(["--check", "--dvc-yaml", str(copy)]) == 1
    printed = capsys.readouterr().out.split("\n")
    assert any(line.startswith("+") and "pipeline/reward.py" in line for line in printed)
    assert any(line.startswith("-") and "mlflow.trace_evaluation" in line for line in printed)
    assert copy.read_text(encoding="utf-8") == _edited(TEXT)  # --check writes nothing

    assert dvc_lists.main(["--dvc-yaml", str(copy)]) == 0
    assert copy.read_text(encoding="utf-8") == _edited(TEXT, generated=False)  # above the marker: as written


def _stage_blocks(text: str) -> dict[str, list[str]]:
    """Each stage's lines in dvc.yaml, from its `  name:` line to the last line indented below it."""
    lines = text.split("\n")
    blocks: dict[str, list[str]] = {}
    starts = [i for i, line in enumerate(lines) if dvc_lists.STAGE.match(line) and lines.index("stages:") < i]
    for start in starts:
        end = start + 1
        while end < len(lines) and lines[end].strip() and len(lines[end]) - len(lines[end].lstrip()) > 2:
            end += 1
        blocks[lines[start].strip().rstrip(":")] = lines[start:end]
    return blocks


def test_every_stage_reads_cmd_outs_data_deps_then_its_generated_lists() -> None:
    assert len(TEXT.rstrip("\n").split("\n")) <= MAX_LINES
    blocks = _stage_blocks(TEXT)
    assert set(blocks) == set(STAGES)
    for name, block in blocks.items():
        keys = list(STAGES[name].get("do", STAGES[name]))
        assert keys[0] == "cmd" and keys[-2:] == ["deps", "params"], f"stage {name!r}: keys in order {keys}"
        markers = [i for i, line in enumerate(block) if line.strip() == dvc_lists.MARKER]
        assert len(markers) == 1, f"stage {name!r}: {len(markers)} marker lines"
        opening = next(i for i, line in enumerate(block) if line.strip() == "deps: [")
        data = [line.split("#")[0].strip().rstrip(",").strip('"') for line in block[opening + 1 : markers[0]]]
        assert "profiles" in data
        assert not [d for d in data if d.split("/")[0] in CODE_PACKAGES], (
            f"stage {name!r}: code above the marker"
        )
        below = [line.split(":")[0].strip() for line in block[markers[0] + 1 :] if ": " in line]
        assert below == ["params"], f"stage {name!r}: keys below the marker {below}"


@pytest.mark.parametrize("name", list(STAGES))
def test_a_folder_is_listed_only_where_the_stage_needs_every_file_in_it(name: str) -> None:
    body = STAGES[name].get("do", STAGES[name])
    needed = stage_files(body["cmd"].split()[1])
    for dep in body["deps"]:
        if dep.split("/")[0] in CODE_PACKAGES and (ROOT / dep).is_dir():
            extra = sorted(str(p.relative_to(ROOT)) for p in hashed_files(ROOT / dep) - needed)
            assert not extra, f"stage {name!r} lists {dep} whole, but does not run or read {extra}"


def test_the_folder_rule_can_refuse_a_folder(tmp_path: Path) -> None:
    """A folder stands for its files only when the stage needs all of them: a README, or a module the
    stage does not import, keeps it out; compiled files (ignored by DVC) do not."""
    for name in (
        "pkg/a/x.py",
        "pkg/a/y.py",
        "pkg/a/__pycache__/x.cpython-311.pyc",
        "pkg/b/z.py",
        "pkg/b/README.md",
        "pkg/c/w.py",
        "pkg/c/unused.py",
        "pkg/top.py",
    ):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("", encoding="utf-8")
    files = {tmp_path / n for n in ("pkg/a/x.py", "pkg/a/y.py", "pkg/b/z.py", "pkg/c/w.py", "pkg/top.py")}
    assert folder_entries(files, [tmp_path / "pkg"], tmp_path) == [
        "pkg/a",
        "pkg/b/z.py",
        "pkg/c/w.py",
        "pkg/top.py",
    ]
    more = files | {tmp_path / "pkg/b/README.md", tmp_path / "pkg/c/unused.py"}
    assert folder_entries(more, [tmp_path / "pkg"], tmp_path) == ["pkg"]


def test_dvcignore_leaves_compiled_python_out_of_a_folders_hash() -> None:
    patterns = set((ROOT / ".dvcignore").read_text(encoding="utf-8").split("\n"))
    assert {f"{d}/" for d in IGNORED_DIRS} | {f"*{s}" for s in IGNORED_SUFFIXES} <= patterns


@pytest.mark.slow
def test_check_runs_in_a_tree_without_tests(tmp_path: Path) -> None:
    """The script and what it is built from live outside tests/: a copy of the project without them
    finds its dvc.yaml current, and a stale copy stale."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("pipeline", "flows", "scripts", "profiles"):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=ignore)
    for name in ("dvc.yaml", "params.yaml", ".dvcignore", "pyproject.toml"):
        shutil.copy(ROOT / name, tmp_path / name)
    script = [sys.executable, str(tmp_path / "scripts" / "dvc_lists.py"), "--check"]
    done = subprocess.run(script, cwd=tmp_path, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    (tmp_path / "dvc.yaml").write_text(_edited(TEXT), encoding="utf-8")
    done = subprocess.run(script, cwd=tmp_path, capture_output=True, text=True, check=False)
    assert done.returncode == 1 and "pipeline/reward.py" in done.stdout, done.stdout + done.stderr
