#!/usr/bin/env bash
# On an H100 host: deepen the wide-row studies, re-emit with neighbour re-measurement, then validate the new
# table on held-out shapes, on a copy of results.db in OUT_DIR.
#   bash docs/experiments/h100_validate.sh OUT_DIR
set -euo pipefail
OUT_DIR=${1:?usage: bash docs/experiments/h100_validate.sh OUT_DIR}
mkdir -p "$OUT_DIR"
cp results.db "$OUT_DIR/results.db"
DB="sqlite:///$OUT_DIR/results.db"
normtune sweep --gpu h100 --shapes docs/experiments/wide-seed-shapes.txt --trials 45 --storage "$DB" \
  --compile-workers 12 --summary "$OUT_DIR/sweep-wide.json"
normtune emit --gpu h100 --db "$DB" --remeasure --out "$OUT_DIR/h100.json"
normtune validate --gpu h100 --shapes heldout --table "$OUT_DIR/h100.json" --trials 16 --db "$DB" \
  --out "$OUT_DIR/validate" --compile-workers 12
