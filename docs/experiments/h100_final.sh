#!/usr/bin/env bash
# On the H100 host (after staging quack): bench the shipped table (configs/h100.json, found by GPU name)
# against every peer on the 30 seed cases, and re-validate it on the held-out shapes. Results in $OUT.
set -u
source .whl/install.sh
export PYTHONUNBUFFERED=1 NORMTUNE_GIT_REVISION="${REV:-unknown}"
cp results.db "$OUT/results.db"
DB="sqlite:///$OUT/results.db"
timeout 300 normtune validate --gpu h100 --shapes heldout --trials 16 --db "$DB" --out "$OUT/validate" \
  --compile-workers 12 2>&1 | tail -4
timeout 280 normtune bench --gpu h100 --shapes seed --peers all --config table --out "$OUT/bench" --db "$DB" \
  --budget 0.3 2>&1 | grep -v "━" | tail -40
tar czf "$OUT/bench.tgz" -C "$OUT" bench && rm -rf "$OUT/bench"
