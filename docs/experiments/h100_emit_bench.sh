#!/usr/bin/env bash
# On the GPU host (after .whlq1/stage.sh): complete the config x shape matrix, emit the table, and bench it
# against every peer, all on the copy of results.db under $OUT. Everything lands in $OUT (few files).
set -u
source .whl/install.sh
export PYTHONUNBUFFERED=1 NORMTUNE_GIT_REVISION="${REV:-unknown}"
cp results.db "$OUT/results.db"
DB="sqlite:///$OUT/results.db"
normtune emit --gpu h100 --db "$DB" --remeasure --out "$OUT/h100.json" 2>&1 | tail -3
NORMTUNE_CONFIG="$OUT/h100.json" timeout "${BENCH_TIMEOUT:-420}" normtune bench --gpu h100 --shapes seed \
  --peers all --config table --out "$OUT/bench" --db "$DB" --budget 0.3 2>&1 | grep -v "━" | tail -45
tar czf "$OUT/bench.tgz" -C "$OUT" bench && rm -rf "$OUT/bench"
