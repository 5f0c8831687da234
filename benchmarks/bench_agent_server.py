"""The agent behind llama.cpp's server: split vs unified KV cache, slot counts, and the next-turn cache.

    python benchmarks/bench_agent_server.py [--conversations 16] [--out benchmarks/results/agent_server.json]

Writes the untrained agent (`agent.model`, dequantised by transformers) as an F16 GGUF with
pipeline.agent.gguf_export (what `promptr1 evaluate` serves), then for each server configuration starts
pipeline.environment.llama_server and sends N conversations at once, two rounds:
- round 1: N prompts of ~300 tokens, 64 completion tokens each (prefill + decode);
- round 2: each conversation's prompt + its reply + a short new user text, 64 tokens (a next turn: the
  slot's prompt cache should hold everything but the new text).
Reported per configuration and round: wall seconds, completion tokens/s over all conversations, and the
prompt tokens the server read from its cache. Run it alone: on 2 cores anything else running distorts it.
"""

from __future__ import annotations

import argparse
import json
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


def _export(tmp: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    from pipeline.agent.gguf_export import export_gguf
    from pipeline.config import load_params
    from pipeline.modelref import resolve_model

    params = load_params(ROOT / "params.yaml")
    resolved = resolve_model(params.agent.model, ROOT)
    model = AutoModelForCausalLM.from_pretrained(resolved.directory, dtype=torch.float32,
                                                 **resolved.from_pretrained_kwargs())
    model.save_pretrained(tmp / "agent")
    return export_gguf(tmp / "agent", resolved.location, tmp / "agent.gguf", "f16")


def _serve(gguf: Path, port: int, slots: int, unified: bool, log: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "pipeline.environment.llama_server", "--model", str(gguf),
               "--model_alias", "agent", "--port", str(port), "--n_ctx", "2112", "--n_parallel", str(slots),
               "--kv_unified", "true" if unified else "false"]
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--port", type=int, default=8797)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "agent_server.json"))
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        gguf = _export(tmp)
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
