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

Each concurrency level runs on a freshly started server. llama.cpp's server keeps the prompts it has read in
memory and a repeated prompt skips its prefill: the same 48 prompts took 33.2 s on a fresh server and 21.3 s
sent again, while 45 new ones took 33.9 s (then 18.3 s again; 8 slots, 16 in flight, 2 threads). Earlier
versions ran every level on one server, so the levels after the first read fast for llama.cpp.

Measured on fresh servers (2026-11-25, 2-core AVX2 EPYC, 2 threads each, 8 slots; env_server.json): at 1
request in flight the two engines are equal (26.0 vs 26.4 s for 32 requests); at 8 in flight llama.cpp's
server gives 1.13x the requests/s (28.4 vs 32.1 s) and 1.41x the completion tokens/s (its greedy replies
ran longer: 1,802 vs 1,450 tokens; 28% identical). The first measurement (2026-11-23, another machine, every
level on one server) had llama-cpp-python at 80.8 s for the 32 requests at 1 in flight and read 3.2x / 2.5x;
that figure was not reproduced. llama.cpp's server stays the default: it still pays at 8 in flight, which is
how the pipeline calls the environment.

Slots (`--parallel`): 16 instead of 8 gave no gain on 2 cores: 1.48 and 1.33 requests/s at 8 and 16 in
flight, against 1.28 and 1.36 with 8 slots (env_server_parallel16.json, env_server_parallel8.json), inside
the run-to-run spread of one configuration (8 slots, 8 in flight: 28.4-37.7 s over today's runs). 8 slots
already keep both cores busy, so `environment.server.parallel` stays 8.
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
from pipeline.environment.spec import ServerSpec
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


def run_engine(params, engine: str, prompts: list[str], levels: list[int]) -> dict[str, object]:
    """Each level on a server of its own, started fresh: llama.cpp's server keeps earlier prompts in memory
    and a repeated prompt skips its prefill (see the module docstring), so a level measured after another
    on the same server would read fast."""
    out: dict[str, object] = {}
    for level in levels:
        params.environment.port = free_port()
        params.environment.server.engine = engine
        params.environment.concurrency = level
        cache_dir = params.path(params.paths.cache_dir)
        spec = ServerSpec(environment=params.environment, root=params.root, cache_dir=cache_dir)
        server = start_server(spec)
        try:
            client = EnvironmentClient.in_cache_dir(params.environment, cache_dir)

            async def one_level(client=client, level=level) -> dict[str, object]:
                await client.reply([], "Say hello.")  # warm-up (not one of the measured prompts)
                try:
                    return await load(client, prompts, level)
                finally:
                    await client.aclose()

            out[str(level)] = asyncio.run(one_level())
            print(engine, level, {k: v for k, v in out[str(level)].items() if k != "replies"}, flush=True)
        finally:
            stop_server(server)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--parallel", type=int, default=4, help="llama.cpp server slots")
    parser.add_argument("--engines", nargs="+", default=["llama-cpp-python", "llama.cpp"],
                        choices=["llama-cpp-python", "llama.cpp"])
    parser.add_argument("--out", type=Path, default=RESULTS / "env_server.json")
    args = parser.parse_args()

    params = load_params(REPO / "params.yaml")
    params.environment.backend = "llamacpp"
    params.environment.cache = False
    params.environment.temperature = 0.0
    params.environment.server.parallel = args.parallel
    instruction = params.evaluate.env_only_instruction
    prompts = [f"{q}\n\n{instruction}" for q in questions(params.path(params.paths.mirror), args.requests)]

    engines = {engine: run_engine(params, engine, prompts, args.concurrency)
               for engine in args.engines}
    result: dict[str, object] = {
        "what": "environment server throughput under concurrent chat requests (env_only prompts, greedy)",
        "command": "python benchmarks/bench_env_server.py " + " ".join(sys.argv[1:]),
        "model": params.environment.model, "max_tokens": params.environment.max_tokens,
        "n_threads": server_threads(params.environment.server.n_threads), "parallel_slots": args.parallel,
        "requests": len(prompts), "server_per_level": True,
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
