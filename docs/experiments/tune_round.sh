#!/usr/bin/env bash
# Tune one GPU as if it were new (its shipped table hidden), from an empty database, then time the new table head
# to head against the shipped table and against the analytic default, on the `llm` set and the `heldout` preset
# (never swept, fitted or validated by tune), both norms, plain and fused residual:
#
#   bash docs/experiments/tune_round.sh GPU OUT [BUDGET_S] [PHASES]
#
# GPU: the key of the device (h100, h200); OUT: the output folder; BUDGET_S: tune's --time-budget (600);
# PHASES: comma list of tune, compare (both). Environment: TUNE_ARGS, more arguments for tune (e.g. "--from h100"
# for a warm start, "--devices 0,1" for two GPUs); BASES, the tables compared against ("shipped default").
# Writes OUT/tune.log, OUT/tune.db, OUT/GPU.json, OUT/report/ (with the
# time-to-table plot) and OUT/compare-{shipped,default}-{llm,heldout}-{plain,residual}.md.
set -euo pipefail
gpu=$1
out=$(mkdir -p "$2" && cd "$2" && pwd)
budget=${3:-600}
phases=${4:-tune,compare}
start=$(date +%s)
if [[ ,$phases, == *,tune,* ]]; then
  NORMTUNE_HOME="$out/home" normtune tune --gpu "$gpu" --as-new-gpu --time-budget "$budget" \
      --db "sqlite:///$out/tune.db" --out "$out/$gpu.json" --report "$out/report" ${TUNE_ARGS:-} 2>&1 | tee "$out/tune.log"
  echo "tune: $(( $(date +%s) - start )) s from the command's start" | tee -a "$out/tune.log"
fi
if [[ ,$phases, == *,compare,* ]]; then
  for base in ${BASES:-shipped default}; do
    old=configs/$gpu.json; [ "$base" = default ] && old=default
    for set in llm heldout; do
      for form in plain residual; do
        flag=(); [ "$form" = residual ] && flag=(--residual)
        # compare exits 1 where the new table is slower on a shape: the verdicts are in the file
        normtune compare "$old" "$out/$gpu.json" --gpu "$gpu" --shapes "$set" "${flag[@]}" \
            >"$out/compare-$base-$set-$form.md" || true
        echo "$base $set $form: $(tail -n 1 "$out/compare-$base-$set-$form.md")"
      done
    done
  done | tee "$out/compare-summary.txt"
fi
