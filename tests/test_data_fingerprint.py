"""Stage `sources`: fingerprints of the raw sources, and the real DVC behaviour they buy.

The DVC test builds a real DVC project in tmp_path (git init + dvc init) from dvc.yaml's own `sources`
and `sample` stages (code deps dropped: the tmp project holds no code) over a tiny mirror, and checks
what the stage exists for: the first repro runs sources + sample, a second one reruns only `sources`
(sample skipped: the fingerprint's hash is unchanged), a changed mirror file reruns sample, and an empty
`paths.mirror` (the Hub) does not break DVC.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import yaml
from helpers import copy_params

from pipeline.data.sources import REGISTRY
from pipeline.stage_files import SOURCES_EVAL_FILE
from pipeline.stages.sources import UNREACHABLE, run_sources

REPO = Path(__file__).resolve().parents[1]


def _tiny_mirror(root: Path, shared_datasets: Path, n: int = 12) -> Path:
    """`<root>/mirror`: a tiny raw/gsm8k file of our own; the authors' real evaluation files (symlinked)."""
    mirror = root / "mirror"
    (mirror / "raw" / "gsm8k").mkdir(parents=True)
    (mirror / "prompt-r1").mkdir()
    (mirror / "prompt-r1" / "eval").symlink_to(shared_datasets / "prompt-r1" / "eval")
    _write_gsm8k(mirror, n)
    return mirror


def _write_gsm8k(mirror: Path, n: int) -> Path:
    path = mirror / "raw" / "gsm8k" / "train.parquet"
    rows = [
        {"id": f"g{i}", "question": f"How many apples does farmer {i} have?", "answers": [str(i)],
         "context": "", "source_split": "train"}
        for i in range(n)
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _read(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.glob("*.json"))}


def test_mirror_fingerprint_changes_with_the_file_and_only_then(data_params, shared_datasets, tmp_path):
    mirror = _tiny_mirror(tmp_path, shared_datasets)
    params = data_params(mirror)
    out = tmp_path / "sources"

    written = run_sources(params, out)
    assert set(written) == {f"{name}.json" for name in REGISTRY} | {SOURCES_EVAL_FILE}
    assert all(written.values())
    first = _read(out)
    gsm8k = json.loads(first["gsm8k.json"])
    assert gsm8k["source"] == "mirror"
    assert gsm8k["raw"][0]["file"] == "raw/gsm8k/train.parquet" and len(gsm8k["raw"][0]["md5"]) == 32
    assert gsm8k["eval"]["file"] == "prompt-r1/eval/gsm8k.parquet" and "md5" in gsm8k["eval"]
    assert json.loads(first["hotpotqa.json"])["raw"][0]["missing"] is True  # absent here: recorded, no error
    assert set(json.loads(first[SOURCES_EVAL_FILE])["eval"]) == set(REGISTRY)
    assert str(tmp_path) not in b"".join(first.values()).decode()  # no machine paths in the fingerprints

    # Nothing changed (even the file's mtime): nothing rewritten, same bytes.
    raw = mirror / "raw" / "gsm8k" / "train.parquet"
    stamp = time.time() + 5
    os.utime(raw, (stamp, stamp))
    assert not any(run_sources(params, out).values())
    assert _read(out) == first

    # The content changed: only gsm8k's fingerprint changes.
    _write_gsm8k(mirror, 13)
    written = run_sources(params, out)
    assert [name for name, changed in written.items() if changed] == ["gsm8k.json"]
    assert _read(out)["gsm8k.json"] != first["gsm8k.json"]


def test_hub_without_network_records_unreachable(data_params, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # conftest sets it too; this test is about that case
    params = data_params(paths={"mirror": ""})
    out = tmp_path / "sources"
    written = run_sources(params, out)  # must not raise: `sample` reports the real error
    assert len(written) == len(REGISTRY) + 1
    gsm8k = json.loads((out / "gsm8k.json").read_text())
    assert gsm8k["source"] == "hub"
    assert gsm8k["hub"] == {"id": "openai/gsm8k", "config": "main", "split": "train", "revision": UNREACHABLE}
    assert gsm8k["eval"]["url"].endswith("/gsm8k.parquet")
    assert not any(run_sources(params, out).values())  # stable while unreachable: downstream stays skipped


# --- real DVC ------------------------------------------------------------------------------------


def _project(tmp_path: Path, mirror: Path) -> Path:
    """A DVC project with dvc.yaml's `sources` and `sample` stages, one training dataset, tiny sample."""
    project = copy_params(tmp_path / "project", profiles=True)
    raw = yaml.safe_load((project / "params.yaml").read_text())
    raw["paths"]["mirror"] = str(mirror)
    raw["data"].update(train_datasets=["gsm8k"], sample_datasets=["gsm8k"], sample_size=8)
    (project / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))

    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    kept = {name: stages[name] for name in ("sources", "sample")}
    for stage in kept.values():
        body = stage.get("do", stage)
        # The tmp project has no code: keep every dep but the pipeline's own modules.
        body["deps"] = [d for d in body["deps"] if not str(d).startswith("pipeline/")]
    (project / "dvc.yaml").write_text(yaml.safe_dump({"stages": kept}, sort_keys=False))
    return project


def _dvc(project: Path, *args: str) -> str:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # `promptr1` of this venv
    env["DVC_NO_ANALYTICS"] = "1"
    proc = subprocess.run([sys.executable, "-m", "dvc", *args], cwd=project, env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0, f"dvc {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout + proc.stderr


def _ran(output: str) -> list[str]:
    return re.findall(r"Running stage '([^']+)'", output)


def test_dvc_reruns_sample_only_when_its_source_changes(shared_datasets, tmp_path):
    mirror = _tiny_mirror(tmp_path, shared_datasets)
    project = _project(tmp_path, mirror)
    subprocess.run(["git", "init", "-q"], cwd=project, check=True, timeout=30)
    _dvc(project, "init", "-q")

    assert _ran(_dvc(project, "repro")) == ["sources", "sample@gsm8k"]
    assert (project / "data" / "sampled" / "gsm8k.parquet").is_file()
    assert (project / "data" / "sources" / "gsm8k.json").is_file()

    second = _dvc(project, "repro")
    assert _ran(second) == ["sources"]
    assert "Stage 'sample@gsm8k' didn't change, skipping" in second

    _write_gsm8k(mirror, 13)  # the tiny mirror's content changes
    assert _ran(_dvc(project, "repro")) == ["sources", "sample@gsm8k"]
    assert pq.read_metadata(project / "data" / "sampled" / "gsm8k.parquet").num_rows == 8

    # The Hub (paths.mirror empty) is just a param: DVC needs neither `/raw` nor the mirror folder.
    raw = yaml.safe_load((project / "params.yaml").read_text())
    raw["paths"]["mirror"] = ""
    (project / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    assert _ran(_dvc(project, "repro", "sources")) == ["sources"]
    assert json.loads((project / "data" / "sources" / "gsm8k.json").read_text())["hub"]["revision"] == UNREACHABLE
