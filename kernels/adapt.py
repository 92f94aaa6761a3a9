"""Making a table rule's config run a problem it was not fitted on: `adapt` (another shape) and `carried_over`
(another dtype: the table's rules of a stand-in dtype, `STAND_IN_DTYPES`). Both return configs that validate for
the problem, or say why none carries over; `tables.Table.match` applies them.
"""

from __future__ import annotations

import dataclasses

from .config import ITEMSIZE, ROW_SPLITS, BackwardConfig, Problem
from .heuristics import (MAX_COLUMNS_ROWS, MAX_SINGLE_PASS, default_config, next_power_of_two, row_block_col,
                         slice_width, wide_fp32_rows)

# A dtype the table has no family of borrows the rules of this one (same norm, closest flags), adapted and validated
# for the problem like any rule's config: fp16 has bf16's element size, so the same tiles, registers and bytes per
# row; fp32 rows hold twice the bytes. A config sized to a bf16 row carries over only where `carried_over` says.
# H200 held-out, analytic default against the best of an unseeded sweep: fp16 200x5120 13.5 against 10.0 µs,
# fp32 96x4096 10.0 against 6.9.
STAND_IN_DTYPES = {"fp16": "bf16", "fp32": "bf16"}


def holds_rows(config: BackwardConfig) -> bool:
    """Whether a config sizes its register tile for the element size it was fitted on: split rows (each slice
    fills the registers) or recompute (which keeps the packed 16-bit tile live instead of fp32 values)."""
    k1 = config.kernel_1
    return k1.strategy == "rows" and not k1.two_pass and (k1.row_split > 1 or k1.recompute)


