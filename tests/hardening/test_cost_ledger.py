"""The environment budget holds across processes: one ledger file, real processes, a real local server.

Three processes each run four concurrent callers against one `budget_usd` through one ledger file under a
shared cache dir: together they never spend more than the budget, every one of them stops with
`BudgetExceeded`, and the ledger's total is exactly what they report. The same processes with a ledger each
(the per-process budget this replaced) overshoot it: the check can fail. A process SIGKILLed while it updates
the ledger never leaves it unreadable, and its call in flight stays counted.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fault_server import Behaviour, FaultServer

from pipeline.environment.ledger import LEDGER_FILE, CostLedger

REPO_ROOT = Path(__file__).resolve().parents[2]
BUDGET = 100.0
# 12 prompt words at $0.001 + 30 reply words at $0.1 = $3.012 a call; worst case reserved:
# (256 + 2 x 16 + 64 + 1) x 2 prompt tokens x $0.001 + 32 x 2 completion tokens x $0.1 = $7.106.
PER_CALL = 12 * 0.001 + 30 * 0.1

SPEND_UNTIL_REFUSED = """
async def caller():
    while True:
        try:
            await client.reply([], "q")
        except BudgetExceeded as exc:
            return str(exc)

async def main():
    try:
        return await asyncio.gather(*(caller() for _ in range(CALLERS)))
    finally:
        await client.aclose()

while not go.exists():  # start together: the imports take different times
    time.sleep(0.01)
errors = asyncio.run(main())
print(json.dumps({"spent": client.spent_usd, "calls": client.usage.calls, "errors": errors}))
"""
"""The tail of every spender script: CALLERS concurrent callers spend until the budget refuses them, then
the process prints what it spent (each script builds `client`, `go` and CALLERS first)."""

SPENDER = """
import asyncio, json, sys, time
from pathlib import Path
from pipeline.config import EnvironmentConfig
from pipeline.environment.client import EnvironmentClient
from pipeline.errors import BudgetExceeded

cfg = EnvironmentConfig(**json.loads(sys.argv[1]))
go = Path(sys.argv[3])
client = EnvironmentClient(cfg, ledger_path=Path(sys.argv[2]) if sys.argv[2] else None)

CALLERS = 4
""" + SPEND_UNTIL_REFUSED

HAMMER = """
import sys
from pathlib import Path
from pipeline.environment.ledger import CostLedger

ledger = CostLedger(1e12, Path(sys.argv[1]))
while True:
    with ledger.hold(1.0) as hold:
        hold.settle(0.25)
"""


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}


def _spend_concurrently(server: FaultServer, tmp_path: Path, shared: bool) -> list[dict]:
    cfg = {
        "backend": "llamacpp", "model": "m", "served_name": "fault-model", "base_url": server.url,
        "system_prompt": "You are a helpful assistant. Read the provided content and help.", "max_tokens": 32,
        "length_retry_factor": 1.0, "timeout_s": 10.0, "cache": False, "concurrency": 4,
        "price_per_million_prompt": 1_000.0, "price_per_million_completion": 100_000.0, "budget_usd": BUDGET,
    }
    go = tmp_path / f"go-{shared}"
    procs = [
        subprocess.Popen([sys.executable, "-c", SPENDER, json.dumps(cfg),
                          str(tmp_path / "cache" / LEDGER_FILE) if shared else "", str(go)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
        for _ in range(3)
    ]
    go.touch()
    return _last_json_lines(procs)


def _last_json_lines(procs) -> list[dict]:
    """Wait for each process; it must succeed, and its last stdout line is its JSON result."""
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-2000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


@pytest.mark.timeout(240)
def test_three_processes_never_spend_more_than_one_budget(tmp_path):
    with FaultServer(Behaviour("ok", delay_s=0.05, text=" ".join(["word"] * 30))) as server:
        results = _spend_concurrently(server, tmp_path, shared=True)
        sent = len(server.chat_requests)
        server.reset()
        per_process = _spend_concurrently(server, tmp_path, shared=False)

    total = sum(r["spent"] for r in results)
    assert total <= BUDGET
    assert total > BUDGET - 12 * 7.2  # it did spend: at most 12 callers' worst cases were left unused
    assert sum(r["calls"] for r in results) == sent and total == pytest.approx(sent * PER_CALL)
    assert sum(r["calls"] > 0 for r in results) >= 2, results  # the processes really competed
    for r in results:  # every caller of every process stopped on the budget, naming the ledger
        assert len(r["errors"]) == 4 and all("environment.budget_usd" in e and LEDGER_FILE in e for e in r["errors"])
    ledger = json.loads((tmp_path / "cache" / LEDGER_FILE).read_text())
    assert ledger["reservations"] == {} and ledger["spent_usd"] == pytest.approx(total)
    # Control: a budget per process (no shared ledger) lets three processes spend about three budgets.
    assert sum(r["spent"] for r in per_process) > 2 * BUDGET


@pytest.mark.timeout(120)
def test_sigkill_mid_update_never_corrupts_the_ledger(tmp_path):
    path = tmp_path / "cache" / LEDGER_FILE
    rng = random.Random(13)
    last = 0.0
    for _ in range(6):
        proc = subprocess.Popen([sys.executable, "-c", HAMMER, str(path)], env=_env())
        target = last + rng.uniform(2, 40)
        deadline = time.monotonic() + 60
        while True:  # kill at a random point of the update loop, once it has spent `target`
            try:
                if json.loads(path.read_text())["spent_usd"] >= target:
                    break
            except (FileNotFoundError, json.JSONDecodeError):
                pass  # not written yet; a JSON error would show as a failure below, never passes silently
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        raw = json.loads(path.read_text())  # complete JSON, whatever the kill interrupted
        assert set(raw) == {"spent_usd", "reservations"} and len(raw["reservations"]) <= 1
        spent = CostLedger(1e12, path).spent_usd  # the dead process's reservation now counts as spent
        assert spent == raw["spent_usd"] + sum(raw["reservations"].values())
        assert (spent * 4).is_integer() and spent >= max(last, target)
        assert json.loads(path.read_text())["reservations"] == {}
        last = spent


def test_unreadable_ledger_fails_closed(tmp_path):
    from pipeline.errors import BudgetExceeded

    path = tmp_path / LEDGER_FILE
    path.write_text('{"spent_usd": 3.0, "reserv')
    with pytest.raises(BudgetExceeded, match="unreadable"), CostLedger(10.0, path).hold(1.0):
        pass


VERL_WORKER = """
import asyncio, json, sys, time
from pathlib import Path
from omegaconf import OmegaConf
from pipeline.config import AgentConfig
from pipeline.errors import BudgetExceeded
from pipeline.train.verl.worker_client import LoopSettings, environment_client

