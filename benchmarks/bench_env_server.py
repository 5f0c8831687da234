"""The environment server under the pipeline's load: llama-cpp-python's server against llama.cpp's own
(batching) server, same GGUF, same requests, same threads.

    python benchmarks/bench_env_server.py [--requests 48] [--concurrency 1 8] [--parallel 4]
    python benchmarks/bench_env_server.py --engines llama.cpp --parallel 16 --concurrency 8 16 \
        --out benchmarks/results/env_server_parallel16.json

For each engine it starts the server exactly as the pipeline does (pipeline.environment.servers' commands,
on a free port), sends one warm-up request, then `--requests` chat requests at each concurrency level: the
`env_only` evaluation prompts (question + instruction) of the authors' evaluation files, greedy, at most
`environment.max_tokens` tokens, through the pipeline's own `EnvironmentClient` with the cache off. It
records wall time, requests/s, completion tokens/s and the median latency, and whether the two engines gave
the same replies. Writes benchmarks/results/env_server.json. Run it on an otherwise idle machine.

Before the measured levels, one untimed pass of all requests at the first level: on a fresh llama.cpp server
the first pass of 48 requests took 30.7 s and the same pass right after 20.1-21.4 s (8 slots, 2 threads),
whatever the level, so without it the first level listed reads ~1.5x slow (`--no-warm-pass` measures that way;
benchmarks/results/env_server.json, an earlier run, was measured so).

Slots (`--parallel`): 16 slots against 8 gave nothing on 2 cores: 120.4 vs 121.5 completion tokens/s with 16
requests in flight, 112.4 vs 123.7 with 8 (benchmarks/results/env_server_parallel16.json and
env_server_parallel8.json): 8 slots already keep both cores busy, so `environment.server.parallel` stays 8.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import sys
import time
from pathlib import Path

import pandas as pd

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pipeline.config import load_params
from pipeline.environment.client import EnvironmentClient
from pipeline.environment.servers import start_server, stop_server
from pipeline.hardware import server_threads

RESULTS = REPO / "benchmarks" / "results"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def questions(mirror: Path, n: int) -> list[str]:
    """The first rows of the authors' evaluation files, round robin over the files (varied lengths)."""
    files = sorted((mirror / "prompt-r1" / "eval").glob("*.parquet"))
    per_file = [pd.read_parquet(f)["prompt"].head(n).tolist() for f in files]
    out: list[str] = []
    for i in range(n):
        for rows in per_file:
            if i < len(rows) and len(out) < n:
                out.append(str(list(rows[i])[-1]["content"]).split("\n", 1)[0])
    return out


async def load(client: EnvironmentClient, prompts: list[str], concurrency: int) -> dict[str, float | list[str]]:
    gate = asyncio.Semaphore(concurrency)
    latencies: list[float] = []

    async def one(prompt: str) -> tuple[str, int]:
        async with gate:
            start = time.perf_counter()
            reply = await client.reply([], prompt)
            latencies.append(time.perf_counter() - start)
            if reply.error:
                raise RuntimeError(f"environment error: {reply.error}")
            return reply.text, reply.completion_tokens

    start = time.perf_counter()
    results = await asyncio.gather(*(one(p) for p in prompts))
    wall = time.perf_counter() - start
    tokens = sum(t for _, t in results)
    return {"wall_s": round(wall, 2), "requests_per_s": round(len(prompts) / wall, 3),
            "completion_tokens_per_s": round(tokens / wall, 1), "completion_tokens": tokens,
            "median_latency_s": round(statistics.median(latencies), 3), "replies": [r for r, _ in results]}


def run_engine(params, engine: str, prompts: list[str], levels: list[int], warm_pass: bool = True) -> dict[str, object]:
    params.environment.port = free_port()
    params.environment.server.engine = engine
    params.environment.concurrency = max(levels)
    server = start_server(params)
    try:
        client = EnvironmentClient.from_params(params)

        async def all_levels() -> dict[str, object]:
            await client.reply([], "Say hello.")  # warm-up
            if warm_pass:  # untimed: a fresh server's first pass ran ~1.5x slower than later ones (see docstring)
                await load(client, prompts, levels[0])
            out: dict[str, object] = {}
            for level in levels:
                out[str(level)] = await load(client, prompts, level)
                print(engine, level, {k: v for k, v in out[str(level)].items() if k != "replies"}, flush=True)
            await client.aclose()
            return out

        return asyncio.run(all_levels())
    finally:
        stop_server(server)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--parallel", type=int, default=4, help="llama.cpp server slots")
    parser.add_argument("--engines", nargs="+", default=["llama-cpp-python", "llama.cpp"],
                        choices=["llama-cpp-python", "llama.cpp"])
    parser.add_argument("--out", type=Path, default=RESULTS / "env_server.json")
    parser.add_argument("--no-warm-pass", action="store_true",
                        help="measure from the first pass over a fresh server (the committed env_server.json was)")
    args = parser.parse_args()

    params = load_params(REPO / "params.yaml")
    params.environment.backend = "llamacpp"
    params.environment.cache = False
    params.environment.temperature = 0.0
    params.environment.server.parallel = args.parallel
    instruction = params.evaluate.env_only_instruction
    prompts = [f"{q}\n\n{instruction}" for q in questions(params.path(params.paths.mirror), args.requests)]

    engines = {engine: run_engine(params, engine, prompts, args.concurrency, warm_pass=not args.no_warm_pass)
               for engine in args.engines}
    result: dict[str, object] = {
        "what": "environment server throughput under concurrent chat requests (env_only prompts, greedy)",
        "command": "python benchmarks/bench_env_server.py " + " ".join(sys.argv[1:]),
        "model": params.environment.model, "max_tokens": params.environment.max_tokens,
        "n_threads": server_threads(params.environment.server.n_threads), "parallel_slots": args.parallel,
        "requests": len(prompts), "warm_pass": not args.no_warm_pass,
        "engines": {e: {lvl: {k: v for k, v in r.items() if k != "replies"} for lvl, r in runs.items()}
                    for e, runs in engines.items()},
    }
    if len(engines) == 2:
        a, b = engines["llama-cpp-python"], engines["llama.cpp"]
        result["speedup_requests_per_s"] = {lvl: round(b[lvl]["requests_per_s"] / a[lvl]["requests_per_s"], 2)
                                            for lvl in a}
        result["same_replies_share"] = {lvl: round(sum(x == y for x, y in zip(a[lvl]["replies"], b[lvl]["replies"],
                                                                               strict=True)) / len(prompts), 3)
                                        for lvl in a}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
