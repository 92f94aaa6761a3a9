#!/usr/bin/env bash
# Sweep throughput and where its wall clock goes, on 1 GPU and on several GPUs of one host: the same command and
# problems, a fresh SQLite database per run. Writes OUTDIR/sweep_scaling.md (the table, the ratios and every
# worker's breakdown) and one log and database per GPU count, and prints the table.
#
#   bash docs/experiments/sweep_scaling.sh OUTDIR [SHAPES] [TRIALS] [GPU_KEY] [GPU_COUNTS]
#
# Defaults: the seed shapes with both norms (30 problems), 30 trials per problem, --gpu auto, GPU counts "1 2 4"
# and every visible GPU (those the host has). Smaller runs: TRIALS 12 (the first round only), or SHAPES
# 4096x4096,8192x8192. Run it on an idle CUDA host with normtune installed (`pip install -e ".[tune]"`).
#
# Per run: wall (the whole command, process start-up included), trials measured, trials/s over the wall and
# between the first and last measurement stored (the rate once the GPUs measure), the first and last
# measurement's times after the command started (NORMTUNE_GIT_REVISION, where set, names the tree measured), the
# GPU measuring share (the measuring processes' busy seconds over the GPUs' wall after their start-up), the
# command's closing steps (from its log), and per worker the breakdown the sweep stores with its run
# (start-up; measuring: inputs, load, gate, timing; the worker's sampler, database, compile wait, heartbeats; the
# measuring process's idle time). Targets (issue 42): 1 GPU, 30 problems x 30 trials: wall <= 70 s, measuring
# >= 80 % of the wall after the first measurement, first measurement <= 5 s; 2 GPUs >= 1.85x and 4 GPUs >= 3.4x
# the trials/s of one (4 GPUs on 60 trials).
#
# FRESH_TRITON_CACHE=1 gives each run an empty Triton cache of its own (OUTDIR/triton-cache-Ngpu), so that every
# GPU count compiles from scratch as the first run on a fresh host does; by default the runs share the user's
# cache and only the first starts cold.
set -euo pipefail
OUTDIR=${1:?usage: bash docs/experiments/sweep_scaling.sh OUTDIR [SHAPES] [TRIALS] [GPU_KEY] [GPU_COUNTS]}
SHAPES=${2:-seed}
TRIALS=${3:-30}
GPU=${4:-auto}
PY=${PYTHON:-python3}
NT=${NORMTUNE:-normtune}
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())")
[ "$NGPU" -ge 1 ] || { echo "sweep_scaling.sh: no CUDA GPU visible" >&2; exit 1; }
COUNTS=${5:-"1 2 4 $NGPU"}
COUNTS=$(for n in $COUNTS; do [ "$n" -le "$NGPU" ] && echo "$n"; done | sort -n -u | tr '\n' ' ')

TABLE="$OUTDIR/sweep_scaling.md"
{
    echo "# Sweep scaling: 1 vs several GPUs of one host"
    echo
    echo "\`$NT sweep --gpu $GPU --shapes $SHAPES --trials $TRIALS --devices …\`, a fresh SQLite database per row;"
    echo "GPU: $(nvidia-smi --query-gpu=name --format=csv,noheader -i 0 2>/dev/null || echo unknown) x $NGPU visible;"
    echo "Triton cache: $([ "${FRESH_TRITON_CACHE:-0}" = 1 ] && echo "empty for every run" || echo "shared by the runs (only the first starts cold)");"
    echo "normtune $("$PY" -c 'import normtune; print(getattr(normtune, "__version__", "?"))'),  tree of ${NORMTUNE_GIT_REVISION:-$(git rev-parse --short HEAD 2>/dev/null || echo 'unknown')}."
    echo
    echo "| GPUs | trials | wall s | trials/s | vs 1 GPU | trials/s measuring | vs 1 GPU | first measurement s | last s | measuring share |"
    echo "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
} >"$TABLE"
BREAKDOWN="$OUTDIR/breakdown.txt"
: >"$BREAKDOWN"

