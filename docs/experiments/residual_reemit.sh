#!/usr/bin/env bash
# Ship a tune's fused residual families in a GPU's table, on a copy of results.db in OUTDIR:
#   merge      copy the runs the tune's table was fitted on from its database (`normtune merge --runs-of`),
#   remeasure  time the residual form on those runs' neighbour plan with the shipped table as the incumbent: its
#              configs (the plain rules the residual form borrows) on every fitted problem, and its fitted shapes
#              of those widths that no run measured (`emit --remeasure --keep`); run again after an interruption,
#              it times only what the earlier re-measurements did not,
#   emit       the table from the shipped table's runs, the merged ones and the re-measurement, keeping the shipped
#              table wherever the new winner is not faster beyond the spread (reads the database only: any machine),
#   compare    the new table against the shipped one head to head on `llm` and `heldout`, plain and residual, and
#              against the analytic default on `heldout` residual (OUTDIR/compare-failed lists what failed).
#
#   bash docs/experiments/residual_reemit.sh GPU_KEY OUTDIR TUNE_DB TUNED_TABLE [STEPS]
#
# STEPS: comma list of merge, remeasure, emit, compare (default: all). Each step reads what the earlier ones left
# in OUTDIR, so the steps can run apart (remeasure and compare need the GPU). Copy OUTDIR/GPU_KEY.json to configs/
# and OUTDIR/results.db back only when OUTDIR/compare-failed is empty.
set -euo pipefail
USAGE="usage: bash docs/experiments/residual_reemit.sh GPU_KEY OUTDIR TUNE_DB TUNED_TABLE [STEPS]"
GPU=${1:?$USAGE}
OUTDIR=${2:?$USAGE}
TUNE_DB=${3:?$USAGE}
TUNED=${4:?$USAGE}
STEPS=",${5:-merge,remeasure,emit,compare},"
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
[ -f "$OUTDIR/results.db" ] || cp results.db "$OUTDIR/results.db"
[ -f "$OUTDIR/shipped.json" ] || cp "configs/$GPU.json" "$OUTDIR/shipped.json"
DB="sqlite:///$OUTDIR/results.db"
export PYTHONUNBUFFERED=1
step() { [[ "$STEPS" == *",$1,"* ]]; }
sql() { python3 -c "import sqlite3,sys; print(sqlite3.connect(sys.argv[1]).execute(sys.argv[2]).fetchone()[0])" \
    "$OUTDIR/results.db" "$1"; }
remeasured() {  # the re-measurement runs made here: the emit runs after the merged ones
    local last=${MERGED##*,}
    local found
    found=$(sql "SELECT group_concat(id) FROM normtune_runs WHERE kind = 'emit' AND id > $last")
    [ "$found" = None ] || echo ",$found"
}

if step merge; then
    normtune merge --from "$TUNE_DB" --runs-of "$TUNED" --db "$DB" | tee "$OUTDIR/merge.log"
    tail -n 1 "$OUTDIR/merge.log" | sed 's/.*: //' > "$OUTDIR/merged-runs"
fi
MERGED=$(cat "$OUTDIR/merged-runs" 2>/dev/null || true)
[ -n "$MERGED" ] || ! { step remeasure || step emit; } || { echo "run the merge step first" >&2; exit 2; }
if step remeasure; then
    normtune emit --gpu "$GPU" --db "$DB" --runs "$MERGED$(remeasured)" --remeasure \
        --keep "$OUTDIR/shipped.json" --out "$OUTDIR/residual-only.json" 2>&1 | tee "$OUTDIR/remeasure.log"
fi
if step emit; then
    SHIPPED=$(python3 -c "import json,sys; print(','.join(map(str, json.load(open(sys.argv[1]))['provenance']['runs'])))" \
        "$OUTDIR/shipped.json")
    normtune emit --gpu "$GPU" --db "$DB" --runs "$SHIPPED,$MERGED$(remeasured)" \
        --keep "$OUTDIR/shipped.json" --out "$OUTDIR/$GPU.json" --force 2>&1 | tail -n 3
fi
if step compare; then
    : > "$OUTDIR/compare-failed"
    for set in llm heldout; do
        for form in plain residual; do
            flag=(); [ "$form" = residual ] && flag=(--residual)
            name="shipped-$set-$form"
            normtune compare "$OUTDIR/shipped.json" "$OUTDIR/$GPU.json" --gpu "$GPU" --shapes "$set" "${flag[@]}" \
                > "$OUTDIR/compare-$name.md" || echo "$name" >> "$OUTDIR/compare-failed"
            echo "$name: $(tail -n 1 "$OUTDIR/compare-$name.md")"
        done
    done
    normtune compare default "$OUTDIR/$GPU.json" --gpu "$GPU" --shapes heldout --residual \
        > "$OUTDIR/compare-default-heldout-residual.md" || echo default-heldout-residual >> "$OUTDIR/compare-failed"
    echo "default-heldout-residual: $(tail -n 1 "$OUTDIR/compare-default-heldout-residual.md")"
fi
