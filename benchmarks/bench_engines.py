"""The CPU engines side by side: the pipeline's llama.cpp servers against the raw engine, on the same files,
threads and token sequences; and the training rollout's pattern replayed through the pipeline's own client.

    python benchmarks/bench_engines.py                       # writes benchmarks/results/engines.json
    python benchmarks/bench_engines.py --label a6fff2b --out /tmp/engines_before.json   # another build

Run it alone on an idle machine: on 2 cores anything else distorts it. ~6 minutes.

Files (`files`, one entry per role):
- `agent`: the untrained agent (`agent.model`, dequantised by transformers) written as an F16 GGUF by
  pipeline.agent.gguf_export, what `promptr1 evaluate` serves (`evaluate.agent_gguf_dtype`);
- `environment`: `environment.model`, the shipped Q4_1 file, what the environment server loads.

The same sequences for both engines: 16 conversations (`evaluate.agent_parallel`) of the Prompt-R1 prompt on
16 questions (~390 tokens each), 64 decoded tokens, then a second turn: the first turn's tokens, an
environment reply in the protocol's format (~40 new tokens) and 64 more. The environment's sequences are
16 environment requests (the env-only instruction and a question) with 64 decoded tokens.

- **raw**: llama-cpp-python (built for this CPU by scripts/install-llama-cpp.sh), one process, one
  sequence at a time, the pipeline's thread count (`environment.server.n_threads: auto`), the server's batch
  sizes and no flash attention; prefill = the prompt's evaluation, decode = one forward per token (the
  served run's own tokens, so both engines read and write the same ids). A second turn continues the same
  context, so it reads only its new tokens: the ideal cache.
- **served**: the pipeline's own server (pipeline.environment.llama_server through
  pipeline.environment.servers, started from the same configuration the stages build: split KV, `--poll 0`,
  no flash attention, the agent's 16 slots, the environment's `parallel`), sent the pipeline's request
  shape (one request holding every prompt, as pipeline.agent.completions_policy.batched_requests sends a
  turn; the environment one request at a time, `environment.server.parallel` 1). Each turn is sent twice:
  with `max_tokens` 1 (prefill: the prompt tokens llama.cpp evaluated over the request's wall time) and then
  in full with `ignore_eos` (decode: the tokens it generated over the wall time; the prompt is then in the
  slot's cache). The agent's requests ask for log-probs (their ids make the second turn; training asks for
  them too, evaluation does not, so its decode is a little faster than `served` says); the environment's do
  not (the environment client asks for none). Tokens are llama.cpp's own counts (`/metrics`: `prompt_tokens_total`,
  `tokens_predicted_total`, which sum every prompt of a request where a reply's `timings` describe its first
  only); the time is the request's wall time at the client (loopback HTTP adds ~1 ms), since concurrent
  slots' own timings overlap.
  The other role's server is up and idle meanwhile: a rollout alternates the two (pipeline.agent.rollout
  generates a turn of every live conversation, then sends their environment calls and waits for the
  replies), so each works alone with every core. `--beside-busy N` adds `served_beside_busy`: N
  conversations with the other server kept busy by a thread that holds one request in flight there all
  the time, a saturation case the pipeline does not produce (two servers of 2 threads on 2 cores wait for
  each other at every operation's barrier).
- `second_turn_prompt_n_minus_new_tokens_sum`: the prompt tokens llama.cpp evaluated at the second turn
  less those that are new there (the environment's reply and the next header), summed over conversations:
  each conversation reads at least its new tokens, so the sum bounds every one of them; ~0 when every slot
  kept its conversation. `evaluate_rollout`: the same for `evaluate.agent_rollout_batch` conversations
  sent in one request each turn, on `evaluate.agent_parallel` slots, with each turn's wall time.

`learning`: the training rollout's pattern (pipeline.train.local.rollout_engine: one slot per trajectory, a
group's G copies as `n` samples, temperature 1 with llama.cpp's truncation off), replayed through
pipeline.agent.completions_policy.OpenAICompletionsPolicy on the agent's F16 export: 2 questions x G=4
(`learn-hops` as recorded), 3 turns of the recorded hops rollouts' mean agent tokens per turn, with their
recorded environment replies between turns, pinned to one core as the recorded seeds ran (`taskset -c 0`,
so the server gets 1 thread). `gen_s_per_trajectory.new` = the turns' wall time over the trajectories
(what `timing_s/gen` over trajectories means in steps.csv), beside the recorded seeds' 6.4 s
(benchmarks/results/learning/hops/seed*/steps.csv, `recorded_hops`); `step_overhead_s`: the per-step
GGUF export from memory and the server start the trainer pays before a rollout.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

QUESTIONS = [
    "Who directed the film The Carter, and in which city was that director born?",
    "What is the capital of the country where the Eiffel Tower stands?",
    "Which river flows through the city where the Brandenburg Gate is located?",
    "In which year was the university attended by the author of Dracula founded?",
    "What is the official language of the country whose capital is Lima?",
    "Who composed the opera first performed at La Scala in 1887 titled Otello?",
    "Which ocean borders the state where the Golden Gate Bridge is located?",
    "What instrument did the founder of the band The Who's guitarist play?",
    "In which country was the inventor of the telephone, Alexander Graham Bell, born?",
    "Which mountain range contains the highest peak of the country where Zurich lies?",
    "Who was the first president of the country whose currency is the rand?",
    "What is the largest city of the state where Mount Rushmore stands?",
    "Which sea lies east of the peninsula that contains the city of Naples?",
    "Who painted the portrait that hangs in the museum in Paris named the Louvre, known as Mona Lisa?",
    "What is the population rank of the city where the Space Needle was built?",
    "Which planet did the space probe launched by NASA in 1977, Voyager 1, visit first?",
]
REPLY = ("The film The Carter was directed by Rex Harlan, who was born in Springfield, the city where he "
         "later founded a small studio.")
DECODE_TOKENS = 64


def _post(client: httpx.Client, url: str, body: dict[str, Any]) -> tuple[dict[str, Any], float]:
    started = time.perf_counter()
    response = client.post(f"{url}/completions", json=body)
    response.raise_for_status()
    return response.json(), time.perf_counter() - started


def _choices(reply: dict[str, Any]) -> list[dict[str, Any]]:
    return sorted(reply["choices"], key=lambda c: int(c.get("index") or 0))


def counters(url: str) -> dict[str, float]:
    """llama.cpp's running totals (`/metrics`): prompt tokens it evaluated (not taken from a cache) and
    tokens it generated, summed over every slot; their change over a request is that request's."""
    text = httpx.get(url.removesuffix("/v1") + "/metrics", timeout=30).text
    wanted = {"llamacpp:prompt_tokens_total": "prompt_n", "llamacpp:tokens_predicted_total": "predicted_n"}
    return {wanted[line.split()[0]]: float(line.split()[1]) for line in text.splitlines()
            if line.split(" ")[0] in wanted}


