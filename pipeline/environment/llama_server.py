"""llama.cpp's own HTTP server (continuous batching over parallel slots), run from the `xllamacpp` package.

    python -m pipeline.environment.llama_server --model M.gguf --model_alias NAME --host 127.0.0.1 \
        --port 8765 --n_ctx 4096 --n_threads 2 --n_parallel 4

Why this and not `python -m llama_cpp.server`: llama-cpp-python's server is Python around one `Llama` object
and answers one request at a time behind a lock, so eight concurrent environment calls queue. llama.cpp's C++
server (tools/server) decodes the requests of all busy slots in one batch (`n_parallel` slots, continuous
batching); on a CPU a decode step costs about the same for one sequence or four, so concurrent calls share
it. `benchmarks/bench_env_server.py` measures the two side by side; its figures are in
benchmarks/results/env_server.json and benchmarks/README.md.

Design decisions:
- **xllamacpp** (PyPI: llama.cpp with its server, started and configured from Python like the other
  backends) rather than a `llama-server` binary of our own. scripts/install-llama-cpp.sh compiles it from
  its source archive for the machine's CPU (native vector extensions, no AMX); the registry's wheel is a
  portable AVX2 build, which on an AVX-512 CPU read the agent's prompts at half the rate
  (benchmarks/results/engines.json).
- **`--n_ctx` is each slot's context**, and each slot has a KV cache of its own (`kv_unified` off; the
  server is given `n_ctx x n_parallel` cells, which llama.cpp splits evenly). In llama.cpp's unified
  cache every decode step attends over the cells of all slots (masked), so the cost of a step grows with
  every conversation in flight: in an evaluation, 16 agent conversations of ~500 tokens decoded at 1.9
  tokens/s per slot unified (server log); `benchmarks/bench_agent_server.py` measures 16 short next turns
  at 105 completion tokens/s unified and 138 split (benchmarks/results/agent_server.json). Split caches
  keep each slot's prompt for the next request that extends it (a conversation's next turn).
- **No busy polling** (`--poll 0`; llama.cpp's default is 50): on a 2-core machine the server shares the
  cores with the agent's torch threads, and spinning server threads waiting for work take them away.
  Under heavy oversubscription (tests, a kill campaign and an evaluation at once) a server with the default
  polling was seen decoding at ~1 token/s instead of ~65; how much of that polling alone causes is not
  measured.
- **No flash attention** (`flash_attn_type` 0; llama.cpp's `auto` turns it on for a CPU model). With it, a
  sequence decoded beside others of one request got log-probs far from its model's from some position on (a
  tiny F32 Llama, two prompts with two samples each in one request: one sample's mean |served - policy|
  log-prob 0.495 nats, the others 0.002-0.011; off, every sample within 0.001), and the agent's F16 server
  sampled other tokens with 1 thread than with 2 (6 of 9 prompts; off, 0 of 9, log-probs equal too).
  Training needs served log-probs that are the policy's, and a run's figures must not depend on the thread
  count. The cost: 3-4% of decode speed (`benchmarks/bench_agent_server.py --flash-attn=-1,0`).
  `--flash_attn_type 1` in `environment.server.extra_args` turns it back on.
- The process blocks until SIGTERM/SIGINT and then exits; the server threads die with it. It is started
  under the owner guard like every server the pipeline runs (pipeline.environment.servers).
- Same flags as llama-cpp-python's server where they overlap (`--model_alias`, `--n_ctx`, `--n_threads`).
  Any other `--name value` pair (`environment.server.extra_args`) sets llama.cpp's `common_params` field of
  that name, converted to the field's type (`--n_batch 1024`, `--cache_prompt false`); an unknown name stops
  the server with a one-line error naming it. llama.cpp's own log goes to stderr (the server log file under
  `paths.cache_dir`).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading


def set_extra(params: object, extra: list[str]) -> None:
    """Apply `--name value` pairs to llama.cpp's params object, converted to each field's current type."""
    if len(extra) % 2:
        raise SystemExit(f"llama_server: extra arguments must be --name value pairs, got {extra}")
    for flag, raw in zip(extra[::2], extra[1::2], strict=True):
        name = flag.removeprefix("--").replace("-", "_")
        if not flag.startswith("--") or not hasattr(params, name):
            raise SystemExit(f"llama_server: unknown llama.cpp server parameter {flag!r}")
        current = getattr(params, name)
        if isinstance(current, bool):
            if raw.lower() not in {"true", "false", "1", "0"}:
                raise SystemExit(f"llama_server: {flag} takes true or false, got {raw!r}")
            value: object = raw.lower() in {"true", "1"}
        elif isinstance(current, int | float | str):
            try:
                value = type(current)(raw)
            except ValueError:
                raise SystemExit(f"llama_server: {flag} takes a {type(current).__name__}, got {raw!r}") from None
        else:
            raise SystemExit(f"llama_server: {flag} is not a plain value parameter and cannot be set here")
        setattr(params, name, value)


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="python -m pipeline.environment.llama_server", description=__doc__)
    parser.add_argument("--model", required=True, help="GGUF file")
    parser.add_argument("--model_alias", required=True, help="name served at /v1/models")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--n_ctx", type=int, default=4096, help="context of each slot (tokens)")
    parser.add_argument("--n_threads", type=int, default=2)
    parser.add_argument("--n_parallel", type=int, default=4, help="slots decoded together")
    parser.add_argument("--poll", type=int, default=0,
                        help="llama.cpp threadpool busy-polling level 0-100 (0: threads sleep while idle)")
    return parser.parse_known_args(argv)


def main(argv: list[str] | None = None) -> int:
    args, extra = parse_args(sys.argv[1:] if argv is None else argv)
    import xllamacpp

    params = xllamacpp.CommonParams()
    params.model.path = args.model
    params.model_alias = {args.model_alias}
    params.hostnames = [args.host]
    params.port = args.port
    params.n_ctx = args.n_ctx * args.n_parallel  # llama.cpp splits it evenly over the slots
    params.n_parallel = args.n_parallel
    params.kv_unified = False
    params.cont_batching = True
    params.flash_attn_type = 0
    params.endpoint_metrics = True  # /metrics: the prompt tokens it evaluated (the agent's cache share)
    params.cpuparams.n_threads = args.n_threads
    params.cpuparams_batch.n_threads = args.n_threads
    params.cpuparams.poll = args.poll
    params.cpuparams_batch.poll = args.poll
    set_extra(params, extra)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    server = xllamacpp.Server(params)
    print(f"llama.cpp server listening on {server.listening_address}", file=sys.stderr, flush=True)
    stop.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
