#!/usr/bin/env bash
# The pre-registered hops2 experiment (benchmarks/results/learning/hops2/plan.md), on an otherwise idle machine:
#   bash benchmarks/run_hops2.sh
# Two workers of benchmarks/bench_hops2.py, each pinned to one core with one thread for torch and llama.cpp,
# take the plan's tasks in its order; an interrupted run resumes where it stopped (run the same command
# again). The last step pools the files into benchmarks/results/learning.json (`hops2`). ~2.2 h on 2 idle cores.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .cache/hops2
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
pids=()
for core in 0 1; do
  taskset -c "$core" python benchmarks/bench_hops2.py --worker "core$core" >>".cache/hops2/worker$core.log" 2>&1 &
  pids+=($!)
  sleep 30  # the first worker claims seed 1's warm-up before the second looks for work
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
python benchmarks/bench_hops2.py --report
exit $status