def _delta(url: str, before: dict[str, float]) -> dict[str, float]:
    after = counters(url)
    return {key: after[key] - before[key] for key in before}


# -- the files ---------------------------------------------------------------------------------------
def environment_file(params: Any) -> Path:
    from pipeline.modelref import resolve_model

    return Path(resolve_model(params.environment.model, ROOT).location)


# -- the sequences -----------------------------------------------------------------------------------
def agent_prompts(tokenizer: Any) -> list[list[int]]:
    from pipeline.agent.protocol import ConversationBuilder
    from pipeline.agent.template import render_user_message

    builder = ConversationBuilder(tokenizer)
    return [builder.start([{"role": "user", "content": render_user_message(q, "hotpotqa")}]) for q in QUESTIONS]


def environment_prompts(tokenizer: Any, params: Any) -> list[list[int]]:
    from pipeline.evaluation.systems import env_only_prompt

    texts = [tokenizer.apply_chat_template(
        [{"role": "system", "content": params.environment.system_prompt},
         {"role": "user", "content": env_only_prompt(q, params.evaluate.env_only_instruction)}],
        add_generation_prompt=True, tokenize=False) for q in QUESTIONS]
    return [list(tokenizer.encode(text, add_special_tokens=False)) for text in texts]


def next_turn(tokenizer: Any, prompt: list[int], generated: list[int]) -> tuple[list[int], int]:
    """The second turn's prompt after `generated` and the number of its new tokens."""
    from pipeline.agent.protocol import ConversationBuilder

    new = ConversationBuilder(tokenizer).env_turn_ids(REPLY, generated)
    return prompt + generated + new, len(new)


