#!/usr/bin/env bash
# Does the GPU set resolve? pip's resolver on package metadata only (nothing installed, no GPU needed):
# pyproject.toml's dependencies + its `gpu` extra under constraints/gpu.txt, for Linux x86_64 wheels.
#   scripts/check-gpu-resolution.sh [PYTHON_VERSION] [WHEEL_DIR]      (defaults: 3.11, none)
# antlr4-python3-runtime (hydra) and llama-cpp-python ship only as sources, which a cross-platform
# resolution cannot build: give their wheels in WHEEL_DIR, made once with
#   pip wheel --no-deps -w WHEEL_DIR antlr4-python3-runtime==4.9.3 "llama-cpp-python[server]"
# Prints the versions chosen for the packages that matter; exits non-zero when the set does not resolve.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON_VERSION="${1:-3.11}"
WHEEL_DIR="${2:-}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

python - > "$work/requirements.txt" <<'PY'
import tomllib

project = tomllib.load(open("pyproject.toml", "rb"))["project"]
print("\n".join(project["dependencies"] + project["optional-dependencies"]["gpu"]))
PY
platforms=()
for minor in $(seq 17 39); do platforms+=(--platform "manylinux_2_${minor}_x86_64"); done
python -m pip install --dry-run --ignore-installed --quiet --python-version "$PYTHON_VERSION" \
  --only-binary=:all: "${platforms[@]}" --platform manylinux2014_x86_64 --platform linux_x86_64 \
  ${WHEEL_DIR:+--find-links "$WHEEL_DIR"} --target "$work/target" \
  -r "$work/requirements.txt" -c constraints/gpu.txt --report "$work/report.json"
python - "$work/report.json" <<'PY'
import json
import sys

chosen = {i["metadata"]["name"].lower().replace("_", "-"): i["metadata"]["version"]
          for i in json.load(open(sys.argv[1]))["install"]}
names = ["torch", "transformers", "vllm", "verl", "transferqueue", "ray", "prefect", "fastapi", "mlflow", "dvc"]
print(f"resolves ({len(chosen)} packages):", ", ".join(f"{n} {chosen.get(n, '-')}" for n in names))
PY
