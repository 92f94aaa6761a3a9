"""The dual strategy's launch plan: one launch of row programs (grad_input) and column programs (dw/db),
`backward/dual.py`; no partials, no kernel_2."""

from __future__ import annotations

import dataclasses

from ..backward.dual import kernel_1_dual
from ..backward.plan import Plan, Step, Target, k1_flags, reads_mean
from ..heuristics import cdiv
from ..problem import Problem
from .configs import BackwardConfig


@dataclasses.dataclass(frozen=True)
class DualPlan(Plan):
    row_programs: int = 0  # the programs that write grad_input (of each column group); its column programs follow

    def bind(self, grad, g_stride, saved, s_stride, dx, dx_stride, dh, dh_stride, z, z_stride, dz, dz_stride, weight,
             bias, rstd, mean, dw, db, work: tuple, counters: tuple | None) -> tuple:
        return ((grad, g_stride, saved, s_stride, dx, dx_stride, dh, dh_stride, z, z_stride, dz, dz_stride, weight,
                 bias, rstd, mean, dw, db, self.problem.M, self.problem.N, self.row_programs),), (), None, None


def plan(p: Problem, config: BackwardConfig, target: Target, int64: bool, hint: int,
         column_groups: int = 1) -> DualPlan:
    """Column groups (`column_groups` > 1): each its own row and column programs, as the config gives the
    problem M x N (the config's programs per column group)."""
    k1, k2 = config.kernel_1, config.kernel_2
    k1_kwargs = dict(k1_flags(p, hint), BLOCK_ROW=k1.block_row, BLOCK_COL=k1.block_col, NUM_STAGES=k1.num_stages,
                     PREFETCH=k1.prefetch, EVICTION=k1.eviction_policy, INT64=int64, RED_BLOCK_M=k2.block_m,
                     RED_BLOCK_N=k2.block_n, num_warps=k1.num_warps)
    if column_groups > 1:
        k1_kwargs["COLUMN_GROUPS"] = column_groups
    rows = config.strategy.row_programs(p.M, config, target.sms)
    programs = (rows + (cdiv(p.N, k2.block_n) if p.has_weight or p.has_bias else 0)) * column_groups
    return DualPlan(p, config, programs, target.phased, k1_kwargs,
                    stage_1=(Step.of(kernel_1_dual, k1_kwargs, programs),), reads_mean=reads_mean(p),
                    row_programs=rows)
