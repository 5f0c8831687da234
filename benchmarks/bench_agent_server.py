"""The agent behind llama.cpp's server: split vs unified KV cache, slot counts, and the next-turn cache.

    python benchmarks/bench_agent_server.py [--conversations 16] [--out benchmarks/results/agent_server.json]
    python benchmarks/bench_agent_server.py --dtypes f16,q8_0,template --out benchmarks/results/agent_server_dtypes.json
    python benchmarks/bench_agent_server.py --beside-env 2+2,1+1,2+1 --out benchmarks/results/agent_server_beside_env.json
    python benchmarks/bench_agent_server.py --flash-attn -1,0 --out benchmarks/results/agent_server_flash_attn.json

Writes the untrained agent (`agent.model`, dequantised by transformers) as an F16 GGUF with
pipeline.agent.gguf_export (what `promptr1 evaluate` serves), then for each server configuration starts
pipeline.environment.llama_server and sends N conversations at once, two rounds:
- round 1: N prompts of ~300 tokens, 64 completion tokens each (prefill + decode);
- round 2: each conversation's prompt + its reply + a short new user text, 64 tokens (a next turn: the
  slot's prompt cache should hold everything but the new text).
Reported per configuration and round: wall seconds, completion tokens/s over all conversations, and the
prompt tokens the server read from its cache. Run it alone: on 2 cores anything else running distorts it.

`--flash-attn`: the same two rounds on 16 split slots for each llama.cpp flash-attention setting (-1 auto, which
turns it on for this model; 0 off, what the pipeline's agent server uses: pipeline.environment.spec).
`--dtypes`: the same two rounds on 16 split slots for each matrix type of the export. `--beside-env A+E,...`:
the agent server with A threads runs the two rounds while the environment server (`environment.model`, 8
slots, E threads) is kept busy by 8 requests in flight (64 tokens each, repeated): what training rollouts and
evaluation do; reported with the environment's completion tokens/s meanwhile. A saturation test: in the
pipeline the split lost (pipeline/hardware.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIGS = [  # (slots, unified KV)
    (16, True),
    (16, False),
    (8, False),
    (4, False),
]


def export_agent(tmp: Path, dtype: str = "f16") -> Path:
    """The untrained agent (`agent.model`, dequantised by transformers) as a GGUF of `dtype` matrices in `tmp`."""
    import torch
    from transformers import AutoModelForCausalLM

    from pipeline.agent.gguf_export import export_gguf
    from pipeline.config import load_params
    from pipeline.modelref import resolve_model

    params = load_params(ROOT / "params.yaml")
    resolved = resolve_model(params.agent.model, ROOT)
    model = AutoModelForCausalLM.from_pretrained(resolved.directory, dtype=torch.float32,
                                                 **resolved.from_pretrained_kwargs())
    if not (tmp / "agent").exists():
        model.save_pretrained(tmp / "agent")
    return export_gguf(tmp / "agent", resolved.location, tmp / f"agent-{dtype}.gguf", dtype)


def _serve(gguf: Path, port: int, slots: int, unified: bool, log: Path, threads: int = 2,
           extra: tuple[str, ...] = ()) -> subprocess.Popen:
    command = [sys.executable, "-m", "pipeline.environment.llama_server", "--model", str(gguf),
               "--model_alias", "agent", "--port", str(port), "--n_ctx", "2112", "--n_parallel", str(slots),
               "--kv_unified", "true" if unified else "false", "--n_threads", str(threads), *extra]
    with open(log, "w") as err:  # the child keeps its own descriptor
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err, cwd=ROOT)
    for _ in range(300):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=1).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    process.kill()
    raise SystemExit(f"server did not start; see {log}")


def _round(url: str, prompts: list[str]) -> tuple[dict, list[str]]:
    def one(prompt: str) -> dict:
        body = {"model": "agent", "prompt": prompt, "max_tokens": 64, "temperature": 0, "ignore_eos": True}
        return httpx.post(f"{url}/completions", json=body, timeout=900).json()

    start = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        replies = list(pool.map(one, prompts))
    wall = time.perf_counter() - start
    completion = sum(r["usage"]["completion_tokens"] for r in replies)
    read = sum(r["usage"]["prompt_tokens"] for r in replies)
    cached = sum((r["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0) for r in replies)
    figures = {"wall_s": round(wall, 2), "completion_tokens_per_s": round(completion / wall, 1),
               "prompt_tokens": read, "cached_prompt_tokens": cached}
    return figures, [r["choices"][0]["text"] for r in replies]


def _conversation_rounds(url: str, n: int) -> dict:
    prompts = [f"Question {i}: " + f"Tell me about the history of city number {i}. " * 25 for i in range(n)]
    first, replies = _round(url, prompts)
    nxt = [p + r + "\nAnd what happened next in that city?" for p, r in zip(prompts, replies, strict=True)]
    second, _ = _round(url, nxt)
    return {"first_turn": first, "next_turn": second}


def _served_rounds(gguf: Path, args: argparse.Namespace, log: Path, extra: tuple[str, ...] = ()) -> dict:
    """The two rounds against `gguf` served on 16 split slots (llama_server flags `extra`), the server stopped after."""
    process = _serve(gguf, args.port, 16, False, log, extra=extra)
    try:
        return _conversation_rounds(f"http://127.0.0.1:{args.port}/v1", args.conversations)
    finally:
        process.terminate()
        process.wait(30)


def _compare_dtypes(args: argparse.Namespace) -> int:
    from pipeline.config import load_params
    from pipeline.modelref import resolve_model

    results = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        for dtype in args.dtypes.split(","):
            if dtype == "template":
                gguf = Path(resolve_model(load_params(ROOT / "params.yaml").agent.model, ROOT).location)
            else:
                start = time.perf_counter()
                gguf = export_agent(tmp, dtype)
                print(f"{dtype}: exported in {time.perf_counter() - start:.1f} s", flush=True)
            row = {"dtype": dtype, "file_mb": round(gguf.stat().st_size / 1e6, 1),
                   **_served_rounds(gguf, args, tmp / "server.log")}
            print(json.dumps(row), flush=True)
            results.append(row)
    out = {"what": "llama.cpp server (xllamacpp) serving the agent (SmolLM2-135M-Instruct exported by "
                   "pipeline.agent.gguf_export in each matrix type; 'template' = the bundled Q4_1 file), "
                   f"{args.conversations} conversations at once on 16 split slots, 64 completion tokens each, "
                   "2 CPU threads", "command": f"python benchmarks/bench_agent_server.py --dtypes {args.dtypes}",
           "results": results}
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"written to {args.out}")
    return 0


def _compare_flash_attn(args: argparse.Namespace) -> int:
    results = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        gguf = export_agent(tmp, "f16")
        for setting in args.flash_attn.split(","):
            row = {"flash_attn_type": int(setting),
                   **_served_rounds(gguf, args, tmp / "server.log", ("--flash_attn_type", setting))}
            print(json.dumps(row), flush=True)
            results.append(row)
    out = {"what": "llama.cpp server (xllamacpp) serving the agent (SmolLM2-135M-Instruct, F16 GGUF export) with "
                   "flash attention auto (-1: on for this model) and off (0), "
                   f"{args.conversations} conversations at once on 16 split slots, 64 completion tokens each, "
                   "2 CPU threads", "command": f"python benchmarks/bench_agent_server.py --flash-attn={args.flash_attn}",
           "cpus": os.cpu_count(), "results": results}
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"written to {args.out}")
    return 0


def _beside_env(args: argparse.Namespace) -> int:
    import threading

    from pipeline.config import load_params
    from pipeline.modelref import resolve_model

    env_gguf = Path(resolve_model(load_params(ROOT / "params.yaml").environment.model, ROOT).location)
    env_port = args.port + 1
    results = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        agent = export_agent(tmp, "f16")
        for split in args.beside_env.split(","):
            agent_threads, env_threads = (int(x) for x in split.split("+"))
            agent_server = _serve(agent, args.port, 16, False, tmp / "agent.log", agent_threads)
            env_server = _serve(env_gguf, env_port, 8, False, tmp / "env.log", env_threads)
            stop, env_tokens = threading.Event(), [0]

            def keep_busy(i: int, stop: threading.Event = stop, env_tokens: list = env_tokens) -> None:
                body = {"model": "agent", "prompt": f"Tell me about topic {i}. " * 20, "max_tokens": 64,
                        "temperature": 0, "ignore_eos": True}
                while not stop.is_set():
                    reply = httpx.post(f"http://127.0.0.1:{env_port}/v1/completions", json=body, timeout=900)
                    env_tokens[0] += reply.json()["usage"]["completion_tokens"]

            try:
                start = time.perf_counter()
                with ThreadPoolExecutor(8) as pool:
                    busy = [pool.submit(keep_busy, i) for i in range(8)]
                    rounds = _conversation_rounds(f"http://127.0.0.1:{args.port}/v1", args.conversations)
                    wall = time.perf_counter() - start
                    stop.set()
                    for future in busy:
                        future.result()
            finally:
                for process in (agent_server, env_server):
                    process.terminate()
                    process.wait(30)
            row = {"threads_agent": agent_threads, "threads_environment": env_threads, **rounds,
                   "environment_completion_tokens_per_s_meanwhile": round(env_tokens[0] / wall, 1)}
            print(json.dumps(row), flush=True)
            results.append(row)
    out = {"what": "llama.cpp agent server (SmolLM2-135M-Instruct F16 export, 16 split slots) running "
                   f"{args.conversations} conversations while the environment server ({env_gguf.name}, 8 slots) "
                   "answers 8 requests in flight; threads agent+environment on a 2-core machine",
           "command": f"python benchmarks/bench_agent_server.py --beside-env {args.beside_env}",
           "cpus": os.cpu_count(), "results": results}
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"written to {args.out}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--port", type=int, default=8797)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "agent_server.json"))
    parser.add_argument("--dtypes", default="",
                        help="compare the export's matrix types instead (comma-separated, e.g. f16,q8_0; "
                             "'template' = agent.model's own GGUF file), 16 split slots each")
    parser.add_argument("--beside-env", default="",
                        help="thread splits agent+environment to compare with the environment busy, e.g. 2+2,1+1")
    parser.add_argument("--flash-attn", default="",
                        help="compare llama.cpp flash-attention settings instead (comma-separated: -1 auto, 0 off)")
    args = parser.parse_args()
    if args.flash_attn:
        return _compare_flash_attn(args)
    if args.dtypes:
        return _compare_dtypes(args)
    if args.beside_env:
        return _beside_env(args)
    results = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        gguf = export_agent(tmp)
        for slots, unified in CONFIGS:
            process = _serve(gguf, args.port, slots, unified, tmp / "server.log")
            try:
                url = f"http://127.0.0.1:{args.port}/v1"
                prompts = [f"Question {i}: " + f"Tell me about the history of city number {i}. " * 25
                           for i in range(args.conversations)]
                first, replies = _round(url, prompts)
                nxt = [p + r + "\nAnd what happened next in that city?" for p, r in zip(prompts, replies, strict=True)]
                second, _ = _round(url, nxt)
            finally:
                process.terminate()
                process.wait(30)
            row = {"slots": slots, "kv_unified": unified, "first_turn": first, "next_turn": second}
            print(json.dumps(row), flush=True)
            results.append(row)
    out = {"what": "llama.cpp server (xllamacpp) serving the agent (SmolLM2-135M-Instruct, F16 GGUF export), "
                   f"{args.conversations} conversations at once, 64 completion tokens each, 2 CPU threads",
           "command": "python benchmarks/bench_agent_server.py", "results": results}
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
