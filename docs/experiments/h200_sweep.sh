#!/usr/bin/env bash
# On an H200 host: sweep the 15 seed shapes x both norms (bf16), time-budgeted (BUDGET seconds, default 300),
# then emit the H200 table with neighbour re-measurement, on a copy of results.db in OUT_DIR.
#   bash docs/experiments/h200_sweep.sh OUT_DIR
set -euo pipefail
OUT_DIR=${1:?usage: bash docs/experiments/h200_sweep.sh OUT_DIR}
mkdir -p "$OUT_DIR"
cp results.db "$OUT_DIR/results.db"
DB="sqlite:///$OUT_DIR/results.db"
normtune sweep --gpu h200 --shapes seed --trials 24 --time-budget "${BUDGET:-300}" --storage "$DB" \
  --compile-workers 12 --summary "$OUT_DIR/sweep-h200.json"
normtune emit --gpu h200 --db "$DB" --remeasure --out "$OUT_DIR/h200.json"
