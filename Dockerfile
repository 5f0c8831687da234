# syntax=docker/dockerfile:1
# Prompt-R1 pipeline images (one Dockerfile, two targets):
#   docker build -t promptr1:gpu .               GPU nodes (default target): CUDA 13 base, Python 3.12,
#                                                scripts/install-gpu.sh (verl 0.9.1's vLLM set, flash-attn)
#   docker build --target cpu -t promptr1:cpu .  CPU: the default profile, `dvc repro`
#   docker run --rm -v "$PWD/../shared:/shared:ro" promptr1:cpu       (params' mirror ../shared/datasets)
#   docker run --rm --gpus all --ipc=host -e PREFECT_API_URL promptr1:gpu flow run --profile paper
# Version pins live in constraints/cpu.txt and constraints/gpu.txt (tests/test_dockerfile.py checks them
# against pyproject.toml and verl's own metadata). torch 2.11.0's PyPI wheels are built for CUDA 13.0,
# hence the CUDA 13 base; the CUDA libraries themselves come as wheels. The devel image compiles flash-attn.

ARG PYTHON_VERSION=3.11
ARG CUDA_VERSION=13.0.2
ARG UBUNTU_VERSION=24.04

# ------------------------------------------------------------------------------------------------ cpu
FROM python:${PYTHON_VERSION}-slim AS cpu

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1
# Telemetry off: pipeline/runtime.py TELEMETRY_OFF (tests/test_dockerfile.py keeps them equal).
ENV MLFLOW_DISABLE_TELEMETRY=true DO_NOT_TRACK=1 PREFECT_SERVER_ANALYTICS_ENABLED=false GX_ANALYTICS_ENABLED=false
ENV DVC_NO_ANALYTICS=1 RAY_USAGE_STATS_ENABLED=0 HF_HUB_DISABLE_TELEMETRY=1 TOKENIZERS_PARALLELISM=false

# build-essential + cmake: llama-cpp-python compiles at install; git: DVC works inside a git repository.
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential cmake git \
 && rm -rf /var/lib/apt/lists/*
RUN useradd --create-home --uid 10001 promptr1

WORKDIR /app
# The CPU wheel first: from PyPI torch would pull gigabytes of CUDA libraries.
RUN pip install --index-url https://download.pytorch.org/whl/cpu "torch==2.13.0"
# llama.cpp's bindings and its server compiled for the build machine's CPU without AMX, as the README's set-up
# does (scripts/install-llama-cpp.sh says why): the image runs on CPUs with the build machine's vector
# extensions. Copied apart from the sources so a code change does not recompile them.
COPY --chown=promptr1:promptr1 pyproject.toml ./
COPY --chown=promptr1:promptr1 constraints/ constraints/
COPY --chown=promptr1:promptr1 scripts/install-llama-cpp.sh scripts/
RUN bash scripts/install-llama-cpp.sh
COPY --chown=promptr1:promptr1 . .
RUN pip install -c constraints/cpu.txt -e . \
 && git init -q . \
 && if [ ! -d .dvc ]; then dvc init -q; fi \
 && chown -R promptr1:promptr1 /app

USER promptr1
CMD ["dvc", "repro"]

# ------------------------------------------------------------------------------------------ gpu-build
FROM nvidia/cuda:${CUDA_VERSION}-devel-ubuntu${UBUNTU_VERSION} AS gpu-build

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential cmake \
      ninja-build git \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

WORKDIR /app
COPY . .
# The one GPU install route (docs/gpu.md uses it too): verl's declared set, then flash-attn without build
# isolation. FLASH_ATTN_WHEEL (build arg) may name a prebuilt flash-attn 2.8.3 wheel to skip its compile
# (the fast path). A build has no GPU to ask, so the compile targets FLASH_ATTN_CUDA_ARCHS: A100 (80) and
# H100/H200 (90) by default, one of them to halve the compile (--build-arg FLASH_ATTN_CUDA_ARCHS=90).
# MAX_JOBS empty: the script derives it from the build machine's memory (~9 GB per compile job).
ARG FLASH_ATTN_WHEEL=""
ARG FLASH_ATTN_CUDA_ARCHS="80;90"
ARG MAX_JOBS=""
RUN FLASH_ATTN_WHEEL="${FLASH_ATTN_WHEEL}" FLASH_ATTN_CUDA_ARCHS="${FLASH_ATTN_CUDA_ARCHS}" MAX_JOBS="${MAX_JOBS}" \
    PYTHON=python scripts/install-gpu.sh \
 && git init -q . \
 && if [ ! -d .dvc ]; then dvc init -q; fi

# ------------------------------------------------------------------------------------------------ gpu
FROM nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu${UBUNTU_VERSION} AS gpu

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/venv/bin:$PATH
# Telemetry off: pipeline/runtime.py TELEMETRY_OFF (tests/test_dockerfile.py keeps them equal).
ENV MLFLOW_DISABLE_TELEMETRY=true DO_NOT_TRACK=1 PREFECT_SERVER_ANALYTICS_ENABLED=false GX_ANALYTICS_ENABLED=false
ENV DVC_NO_ANALYTICS=1 RAY_USAGE_STATS_ENABLED=0 HF_HUB_DISABLE_TELEMETRY=1 TOKENIZERS_PARALLELISM=false

# python3-dev + gcc: Triton (vLLM, verl) compiles small launchers at run time; libgomp1: llama.cpp.
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-dev gcc libc6-dev libgomp1 git curl \
 && rm -rf /var/lib/apt/lists/*
# uid 10001: Ubuntu 24.04 images already have uid 1000 (user ubuntu).
RUN useradd --create-home --uid 10001 promptr1

COPY --from=gpu-build /opt/venv /opt/venv
COPY --from=gpu-build --chown=promptr1:promptr1 /app /app
WORKDIR /app
USER promptr1
ENTRYPOINT ["promptr1"]
CMD ["--help"]
