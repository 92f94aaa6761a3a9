#!/usr/bin/env bash
# On the H100 host: deepen the wide-row studies (new seed strategies), re-emit with neighbour re-measurement,
# then validate the new table on held-out shapes. Everything lands in $OUT.
set -u
source .whl/install.sh
export PYTHONUNBUFFERED=1 NORMTUNE_GIT_REVISION="${REV:-unknown}"
cp results.db "$OUT/results.db"
DB="sqlite:///$OUT/results.db"
normtune sweep --gpu h100 --shapes docs/experiments/wide-seed-shapes.txt --trials 45 --storage "$DB" \
  --compile-workers 12 --summary "$OUT/sweep-wide.json" 2>&1 | grep -E "trials,|^sweep:" | tail -14
normtune emit --gpu h100 --db "$DB" --remeasure --out "$OUT/h100.json" 2>&1 | tail -3
timeout "${VALIDATE_TIMEOUT:-330}" normtune validate --gpu h100 --shapes heldout --table "$OUT/h100.json" \
  --trials 16 --db "$DB" --out "$OUT/validate" --compile-workers 12 2>&1 | tail -34
