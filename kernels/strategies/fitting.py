"""Fitting a table rule's row tile to another problem (`Strategy.adapt` of the strategies that hold rows, through
the rows strategy's `fit_rows` or directly): the column tile to the row, the row tile to the rows, then the warps
that validate."""

from __future__ import annotations

import dataclasses

from .capabilities import fits
from ..heuristics import MAX_SINGLE_PASS, next_power_of_two
from ..knobs import Kernel1Config, Kernel2Config
from ..limits import DeviceLimits
from ..problem import Problem
from .configs import BackwardConfig


def fit_row_tile(k1: Kernel1Config, k2: Kernel2Config, problem: Problem, sm_count: int | None, *,
                 whole_rows: bool = True, limits: DeviceLimits | None = None) -> BackwardConfig | None:
    """A row tile fitted to `problem`: with `sm_count`, smaller row tiles for a problem too short to fill a quarter
    of the rule's grid; whole rows (single pass) take block_col = next_pow2(N) on a tile no larger than the
    rule's (None past MAX_SINGLE_PASS); then the rule's warps, or the fewest that validate on the device of
    `limits` (`capabilities.fits`). None: nothing validates."""
    n_pow2 = next_power_of_two(problem.N)
    if sm_count:
        want = max(1, round(k1.programs_per_sm * sm_count) // 4)
        while k1.block_row > 1 and -(-problem.M // k1.block_row) < want:
            k1 = dataclasses.replace(k1, block_row=k1.block_row // 2)
    if whole_rows:
        if n_pow2 > MAX_SINGLE_PASS:
            return None
        block_row = k1.block_row
        while block_row > 1 and block_row * n_pow2 > k1.block_row * k1.block_col:
            block_row //= 2  # keep the tile no larger than the rule's
        k1 = dataclasses.replace(k1, block_col=n_pow2, block_row=block_row)
    if k2.block_n > n_pow2:
        k2 = dataclasses.replace(k2, block_n=n_pow2)
    for warps in (k1.num_warps, 16, 8, 4, 2, 1):
        cand = BackwardConfig(dataclasses.replace(k1, num_warps=warps), k2)
        if fits(problem, cand, limits):
            return cand
    return None