BASE=""
for n in $COUNTS; do
    devices=$(seq -s, 0 $((n - 1)))
    db="$OUTDIR/scaling-${n}gpu.db"
    rm -f "$db" "$db-wal" "$db-shm"
    if [ "${FRESH_TRITON_CACHE:-0}" = 1 ]; then
        rm -rf "$OUTDIR/triton-cache-${n}gpu"
        export TRITON_CACHE_DIR="$OUTDIR/triton-cache-${n}gpu"
    fi
    start=$(date +%s.%N)
    if [ "$n" -eq 1 ]; then dev=(--device 0); else dev=(--devices "$devices"); fi
    COLUMNS=200 "$NT" sweep --gpu "$GPU" --shapes "$SHAPES" --trials "$TRIALS" "${dev[@]}" --db "$db" \
        >"$OUTDIR/scaling-${n}gpu.log" 2>&1 || { echo "sweep on $n GPU(s) failed: see $OUTDIR/scaling-${n}gpu.log" >&2; exit 1; }
    end=$(date +%s.%N)
    row=$("$PY" - "$n" "$db" "$start" "$end" "$BASE" "$BREAKDOWN" "$OUTDIR/scaling-${n}gpu.log" <<'PYEOF'
import datetime as dt
import json
import sqlite3
import sys

n, db, start, end, base, breakdown, log = sys.argv[1:8]
start, end = float(start), float(end)
con = sqlite3.connect(db)
measured, first, last = con.execute(
    "SELECT COUNT(*), MIN(created_at), MAX(created_at) FROM normtune_measurements").fetchone()
stamp = lambda text: dt.datetime.fromisoformat(text).replace(tzinfo=dt.timezone.utc).timestamp() - start
first_s, last_s = stamp(first), stamp(last)
wall = end - start
rate = measured / wall
# Between the first and the last measurement stored: the rate once every GPU is measuring, start-up and the
# command's end left out.
steady = (measured - 1) / (last_s - first_s) if last_s > first_s else float("nan")
bases = base.split(",") if base else [rate, steady]
base_rate, base_steady = float(bases[0]), float(bases[1])
closing = ""
for text in open(log, errors="replace"):
    if "closing steps since the command started:" in text:
        closing = text.split("started:", 1)[1].strip()
costs = [json.loads(c) for (c,) in con.execute("SELECT costs_json FROM normtune_run_costs ORDER BY run_id")]
busy = sum(c["measuring_s"] for c in costs)
after = sum(c["wall_s"] - c["startup_s"] for c in costs)
share = f"{100 * busy / after:.0f} %" if after > 0 else "–"

from normtune.tuner.sweep import costs_line

with open(breakdown, "a") as fh:
    fh.write(f"{n} GPU(s): wall {wall:.1f} s, {measured} trials, {rate:.2f} trials/s; measurements stored from "
             f"{first_s:.1f} to {last_s:.1f} s; closing steps: {closing or '–'}; command ended {wall:.1f}\n")
    for i, c in enumerate(costs):
        fh.write(f"  worker {i}: {costs_line(c)}\n")
print(f"{rate:.6f},{steady:.6f}||| {n} | {measured} | {wall:.1f} | {rate:.2f} | {rate / base_rate:.2f}x | "
      f"{steady:.2f} | {steady / base_steady:.2f}x | {first_s:.1f} | {last_s:.1f} | {share} |")
PYEOF
)
    [ -n "$BASE" ] || BASE=${row%%||*}
    echo "${row#*||}" >>"$TABLE"
done
{
    echo
    echo "Where each worker's wall clock went (stored with its run; \`normtune status\` shows the same):"
    echo
    echo '```'
    cat "$BREAKDOWN"
    echo '```'
} >>"$TABLE"
echo "wrote $TABLE"
cat "$TABLE"
