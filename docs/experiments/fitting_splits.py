"""Row splits that fit the row, on a GPU: rows of 3, 5 or 7 times a power of two (5120, 7168, 10240, 12288,
14336) split into 3, 5, 6 or 7 power-of-two slices, against the shipped table's config and the analytic default,
timed cold-L2 in one process. A split of 2, 4 or 8 leaves a quarter or more of such a row's tile lanes masked.
Prints one line per config (total, kernel_1, kernel_2, fraction of the copy floor) and writes JSON lines.

    python docs/experiments/fitting_splits.py OUT_DIR [--cases layer_norm:4096x12288,...] [--variants …] [--tag …]
"""

from __future__ import annotations

import os
import sys

from normtune.kernels.config import BackwardConfig, Kernel2Config, Problem, default_config, kernel_1_config
from normtune.kernels.heuristics import row_block_col
from normtune.kernels.select.select import select_config
from normtune.tuner.space import fitting_split

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from variant_timing import run  # noqa: E402

CASES = ("layer_norm:4096x12288,layer_norm:16384x12288,rms_norm:4096x12288,rms_norm:16384x12288,"
         "layer_norm:1500x10240,layer_norm:4096x14336,layer_norm:4096x5120,rms_norm:4096x7168")
SPLITS = (3, 5, 6, 7)
# (tile elements, num_warps, programs_per_sm): one slice's width, as many rows as make the tile that big (each
# tile pays one exchange of row sums between the group's programs, so short tiles are latency bound), dw/db per
# column, the raw tile kept.
TILES = ((8192, 8, 1), (16384, 8, 1), (16384, 16, 1), (32768, 16, 1), (8192, 8, 2))
EARLY = Kernel2Config(block_m=128, block_n=32, num_warps=4, pdl=True)


def variants(p: Problem, device_name: str) -> dict[str, BackwardConfig]:
    table = select_config(p, device_name)
    out = {"table": table, "default": default_config(p)}
    for split in (s for s in SPLITS if fitting_split(p.N, s)):
        width = row_block_col(p.N, split)
        for elements, warps, per_sm in TILES:
            block_row = max(1, elements // width)
            k1 = kernel_1_config(block_row=block_row, block_col=width, num_warps=warps, programs_per_sm=per_sm,
                               eviction_policy="evict_first", recompute=True, row_split=split,
                               column_accumulators=True)
            name = f"split{split} {block_row}x{width} w{warps}{f' {per_sm}/SM' if per_sm > 1 else ''}"
            out[name] = BackwardConfig(k1, EARLY)
    return {name: cfg for name, cfg in out.items() if cfg.is_valid(p)}


if __name__ == "__main__":
    sys.exit(run("fitting_splits", variants, CASES, __doc__))
