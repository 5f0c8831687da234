#!/usr/bin/env bash
# The one install route for GPU nodes: the Dockerfile's gpu image runs it, docs/gpu.md tells you to.
# Run from anywhere, inside the virtual environment to install into (Python 3.11 or 3.12, Linux x86_64):
#   scripts/install-gpu.sh
#
# Step 0: where nvidia-smi answers, its driver must be >= 580 (CUDA 13); docs/gpu.md section 2.
# Step 1: the project with its `gpu` extra under constraints/gpu.txt: the set verl 0.9.1 declares
#         together (its `vllm` extra: torch 2.11.0, transformers 5.9.0, vllm 0.24.0, plus verl-core).
#         llama-cpp-python (a main dependency: the CPU environment server) builds for CPU here.
# Step 2: flash-attn, verl's pin 2.8.3, WITHOUT build isolation: its build imports the torch installed
#         in step 1, which an isolated build cannot see (the failure `pip install -e ".[gpu]"` used to hit).
#         Fast path: FLASH_ATTN_WHEEL names a prebuilt wheel (path or URL) for this Python, torch 2.11 and
#         CUDA 13, and nothing compiles. Otherwise it compiles (nvcc needed: a CUDA devel image or toolkit),
#         since no official 2.8.3 wheel exists for torch 2.11 + CUDA 13. The build command itself sets
#         FLASH_ATTENTION_FORCE_BUILD=TRUE: without it flash-attn's setup.py (CachedWheelsCommand) first
#         tries to download a prebuilt wheel from GitHub with urllib and no timeout, so an offline or
#         firewalled node waits or fails before compiling anything. The compile is bounded:
#         - only this node's GPU architecture: FLASH_ATTN_CUDA_ARCHS (what flash-attn's setup.py reads; its
#           default builds four: 80;90;100;120) from `nvidia-smi --query-gpu=compute_cap`, each capability
#           mapped to the flash-attn target whose kernels run on it (8.x -> 80, 9.0 -> 90, 10.x -> 100,
#           12.x -> 120), and TORCH_CUDA_ARCH_LIST (other torch extensions) to the capabilities themselves;
#         - MAX_JOBS from memory: one compile job per ~9 GB (flash-attn's own estimate, nvcc at 4 threads)
#           of MemAvailable in /proc/meminfo, or of the cgroup's memory.max when that is lower (a container
#           sees the host's meminfo), at least 1.
#         Compile time, an estimate until a node measures it: ~15-20 minutes on 16 cores for one
#         architecture, about twice that for the Dockerfile's two (80;90).
#         Each variable set beforehand wins. Without nvidia-smi (a `docker build`) FLASH_ATTN_CUDA_ARCHS
#         must be given. `scripts/install-gpu.sh --print-build-env` prints the derived values and
#         installs nothing (NVIDIA_SMI, MEMINFO and CGROUP_MEMORY_MAX name other sources, for tests).
# Step 3: check that what is installed is exactly the pinned set.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python}"
CONSTRAINTS=constraints/gpu.txt
GB_PER_COMPILE_JOB=9
MIN_DRIVER=580
NVIDIA_SMI="${NVIDIA_SMI:-nvidia-smi}"
MEMINFO="${MEMINFO:-/proc/meminfo}"
CGROUP_MEMORY_MAX="${CGROUP_MEMORY_MAX:-/sys/fs/cgroup/memory.max}"

# flash-attn 2.8.3 target (setup.py: 80, 90, 100, 120) whose kernels run on compute capability $1
flash_attn_target() {
  case "$1" in
    8.*) echo 80 ;;
    9.0) echo 90 ;;
    10.*) echo 100 ;;
    12.*) echo 120 ;;
    *) echo "install-gpu.sh: flash-attn 2.8.3 has no kernels for compute capability $1 (it needs 8.0+;" \
            "set FLASH_ATTN_CUDA_ARCHS to build anyway)" >&2
       return 1 ;;
  esac
}

