"""A canary API key through a whole micro-profile `dvc repro`: it reaches the configured endpoint and nothing else.

The paid backend (`environment.backend=api`) is pointed at a local OpenAI-compatible server standing in for
the paid API (http on loopback is the one clear-text case the client allows). The key lives only in the
environment variable. After the real pipeline ran every stage (sample → … → register) the canary must be
found nowhere: not in `mlflow.db` or the MLflow artifacts, `dvc.lock`, params, reports, caches, logs, the
pipeline's own output, or any process's command line while it ran. The stand-in server seeing the key in
its requests is the positive control: the canary really flowed through the run.
"""

from __future__ import annotations

import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest
import yaml
from demo_project import copy_project, one_step_run, project_env
from fault_server import FaultServer

pytestmark = pytest.mark.slow


def micro_params(raw: dict, mirror: Path, agent_dir: Path, url: str) -> dict:
    """The default profile shrunk to a micro run with a tiny agent and the api backend at `url`."""
    one_step_run(raw, mirror, sample_size=16)
    raw["agent"].update(model=str(agent_dir), max_turns=3, max_turn_tokens=40, max_response_tokens=400)
    raw["environment"].update(backend="api", base_url=url, served_name="fault-model", max_tokens=16,
                              api_key_env="PROMPTR1_CANARY_KEY", max_retries=0)
    raw["evaluate"].update(rows_per_dataset=1, agent_max_turn_tokens=8, bootstrap_samples=20)
    return raw


def test_canary_key_appears_only_in_requests_to_the_configured_endpoint(
        tmp_path, repo_root, shared_datasets, tiny_llama_dir):
    canary = f"sk-canary-{uuid.uuid4().hex}"
    project = tmp_path / "project"
    copy_project(repo_root, project)
    with FaultServer() as server:
        raw = yaml.safe_load((project / "params.yaml").read_text())
        params = micro_params(raw, shared_datasets, tiny_llama_dir, server.url)
        (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
        env = project_env() | {"PROMPTR1_CANARY_KEY": canary}
        for cmd in (["git", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-qm", "snapshot"]):
            subprocess.run(cmd, cwd=project, env=env, check=True, timeout=60)

        seen_in_ps: list[str] = []
        done = threading.Event()

        def watch_processes() -> None:
            while not done.is_set():
                listing = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=False).stdout
                seen_in_ps.extend(line for line in listing.splitlines() if canary in line)
                time.sleep(0.5)

        watcher = threading.Thread(target=watch_processes, daemon=True)
        watcher.start()
        try:
            proc = subprocess.run(["dvc", "repro"], cwd=project, env=env, capture_output=True, text=True,
                                  timeout=1500, check=False)
        finally:
            done.set()
            watcher.join(timeout=5)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        requests = server.chat_requests

    assert requests, "the run never called the environment: the canary was not exercised"
    assert all(r.headers["authorization"] == f"Bearer {canary}" for r in requests)
    assert (project / "reports" / "promotion.json").is_file()
    assert canary not in proc.stdout and canary not in proc.stderr
    assert not seen_in_ps, seen_in_ps[:3]
    leaks = [str(path.relative_to(project)) for path in project.rglob("*")
             if path.is_file() and ".git" not in path.parts and canary.encode() in path.read_bytes()]
    assert leaks == []
