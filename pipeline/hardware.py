"""What the machine's arithmetic can do, for settings that depend on it (`train.autocast`, `evaluate.autocast`,
`environment.server.n_threads`).

bfloat16 autocast pays only where the hardware multiplies bf16 natively: CUDA GPUs of compute capability 8.0+
and CPUs with AVX512-BF16 or AMX (oneDNN's bf16 kernels). On a CPU without them (AVX2 only) oneDNN falls back
to slow reference kernels: measured on a 2-core AMD EPYC (AVX2) with torch 2.13, a 512x576 @ 576x1536 matmul ran
at 1.3 GFLOP/s in bf16 against 128 GFLOP/s in float32, and the default profile's format warm-up took ~230 s a
step instead of ~9 s. So `auto` (the default) asks the hardware, and an explicit `bfloat16` on such a CPU is
honoured with a warning.

llama.cpp servers (`environment.server.n_threads: auto`): every usable core (the affinity mask), for the
environment server and the agent server alike. Splitting the cores between the two was measured and not
adopted. In a synthetic saturation test (`python benchmarks/bench_agent_server.py --beside-env 2+2,1+1,2+1`,
benchmarks/results/agent_server_beside_env.json: 16 agent conversations while 8 environment requests stay
in flight all the time) two servers with 2 threads each on 2 cores collapsed (agent 10.4/5.4 completion
tokens/s first/next turn, environment 14.2) against 2 agent + 1 environment thread (15.7/33.4 and 48.0):
ggml's threads spin at every op's barrier while the other server holds the core. But the default
profile's `dvc repro` with the environment on half the cores beside an agent server was slower, not faster
(benchmarks/results/pipeline_threads_split.json: evaluation 730 s against 513 s, `env_only` 70 s against
34 s): in a real rollout the environment's replies are the critical path and the two servers are rarely
both saturated, so the environment needs its cores more than the overlap costs.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from typing import Any

logger = logging.getLogger(__name__)


@functools.cache
def native_bf16(device_type: str) -> bool:
    """True when `device_type` ("cuda" or "cpu") multiplies bf16 natively on this machine."""
    import torch

    if device_type == "cuda":
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    if device_type == "cpu":
        try:
            return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        except (AttributeError, RuntimeError):  # a torch build without oneDNN
            return False
    return False


def cpu_capability() -> str:
    """torch's name for the CPU's vector instructions (AVX2, AVX512, ...), for messages."""
    import torch

    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except (AttributeError, RuntimeError):
        return "unknown"


_warned: set[tuple[str, str]] = set()


def resolve_autocast(setting: str | None, device: Any, key: str) -> str | None:
    """The autocast dtype to use for `setting` (`auto`, `bfloat16` or None) on `device` (a torch.device or its
    type); `key` names the setting in messages. auto: bfloat16 where the device has native bf16, else None
    (float32). An explicit bfloat16 without native bf16 is kept, with one warning per key and device."""
    device_type = getattr(device, "type", device) or "cpu"
    if setting is None:
        return None
    if setting == "auto":
        return "bfloat16" if native_bf16(device_type) else None
    if setting == "bfloat16" and not native_bf16(device_type) and (key, device_type) not in _warned:
        _warned.add((key, device_type))
        where = f"this CPU ({cpu_capability()})" if device_type == "cpu" else f"this {device_type} device"
        logger.warning("%s: bfloat16 on %s, which has no native bf16 arithmetic: matmuls run far slower than in "
                       "float32 (measured ~100x on an AVX2 CPU); set %s: auto (or null) unless you mean it",
                       key, where, key)
    return setting


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask: a container's or taskset's limit)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def busy_cores(sample_s: float = 0.5) -> float:
    """How many cores' worth of CPU the whole machine kept busy over `sample_s` seconds (/proc/stat; 0.0
    where it cannot be read)."""
    def snapshot() -> tuple[int, int] | None:
        try:
            with open("/proc/stat") as fh:
                fields = [int(x) for x in fh.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return sum(fields[:8]), idle

    first = snapshot()
    time.sleep(sample_s)
    second = snapshot()
    if first is None or second is None or second[0] <= first[0]:
        return 0.0
    total, idle = second[0] - first[0], second[1] - first[1]
    return (total - idle) / total * (os.cpu_count() or 1)


_auto_threads: int | None = None
"""The thread count `n_threads: auto` chose at this process's first server start (`server_threads`)."""


def server_threads(setting: int | str) -> int:
    """llama.cpp threads for `environment.server.n_threads`: an int is kept; auto = the usable cores less those
    other work keeps busy, sampled (0.5 s) at the first automatic start of the process and kept for its later
    servers (the training stage starts an agent server every step).

    Why not every core on a loaded machine: llama.cpp's threads meet at a barrier after every operation, so
    when one of them waits for a core another process holds, every token waits for the scheduler: on 2 cores
    with one kept busy, 2 threads decoded 0.33 tokens/s against ~17 idle, and environment calls timed out;
    1 thread decoded as fast as 1 thread idle. The thread count does not change what the servers compute
    (without flash attention, pipeline.environment.llama_server): the environment's replies were the same
    for 12 of 12 questions and the agent's samples and log-probs for 9 of 9 prompts with 1 and 2 threads, so
    a loaded run gives the idle run's figures, only later."""
    global _auto_threads
    if isinstance(setting, int):
        return setting
    if _auto_threads is None:
        usable = usable_cores()
        busy = min(usable - 1, int(busy_cores() + 0.25))
        if busy > 0:
            logger.warning("other work keeps ~%d of %d cores busy: llama.cpp servers get %d thread(s) (its threads "
                           "wait for each other at every operation; 0.33 tokens/s measured with 2 threads and 1 "
                           "of 2 cores busy)", busy, usable, usable - busy)
        _auto_threads = usable - busy
    return _auto_threads
