"""The dual strategy on a GPU: few rows (64…2048) where one launch with row programs (grad_input) and column
programs (final dw/db) replaces kernel_1's partials and kernel_2. Times the shipped table's config, the analytic
default and dual configs (row tiles × column tiles) cold-L2 in one process against the float64 reference. Prints
one line per config (total, kernel_1, kernel_2, fraction of the copy floor) and writes JSON lines.

    python docs/experiments/dual_strategy.py OUT_DIR [--cases rms_norm:128x8192,...] [--variants …] [--tag …]
"""

from __future__ import annotations

import dataclasses
import os
import sys

from normtune.kernels.config import BackwardConfig, Kernel2Config, Problem, default_config
from normtune.kernels.select.select import select_config

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from variant_timing import run  # noqa: E402

CASES = ",".join(f"{norm}:{shape}" for norm in ("rms_norm", "layer_norm")
                 for shape in ("64x4096", "128x8192", "256x16384", "512x8192", "1024x8192"))
# (block_m, block_n): rows per step and columns per column program.
COLUMN_TILES = ((32, 64), (32, 128), (64, 64), (16, 256))


def variants(p: Problem, device_name: str) -> dict[str, BackwardConfig]:
    table = select_config(p, device_name)
    default = default_config(p)
    out = {"table": table, "default": default}
    row_tiles = {"default rows": default.kernel_1}
    if table.kernel_1.strategy == "rows" and not table.kernel_1.two_pass and table.kernel_1.row_split == 1:
        row_tiles["table rows"] = table.kernel_1
    for rows_name, k1 in row_tiles.items():
        for warps in sorted({k1.num_warps, 8 if k1.num_warps < 8 else 4}):
            dual = dataclasses.replace(k1, strategy="dual", recompute=False, column_accumulators=False,
                                       num_warps=warps)
            for block_m, block_n in COLUMN_TILES:
                name = f"dual {rows_name} {k1.block_row}x{k1.block_col} w{warps} cols {block_m}x{block_n}"
                out[name] = BackwardConfig(dual, Kernel2Config(block_m=block_m, block_n=block_n, num_warps=1))
    return {name: cfg for name, cfg in out.items() if cfg.is_valid(p)}


if __name__ == "__main__":
    sys.exit(run("dual_strategy", variants, CASES, __doc__))
