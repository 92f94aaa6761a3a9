"""Wide rows on a GPU: the shipped table's config, the analytic default and single-pass variants (row_split 1-8,
row tiles of 1-8 rows, dw/db accumulated per tile element or per column) on wide LayerNorm/RMSNorm shapes, timed cold-L2 in one process.
Prints one line per config (total, kernel_1, kernel_2, fraction of the copy floor) and writes JSON lines.

    python docs/experiments/wide_rows.py OUT_DIR [--cases layer_norm:2048x16384,rms_norm:4096x32768,...]
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import sys

from normtune.kernels.config import BackwardConfig, Problem, default_config, kernel_1_config
from normtune.kernels.heuristics import MAX_SINGLE_PASS, max_warps, row_block_col, slice_width
from normtune.kernels.select.select import select_config

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from variant_timing import run  # noqa: E402

CASES = ("layer_norm:2048x16384,layer_norm:1024x16384,layer_norm:512x16384,layer_norm:4096x32768,"
         "rms_norm:4096x32768,rms_norm:2048x16384")


def variants(p: Problem, device_name: str) -> dict[str, BackwardConfig]:
    table = select_config(p, device_name)
    out = {"table": table, "default": default_config(p)}
    k2 = table.kernel_2 if table.kernel_1.strategy == "rows" else out["default"].kernel_2
    for split, block_row, colacc in itertools.product((1, 2, 4, 8), (1, 2, 4, 8), (False, True)):
        width = row_block_col(p.N, split)
        if width > MAX_SINGLE_PASS or (split > 1 and slice_width(p.N, split) < 256) or (colacc and block_row == 1):
            continue
        tile = block_row * width
        for warps in sorted({min(16, max_warps(tile)), min(32, max_warps(tile))}):
            k1 = kernel_1_config(block_row=block_row, block_col=width, num_warps=warps, programs_per_sm=1,
                               eviction_policy="evict_first", prefetch=True, row_split=split,
                               column_accumulators=colacc)
            for cand in (k1, dataclasses.replace(k1, prefetch=False, recompute=True)):
                cfg = BackwardConfig(cand, k2)
                if cfg.is_valid(p):
                    name = (f"split{split} {block_row}x{width} w{warps}{' colacc' if colacc else ''}"
                            f"{' recompute' if cand.recompute else ''}")
                    out[name] = cfg
                    break
    return out


if __name__ == "__main__":
    sys.exit(run("wide_rows", variants, CASES, __doc__))