# The trainer config verl hands every agent-loop worker: the `prompt_r1` block verl_backend writes.
config = OmegaConf.create({"prompt_r1": {"environment": json.loads(sys.argv[1]), "cache_dir": sys.argv[2],
                                         "agent": AgentConfig(model="m").model_dump(mode="json")},
                           "reward": {"custom_reward_function": {"reward_kwargs": {"preset": "paper"}}}})
client = environment_client(LoopSettings.from_trainer_config(config), num_workers=3)
go = Path(sys.argv[3])
(go.parent / f"ready-{sys.argv[4]}").touch()

CALLERS = 2
""" + SPEND_UNTIL_REFUSED


@pytest.mark.timeout(240)
def test_verl_workers_spend_from_the_projects_ledger(tmp_path):
    """Three agent-loop worker processes, built as verl builds them, share the budget with the rest of the
    pipeline: what earlier stages spent (already in the ledger) is not available to them again."""
    cache = tmp_path / "cache"
    cache.mkdir()
    earlier = BUDGET / 2
    (cache / LEDGER_FILE).write_text(json.dumps({"spent_usd": earlier, "reservations": {}}))
    cfg = {
        "backend": "llamacpp", "model": "m", "served_name": "fault-model",
        "system_prompt": "You are a helpful assistant. Read the provided content and help.", "max_tokens": 32,
        "length_retry_factor": 1.0, "timeout_s": 10.0, "cache": False, "concurrency": 6,
        "price_per_million_prompt": 1_000.0, "price_per_million_completion": 100_000.0, "budget_usd": BUDGET,
    }
    go = tmp_path / "go"
    with FaultServer(Behaviour("ok", delay_s=0.2, text=" ".join(["word"] * 30))) as server:
        cfg["base_url"] = server.url
        procs = [subprocess.Popen([sys.executable, "-c", VERL_WORKER, json.dumps(cfg), str(cache), str(go), str(n)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
                 for n in range(3)]
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("ready-*"))) < 3:  # every worker built its client: start them together
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
            time.sleep(0.05)
        go.touch()
        results = _last_json_lines(procs)
        sent = len(server.chat_requests)

    total = sum(r["spent"] for r in results)
    # Only what the earlier stages left: an even share per worker (the old split) would spend ~BUDGET here.
    assert total <= BUDGET - earlier
    assert total > BUDGET - earlier - 6 * 7.2 and total == pytest.approx(sent * PER_CALL)
    assert sum(r["calls"] > 0 for r in results) >= 2, results  # the workers really competed
    for r in results:  # each worker ran 2 callers (concurrency 6 over 3 workers), all stopped on the ledger
        assert len(r["errors"]) == 2 and all(str(cache / LEDGER_FILE) in e for e in r["errors"]), r["errors"]
    ledger = json.loads((cache / LEDGER_FILE).read_text())
    assert ledger["reservations"] == {} and ledger["spent_usd"] == pytest.approx(earlier + total)
