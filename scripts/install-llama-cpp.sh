#!/usr/bin/env bash
# Builds llama-cpp-python (the Python bindings the GGUF export is checked with) for this CPU, without
# llama.cpp's AMX kernels, into the active environment. Run before `pip install -e ".[dev]"` (README, .ci/run).
#
# Why: llama.cpp compiles with -march=native. On a CPU that reports AMX (Sapphire Rapids and later) inside a
# VM that does not enable AMX's tile registers, the first AMX instruction (`tilezero`) stops the process with
# "Illegal instruction" (SIGILL in libggml-cpu.so). -mno-amx-* keeps every other native instruction set
# (AVX-512 included) and leaves out the AMX code; on CPUs without AMX the flags change nothing.
# --no-cache-dir: pip's wheel cache is keyed by the source archive, not by these flags, so a wheel built
# earlier with AMX would otherwise be reused.
set -euo pipefail
cd "$(dirname "$0")/.."
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
CMAKE_ARGS="${CMAKE_ARGS:-} -DCMAKE_C_FLAGS='${NO_AMX}' -DCMAKE_CXX_FLAGS='${NO_AMX}'" \
  python -m pip install --no-cache-dir "llama-cpp-python[server]" -c constraints/cpu.txt
