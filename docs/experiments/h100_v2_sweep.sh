#!/usr/bin/env bash
# Kernel family v2 on an H100: sweep the new search space (seed shapes re-seeded with the v2 strategies, and
# few-row shapes; bf16, both norms) into a copy of results.db in OUTDIR, fit a table from it, and bench that
# table against the peers. Usage: bash docs/experiments/h100_v2_sweep.sh OUTDIR [SECONDS]
set -u
out=${1:?usage: h100_v2_sweep.sh OUTDIR [SECONDS]}
budget=${2:-420}
mkdir -p "$out"
cp results.db "$out/results.db"
db="sqlite:///$out/results.db"
export PYTHONUNBUFFERED=1
normtune sweep --gpu h100 --shapes seed --trials 50 --time-budget "$((budget * 3 / 4))" --db "$db" \
  --compile-workers 14 2>&1 | grep -v "━" | tail -4
normtune sweep --gpu h100 --shapes docs/experiments/few-rows-shapes.txt --trials 30 \
  --time-budget "$((budget / 4))" --db "$db" --compile-workers 14 2>&1 | grep -v "━" | tail -4
normtune emit --gpu h100 --db "$db" --out "$out/h100.json" 2>&1 | tail -3
NORMTUNE_CONFIG="$out/h100.json" normtune bench --gpu h100 --shapes seed --peers torch,compile,liger \
  --config table --out "$out/bench" --db "$db" --budget 0.3 2>&1 | grep -v "━" | tail -40
