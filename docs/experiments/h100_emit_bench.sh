#!/usr/bin/env bash
# On an H100 host: complete the config x shape matrix, emit the table, and bench it against every peer, all on
# a copy of results.db in OUT_DIR (the table lands there too; copy it to configs/h100.json once checked).
#   bash docs/experiments/h100_emit_bench.sh OUT_DIR
set -euo pipefail
OUT_DIR=${1:?usage: bash docs/experiments/h100_emit_bench.sh OUT_DIR}
mkdir -p "$OUT_DIR"
cp results.db "$OUT_DIR/results.db"
DB="sqlite:///$OUT_DIR/results.db"
normtune emit --gpu h100 --db "$DB" --remeasure --out "$OUT_DIR/h100.json"
NORMTUNE_CONFIG="$OUT_DIR/h100.json" normtune bench --gpu h100 --shapes seed --peers all --config table \
  --out "$OUT_DIR/bench" --db "$DB" --budget 0.3
