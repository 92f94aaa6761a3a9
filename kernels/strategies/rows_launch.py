"""The rows strategy's launch plan (`backward/rows.py`, `backward/reduce.py`): persistent row groups of
row_split programs each, fp32 partial rows reduced by kernel_2 (a second launch, or fused into kernel_1's tail),
the split row's exchange buffer. A grid whose programs wait for each other (row_split > 1, fused) is capped at
what the GPU holds at once, read from the compiled kernel (`Target.resident`)."""

from __future__ import annotations

import dataclasses

from ..backward.plan import (PLACEHOLDER_COUNTERS, GroupsNotResident, Plan, Step, Target, k1_flags, placeholder_work, placeholders,
                             reads_mean)
from ..backward.reduce import kernel_2
from ..backward.rows import kernel_1_single_pass, kernel_1_two_pass
from ..heuristics import cdiv, slice_width
from ..problem import Problem
from .configs import BackwardConfig


@dataclasses.dataclass(frozen=True)
class RowsPlan(Plan):
    slice: int = 0  # columns of a row_split slice (kernel_1's last argument)
    phases: int = 1  # kernel_1's launches (the interpreter runs a split row's exchange as two)
    column_groups: int = 1  # groups of N columns side by side in one launch (the partial rows span them all)

    def bind(self, grad, g_stride, saved, s_stride, dx, dx_stride, dh, dh_stride, z, z_stride, dz, dz_stride, weight,
             bias, rstd, mean, dw, db, work: tuple, counters: tuple | None) -> tuple:
        partial_dw, partial_db, exchange = work
        if counters is None:  # nothing waits: placeholders the kernel never dereferences
            group_a = group_b = global_counters = rstd
        else:
            group_a, group_b, global_counters = counters
        pdw = rstd if partial_dw is None else partial_dw
        pdb = rstd if partial_db is None else partial_db
        p = self.problem
        k1 = (grad, g_stride, saved, s_stride, dx, dx_stride, dh, dh_stride, z, z_stride, dz, dz_stride, weight, bias,
              rstd, mean, pdw, pdb, dw, db, rstd if exchange is None else exchange, group_a, group_b, global_counters,
              p.M, p.N, self.slice)
        args_1 = (k1, k1) if self.phases == 2 else (k1,)
        if self.stage_2:
            width = p.N * self.column_groups
            return args_1, ((pdw, pdb, dw, db, self.partial_rows, width),), partial_dw, partial_db
        return args_1, (), partial_dw, partial_db


def kernel_1_kwargs(p: Problem, config: BackwardConfig, *, int64: bool, pdl: bool, fused: bool, phase: int,
                    slots: int, hint: int, column_groups: int = 1) -> dict:
    k1, k2 = config.kernel_1, config.kernel_2
    grouped = {"COLUMN_GROUPS": column_groups} if column_groups > 1 else {}
    return dict(grouped, **k1_flags(p, hint), BLOCK_ROW=k1.block_row, BLOCK_COL=k1.block_col,
                NUM_STAGES=k1.num_stages,
                PREFETCH=k1.prefetch, RELOAD_WEIGHT=k1.block_row == 1, RECOMPUTE=k1.recompute,
                EVICTION=k1.eviction_policy, INT64=int64, PDL=pdl, ROW_SPLIT=k1.row_split, SLOTS=slots,
                PHASE=phase, FUSED=fused, RED_BLOCK_M=k2.block_m, RED_BLOCK_N=k2.block_n,
                RED_STAGES=k2.num_stages, COLUMN_ACC=k1.column_accumulators, PIPELINED=k1.pipelined_split,
                num_warps=k1.num_warps)


def launches_pdl(config: BackwardConfig, target_pdl: bool) -> bool:
    """kernel_2 launches with programmatic dependent launch: the config asks for it, has a kernel_2 launch to
    overlap, and the target launches it."""
    k2 = config.kernel_2
    return bool(k2.pdl and not k2.fused and target_pdl)


