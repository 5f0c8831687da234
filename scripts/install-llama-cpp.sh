#!/usr/bin/env bash
# Builds llama.cpp twice for this CPU, without llama.cpp's AMX kernels, into the active environment:
# - llama-cpp-python (the Python bindings the GGUF export is checked with, and the raw engine
#   benchmarks/bench_engines.py measures the servers against);
# - xllamacpp (llama.cpp's own batching server, which runs the environment and agent servers:
#   pipeline/environment/llama_server.py), from its source archive instead of the registry's wheel.
# Run before `pip install -e ".[dev]"` (README, .ci/run, the CPU Docker target); that install then finds
# xllamacpp at the pinned version and keeps this build.
#
# Why build the server: the registry's xllamacpp wheel is a portable AVX2 build; llama.cpp built with
# -march=native uses every vector extension this CPU has (AVX-512, its BF16/FP16/VNNI parts), which is
# where a 2-core machine spends its time (benchmarks/results/engines.json). The two builds compute the
# same figures (benchmarks/README.md, "The CPU engines").
# Why without AMX: on a CPU that reports AMX (Sapphire Rapids and later) inside a VM that does not enable
# AMX's tile registers, the first AMX instruction (`tilezero`) stops the process with "Illegal
# instruction" (SIGILL in libggml-cpu.so). -mno-amx-* keeps every other native instruction set and leaves
# out the AMX code; on CPUs without AMX the flags change nothing.
# xllamacpp's extra switches: no llguidance, BoringSSL, OpenSSL or curl (each would be fetched with git at
# build time, which fails offline; the servers listen on 127.0.0.1 over plain HTTP and load local files).
# --force-reinstall: an environment that already holds the registry's wheel gets this build instead.
# --no-cache-dir: pip's wheel cache is keyed by the source archive, not by these flags, so a wheel built
# earlier for another CPU would otherwise be reused.
set -euo pipefail
cd "$(dirname "$0")/.."
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
CMAKE_ARGS="${CMAKE_ARGS:-} -DCMAKE_C_FLAGS='${NO_AMX}' -DCMAKE_CXX_FLAGS='${NO_AMX}'" \
  python -m pip install --no-cache-dir "llama-cpp-python[server]" -c constraints/cpu.txt

XLLAMACPP="$(grep -o '"xllamacpp==[^"]*"' pyproject.toml | tr -d '"')"
CMAKE_ARGS="${CMAKE_ARGS:-} -DGGML_NATIVE=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
  -DCMAKE_C_FLAGS='${NO_AMX}' -DCMAKE_CXX_FLAGS='${NO_AMX}' -DGGML_CCACHE=OFF \
  -DLLAMA_LLGUIDANCE=OFF -DLLAMA_BUILD_BORINGSSL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF" \
  python -m pip install --no-cache-dir --force-reinstall --no-deps --no-binary xllamacpp "${XLLAMACPP}"
