#!/usr/bin/env bash
# Gather the wheels benchmarks/gpu_actor_check.py needs on the GPU check machine, which has no network access and
# receives the repository plus at most 64 MiB: the pins of benchmarks/gpu_actor_check.requirements.txt built for
# that machine (Python 3.12, manylinux x86_64; pip's --python-version/--platform, so this runs on any host with
# network access), the pure-Python packages the registry has only as sdists built here, and the Ray stand-in
# (benchmarks/gpu_check_ray), then a MANIFEST.json (names, versions, sizes, sha256) and the set's checks
# (benchmarks/gpu_check_wheels.py): every pin present once, nothing else, at most 30 MiB; exit 1 otherwise.
#
#   scripts/gpu-check-wheels.sh [DEST] [PYTHON_VERSION]   # defaults: .cache/gpu-check-wheels 3.12
#
# On the GPU machine, from the repository root with DEST carried beside it:
#   python3 -m pip install --no-index --no-deps --target /tmp/site DEST/*.whl && export PYTHONPATH=/tmp/site
#   python3 benchmarks/gpu_actor_check.py --out benchmarks/results/gpu_actor_check.json
# (--target and PYTHONPATH put transformers 5.9.0 and tokenizers 0.22.2 ahead of the machine's own versions.)
set -euo pipefail
cd "$(dirname "$0")/.."
dest="${1:-.cache/gpu-check-wheels}"
version="${2:-3.12}"
requirements=benchmarks/gpu_actor_check.requirements.txt
sdist_only="antlr4-python3-runtime"   # pure Python; no wheel of the pinned version on the registry

rm -rf "$dest"
mkdir -p "$dest"
mapfile -t pins < <(grep -vE '^[[:space:]]*(#|$)' "$requirements")
binary=()
built=()
for pin in "${pins[@]}"; do
  if [[ "${pin%%==*}" == "$sdist_only" ]]; then built+=("$pin"); else binary+=("$pin"); fi
done
python -m pip download --quiet --no-deps --only-binary=:all: --dest "$dest" \
  --python-version "$version" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 "${binary[@]}"
for pin in "${built[@]}"; do
  python -m pip wheel --quiet --no-deps --wheel-dir "$dest" "$pin"
done
python benchmarks/gpu_check_wheels.py standin "$dest" >/dev/null
python benchmarks/gpu_check_wheels.py manifest "$dest" --python-version "$version"
