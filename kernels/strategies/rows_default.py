"""The rows strategy's analytic default (`Rows.default`, after the columns strategy's, for rows too wide for one
pass): `strategy` is the rows strategy, whose `make` builds its configs."""

from __future__ import annotations

import dataclasses

from .capabilities import checked
from ..heuristics import (MAX_COLUMNS_ROWS, MAX_SINGLE_PASS, ROW_SPLITS, ROW_TILE_ELEMENTS, SPLIT_SLICE,
                          WIDE_DEFAULT_MIN_ROWS, WIDE_FP32_SLICE, estimate_registers, gated, hardware_registers, max_warps,
                          next_power_of_two, row_block_col, slice_width, wide_fp32_rows)
from ..knobs import Kernel2Config
from ..limits import DeviceLimits
from ..problem import Problem
from .base import fit
from .configs import BackwardConfig


def default(strategy, problem: Problem, lim: DeviceLimits) -> BackwardConfig:
    """Rules that keep a streaming kernel's loads in flight without spilling registers (the measurements
    behind them: docs/perf-notes.md):

    - single pass while a whole row fits the register tile (next_pow2(N) <= MAX_SINGLE_PASS); wider rows from
      MAX_COLUMNS_ROWS rows split over programs in SPLIT_SLICE-column slices (16-bit data), else two-pass on
      4096-column chunks on 8 warps;
    - fp32 rows of 8193-16384 columns from WIDE_DEFAULT_MIN_ROWS rows: the fewest slices of at most
      WIDE_FP32_SLICE columns, 2-row tiles, prefetch, dw/db per column;
    - 16-bit rows of 8193-16384 columns from WIDE_DEFAULT_MIN_ROWS rows: LayerNorm in 4 slices of 4-row tiles,
      dw/db per column, 3 stages through the pipelined exchange; RMSNorm prefetch with recompute;
    - otherwise block_row fills the tile up to ROW_TILE_ELEMENTS (up to 64 rows), num_warps 8 up to 2048-column
      rows and 16 from 4096, prefetch wherever its registers fit, else recompute for 16-bit LayerNorm with a
      bias; evict_first, one program per SM;
    - kernel_2: many programs of narrow columns and tall tiles (128x16), PDL off.

    Every candidate is sized by the device's registers, shared memory and warps (`lim`), and taken in its
    portable form (`fit`).
    """
    n_pow2 = next_power_of_two(problem.N)
    two_pass = n_pow2 > MAX_SINGLE_PASS
    tail = Kernel2Config(block_m=128, block_n=16, num_warps=4)
    split = next((s for s in (2, 4, 8) if slice_width(problem.N, s) <= SPLIT_SLICE), 0) if two_pass else 0
    if split and problem.M > MAX_COLUMNS_ROWS and problem.itemsize == 2:
        # Many 16-bit rows too wide for one pass: slices keeping the raw tile, dw/db per column so that 2-4-row
        # tiles fit.
        split_k1 = strategy.make(block_row=2 if problem.has_bias else 4, block_col=row_block_col(problem.N, split),
                             num_warps=16, programs_per_sm=1, eviction_policy="evict_first", recompute=True,
                             row_split=split, column_accumulators=True)
        for k1 in (split_k1, dataclasses.replace(split_k1, block_row=1)):
            if config := fit(BackwardConfig(k1, tail), problem, lim):
                return config
    if wide_fp32_rows(problem):
        split = next(s for s in ROW_SPLITS[1:] if row_block_col(problem.N, s) <= WIDE_FP32_SLICE)
        wide = BackwardConfig(
            strategy.make(block_row=2, block_col=row_block_col(problem.N, split), num_warps=16, num_stages=1,
                      programs_per_sm=1, eviction_policy="", prefetch=True, row_split=split,
                      column_accumulators=True),
            Kernel2Config(block_m=64, block_n=16, num_warps=4, pdl=True))
        if config := fit(wide, problem, lim):
            return config
    wide_16_bit = n_pow2 == MAX_SINGLE_PASS and problem.itemsize == 2 and problem.M >= WIDE_DEFAULT_MIN_ROWS
    if wide_16_bit and problem.norm == "layer_norm":
        wide = BackwardConfig(
            strategy.make(block_row=4, block_col=row_block_col(problem.N, 4), num_warps=8, num_stages=3,
                      programs_per_sm=1, eviction_policy="", row_split=4, column_accumulators=True,
                      pipelined_split=True),
            Kernel2Config(block_m=64, block_n=16, num_warps=1, pdl=True))
        if config := fit(wide, problem, lim):
            return config
    block_col = 4096 if two_pass else n_pow2
    block_row = 1 if two_pass else max(1, min(64, ROW_TILE_ELEMENTS // block_col))
    tile = block_row * block_col
    num_warps = 8 if two_pass else (16 if block_col >= 4096 else max(4, min(8, tile // 1024)))
    num_warps = min(num_warps, max_warps(tile, lim))
    prefetch = estimate_registers(problem, block_row, block_col, num_warps, two_pass, True,
                                  warp_size=lim.warp_size) <= hardware_registers(num_warps, lim)
    # Where prefetch does not fit (one-row tiles of 16384 columns), 16-bit LayerNorm rows with a bias (two
    # accumulators) keep their raw tile across the reductions instead of fp32 copies (recompute).
    recompute = (not two_pass and not prefetch and problem.itemsize == 2 and block_row == 1
                 and bool(problem.has_bias))
    if wide_16_bit and not prefetch and problem.norm == "rms_norm":
        prefetch = recompute = True  # prefetch fits once the raw tile is kept across the reductions
    # A gated tile without prefetch pipelines its loads (x, dy and z) through shared memory instead.
    stages = 3 if gated(problem) and not (prefetch or two_pass or recompute) else 1
    k1 = strategy.make(block_row=block_row, block_col=block_col, num_warps=num_warps, num_stages=stages,
                   programs_per_sm=1, two_pass=two_pass, eviction_policy="evict_first", prefetch=prefetch,
                   recompute=recompute)
    block_n, block_m = min(16, n_pow2), 128
    k2 = Kernel2Config(block_m=block_m, block_n=block_n,
                       num_warps=max(1, min(4, (block_m * block_n) // lim.warp_size)))
    # Where the register estimate rejects the plain tile (e.g. LayerNorm recovering x̂ from y with a bias at
    # N=16384 also holds the bias row), keep the raw tile instead (recompute), then more warps, then two-pass.
    # A staged (gated) tile past the device's shared memory takes fewer stages; the last resort is two-pass, on
    # as many of its 8 warps as the chunk keeps busy.
    chunk = min(4096, block_col)
    candidates = [k1, dataclasses.replace(k1, recompute=problem.itemsize == 2),
                  dataclasses.replace(k1, recompute=problem.itemsize == 2,
                                      num_warps=min(lim.max_warps, 2 * num_warps)),
                  *(dataclasses.replace(k1, num_stages=s) for s in range(stages - 1, 0, -1)),
                  strategy.make(block_row=1, block_col=chunk, num_warps=min(8, max_warps(chunk, lim)),
                                programs_per_sm=1, two_pass=True, eviction_policy="evict_first", prefetch=True)]
    for cand in candidates:
        if config := fit(BackwardConfig(cand, k2), problem, lim):
            return config
    return checked(problem, BackwardConfig(candidates[-1], k2), lim)
