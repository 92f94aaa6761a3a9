#!/usr/bin/env bash
# On an H200 host: sweep the 15 seed shapes x both norms (bf16), time-budgeted, then emit configs/h200.json
# with neighbour re-measurement. The database copy and the table land in $OUT.
set -u
source .whl/install.sh >/dev/null 2>&1
export PYTHONUNBUFFERED=1 NORMTUNE_GIT_REVISION="${REV:-unknown}"
cp results.db "$OUT/results.db"
DB="sqlite:///$OUT/results.db"
normtune sweep --gpu h200 --shapes seed --trials 24 --time-budget "${BUDGET:-300}" --storage "$DB" \
  --compile-workers 12 --summary "$OUT/sweep-h200.json" 2>&1 | grep -E "trials,|^sweep:|stopped" | tail -34
timeout 120 normtune emit --gpu h200 --db "$DB" --remeasure --out "$OUT/h200.json" 2>&1 | tail -3
