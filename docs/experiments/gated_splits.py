"""Gated RMSNorm rows of 5 times a power of two (5120 columns), on a GPU: a single-pass tile padded to the next
power of two (what the gated tune's table runs: 8192 lanes for 5120 columns, x, z and dy staged through shared
memory), against rows split into five 1024-column slices (no lane masked; each tile pays one exchange of row
sums between the group's five programs) and two-pass walks of 1024-column chunks, timed cold-L2 in one process
against the float64 reference. Prints one line per config (total, kernel_1, kernel_2, fraction of the copy floor)
and writes JSON lines.

Padded tiles of one and two rows on 4-32 warps, pipelined 1-4 stages deep, are timed beside them.

    python docs/experiments/gated_splits.py OUT_DIR [--cases rms_norm/gate-after:8192x5120,...] [--variants …]
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

CASES = "rms_norm/gate-after:8192x5120,rms_norm/gate-after:32768x5120,rms_norm/gate-after:2048x5120"
# Split tiles: (block_row, num_warps, programs_per_sm, num_stages, pipelined exchange).
SPLIT_TILES = ((1, 4, 4, 1, False), (2, 4, 4, 1, False), (4, 8, 2, 1, False), (8, 8, 1, 1, False),
               (16, 16, 1, 1, False), (2, 4, 4, 3, True), (4, 8, 2, 3, True), (4, 4, 3, 2, True),
               (8, 8, 1, 2, True))
# Padded single-pass tiles (block_col: the next power of two): (block_row, num_warps, num_stages, prefetch,
# column accumulators, programs_per_sm): taller tiles (the raw tile kept: recompute) keep more useful bytes in flight.
PADDED_TILES = ((1, 16, 3, False, True, 1), (1, 16, 2, False, False, 1), (1, 8, 3, False, False, 1),
                (1, 32, 3, False, False, 1), (1, 16, 4, False, False, 1), (2, 16, 2, False, True, 1),
                (2, 32, 2, False, True, 1), (2, 16, 1, True, True, 1), (2, 32, 1, True, True, 1),
                (1, 8, 2, False, False, 2), (1, 16, 1, False, True, 2), (1, 4, 2, False, True, 2))
# Two-pass tiles: (block_row, num_warps, programs_per_sm, num_stages).
TWO_PASS_TILES = ((1, 4, 4, 1), (2, 4, 4, 1), (4, 8, 2, 1), (2, 4, 4, 3), (4, 8, 2, 3))
EARLY = Kernel2Config(block_m=128, block_n=32, num_warps=4, pdl=True)


def variants(p: Problem, device_name: str) -> dict[str, BackwardConfig]:
    out = {"table": select_config(p, device_name), "default": default_config(p)}
    for split in (s for s in (3, 5, 6, 7) if fitting_split(p.N, s)):
        width = row_block_col(p.N, split)
        for block_row, warps, per_sm, stages, piped in SPLIT_TILES:
            for recompute in (False, True):
                k1 = kernel_1_config(block_row=block_row, block_col=width, num_warps=warps, programs_per_sm=per_sm,
                                     num_stages=stages, eviction_policy="evict_first", recompute=recompute,
                                     row_split=split, column_accumulators=True, pipelined_split=piped)
                name = (f"split{split} {block_row}x{width} w{warps} s{stages}{' piped' if piped else ''} "
                        f"{per_sm}/SM{' recompute' if recompute else ''}")
                out[name] = BackwardConfig(k1, EARLY)
    for block_row, warps, stages, prefetch, colacc, per_sm in PADDED_TILES:
        for eviction in ("evict_first", ""):
            k1 = kernel_1_config(block_row=block_row, block_col=row_block_col(p.N), num_warps=warps,
                                 num_stages=stages, prefetch=prefetch, column_accumulators=colacc,
                                 programs_per_sm=per_sm, eviction_policy=eviction, recompute=block_row > 1)
            name = (f"padded {block_row}x{row_block_col(p.N)} w{warps} s{stages}{' prefetch' if prefetch else ''}"
                    f"{' colacc' if colacc else ''}{' recompute' if block_row > 1 else ''} {per_sm}/SM"
                    f"{' ' + eviction if eviction else ''}")
            out[name] = BackwardConfig(k1, EARLY)
    chunk = 1024
    if p.N % chunk == 0:
        for block_row, warps, per_sm, stages in TWO_PASS_TILES:
            k1 = kernel_1_config(block_row=block_row, block_col=chunk, num_warps=warps, programs_per_sm=per_sm,
                                 num_stages=stages, two_pass=True)
            out[f"2pass {block_row}x{chunk} w{warps} s{stages} {per_sm}/SM"] = BackwardConfig(k1, EARLY)
    return {name: cfg for name, cfg in out.items() if cfg.is_valid(p)}


if __name__ == "__main__":
    sys.exit(run("gated_splits", variants, CASES, __doc__))
