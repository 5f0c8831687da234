"""Benchmark `promptr1 ask` on CPU with the default models (SmolLM2-135M-Instruct as agent and environment).

Measures, with the default params (agent via transformers, environment via llama.cpp, greedy):
1. `promptr1 ask QUESTION` as a user runs it: wall time of the whole command in a fresh process
   (imports, llama.cpp server start and stop, agent load, rollout, printing);
2. the same in-process (`run_ask`), split into agent load and rollout, with the agent's tokens/s
   (agent tokens ÷ generation time) and the environment's tokens/s (completion tokens ÷ latency);
3. the environment's decode speed on its own: a few direct requests through `EnvironmentClient` (the
   untrained agent rarely writes an `<interaction_prompt>`, so step 2 may make no environment call).

Run (the heavy lock keeps it from competing with other heavy jobs on a shared machine):
    flock /tmp/promptr1-heavy.lock python benchmarks/bench_ask.py [--question "..."] [--repeats 1]
Writes benchmarks/results/ask.json.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "ask.json"
ENV_PROMPTS = [
    "Explain briefly who directed the 2009 documentary film The Carter.",
    "List three facts about the city of Paris.",
    "What is the capital of Italy? Answer in one sentence.",
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def overrides(cache_dir: str, port: int) -> dict:
    # A fresh port and cache: no reused server, no cached environment replies; no merged agent.
    return {"environment": {"port": port}, "paths": {"cache_dir": cache_dir, "model_dir": f"{cache_dir}/none"}}


def cli_wall(question: str, cache_dir: str) -> float:
    port = free_port()
    command = [sys.executable, "-m", "pipeline.cli", "ask", question, "--params", str(ROOT / "params.yaml"),
               "--set", f"environment.port={port}", "--set", f"paths.cache_dir={cache_dir}",
               "--set", f"paths.model_dir={cache_dir}/none"]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900, check=False)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"promptr1 ask failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return wall


def in_process(question: str, cache_dir: str) -> dict:
    from rich.console import Console

    from pipeline.commands.ask import run_ask
    from pipeline.config import load_params

    params = load_params(ROOT / "params.yaml", overrides(cache_dir, free_port()))
    result = run_ask(params, question, None, console=Console(file=io.StringIO(), width=100))
    traj, usage = result.trajectory, result.trajectory.usage
    return {
        "wall_s": round(result.wall_s, 2),
        "agent_load_s": round(result.load_s, 2),
        "rollout_s": round(result.rollout_s, 2),
        "turns": traj.num_turns,
        "stop_reason": traj.stop_reason,
        "prompt_tokens": len(traj.prompt_ids),
        "agent_tokens": result.agent_tokens,
        "env_tokens_in_context": result.env_tokens,
        "agent_generation_s": round(traj.generation_s, 2),
        "agent_tokens_per_s": round(result.agent_tokens_per_s, 2),
        "env_calls": usage.calls,
        "env_completion_tokens": usage.completion_tokens,
        "env_latency_s": round(usage.latency_s, 2),
        "env_tokens_per_s": round(result.env_tokens_per_s, 2),
        "cost_usd": usage.cost_usd,
    }


def environment_alone(cache_dir: str) -> dict:
    from pipeline.config import load_params
    from pipeline.environment.client import EnvironmentClient
    from pipeline.environment.servers import serve_environment
    from pipeline.environment.spec import ServerSpec

    params = load_params(ROOT / "params.yaml", overrides(cache_dir, free_port()))
    params.environment.cache = False

    async def ask_all() -> list:
        client = EnvironmentClient(params.environment)
        try:
            return [await client.reply([], prompt) for prompt in ENV_PROMPTS]
        finally:
            await client.aclose()

    cache = params.path(params.paths.cache_dir)
    with serve_environment(ServerSpec(environment=params.environment, root=params.root, cache_dir=cache)):
        replies = asyncio.run(ask_all())
    tokens = sum(r.completion_tokens for r in replies)
    latency = sum(r.latency_s for r in replies)
    return {"requests": len(replies), "completion_tokens": tokens, "latency_s": round(latency, 2),
            "tokens_per_s": round(tokens / latency, 2) if latency else 0.0,
            "max_tokens": params.environment.max_tokens, "errors": sum(r.error is not None for r in replies)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--question", default="Who directed The Carter?")
    parser.add_argument("--repeats", type=int, default=1, help="runs of the CLI command (median reported)")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="bench_ask_") as tmp:
        walls = [cli_wall(args.question, f"{tmp}/cli{i}") for i in range(args.repeats)]
        split = in_process(args.question, f"{tmp}/inproc")
        env = environment_alone(f"{tmp}/env")

    from pipeline.config import load_params

    params = load_params(ROOT / "params.yaml")
    result = {
        "command": f'promptr1 ask "{args.question}"',
        "benchmark": "python benchmarks/bench_ask.py",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "models": {"agent": params.agent.model, "environment": params.environment.model,
                   "environment_backend": params.environment.backend},
        "settings": {"max_turns": params.agent.max_turns, "max_turn_tokens": params.agent.max_turn_tokens,
                     "max_response_tokens": params.agent.max_response_tokens, "temperature": 0.0,
                     "env_max_tokens": params.environment.max_tokens, "llama_threads": params.environment.server.n_threads},
        "cli_wall_s": [round(w, 2) for w in walls],
        "cli_wall_s_median": round(statistics.median(walls), 2),
        "in_process": split,
        "environment_alone": env,
        "note": "The untrained SmolLM2 agent rarely follows the Prompt-R1 tags, so `ask` may end after one "
                "turn without an environment call; environment_alone measures the environment's speed.",
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
