#!/usr/bin/env bash
# Sweep throughput on 1 GPU vs 2 (vs 4 when present) GPUs of one host: the same problems and trials, a fresh
# database each time; writes OUTDIR/sweep_scaling.md (the table) and one log and database per GPU count.
#
#   bash docs/experiments/sweep_scaling.sh OUTDIR [SHAPES] [TRIALS] [GPU_KEY]
#
# Defaults: the seed shapes, 20 trials per problem, --gpu auto. Run it on an idle CUDA host with normtune
# installed (`pip install -e ".[tune]"`); the figures to record in docs/perf-notes.md are the trials/s column
# and the speedup over one GPU (target: >= 1.8x on 2 GPUs, >= 3.4x on 4).
set -euo pipefail
OUTDIR=${1:?usage: bash docs/experiments/sweep_scaling.sh OUTDIR [SHAPES] [TRIALS] [GPU_KEY]}
SHAPES=${2:-seed}
TRIALS=${3:-20}
GPU=${4:-auto}
PY=${PYTHON:-python3}
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())")
[ "$NGPU" -ge 1 ] || { echo "sweep_scaling.sh: no CUDA GPU visible" >&2; exit 1; }

TABLE="$OUTDIR/sweep_scaling.md"
{
    echo "# Sweep scaling: trials per second on 1 vs several GPUs of one host"
    echo
    echo "\`normtune sweep --gpu $GPU --shapes $SHAPES --trials $TRIALS --devices …\`, a fresh SQLite database per row;"
    echo "GPU: $(nvidia-smi --query-gpu=name --format=csv,noheader -i 0 2>/dev/null || echo unknown) x $NGPU visible."
    echo
    echo "Wall: the whole command (process start-up included). Steady: first to last stored measurement."
    echo
    echo "| GPUs | devices | trials measured | wall s | trials/s | speedup vs 1 GPU | steady trials/s | steady speedup |"
    echo "|---:|---|---:|---:|---:|---:|---:|---:|"
} >"$TABLE"

BASE=""
for n in 1 2 4; do
    [ "$n" -le "$NGPU" ] || continue
    devices=$(seq -s, 0 $((n - 1)))
    db="$OUTDIR/scaling-${n}gpu.db"
    rm -f "$db" "$db-wal" "$db-shm"
    start=$(date +%s.%N)
    normtune sweep --gpu "$GPU" --shapes "$SHAPES" --trials "$TRIALS" --devices "$devices" --db "$db" \
        >"$OUTDIR/scaling-${n}gpu.log" 2>&1 || { echo "sweep on $n GPU(s) failed: see $OUTDIR/scaling-${n}gpu.log" >&2; exit 1; }
    end=$(date +%s.%N)
    row=$("$PY" - "$n" "$devices" "$db" "$start" "$end" "$BASE" <<'PYEOF'
import datetime as dt
import sqlite3
import sys
n, devices, db, start, end, base = sys.argv[1:7]
measured, first, last = sqlite3.connect(db).execute(
    "SELECT COUNT(*), MIN(created_at), MAX(created_at) FROM normtune_measurements").fetchone()
wall = float(end) - float(start)
rate = measured / wall
span = (dt.datetime.fromisoformat(last) - dt.datetime.fromisoformat(first)).total_seconds()
steady = (measured - 1) / span if span > 0 else float("nan")
base_rate, base_steady = (float(v) for v in base.split(",")) if base else (rate, steady)
print(f"{rate:.4f},{steady:.4f}||| {n} | {devices} | {measured} | {wall:.0f} | {rate:.2f} | "
      f"{rate / base_rate:.2f}x | {steady:.2f} | {steady / base_steady:.2f}x |")
PYEOF
)
    [ -n "$BASE" ] || BASE=${row%%||*}
    echo "${row#*||}" >>"$TABLE"
done
echo >>"$TABLE"
echo "wrote $TABLE"
cat "$TABLE"