# FLASH_ATTN_CUDA_ARCHS and TORCH_CUDA_ARCH_LIST for the GPUs nvidia-smi lists (unless already set)
derive_cuda_archs() {
  if [ -z "${FLASH_ATTN_CUDA_ARCHS:-}" ]; then
    local caps cap targets=""
    if ! caps=$("$NVIDIA_SMI" --query-gpu=compute_cap --format=csv,noheader 2>/dev/null) || [ -z "$caps" ]; then
      echo "install-gpu.sh: cannot read the GPU's compute capability from '$NVIDIA_SMI' (no GPU here, e.g." \
           "a docker build): set FLASH_ATTN_CUDA_ARCHS (90 for H100/H200, 80 for A100) or FLASH_ATTN_WHEEL" >&2
      return 1
    fi
    caps=$(printf '%s\n' "$caps" | tr -d ' \r' | sed '/^$/d' | sort -uV)
    for cap in $caps; do
      targets="$targets $(flash_attn_target "$cap")" || return 1
    done
    FLASH_ATTN_CUDA_ARCHS=$(printf '%s\n' $targets | sort -un | paste -sd ';')
    TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-$(printf '%s\n' $caps | paste -sd ';')}"
  fi
  # given targets only: torch's list from them (90 -> 9.0, 100 -> 10.0)
  TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-$(printf '%s\n' ${FLASH_ATTN_CUDA_ARCHS//;/ } \
    | sed -E 's/^([0-9]+)([0-9])$/\1.\2/' | paste -sd ';')}"
  export FLASH_ATTN_CUDA_ARCHS TORCH_CUDA_ARCH_LIST
}

# MAX_JOBS: one compile job per GB_PER_COMPILE_JOB of available memory, at least 1 (unless already set)
derive_max_jobs() {
  if [ -z "${MAX_JOBS:-}" ]; then
    local available_kb limit
    available_kb=$(awk '/^MemAvailable:/ {print $2}' "$MEMINFO" 2>/dev/null || true)
    if [ -z "$available_kb" ]; then
      echo "install-gpu.sh: no MemAvailable in $MEMINFO: set MAX_JOBS" >&2
      return 1
    fi
    limit=$(cat "$CGROUP_MEMORY_MAX" 2>/dev/null || true)
    if [[ "$limit" =~ ^[0-9]+$ ]] && [ $((limit / 1024)) -lt "$available_kb" ]; then
      available_kb=$((limit / 1024))
    fi
    MAX_JOBS=$((available_kb / (GB_PER_COMPILE_JOB * 1024 * 1024)))
    [ "$MAX_JOBS" -ge 1 ] || MAX_JOBS=1
  fi
  export MAX_JOBS
}

# CUDA 13 (torch 2.11's wheels) runs on NVIDIA driver 580 or newer: refuse an older one before installing
check_driver() {
  local version
  version=$("$NVIDIA_SMI" --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1 | tr -d ' \r') \
    || true
  if [ -z "$version" ]; then
    echo "install-gpu.sh: no driver version from '$NVIDIA_SMI' (no GPU here): the nodes that run this need" \
         "NVIDIA driver >= $MIN_DRIVER" >&2
  elif [ "${version%%.*}" -lt "$MIN_DRIVER" ]; then
    echo "install-gpu.sh: NVIDIA driver $version is older than $MIN_DRIVER, which CUDA 13 (torch 2.11's" \
         "wheels) needs: upgrade the driver first" >&2
    return 1
  fi
}

if [ "${1:-}" = "--print-build-env" ]; then
  derive_cuda_archs || exit 1
  derive_max_jobs || exit 1
  printf 'FLASH_ATTN_CUDA_ARCHS=%s\nTORCH_CUDA_ARCH_LIST=%s\nMAX_JOBS=%s\n' \
    "$FLASH_ATTN_CUDA_ARCHS" "$TORCH_CUDA_ARCH_LIST" "$MAX_JOBS"
  exit 0
fi

pip_install() { "$PYTHON" -m pip install --constraint "$CONSTRAINTS" "$@"; }

check_driver

"$PYTHON" -m pip install --upgrade pip setuptools wheel ninja packaging psutil

# step 1
CMAKE_ARGS="${CMAKE_ARGS:--DGGML_CUDA=off}" pip_install -e ".[gpu]"

# step 2
if [ -n "${FLASH_ATTN_WHEEL:-}" ]; then
  pip_install --no-deps "$FLASH_ATTN_WHEEL"
else
  derive_cuda_archs
  derive_max_jobs
  echo "install-gpu.sh: compiling flash-attn for FLASH_ATTN_CUDA_ARCHS=$FLASH_ATTN_CUDA_ARCHS" \
       "(TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST) with MAX_JOBS=$MAX_JOBS (estimate: ~15-20 minutes on 16 cores" \
       "per architecture)"
  FLASH_ATTENTION_FORCE_BUILD=TRUE pip_install --no-build-isolation flash-attn
fi

# step 3
"$PYTHON" scripts/check_pins.py "$CONSTRAINTS"
