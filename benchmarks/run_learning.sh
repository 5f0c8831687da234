#!/usr/bin/env bash
# The whole learning experiment of issue 32, one run after another on an otherwise idle machine:
#   bash benchmarks/run_learning.sh            # terse seeds 1-3 with every control, question (knowledge) seed 1
#   SEEDS="4 5" bash benchmarks/run_learning.sh    # more terse seeds (the question seed is skipped when present)
# Each seed is `benchmarks/bench_learning.py` (one process, its own work folder under .cache/); every seed's
# files land in benchmarks/results/learning/<mode>/seed<N>/ and the last step pools them into learning.json.
# 36-37 min a terse seed with its controls, ~21 min the question seed (2 idle cores; see benchmarks/README.md).
set -euo pipefail
cd "$(dirname "$0")/.."
SEEDS=${SEEDS:-"1 2 3"}
for seed in $SEEDS; do
  python benchmarks/bench_learning.py --mode terse --seed "$seed"
done
if [ ! -f benchmarks/results/learning/question/seed1/run.json ]; then
  python benchmarks/bench_learning.py --mode question --seed 1 --controls trivial_rule
fi
python benchmarks/bench_learning.py --report
