"""Every documented Prefect command, for real, against a temporary `prefect server start` on 127.0.0.1.

docs/prefect.md's GPU route (`prefect work-pool create`, `prefect gcl create`, `prefect --no-prompt deploy
--all`), `prefect deployment ls`, `prefect deployment run`, and `promptr1 flow serve`: each runs as a
subprocess against a server with its own temporary PREFECT_HOME, exactly as a person types it. This is what
caught the pins in pyproject.toml: with fastapi >= 0.151 Prefect 3.8.8's server answers its own client's
`"limit": null` with 422 (deploy exits 1 after registering, `deployment ls` fails, the served runner logs
422 tracebacks), and with SQLAlchemy 2.1 its scheduler never creates the scheduled runs, which is checked
here through the API.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import httpx
import pytest
import yaml
from demo_project import free_port

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
GPU_DEPLOYMENT = "promptr1-retrain/retrain-paper"
SERVED_DEPLOYMENT = re.compile(r"promptr1-retrain/retrain(?![\w-])")  # not retrain-paper
PROBLEMS = ("422 Unprocessable Entity", "Traceback")


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory):
    """`prefect server start` on a free port with a temporary PREFECT_HOME; yields the env to talk to it."""
    home = tmp_path_factory.mktemp("prefect-home")
    port = free_port()
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "COLUMNS": "200",
    }  # wide tables: `prefect deployment ls` would cut names at 80 columns
    env.pop("PREFECT_API_URL", None)
    log = (home / "server.log").open("w")
    server = subprocess.Popen(
        [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    api = f"http://127.0.0.1:{port}/api"
    try:
        deadline = time.monotonic() + 180
        while True:
            if server.poll() is not None:
                pytest.fail(f"prefect server exited: {(home / 'server.log').read_text()[-3000:]}")
            try:
                if httpx.get(f"{api}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"prefect server not up after 180 s: {(home / 'server.log').read_text()[-3000:]}")
            time.sleep(0.5)
        yield {**env, "PREFECT_API_URL": api}
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=30)
        log.close()
    server_log = (home / "server.log").read_text()
    assert not any(p in server_log for p in PROBLEMS), server_log[-3000:]


def prefect(env: dict[str, str], *args: str, timeout: float = 120) -> str:
    """Run `prefect <args>` from the project root; fail with its output unless it exits 0 cleanly."""
    done = subprocess.run(
        [str(BIN / "prefect"), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, f"`prefect {' '.join(args)}` exited {done.returncode}:\n{out[-3000:]}"
    assert not any(p in out for p in PROBLEMS), f"`prefect {' '.join(args)}`:\n{out[-3000:]}"
    return out


def test_documented_gpu_route_deploys_lists_schedules_and_runs(prefect_server):
    env = prefect_server
    pool = yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"][0]["work_pool"]["name"]
    prefect(env, "work-pool", "create", pool, "--type", "process")
    prefect(env, "gcl", "create", "promptr1-pipeline", "--limit", "1")
    deployed = prefect(env, "--no-prompt", "deploy", "--all")
    assert f"Deployment '{GPU_DEPLOYMENT}' successfully created" in " ".join(deployed.split())

    listed = prefect(env, "deployment", "ls")
    assert GPU_DEPLOYMENT in listed and pool in listed

    with httpx.Client(base_url=env["PREFECT_API_URL"], timeout=30) as api:
        deployment = api.get(f"/deployments/name/{GPU_DEPLOYMENT}").raise_for_status().json()
        assert deployment["work_pool_name"] == pool
        assert deployment["parameters"]["profile"] == "paper"
        # the worker's checkout is resolved on the node, not frozen at deploy time
        assert deployment["pull_steps"] == [
            {"prefect.deployments.steps.set_working_directory": {"directory": "{{ $PROMPTR1_PROJECT_DIR }}"}}
        ]
        body = {
            "deployments": {"id": {"any_": [deployment["id"]]}},
            "limit": 50,
            "offset": 0,
            "sort": "EXPECTED_START_TIME_ASC",
        }
        deadline = time.monotonic() + 60
        scheduled: list[dict] = []
        while not scheduled and time.monotonic() < deadline:  # the scheduler inserts them asynchronously
            runs = api.post("/flow_runs/filter", json=body).raise_for_status().json()
            scheduled = [r for r in runs if r["state_type"] == "SCHEDULED"]
            time.sleep(1)
    assert scheduled, "the server's scheduler created no run for the weekly schedule"
    for run in scheduled:  # cron "0 3 * * 1" in UTC: Mondays, 03:00
        when = datetime.fromisoformat(run["expected_start_time"])
        assert (when.weekday(), when.hour, when.minute) == (0, 3, 0), run["expected_start_time"]

    triggered = prefect(env, "deployment", "run", GPU_DEPLOYMENT)
    assert "Created flow run" in triggered


def test_flow_serve_registers_the_served_deployment_and_polls_cleanly(prefect_server, tmp_path):
    env = prefect_server
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        serve = subprocess.Popen(
            [str(BIN / "promptr1"), "flow", "serve"],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 120
        listed = ""
        while not SERVED_DEPLOYMENT.search(listed):
            assert serve.poll() is None, f"`promptr1 flow serve` exited: {log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"never served: {log.read_text()[-3000:]}"
            time.sleep(2)
            listed = prefect(env, "deployment", "ls")
        time.sleep(15)  # the runner polls for due runs every 10 s: at least one poll against the server
        assert serve.poll() is None, f"`promptr1 flow serve` exited: {log.read_text()[-3000:]}"
        served = log.read_text()  # before Ctrl-C, whose unwinding is not what is checked here
    finally:
        os.killpg(serve.pid, signal.SIGINT)
        try:
            serve.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(serve.pid, signal.SIGKILL)
            serve.wait(timeout=30)
    assert not any(p in served for p in PROBLEMS), served[-3000:]
    assert "422" not in log.read_text()
