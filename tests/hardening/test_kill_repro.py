"""kill -9 inside `dvc repro`, once per stage kind, on one micro project: every rerun finishes, nothing is
half-written, nothing is repeated where the stage resumes, the registry keeps no orphan version.

One micro project (tests/kill_points.py: one training set, a tiny agent, the `api` backend at a local
stand-in server) is shared by the tests below, in file order, each continuing from the state the previous
one left: a real `dvc repro` whose stage process is SIGKILLed at an observed point (never after a sleep),
the checks on what the kill left, then a rerun of that stage through DVC. Training killed mid-step has its
own test (tests/test_train_local.py::test_killed_training_resumes_without_repeating_steps); the campaign of
random kills across all stages is benchmarks/bench_kill_campaign.py.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pandas as pd
import pytest
from fault_server import FaultServer
from kill_points import (
    dvc_changed,
    half_written,
    make_micro_project,
    micro_env,
    orphan_versions,
    reached_evaluation,
    reached_registering,
    reached_sampling,
    registered_versions,
    repeated_steps,
    repro_killing,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


class Micro:
    def __init__(self, project: Path, server: FaultServer, mirror: Path) -> None:
        self.project, self.server, self.mirror, self.env = project, server, mirror, micro_env()

    def repro(self, *targets: str) -> subprocess.CompletedProcess:
        proc = subprocess.run(["dvc", "repro", *targets], cwd=self.project, env=self.env, capture_output=True,
                              text=True, timeout=900, check=False)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return proc


@pytest.fixture(scope="module")
def micro(tmp_path_factory, repo_root, shared_datasets, tiny_llama_dir):
    with FaultServer() as server:
        project = make_micro_project(tmp_path_factory.mktemp("kill") / "project", repo_root, shared_datasets,
                                     tiny_llama_dir, server.url)
        yield Micro(project, server, shared_datasets)


def _leftover_temporaries(project: Path) -> list[str]:
    return [str(p.relative_to(project)) for folder in ("data", "reports", "models")
            for p in (project / folder).rglob(".*.tmp") if (project / folder).is_dir()]


def test_kill_sampling_mid_read(micro):
    run = repro_killing(micro.project, micro.env, "sample@hotpotqa",
                        arm=lambda: reached_sampling(micro.project, micro.mirror))
    assert run.killed and run.returncode != 0, run.output[-20:]
    assert half_written(micro.project) == []
    assert not (micro.project / "data" / "sampled" / "hotpotqa.parquet").exists()  # nothing partial in place

    micro.repro("sample@hotpotqa")
    rows = pd.read_parquet(micro.project / "data" / "sampled" / "hotpotqa.parquet")
    report = json.loads((micro.project / "reports" / "sample" / "hotpotqa.json").read_text())
    assert len(rows) == report["rows_written"] == 16
    assert _leftover_temporaries(micro.project) == []


def test_kill_evaluation_mid_set(micro):
    server = micro.server
    run = repro_killing(micro.project, micro.env, "evaluate", arm=lambda: reached_evaluation(server, calls=3))
    assert run.killed and run.returncode != 0, run.output[-20:]
    assert half_written(micro.project) == []
    assert not (micro.project / "reports" / "eval" / "metrics.json").exists()
    before = {json.dumps(r.body, sort_keys=True) for r in server.chat_requests}
    sent_before = len(server.chat_requests)

    micro.repro("evaluate")
    metrics = json.loads((micro.project / "reports" / "eval" / "metrics.json").read_text())
    assert metrics["systems"] == ["prompt_r1", "env_only"]
    # Replies answered before the kill come from the response cache: at most the one call in flight at the
    # kill (batch size 1) is sent again.
    again = [r for r in server.chat_requests[sent_before:] if json.dumps(r.body, sort_keys=True) in before]
    assert len(again) <= 1, len(again)
    assert _leftover_temporaries(micro.project) == []


def test_kill_registering_leaves_no_orphan_version(micro):
    run = repro_killing(micro.project, micro.env, "register", arm=lambda: reached_registering(micro.project))
    assert run.killed and run.returncode != 0, run.output[-20:]
    assert half_written(micro.project) == []
    # Killed within milliseconds of the version's creation, long before the ~25 store writes that record
    # its evaluation and decision: the kill left exactly the orphan the rerun must settle.
    assert len(orphan_versions(micro.project)) == 1

    micro.repro("register")
    promotion = json.loads((micro.project / "reports" / "promotion.json").read_text())
    assert orphan_versions(micro.project) == []
    versions = registered_versions(micro.project)
    assert [v for _, v, _ in versions][-1] == promotion["version"]
    assert promotion["promoted"] and promotion["champion_after"] == promotion["version"]


def test_rerun_after_the_kills_completes_and_is_up_to_date(micro):
    micro.repro()
    assert dvc_changed(micro.project, micro.env) == {}
    assert half_written(micro.project) == []
    assert repeated_steps(micro.project) == []
    assert orphan_versions(micro.project) == []
    assert _leftover_temporaries(micro.project) == []
