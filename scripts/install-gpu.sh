#!/usr/bin/env bash
# The one install route for GPU nodes: the Dockerfile's gpu image runs it, docs/gpu.md tells you to.
# Run from anywhere, inside the virtual environment to install into (Python 3.11 or 3.12, Linux x86_64):
#   scripts/install-gpu.sh
#
# Step 1: the project with its `gpu` extra under constraints/gpu.txt: the set verl 0.9.1 declares
#         together (its `vllm` extra: torch 2.11.0, transformers 5.9.0, vllm 0.24.0, plus verl-core).
#         llama-cpp-python (a main dependency: the CPU environment server) builds for CPU here.
# Step 2: flash-attn, verl's pin 2.8.3, WITHOUT build isolation: its build imports the torch installed
#         in step 1, which an isolated build cannot see (the failure `pip install -e ".[gpu]"` used to hit).
#         No official 2.8.3 wheel exists for torch 2.11 + CUDA 13, so it compiles (nvcc needed: a CUDA
#         devel image or toolkit; MAX_JOBS bounds memory) unless FLASH_ATTN_WHEEL names a prebuilt
#         wheel (path or URL) for this Python, torch 2.11 and CUDA 13.
# Step 3: check that what is installed is exactly the pinned set.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python}"
CONSTRAINTS=constraints/gpu.txt
pip_install() { "$PYTHON" -m pip install --constraint "$CONSTRAINTS" "$@"; }

"$PYTHON" -m pip install --upgrade pip setuptools wheel ninja packaging psutil

# step 1
CMAKE_ARGS="${CMAKE_ARGS:--DGGML_CUDA=off}" pip_install -e ".[gpu]"

# step 2
if [ -n "${FLASH_ATTN_WHEEL:-}" ]; then
  pip_install --no-deps "$FLASH_ATTN_WHEEL"
else
  MAX_JOBS="${MAX_JOBS:-8}" pip_install --no-build-isolation flash-attn
fi

# step 3
"$PYTHON" scripts/check_pins.py "$CONSTRAINTS"