# -- raw: llama-cpp-python ---------------------------------------------------------------------------
def raw_rates(gguf: Path, threads: int, turns: list[list[tuple[list[int], list[int]]]], n_ctx: int) -> dict[str, float]:
    """Prefill and decode tokens/s of llama-cpp-python over `turns` (per conversation: (new prompt tokens,
    decoded tokens) for each turn, in order), one conversation at a time in one context."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, n_batch=2048,
                n_ubatch=512, flash_attn=False, verbose=False)
    prefill_tokens = decode_tokens = 0
    prefill_s = decode_s = 0.0
    for conversation in turns:
        llm.reset()
        for new_prompt, decoded in conversation:
            started = time.perf_counter()
            llm.eval(new_prompt)
            prefill_s += time.perf_counter() - started
            prefill_tokens += len(new_prompt)
            started = time.perf_counter()
            for token in decoded:
                llm.eval([token])
            decode_s += time.perf_counter() - started
            decode_tokens += len(decoded)
    del llm
    return {"prefill_tokens_per_s": round(prefill_tokens / prefill_s, 1),
            "decode_tokens_per_s": round(decode_tokens / decode_s, 1)}


# -- served: the pipeline's servers ------------------------------------------------------------------
@contextmanager
def pipeline_servers(params: Any, agent_gguf: Path, cache_dir: Path, *, agent_port: int, env_port: int):
    """The environment server and the agent's server, each from the configuration the stages build."""
    from pipeline.agent.llama_launcher import AgentServing, agent_environment
    from pipeline.environment.servers import serve_environment
    from pipeline.environment.spec import ServerSpec, environment_with

    environment = environment_with(params.environment, port=env_port)
    serving = AgentServing.from_sections(params.agent, environment, params.evaluate, root=ROOT, cache_dir=cache_dir)
    agent = agent_environment(agent_gguf, serving, params.evaluate.agent_parallel, port=agent_port)
    with ExitStack() as stack:
        env_url = stack.enter_context(serve_environment(ServerSpec(environment=environment, root=ROOT,
                                                                   cache_dir=cache_dir), quiet=True))
        agent_url = stack.enter_context(serve_environment(ServerSpec(environment=agent, root=ROOT,
                                                                     cache_dir=cache_dir), role="agent", quiet=True))
        yield {"environment": (env_url.rstrip("/"), environment.served_name),
               "agent": (agent_url.rstrip("/"), agent.served_name)}


@contextmanager
def kept_busy(url: str, model: str, prompt: list[int]):
    """One request in flight at `url` all the time, until the block ends."""
    stop = threading.Event()

    def loop() -> None:
        with httpx.Client(timeout=600) as client:
            while not stop.is_set():
                _post(client, url, {"model": model, "prompt": [prompt], "max_tokens": 32, "temperature": 0.0,
                                    "ignore_eos": True, "cache_prompt": False})

    worker = threading.Thread(target=loop, daemon=True)
    worker.start()
    try:
        yield
    finally:
        stop.set()
        worker.join()


