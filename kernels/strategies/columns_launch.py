"""The columns strategy's launch plan: the row-sums kernel over every row, then one program per column slice
(`backward/columns.py`); no partials, no kernel_2."""

from __future__ import annotations

import dataclasses

from ..backward.columns import kernel_1_columns, row_sums
from ..backward.plan import Plan, Step, Target, flags, k1_flags, reads_mean
from ..heuristics import cdiv, max_warps, next_power_of_two
from ..problem import Problem
from .configs import BackwardConfig


@dataclasses.dataclass(frozen=True)
class ColumnsPlan(Plan):
    def bind(self, grad, g_stride, saved, s_stride, dx, dx_stride, dh, dh_stride, z, z_stride, dz, dz_stride, weight,
             bias, rstd, mean, dw, db, work: tuple, counters: tuple | None) -> tuple:
        c0, c1 = work  # the per-row sums
        M, N = self.problem.M, self.problem.N
        sums = (grad, g_stride, saved, s_stride, z, z_stride, weight, bias, rstd, mean, c0, c1, M, N)
        k1 = (grad, g_stride, saved, s_stride, dx, dx_stride, dh, dh_stride, z, z_stride, dz, dz_stride, weight, bias,
              rstd, mean, c0, c1, dw, db, M, N)
        return (sums, k1), (), None, None


def row_sums_tile(N: int) -> tuple[int, int, int]:
    """(rows, columns, warps) of the row-sums kernel: 4096-column chunks (a pure streaming reduction: nothing is
    held across chunks), several rows per program for short rows."""
    block_col = min(next_power_of_two(N), 4096)
    block_row = max(1, min(16, 4096 // block_col))
    return block_row, block_col, min(8, max_warps(block_row * block_col))


def plan(p: Problem, config: BackwardConfig, target: Target, int64: bool, hint: int,
         column_groups: int = 1) -> ColumnsPlan:
    """Column groups (`column_groups` > 1): each its own row-sums programs and column programs, its row sums at
    M·group in the scratch."""
    k1 = config.kernel_1
    rb, rc, rw = row_sums_tile(p.N)
    k1_kwargs = dict(k1_flags(p, hint), BLOCK_ROW=k1.block_row, BLOCK_COL=k1.block_col, NUM_STAGES=k1.num_stages,
                     PREFETCH=k1.prefetch, EVICTION=k1.eviction_policy, INT64=int64, num_warps=k1.num_warps)
    rs_kwargs = dict(flags(p, hint), BLOCK_ROW=rb, BLOCK_COL=rc, INT64=int64, num_warps=rw)
    if column_groups > 1:
        k1_kwargs["COLUMN_GROUPS"] = rs_kwargs["COLUMN_GROUPS"] = column_groups
    programs = cdiv(p.N, k1.block_col) * column_groups
    return ColumnsPlan(p, config, programs, target.phased, k1_kwargs,
                       stage_1=(Step.of(row_sums, rs_kwargs, cdiv(p.M, rb) * column_groups),
                                Step.of(kernel_1_columns, k1_kwargs, programs)),
                       scratch=((p.M * column_groups,), (p.M * column_groups,)), reads_mean=reads_mean(p))
