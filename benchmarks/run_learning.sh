#!/usr/bin/env bash
# The whole learning experiment, one run after another on an otherwise idle machine:
#   bash benchmarks/run_learning.sh                      # hops seeds 1-3 with every control, then the report
#   HOPS_SEEDS="4 5" bash benchmarks/run_learning.sh     # more hops seeds (seeds may land one by one)
#   TERSE_SEEDS="1 2 3" bash benchmarks/run_learning.sh  # the terse mode's seeds too
# Each seed is `benchmarks/bench_learning.py` (one process, its own work folder under .cache/); every seed's
# files land in benchmarks/results/learning/<mode>/seed<N>/ and the last step pools them into learning.json
# (the hops figures under its `hops` key). A hops seed stops after the warm-up when the pre-check fails
# (precheck.json says which warm-up setting to change). 36-37 min a terse seed with its controls, ~21 min the
# question seed (2 idle cores); a hops seed 64-76 min on one core (each seed pinned to its own core), its
# evaluations and pre-check about 15% faster on 2 cores (see benchmarks/README.md). A seed the health gate
# stops is evaluated at the checkpoint the gate kept, and its controls still run.
set -euo pipefail
cd "$(dirname "$0")/.."
HOPS_SEEDS=${HOPS_SEEDS:-"1 2 3"}
TERSE_SEEDS=${TERSE_SEEDS:-""}
for seed in $HOPS_SEEDS; do
  python benchmarks/bench_learning.py --mode hops --seed "$seed"
done
for seed in $TERSE_SEEDS; do
  python benchmarks/bench_learning.py --mode terse --seed "$seed"
done
if [ ! -f benchmarks/results/learning/question/seed1/run.json ]; then
  python benchmarks/bench_learning.py --mode question --seed 1 --controls trivial_rule
fi
python benchmarks/bench_learning.py --report
