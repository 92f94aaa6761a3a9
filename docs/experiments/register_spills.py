"""What the compiler gives kernel_1 on a GPU: registers per thread and spilled values for single-pass row tiles
(row_split 1-8, 1-4 rows, 8/16/32 warps, prefetch and recompute on and off, kernel_2 separate or fused) next to
the register estimate the search space prunes with (`heuristics.estimate_registers`). Configs over the estimate's
budget are compiled too (the budget check is lifted in this process only): that is the point, to see where the
estimate is too strict or too loose. Compiles only, times nothing. Writes JSON lines.

    python docs/experiments/register_spills.py OUT_DIR [--cases layer_norm:2048x16384,...]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch

import normtune.kernels.config as config_module
from normtune.kernels import backward_launch as launch
from normtune.kernels.config import BackwardConfig, Kernel2Config, Problem, kernel_1_config
from normtune.kernels.heuristics import estimate_registers, register_budget, row_block_col, slice_width

CASES = "layer_norm:2048x16384,rms_norm:2048x16384,layer_norm:4096x32768,rms_norm:4096x32768,layer_norm:2048x8192"
TILES = ((1, 1, False), (2, 1, False), (2, 2, True), (4, 2, True), (4, 4, True), (8, 4, True))  # split, rows, colacc


def tiles(p: Problem):
    for split, block_row, colacc in TILES:
        width = row_block_col(p.N, split)
        if width > 16384 or (split > 1 and slice_width(p.N, split) < 256):
            continue
        for warps, prefetch, recompute in itertools.product((8, 16, 32), (False, True), (False, True)):
            yield kernel_1_config(block_row=block_row, block_col=width, num_warps=warps, programs_per_sm=1,
                                eviction_policy="evict_first", prefetch=prefetch, recompute=recompute,
                                row_split=split, column_accumulators=colacc)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out_dir", help="folder for register_spills.jsonl")
    ap.add_argument("--cases", default=CASES, help="comma-separated NORM:MxN")
    args = ap.parse_args()
    config_module.register_budget = lambda warps: 10**6  # compile what the space would prune, here only
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "register_spills.jsonl"), "w") as out:
        for item in args.cases.split(","):
            norm, shape = item.split(":")
            M, N = (int(v) for v in shape.split("x"))
            p = Problem(norm, M, N, "bf16", has_bias=norm == "layer_norm")
            for k1 in tiles(p):
                for fused in (False, True):
                    k2 = (Kernel2Config(block_m=32, block_n=128, num_warps=1, fused=True) if fused
                          else Kernel2Config(block_m=128, block_n=32, num_warps=4, pdl=True))
                    cfg = BackwardConfig(k1, k2)
                    if not cfg.is_valid(p):
                        continue
                    pl, (args, *_) = launch.compile_ahead_args(p, cfg, torch.device("cuda"))
                    step = pl.stage_1[0]
                    compiled = step.kernel.warmup(*args, grid=(1,), **step.kwargs)
                    compiled._init_handles()
                    est = estimate_registers(p, k1.block_row, k1.block_col, k1.num_warps, False, k1.prefetch,
                                             k1.recompute, k1.column_accumulators)
                    rec = dict(case=item, split=k1.row_split, br=k1.block_row, bc=k1.block_col, w=k1.num_warps,
                               pf=k1.prefetch, rc=k1.recompute, ca=k1.column_accumulators, fused=fused,
                               regs=int(compiled.n_regs), spills=int(compiled.n_spills), est=est,
                               budget=register_budget(k1.num_warps))
                    out.write(json.dumps(rec) + "\n")
                    out.flush()
                    print(f"{item:22s} {cfg}  regs {rec['regs']:3d} spills {rec['spills']:4d} est {est} "
                          f"(budget {rec['budget']})", flush=True)


if __name__ == "__main__":
    sys.exit(main())
