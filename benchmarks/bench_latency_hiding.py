"""Latency hiding of EnvironmentClient: do concurrent trajectories overlap their environment calls?

32 "trajectories" run at once; each makes `--turns` sequential environment calls (as a Prompt-R1 agent
does, one per turn) through one shared `EnvironmentClient` (concurrency 32, cache off) against the
fault server (tests/fault_server.py, its own process) answering every call after a fixed 200 ms delay.
Perfect overlap takes `calls × 0.2 s ÷ 32`; the figure is wall time ÷ that ideal (target ≤ 1.15).
One untimed warm-up round opens the HTTP connections first (a long run pays that once); the cold figure,
with connection setup, is reported too, and so is the floor of the transport itself: the same pattern
sent with a bare `httpx.AsyncClient` (no SDK, no client logic), so the client's own cost can be read off.

    python benchmarks/bench_latency_hiding.py [--trajectories 32] [--turns 3] [--delay 0.2] [--repeats 3]

Prints the figures and writes benchmarks/results/latency_hiding.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.config import EnvironmentConfig
from pipeline.environment.client import EnvironmentClient

RESULTS = ROOT / "benchmarks" / "results" / "latency_hiding.json"


async def trajectory(client: EnvironmentClient, index: int, turns: int, round_: int) -> int:
    history: list[dict[str, str]] = []
    errors = 0
    for turn in range(turns):
        prompt = f"round {round_} trajectory {index} turn {turn}"
        reply = await client.reply(history, prompt)
        errors += reply.error is not None
        history += [{"role": "user", "content": prompt}, {"role": "assistant", "content": reply.text}]
    return errors


async def run_round(client: EnvironmentClient, trajectories: int, turns: int, round_: int) -> tuple[float, int]:
    start = time.perf_counter()
    errors = await asyncio.gather(*(trajectory(client, i, turns, round_) for i in range(trajectories)))
    return time.perf_counter() - start, sum(errors)


async def bench(url: str, trajectories: int, turns: int, repeats: int) -> dict:
    cfg = EnvironmentConfig(
        backend="llamacpp", model="fault-server", served_name="fault-model", base_url=url,
        system_prompt="You are a helpful assistant.", temperature=0.0, max_tokens=32, timeout_s=10.0,
        max_retries=0, concurrency=trajectories, cache=False,
    )
    client = EnvironmentClient(cfg)
    try:
        cold, cold_errors = await run_round(client, trajectories, turns, 0)
        warm = []
        errors = cold_errors
        for r in range(repeats):
            wall, e = await run_round(client, trajectories, turns, r + 1)
            warm.append(wall)
            errors += e
    finally:
        await client.aclose()
    return {"cold_wall_s": cold, "warm_wall_s": warm, "errors": errors, "calls": client.usage.calls}


async def bench_raw_httpx(url: str, trajectories: int, turns: int, repeats: int) -> list[float]:
    """The same trajectories through a bare httpx client: the floor our client sits on."""
    limits = httpx.Limits(max_connections=trajectories * 2, max_keepalive_connections=trajectories * 2)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=10.0) as http:
        async def one(index: int, round_: int) -> None:
            messages = [{"role": "system", "content": "You are a helpful assistant."}]
            for turn in range(turns):
                messages.append({"role": "user", "content": f"round {round_} trajectory {index} turn {turn}"})
                body = {"model": "fault-model", "messages": messages, "temperature": 0.0, "max_tokens": 32}
                reply = (await http.post("/chat/completions", json=body)).json()
                messages.append(reply["choices"][0]["message"])

        walls = []
        for r in range(repeats + 1):
            start = time.perf_counter()
            await asyncio.gather(*(one(i, r) for i in range(trajectories)))
            walls.append(time.perf_counter() - start)
    return walls[1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trajectories", type=int, default=32)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--delay", type=float, default=0.2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    server = subprocess.Popen([sys.executable, str(ROOT / "tests" / "fault_server.py"), "--delay", str(args.delay)],
                              stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())
        url = f"http://127.0.0.1:{port}/v1"
        out = asyncio.run(bench(url, args.trajectories, args.turns, args.repeats))
        raw = asyncio.run(bench_raw_httpx(url, args.trajectories, args.turns, args.repeats))
    finally:
        server.terminate()
        server.wait(timeout=10)

    calls = args.trajectories * args.turns
    ideal = calls * args.delay / args.trajectories
    warm_median = statistics.median(out["warm_wall_s"])
    result = {
        "benchmark": "latency_hiding",
        "trajectories": args.trajectories,
        "calls_per_trajectory": args.turns,
        "calls_per_round": calls,
        "server_delay_s": args.delay,
        "ideal_s": ideal,
        "wall_s_median": warm_median,
        "wall_s_runs": out["warm_wall_s"],
        "ratio": warm_median / ideal,
        "ratio_cold": out["cold_wall_s"] / ideal,
        "ratio_raw_httpx_floor": statistics.median(raw) / ideal,
        "target": 1.15,
        "errors": out["errors"],
        "total_calls": out["calls"],
        "machine": f"{platform.machine()} {platform.python_implementation()} {platform.python_version()}",
        "command": "python benchmarks/bench_latency_hiding.py " + " ".join(sys.argv[1:]),
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(f"{calls} calls ({args.trajectories} trajectories x {args.turns} turns), server delay {args.delay:g}s: "
          f"wall {warm_median:.3f}s vs ideal {ideal:.3f}s -> ratio {result['ratio']:.3f} "
          f"(cold, with connection setup: {result['ratio_cold']:.3f}; bare httpx floor: "
          f"{result['ratio_raw_httpx_floor']:.3f}; target <= 1.15; errors {out['errors']})")
    print(f"written {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
