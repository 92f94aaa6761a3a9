#!/usr/bin/env bash
# On an H100 host: bench the shipped table (configs/h100.json, found by GPU name) against every peer on the 30
# seed cases, and re-validate it on the held-out shapes, on a copy of results.db in OUT_DIR.
#   bash docs/experiments/h100_final.sh OUT_DIR
set -euo pipefail
OUT_DIR=${1:?usage: bash docs/experiments/h100_final.sh OUT_DIR}
mkdir -p "$OUT_DIR"
cp results.db "$OUT_DIR/results.db"
DB="sqlite:///$OUT_DIR/results.db"
normtune validate --gpu h100 --shapes heldout --trials 16 --db "$DB" --out "$OUT_DIR/validate" \
  --compile-workers 12
normtune bench --gpu h100 --shapes seed --peers all --config table --out "$OUT_DIR/bench" --db "$DB" \
  --budget 0.3