def _ids(tokenizer: Any, text: str) -> list[int]:
    """`DECODE_TOKENS` ids for the raw engine to decode: the served text's encoding, cut or repeated to length
    (the raw engine's decode costs the same for any ids; a second turn needs the conversation's own)."""
    ids = list(tokenizer.encode(text, add_special_tokens=False)) or [tokenizer.eos_token_id]
    return (ids * (DECODE_TOKENS // len(ids) + 1))[:DECODE_TOKENS]


def served_turn(client: httpx.Client, url: str, model: str, prompts: list[list[int]], one_at_a_time: bool,
                tokenizer: Any, logprobs: bool) -> tuple[dict[str, float], list[list[int]]]:
    """One turn of `prompts`: prefill (max_tokens 1), then the whole turn (64 decoded tokens, the prompt
    now cached). Returns the totals (llama.cpp's token counts, the requests' wall time) and each prompt's
    decoded ids."""
    groups = [[p] for p in prompts] if one_at_a_time else [prompts]
    body = {"model": model, "temperature": 0.0, "ignore_eos": True}
    if logprobs:  # the sampled ids (a second turn must extend the slot's own tokens); costs a little decode
        body["logprobs"] = 1
    totals = {"prefill_tokens": 0.0, "prefill_s": 0.0, "decode_tokens": 0.0, "decode_s": 0.0}
    decoded: list[list[int]] = []
    for group in groups:  # each group's prefill, then its decode (a one-slot server holds one prompt)
        before = counters(url)
        _, wall = _post(client, url, {**body, "prompt": group, "max_tokens": 1})
        totals["prefill_tokens"] += _delta(url, before)["prompt_n"]
        totals["prefill_s"] += wall
        before = counters(url)
        reply, wall = _post(client, url, {**body, "prompt": group, "max_tokens": DECODE_TOKENS})
        decoded += [[int(e["id"]) for e in choice["logprobs"]["content"]] if logprobs
                    else _ids(tokenizer, choice["text"]) for choice in _choices(reply)]
        totals["decode_tokens"] += _delta(url, before)["predicted_n"]
        totals["decode_s"] += wall
    return totals, decoded


def served_rates(servers: dict[str, tuple[str, str]], role: str, tokenizer: Any, prompts: list[list[int]],
                 busy: bool, second_turn: bool) -> tuple[dict[str, Any], list[list[tuple[list[int], list[int]]]]]:
    """The served rates of `role` (the other role's server busy or idle) and the token sequences it read
    and wrote (for the raw run)."""
    url, model = servers[role]
    other = "environment" if role == "agent" else "agent"
    with httpx.Client(timeout=1800) as client, ExitStack() as stack:
        if busy:
            stack.enter_context(kept_busy(*servers[other], prompts[0]))
        totals, decoded = served_turn(client, url, model, prompts, one_at_a_time=role == "environment",
                                      tokenizer=tokenizer, logprobs=second_turn)
        conversations = [[(p, d)] for p, d in zip(prompts, decoded, strict=True)]
        if second_turn:
            seconds = [next_turn(tokenizer, p, d) for p, d in zip(prompts, decoded, strict=True)]
            more, decoded2 = served_turn(client, url, model, [s for s, _ in seconds], one_at_a_time=False,
                                         tokenizer=tokenizer, logprobs=True)
            excess = more["prefill_tokens"] - sum(new for _, new in seconds)
            for key, value in more.items():
                totals[key] += value
            for conversation, (second, new), d2 in zip(conversations, seconds, decoded2, strict=True):
                conversation.append((second[-new:], d2))
    rates = {"prefill_tokens_per_s": round(totals["prefill_tokens"] / totals["prefill_s"], 1),
             "decode_tokens_per_s": round(totals["decode_tokens"] / totals["decode_s"], 1)}
    if second_turn:
        # Each conversation reads at least its new tokens, so the sum over conversations bounds each one.
        rates["second_turn_prompt_n_minus_new_tokens_sum"] = int(excess)
    return rates, conversations


def evaluate_rollout(servers: dict[str, tuple[str, str]], tokenizer: Any, conversations: int) -> dict[str, Any]:
    """Two turns of `conversations` agent conversations in one request each (what the evaluate stage sends
    for `evaluate.agent_rollout_batch` questions): each turn's wall time and, at the second, the prompt
    tokens llama.cpp evaluated beyond the new ones (summed over conversations)."""
    url, model = servers["agent"]
    prompts = (agent_prompts(tokenizer) * (conversations // len(QUESTIONS) + 1))[:conversations]
    prompts = [p[:-1] + [p[-1]] * (1 + i // len(QUESTIONS)) for i, p in enumerate(prompts)]  # all distinct
    body = {"model": model, "temperature": 0.0, "ignore_eos": True, "max_tokens": DECODE_TOKENS, "logprobs": 1}
    with httpx.Client(timeout=3600) as client:
        reply, first = _post(client, url, {**body, "prompt": prompts})
        decoded = [[int(e["id"]) for e in c["logprobs"]["content"]] for c in _choices(reply)]
        seconds = [next_turn(tokenizer, p, d) for p, d in zip(prompts, decoded, strict=True)]
        before = counters(url)
        _, second = _post(client, url, {**body, "prompt": [s for s, _ in seconds]})
        evaluated = _delta(url, before)["prompt_n"]
    return {"conversations": conversations, "turn_s": [round(first, 1), round(second, 1)],
            "second_turn_prompt_n_minus_new_tokens_sum": int(evaluated - sum(new for _, new in seconds))}


# -- learning: the training rollout's pattern --------------------------------------------------------
def recorded_hops() -> dict[str, Any]:
    """Per turn, the recorded hops rollouts' mean agent tokens and their environment replies; and the
    recorded generation seconds per trajectory (timing_s/gen summed over the seeds' steps / trajectories)."""
    import csv

    tokens: dict[int, list[int]] = {}
    replies: list[str] = []
    gen_s = trajectories = 0.0
    for seed in sorted((ROOT / "benchmarks/results/learning/hops").glob("seed*")):
        with gzip.open(seed / "rollouts.jsonl.gz", "rt") as fh:
            for line in fh:
                for k, turn in enumerate(json.loads(line)["turns"]):
                    tokens.setdefault(k, []).append(int(turn["agent_tokens"]))
                    text = (turn.get("environment") or {}).get("text") if isinstance(turn.get("environment"), dict) else None
                    if text:
                        replies.append(text)
        with open(seed / "steps.csv") as fh:
            for row in csv.DictReader(fh):
                if row.get("timing_s/gen"):
                    gen_s += float(row["timing_s/gen"])
                    trajectories += float(row["critic/score/count"])
    return {"tokens_per_turn": [round(statistics.mean(tokens[k])) for k in sorted(tokens)],
            "replies": replies, "gen_s_per_trajectory": round(gen_s / trajectories, 2)}


def learning_replay(agent_dir: Path, cache_dir: Path, port: int, steps: int = 3) -> dict[str, Any]:
    """The rollout of `steps` GRPO steps as pipeline.train.local.trainer runs it through llama.cpp (module doc)."""
    import torch
    from transformers import AutoModelForCausalLM

    from pipeline.agent.gguf_export import export_model
    from pipeline.agent.llama_launcher import AgentServing, served_policy
    from pipeline.agent.protocol import ConversationBuilder
    from pipeline.config import load_params
    from pipeline.modelref import load_tokenizer, resolve_model

    record = recorded_hops()
    params = load_params(ROOT / "params.yaml", {"profile": "learn-hops"})  # the recorded seeds' agent section
    tokenizer = load_tokenizer(params.agent.model, ROOT)
    builder = ConversationBuilder(tokenizer)
    serving = AgentServing.from_sections(params.agent, params.environment, params.evaluate, root=ROOT,
                                         cache_dir=cache_dir)
    serving = AgentServing(agent=serving.agent, environment=serving.environment, port=port,
                           gguf_dtype=params.train.rollout_gguf_dtype, root=ROOT, cache_dir=cache_dir)
    questions, group = params.train.batch_size, params.train.group_size
    trajectories = questions * group
    model = AutoModelForCausalLM.from_pretrained(agent_dir, dtype=torch.float32)
    template = resolve_model(params.agent.model, ROOT).location
    walls: list[float] = []
    overheads: list[float] = []
    excess: list[int] = []
    for step in range(steps):
        started = time.perf_counter()
        path = cache_dir / f"agent-train-step{step}.gguf"
        export_model(model, template, path, serving.gguf_dtype)
        with served_policy(path, serving, tokenizer, trajectories, quiet=True, grouped=group > 1) as policy:
            overheads.append(time.perf_counter() - started)
            policy.seed = step
            policy.sampling = {**policy.sampling, "ignore_eos": True}
            prompts = [builder.start([{"role": "user", "content": render_question(q)}])
                       for q in QUESTIONS[2 * step: 2 * step + questions] for _ in range(group)]
            new_tokens = 0  # the previous turn's environment reply and header, summed over trajectories
            for k, limit in enumerate(record["tokens_per_turn"]):
                sent_before, cached_before = policy.prompt_tokens, policy.cached_prompt_tokens
                started = time.perf_counter()
                generations = policy.generate(prompts, limit, temperature=1.0, top_p=1.0, stop=[],
                                              return_logprobs=True)
                walls.append(time.perf_counter() - started)
                evaluated = (policy.prompt_tokens - sent_before) - (policy.cached_prompt_tokens - cached_before)
                if k:
                    excess.append(evaluated - new_tokens)
                reply = record["replies"][(step * 7 + k) % len(record["replies"])]
                following = [builder.env_turn_ids(reply, g.token_ids) for g in generations]
                new_tokens = sum(len(f) for f in following)
                prompts = [p + g.token_ids + f for p, g, f in zip(prompts, generations, following, strict=True)]
        path.unlink(missing_ok=True)
    return {"gen_s_per_trajectory": {"recorded_hops": record["gen_s_per_trajectory"],
                                     "new": round(sum(walls) / (steps * trajectories), 2)},
            # Per later turn, the prompt tokens llama.cpp evaluated less the new ones, summed over the
            # trajectories: an upper bound of any one trajectory's (each reads at least its new tokens).
            "prompt_n_minus_new_tokens_max": max(excess),
            "prompt_n_minus_new_tokens_per_turn": excess,
            "prompt_n_minus_new_tokens_mean": round(statistics.mean(excess) / trajectories, 1),
            "step_overhead_s": round(statistics.mean(overheads), 2),
            "tokens_per_turn": record["tokens_per_turn"], "steps": steps, "trajectories_per_step": trajectories}


def render_question(question: str) -> str:
    from pipeline.agent.template import render_user_message

    return render_user_message(question, "hops")


# -- the run -----------------------------------------------------------------------------------------
def build_info() -> str:
    """Which xllamacpp build serves: llama.cpp's system line (its CPU features) as xllamacpp reports it."""
    out = subprocess.run([sys.executable, "-c", "import xllamacpp; print(xllamacpp.get_system_info())"],
                         capture_output=True, text=True, cwd=ROOT, check=False)
    return (out.stdout or out.stderr).strip()[:400]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/engines.json")
    parser.add_argument("--label", default="", help="names the build measured (default: the commit)")
    parser.add_argument("--skip-learning", action="store_true")
    parser.add_argument("--beside-busy", type=int, default=0, metavar="N",
                        help="also measure N of the conversations with the other role's server kept busy")
    args = parser.parse_args()

    from bench_agent_server import export_agent
    from bench_pipeline import machine

    from pipeline.config import load_params
    from pipeline.hardware import server_threads
    from pipeline.modelref import load_tokenizer

    params = load_params(ROOT / "params.yaml")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                            check=False).stdout.strip()
    threads = server_threads(params.environment.server.n_threads)
    tmp = Path(tempfile.mkdtemp(prefix="promptr1-engines-"))
    agent_gguf = export_agent(tmp, params.evaluate.agent_gguf_dtype)
    tokenizer = load_tokenizer(params.agent.model, ROOT)
    files = []
    n_ctx = params.agent.max_prompt_tokens + params.agent.max_response_tokens + 64
    with pipeline_servers(params, agent_gguf, tmp, agent_port=8791, env_port=8790) as servers:
        measured = {}
        for role, prompts in (("agent", agent_prompts(tokenizer)), ("environment", environment_prompts(tokenizer, params))):
            served, sequences = served_rates(servers, role, tokenizer, prompts, busy=False, second_turn=role == "agent")
            beside = None
            if args.beside_busy:
                beside, _ = served_rates(servers, role, tokenizer, prompts[: args.beside_busy], busy=True,
                                         second_turn=False)
            measured[role] = (served, beside, sequences)
        rollout = evaluate_rollout(servers, tokenizer, params.evaluate.agent_rollout_batch)
    for role, gguf in (("agent", agent_gguf), ("environment", environment_file(params))):
        served, beside, sequences = measured[role]
        raw = raw_rates(gguf, threads, sequences, n_ctx)
        entry = {"role": role, "gguf": gguf.name, "threads": threads, "raw": raw, "served": served,
                 "served_over_raw": {k.split("_")[0]: round(served[k] / raw[k], 2) for k in raw}}
        if beside is not None:
            entry["served_beside_busy"] = beside
            entry["served_beside_busy_over_raw"] = {k.split("_")[0]: round(beside[k] / raw[k], 2) for k in raw}
        files.append(entry)
    learning = None
    if not args.skip_learning:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # as the recorded seeds ran: one core
        learning = learning_replay(tmp / "agent", tmp, port=8792)
        learning["threads"] = 1
    result = {"files": files, "evaluate_rollout": {**rollout, "slots": params.evaluate.agent_parallel},
              "learning": learning,
              "command": "python benchmarks/bench_engines.py" + (f" --label {args.label}" if args.label else ""),
              "commit": args.label or commit, "machine": {**machine(), "server_build": build_info()}}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
