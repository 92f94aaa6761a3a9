#!/usr/bin/env bash
# A table round on a CUDA host, on a copy of results.db in OUTDIR:
#   sweep     each shape set with the current search space (new studies when the space grew),
#   emit      the table again from the runs it was fitted on plus every sweep of these sets on this GPU (earlier
#             rounds' too: a resumed study keeps its earlier trials under their own runs), with neighbour re-measurement,
#             keeping the shipped table's config wherever the new winner is not faster beyond the spread,
#   compare   the new table against the shipped one, head to head, on the seed and held-out shapes and on
#             each swept set (OUTDIR/compare-SET.md; OUTDIR/compare-failed lists the sets that failed the gate),
#   validate  that table on the held-out shapes, both norms (unseeded reference sweeps, resumed when stored),
#   bench     it against the peers on the seed shapes and on each swept set.
#
#   bash docs/experiments/shapes_round.sh GPU_KEY OUTDIR SHAPE_SETS [SWEEP_SECONDS] [TRIALS] [PEERS] [STEPS]
#
# SHAPE_SETS: comma list of presets or shape files (e.g. docs/experiments/wide-rows-shapes.txt,llm); each set
# gets SWEEP_SECONDS (default 240). STEPS: comma list of sweep, emit, compare, validate, bench (default: all); a
# later step without its earlier ones uses what OUTDIR already holds (OUTDIR/GPU_KEY.json).
set -euo pipefail
USAGE="usage: bash docs/experiments/shapes_round.sh GPU_KEY OUTDIR SHAPE_SETS [SWEEP_SECONDS] [TRIALS] [PEERS] [STEPS]"
GPU=${1:?$USAGE}
OUTDIR=${2:?$USAGE}
SETS=${3:?$USAGE}
SECONDS_BUDGET=${4:-240}
TRIALS=${5:-30}
PEERS=${6:-all}
STEPS=",${7:-sweep,emit,compare,validate,bench},"
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
[ -f "$OUTDIR/results.db" ] || cp results.db "$OUTDIR/results.db"
DB="sqlite:///$OUTDIR/results.db"
export PYTHONUNBUFFERED=1
step() { [[ "$STEPS" == *",$1,"* ]]; }
with_swept() {  # the given sets, then each swept set once (a set named twice, or one given, comes once)
    local out=" $* "
    for SET in ${SETS//,/ }; do [[ "$out" == *" $SET "* ]] || out="$out$SET "; done
    echo $out
}
sql() { python -c "import sqlite3,sys; print(sqlite3.connect(sys.argv[1]).execute(sys.argv[2]).fetchone()[0])" \
    "$OUTDIR/results.db" "$1"; }

if step sweep; then
    FIRST=$(sql "SELECT coalesce(max(id), 0) FROM normtune_runs")
    for SET in ${SETS//,/ }; do
        normtune sweep --gpu "$GPU" --shapes "$SET" --trials "$TRIALS" --time-budget "$SECONDS_BUDGET" \
            --db "$DB" --summary "$OUTDIR/sweep-$(basename "$SET" .txt).json" 2>&1 | grep -v "━" | tail -4
    done
    sql "SELECT group_concat(id) FROM normtune_runs WHERE kind = 'sweep' AND id > $FIRST" > "$OUTDIR/sweep-runs"
fi
runs_to_fit() {  # the shipped table's runs, every earlier sweep of the given sets on this GPU, and this round's
    local runs found
    runs=$(python -c "import json,sys; print(','.join(str(r) for r in json.load(open(sys.argv[1]))['provenance']['runs']))" \
        "configs/$GPU.json")
    for SET in ${SETS//,/ }; do  # a resumed study's earlier trials were stored under the run that measured them
        found=$(sql "SELECT group_concat(id) FROM normtune_runs WHERE kind = 'sweep' AND gpu_key = '$GPU'
                   AND command_line LIKE 'normtune sweep %--shapes $SET %'")
        [ "$found" = None ] || runs="$runs,$found"
    done
    [ -s "$OUTDIR/sweep-runs" ] && runs="$runs,$(cat "$OUTDIR/sweep-runs")"
    python -c "import sys; print(','.join(map(str, sorted({int(r) for r in sys.argv[1].split(',') if r}))))" "$runs"
}
if step emit; then
    RUNS=$(runs_to_fit)
    echo "fitting on runs $RUNS"
    normtune emit --gpu "$GPU" --db "$DB" --runs "$RUNS" --remeasure --keep "configs/$GPU.json" \
        --out "$OUTDIR/$GPU.json" 2>&1 | tail -12
fi
TABLE="$OUTDIR/$GPU.json"
[ -f "$TABLE" ] || TABLE="configs/$GPU.json"
if step compare; then
    : > "$OUTDIR/compare-failed"
    for SET in $(with_swept seed heldout); do
        NAME=$(basename "$SET" .txt)
        if normtune compare "configs/$GPU.json" "$TABLE" --gpu "$GPU" --shapes "$SET" > "$OUTDIR/compare-$NAME.md" \
            2> "$OUTDIR/compare-$NAME.log"; then :; else echo "$NAME" >> "$OUTDIR/compare-failed"; fi
        tail -1 "$OUTDIR/compare-$NAME.md"
    done
fi
if step validate; then
    for NORM in rms_norm layer_norm; do
        normtune validate --gpu "$GPU" --norm "$NORM" --shapes heldout --table "$TABLE" --trials 40 --db "$DB" \
            --out "$OUTDIR/validate-$NORM" --compile-workers 14 2>&1 | grep -v "━" | tail -4
    done
fi
if step bench; then
    for SET in $(with_swept seed); do
        NORMTUNE_CONFIG="$TABLE" normtune bench --gpu "$GPU" --shapes "$SET" --peers "$PEERS" --config table \
            --out "$OUTDIR/bench-$(basename "$SET" .txt)" --db "$DB" --budget 0.2 2>&1 | grep -v "━" | tail -3
    done
fi