def plan(p: Problem, config: BackwardConfig, target: Target, int64: bool, hint: int,
         column_groups: int = 1) -> RowsPlan:
    """Column groups (`column_groups` > 1): each runs the config's grid for its problem (the config's programs
    per column group, as the tuned problem M x N runs them), except that a grid whose programs wait for each
    other is capped so that every column group's programs are resident together. kernel_2 reduces the partial
    rows of every group's columns in one launch, N x column_groups wide."""
    k1, k2 = config.kernel_1, config.kernel_2
    M, N, cg = p.M, p.N, column_groups
    phased = target.phased
    reduce = p.has_weight or p.has_bias
    groups = config.strategy.partial_rows(M, config, target.sms)
    fused = k2.fused and reduce
    pdl = launches_pdl(config, target.pdl)
    slots = cdiv(cdiv(M, k1.block_row), groups) if phased else 2
    waits = k1.row_split > 1 or fused
    kernel = kernel_1_two_pass if k1.two_pass else kernel_1_single_pass
    if waits and not phased:  # as many groups as the GPU runs at once, the compiled kernel's resources say
        kwargs = kernel_1_kwargs(p, config, int64=int64, pdl=pdl, fused=fused, phase=0, slots=2, hint=hint,
                                 column_groups=cg)
        shapes = _scratch(p, groups, 2, k1.row_split, k1.block_row, cg)
        draft = RowsPlan(p, config, groups * k1.row_split * cg, phased, kwargs, scratch=shapes, waits=True,
                         slice=slice_width(N, k1.row_split), column_groups=cg)
        ops, dw, db = placeholders(p)
        (args,), _, _, _ = draft.bind(*ops, dw, db, placeholder_work(shapes), PLACEHOLDER_COUNTERS)
        resident = target.resident(kernel, args, kwargs, groups * k1.row_split * cg)
        if cg > 1 and resident < k1.row_split * cg:
            raise GroupsNotResident(f"column_groups={cg}: a grid of row_split={k1.row_split} programs per column group "
                             f"does not fit the GPU at once ({resident} programs); use a config without "
                             "row_split or fused, or fewer column groups")
        groups = min(groups, max(k1.row_split, resident // cg) // k1.row_split)
    programs = groups * k1.row_split * cg
    split_phases = phased and k1.row_split > 1
    k1_kwargs = kernel_1_kwargs(p, config, int64=int64, pdl=pdl, fused=fused and not phased,
                                phase=1 if split_phases else 0, slots=slots, hint=hint, column_groups=cg)
    stage_1 = (Step.of(kernel, k1_kwargs, programs),)
    if split_phases:  # the interpreter runs the exchange's two sides as two launches
        stage_1 += (Step.of(kernel, dict(k1_kwargs, PHASE=2), programs),)
    stage_2 = ()
    if reduce and (not fused or phased):
        warps = k1.num_warps if fused else k2.num_warps  # the interpreter runs a fused reduction as kernel_2
        k2_kwargs = dict(HAS_WEIGHT=p.has_weight, HAS_BIAS=bool(p.has_bias), BLOCK_M=k2.block_m,
                         BLOCK_N=k2.block_n, NUM_STAGES=k2.num_stages, PDL=pdl, HINT=hint, num_warps=warps)
        if pdl:
            k2_kwargs["launch_pdl"] = True
        stage_2 = (Step.of(kernel_2, k2_kwargs, programs if fused else cdiv(N * cg, k2.block_n)),)
    return RowsPlan(p, config, programs, phased, k1_kwargs, stage_1, stage_2,
                    scratch=_scratch(p, groups, slots, k1.row_split, k1.block_row, cg), partial_rows=groups,
                    waits=waits, pdl=pdl and bool(stage_2), reads_mean=reads_mean(p),
                    slice=slice_width(N, k1.row_split), phases=len(stage_1), column_groups=cg)


def _scratch(p: Problem, groups: int, slots: int, row_split: int, block_row: int, column_groups: int = 1) -> tuple:
    """(partial dw, partial db, split-row exchange) shapes, None where absent (every column group's)."""
    partials = (groups, p.N * column_groups) if groups else None
    exchange = (groups * column_groups * slots * row_split * 2 * block_row,) if row_split > 1 else None
    return (partials if p.has_weight else None, partials if p.has_bias else None, exchange)