def carried_over(config: BackwardConfig, stand_in: str, problem: Problem) -> tuple[BackwardConfig | None, str]:
    """A stand-in's `holds_rows` config for `problem`'s dtype, or None and why it does not carry over.

    - the same element size (fp16 on a bf16 rule): the config as it is. recompute widens the packed 16-bit tile
      again after the row reductions for either dtype (`widen_again`; sm_90 compile, RMSNorm 2048x16384 on a
      1x16384 recompute tile: 128 registers and no stack in bf16 and in fp16);
    - twice the element size (fp32): a split row in twice the slices, each of the same bytes, without recompute,
      that `adapt` then fits to the row. H200, fp32 2048x32768 on the bf16 rule's split-in-4 config as it was:
      593.7 µs (LayerNorm) against the default's 355.7; in 8 slices (H100) 340.0 against 473.0. A whole row held
      in registers does not split well: H100 RMSNorm fp32 4096x12288 in 2 slices 275.2 µs against 252.4.
      Where twice the slices would pass ROW_SPLITS' largest, the largest split takes what it can and the tile
      holds fewer rows for the rest (a rule in 8 slices of 4x4096 runs fp32 in 8 slices of 2x4096): the best
      configs of unseeded fp32 sweeps of 2048x32768 split in 8, on 2x4096 (LayerNorm) and 1x4096 (RMSNorm) tiles
      (H100 held-out validation, run 271: 297 µs against the analytic default's 459 for RMSNorm).
    - fp32 rows of 8193-16384 columns from 512 rows (`heuristics.wide_fp32_rows`): none; the analytic default
      splits them in slices of 4096 columns on 2-row tiles, level with or faster than the bf16 LayerNorm rules
      carried in 8 slices of 4 x 2048 on every shape timed (H200, 512-16384 rows of 9216-16384 columns: 1.01-1.24x,
      within the spread at 512 and 1024 x 16384; docs/experiments/fp32_wide_rows.py).
    """
    k1 = config.kernel_1
    dtype = problem.dtype
    factor = ITEMSIZE[dtype] // ITEMSIZE[stand_in]
    if factor == 1:
        return config, ""
    if wide_fp32_rows(problem):
        return None, f"{dtype} rows of 8193-16384 columns from 512 rows split in the analytic default's slices"
    split = k1.row_split * factor
    if k1.row_split == 1:
        return None, f"its config holds whole {stand_in} rows in registers"
    block_row, block_col = k1.block_row, max(1, k1.block_col // factor)
    if split > ROW_SPLITS[-1]:
        rest = -(-split // ROW_SPLITS[-1])  # the factor the slices cannot take: fewer rows per tile instead
        if k1.block_row < rest:
            return None, (f"its config holds {stand_in} rows in registers in {k1.row_split} slices of one row, and "
                          f"{dtype} would need more than {ROW_SPLITS[-1]}")
        split, block_row, block_col = ROW_SPLITS[-1], k1.block_row // rest, k1.block_col
    return BackwardConfig(dataclasses.replace(k1, row_split=split, block_row=block_row, block_col=block_col,
                                              recompute=False), config.kernel_2), ""


def adapt(config: BackwardConfig, problem: Problem, sm_count: int | None = None) -> BackwardConfig:
    """Make a rule's config valid for `problem`: single pass takes block_col = next_pow2(N) (two-pass past
    MAX_SINGLE_PASS); knobs that cannot apply are dropped; if it still cannot run, the analytic default.
    With `sm_count`, a problem too short to fill a quarter of the rule's grid with row tiles gets smaller row
    tiles (H100: LayerNorm 128x16384 ran 20% slower on the 4-row tiles fitted at M=512 — 32 tiles for 132 SMs —
    than the best config a fresh sweep found, on 2-row tiles). Above a quarter the fitted tile is kept: 257x14336
    on the same 4-row tiles (65 tiles) validated at regret 1.000."""
    k1 = config.kernel_1
    n_pow2 = next_power_of_two(problem.N)
    if k1.strategy == "columns":  # a column slice sweeps every row: any N, up to MAX_COLUMNS_ROWS rows
        cand = BackwardConfig(dataclasses.replace(k1, block_col=min(k1.block_col, n_pow2)), config.kernel_2)
        return cand if problem.M <= MAX_COLUMNS_ROWS and cand.is_valid(problem) else default_config(problem)
    if k1.strategy == "dual" and problem.M > MAX_COLUMNS_ROWS:  # its column programs sweep every row
        return default_config(problem)
    if k1.row_split > 1:  # the row's slices must stay >= 256 columns and fit one pass
        # The rule's split if its slices still fit the rule's tile, else the next split that keeps that tile (a
        # rule fitted at 12288 columns in 3 slices of 4096 runs 12800 in 4), else the rule's split on wider tiles.
        fits = [s for s in ROW_SPLITS if s >= k1.row_split and row_block_col(problem.N, s) <= k1.block_col]
        for split in fits[:1] + [k1.row_split]:
            width = row_block_col(problem.N, split)
            if slice_width(problem.N, split) >= 256 and width <= MAX_SINGLE_PASS:
                cand = BackwardConfig(dataclasses.replace(k1, block_col=width, row_split=split), config.kernel_2)
                if cand.is_valid(problem):
                    return cand
        k1 = dataclasses.replace(k1, row_split=1, pipelined_split=False)  # nothing to exchange: the plain loop
    if sm_count:
        want = max(1, round(k1.programs_per_sm * sm_count) // 4)
        while k1.block_row > 1 and -(-problem.M // k1.block_row) < want:
            k1 = dataclasses.replace(k1, block_row=k1.block_row // 2)
    if not k1.two_pass:
        if n_pow2 <= MAX_SINGLE_PASS:
            block_row = k1.block_row
            while block_row > 1 and block_row * n_pow2 > k1.block_row * k1.block_col:
                block_row //= 2  # keep the tile no larger than the rule's
            k1 = dataclasses.replace(k1, block_col=n_pow2, block_row=block_row)
        else:
            k1 = dataclasses.replace(k1, two_pass=True, block_col=min(4096, k1.block_col), block_row=1,
                                     recompute=False, column_accumulators=False)
    elif k1.block_col >= n_pow2 and n_pow2 <= MAX_SINGLE_PASS:
        k1 = dataclasses.replace(k1, two_pass=False, block_col=n_pow2)
    k2 = config.kernel_2
    if k2.block_n > n_pow2:
        k2 = dataclasses.replace(k2, block_n=n_pow2)
    for warps in (k1.num_warps, 16, 8, 4, 2, 1):
        cand = BackwardConfig(dataclasses.replace(k1, num_warps=warps), k2)
        if cand.is_valid(problem):
            return cand
    return default_config(problem)
