#!/usr/bin/env bash
# A table round for wide rows on a CUDA host, on a copy of results.db in OUTDIR: the wide-row shapes swept
# with the current search space (new studies when the space grew), the table re-emitted from the runs it was
# fitted on plus this sweep, then benched against the peers on the wide shapes and the seed shapes.
#
#   bash docs/experiments/wide_round.sh GPU_KEY OUTDIR [SWEEP_SECONDS] [TRIALS] [PEERS] [STEPS]
#
# STEPS: all (default), tune (sweep and emit) or bench (bench the table OUTDIR/GPU_KEY.json a tune step wrote).
set -euo pipefail
GPU=${1:?usage: bash docs/experiments/wide_round.sh GPU_KEY OUTDIR [SWEEP_SECONDS] [TRIALS] [PEERS]}
OUTDIR=${2:?usage: bash docs/experiments/wide_round.sh GPU_KEY OUTDIR [SWEEP_SECONDS] [TRIALS] [PEERS]}
SECONDS_BUDGET=${3:-240}
TRIALS=${4:-30}
PEERS=${5:-all}
STEPS=${6:-all}
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
[ -f "$OUTDIR/results.db" ] || cp results.db "$OUTDIR/results.db"
DB="sqlite:///$OUTDIR/results.db"
SHAPES=docs/experiments/wide-rows-shapes.txt
export PYTHONUNBUFFERED=1
if [ "$STEPS" != bench ]; then
normtune sweep --gpu "$GPU" --shapes "$SHAPES" --trials "$TRIALS" --time-budget "$SECONDS_BUDGET" \
    --db "$DB" --summary "$OUTDIR/sweep-summary.json" 2>&1 | grep -v "━" | tail -4
SWEEP_RUN=$(python -c "import sqlite3,sys; print(sqlite3.connect(sys.argv[1]).execute(
    \"SELECT max(id) FROM normtune_runs WHERE kind = 'sweep'\").fetchone()[0])" "$OUTDIR/results.db")
RUNS=$(python -c "import json,sys; print(','.join(str(r) for r in json.load(open(sys.argv[1]))['provenance']['runs']))" \
    "configs/$GPU.json")
normtune emit --gpu "$GPU" --db "$DB" --runs "$RUNS,$SWEEP_RUN" --remeasure --out "$OUTDIR/$GPU.json" 2>&1 | tail -3
fi
[ "$STEPS" = tune ] && exit 0
for SET in "$SHAPES" seed; do
    NAME=$([ "$SET" = seed ] && echo seed || echo wide)
    NORMTUNE_CONFIG="$OUTDIR/$GPU.json" normtune bench --gpu "$GPU" --shapes "$SET" --peers "$PEERS" --config table \
        --out "$OUTDIR/bench-$NAME" --db "$DB" --budget 0.2 2>&1 | grep -v "━" | tail -3
done
