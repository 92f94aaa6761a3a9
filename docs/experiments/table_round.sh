#!/usr/bin/env bash
# One round of table work on a CUDA host, on a copy of results.db in OUTDIR:
#   sweep  the seed shapes with the current search space (time-budgeted; resumes the studies in results.db),
#   emit   OUTDIR/<gpu>.json from the sweep runs (never from validate or bench runs),
#   bench  that table against the peers on the seed cases (GPU time, kernel sums, host µs per call).
# Validation on the held-out shapes is a separate step (`normtune validate`), as is `normtune compare`.
#
#   bash docs/experiments/table_round.sh GPU_KEY OUTDIR [SWEEP_SECONDS] [DEVICES] [PEERS]
#
# Defaults: 240 s of sweeping on device 0, peers "all" (quack is skipped with a note when not installed).
set -euo pipefail
GPU=${1:?usage: bash docs/experiments/table_round.sh GPU_KEY OUTDIR [SWEEP_SECONDS] [DEVICES] [PEERS]}
OUTDIR=${2:?usage: bash docs/experiments/table_round.sh GPU_KEY OUTDIR [SWEEP_SECONDS] [DEVICES] [PEERS]}
SECONDS_BUDGET=${3:-240}
DEVICES=${4:-0}
PEERS=${5:-all}
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
[ -f "$OUTDIR/results.db" ] || cp results.db "$OUTDIR/results.db"
DB="sqlite:///$OUTDIR/results.db"
export PYTHONUNBUFFERED=1
normtune sweep --gpu "$GPU" --shapes seed --trials 80 --time-budget "$SECONDS_BUDGET" --devices "$DEVICES" \
    --db "$DB" --compile-workers 14 --summary "$OUTDIR/sweep-summary.json" 2>&1 | grep -v "━" | tail -6
normtune emit --gpu "$GPU" --db "$DB" --out "$OUTDIR/$GPU.json" 2>&1 | tail -3
NORMTUNE_CONFIG="$OUTDIR/$GPU.json" normtune bench --gpu "$GPU" --shapes seed --peers "$PEERS" --config table \
    --out "$OUTDIR/bench" --db "$DB" --budget 0.2 2>&1 | grep -v "━" | tail -45
