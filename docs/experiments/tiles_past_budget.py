"""Taller split-row tiles than the register estimate allows: the shipped table's config next to single-pass
row_split 2 and 4 configs with 2-8 rows per tile on 16 and 32 warps (recompute, dw/db per column, with and without
evict_first), the estimate's budget lifted in this process only, timed cold-L2 in one process against float64.
The question: does the estimate refuse tiles that would be faster (fewer row-sum exchanges per row)?

    python docs/experiments/tiles_past_budget.py OUT_DIR [--cases layer_norm:2048x16384,...]

Prints one line per config (total, kernel_1, kernel_2, fraction of the copy floor); writes JSON lines.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import normtune.kernels.config as config_module
from normtune.kernels.config import BackwardConfig, Problem
from normtune.kernels.select.select import select_config

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from variant_timing import run  # noqa: E402

CASES = "layer_norm:2048x16384,layer_norm:1024x16384,layer_norm:4096x16384"
config_module.register_budget = lambda num_warps: 10**6  # compile and time what the estimate refuses


def variants(p: Problem, device_name: str) -> dict[str, BackwardConfig]:
    table = select_config(p, device_name)
    out = {"table": table}
    for split in (2, 4):
        for rows, warps in ((2, 32), (4, 32), (8, 32), (4, 16)):
            for eviction in ("", "evict_first"):
                k1 = dataclasses.replace(table.kernel_1, row_split=split, block_col=p.N // split, block_row=rows,
                                         num_warps=warps, recompute=True, column_accumulators=True,
                                         eviction_policy=eviction, prefetch=False, num_stages=1, two_pass=False,
                                         strategy="rows")
                out[f"split{split} {rows}x{p.N // split} w{warps} {eviction or 'no hint'}"] = \
                    dataclasses.replace(table, kernel_1=k1)
    return out


if __name__ == "__main__":
    run("tiles_past_budget", variants, CASES, __doc__)
