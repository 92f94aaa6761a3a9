"""Host side of the backward: a `Plan` per (problem, config, device) — kernels, compile-time arguments, grids,
buffer shapes — built once and cached, and `BackwardLaunch`, which allocates one call's outputs and launches.

Strategies (config fields, chosen by the tuner): rows (single pass, optionally row_split; or two-pass) with
kernel_2 as a second launch or fused into kernel_1's tail; columns (few rows: row sums, then a column sweep that
writes dw/db itself); dual (few rows, one launch: row programs write grad_input, column programs dw/db). Grids of
kernels whose programs wait for each other (row_split > 1, fused) are capped at what the GPU holds at once, read
from the compiled kernel's registers and shared memory.

Residual problems (`Problem.residual`) pass the residual stream's gradient dh to kernel_1 (HAS_DRES), which adds
it into grad_input where it writes it; grad_input is then in dh's dtype. Every strategy and knob takes it alike.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
import triton

from ..capabilities import checked
from ..config import RECOVER_LIMITS, BackwardConfig, Problem
from ..device import device_limits, interpret_mode, sm_count
from ..launcher import Launcher
from ..heuristics import (
    MAX_PROGRAMS_PER_SM_SYNC,
    alignment_hint,
    cdiv,
    max_warps,
    needs_int64,
    next_power_of_two,
    occupancy,
    slice_width,
)
from .columns import kernel_1_columns, row_sums
from .dual import kernel_1_dual
from .reduce import PDL_SUPPORTED, kernel_2
from .rows import kernel_1_single_pass, kernel_1_two_pass
from .workspace import scratch, sync_counters

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Row-stride triples remembered per resolved call (`BackwardLaunch`'s `plans`) before the memo starts over.
MAX_PLANS_PER_CALL = 64


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything about one backward that does not depend on the tensors' addresses."""

    problem: Problem
    config: BackwardConfig
    groups: int  # partial rows (rows strategy); 0 for columns, dual or M = 0
    programs: int  # kernel_1's grid (dual: the row programs first, then the column programs)
    phased: bool  # interpreter: waiting kernels run as two launches (see common.py)
    slots: int  # row_split exchange slots per group
    k1_kwargs: dict
    k2_kwargs: dict | None  # None: no separate kernel_2 launch (fused on a GPU, columns, or nothing to reduce)
    k2_grid: int
    rs_kwargs: dict | None  # columns strategy: the row-sums kernel
    rs_grid: int
    k1_launch: Launcher | None = None
    k2_launch: Launcher | None = None
    rs_launch: Launcher | None = None
    row_programs: int = 0  # dual: programs that write grad_input
    waits: bool = False  # kernel_1's programs wait for each other (takes the stream's sync counters)
    slice: int = 0  # columns of a row_split slice (the rows strategy's last argument)
    # fp32 scratch shapes (`workspace.scratch`): rows (partial dw, partial db, split-row exchange), None where
    # absent; columns (the per-row sums, twice)
    scratch: tuple = ()

    @property
    def kernel_1(self):
        k1 = self.config.kernel_1
        if k1.strategy == "columns":
            return kernel_1_columns
        if k1.strategy == "dual":
            return kernel_1_dual
        return kernel_1_two_pass if k1.two_pass else kernel_1_single_pass


def _flags(p: Problem, hint: int) -> dict:
    return dict(IS_RMS=p.norm == "rms_norm", HAS_WEIGHT=p.has_weight, HAS_BIAS=bool(p.has_bias),
                ZERO_CENTERED=p.zero_centered, FROM_OUTPUT=p.save == "output", RECOVER_LIMIT=RECOVER_LIMITS[p.dtype],
                HINT=hint)


def _k1_flags(p: Problem, hint: int) -> dict:
    """`_flags` of the kernels that write grad_input (kernel_1 of every strategy), with the residual's."""
    return dict(_flags(p, hint), HAS_DRES=p.residual)


def _rows_kwargs(p: Problem, config: BackwardConfig, *, int64: bool, pdl: bool, fused: bool, phase: int,
                 slots: int, hint: int) -> dict:
    k1, k2 = config.kernel_1, config.kernel_2
    return dict(_k1_flags(p, hint), BLOCK_ROW=k1.block_row, BLOCK_COL=k1.block_col, NUM_STAGES=k1.num_stages,
                PREFETCH=k1.prefetch, RELOAD_WEIGHT=k1.block_row == 1, RECOMPUTE=k1.recompute,
                EVICTION=k1.eviction_policy, INT64=int64, PDL=pdl, ROW_SPLIT=k1.row_split, SLOTS=slots,
                PHASE=phase, FUSED=fused, RED_BLOCK_M=k2.block_m, RED_BLOCK_N=k2.block_n,
                RED_STAGES=k2.num_stages, COLUMN_ACC=k1.column_accumulators, PIPELINED=k1.pipelined_split,
                num_warps=k1.num_warps)


def _dual_kwargs(p: Problem, config: BackwardConfig, int64: bool, hint: int) -> dict:
    k1, k2 = config.kernel_1, config.kernel_2
    return dict(_k1_flags(p, hint), BLOCK_ROW=k1.block_row, BLOCK_COL=k1.block_col, NUM_STAGES=k1.num_stages,
                PREFETCH=k1.prefetch, EVICTION=k1.eviction_policy, INT64=int64, RED_BLOCK_M=k2.block_m,
                RED_BLOCK_N=k2.block_n, num_warps=k1.num_warps)


def _columns_kwargs(p: Problem, config: BackwardConfig, int64: bool, hint: int) -> dict:
    k1 = config.kernel_1
    return dict(_k1_flags(p, hint), BLOCK_ROW=k1.block_row, BLOCK_COL=k1.block_col, NUM_STAGES=k1.num_stages,
                PREFETCH=k1.prefetch, EVICTION=k1.eviction_policy, INT64=int64, num_warps=k1.num_warps)


def _row_sums_tile(N: int) -> tuple[int, int, int]:
    """(rows, columns, warps) of the columns strategy's row-sums kernel: 4096-column chunks (a pure streaming
    reduction: nothing is held across chunks), several rows per program for short rows."""
    block_col = min(next_power_of_two(N), 4096)
    block_row = max(1, min(16, 4096 // block_col))
    return block_row, block_col, min(8, max_warps(block_row * block_col))


def pdl_enabled(config: BackwardConfig, device: torch.device) -> bool:
    """kernel_2 launches with programmatic dependent launch: the config asks for it, this Triton has it, and the
    device does (`DeviceLimits.pdl`: NVIDIA from compute capability 9.0; not a ROCm GPU, whatever major version
    ROCm reports)."""
    k2 = config.kernel_2
    return bool(k2.pdl and not k2.fused and config.kernel_1.strategy == "rows" and PDL_SUPPORTED
                and not interpret_mode() and device.type == "cuda" and device_limits(device).pdl)


def _waits(config: BackwardConfig, p: Problem) -> bool:
    k1 = config.kernel_1
    return k1.strategy == "rows" and (k1.row_split > 1 or (config.kernel_2.fused and (p.has_weight or p.has_bias)))


@functools.lru_cache(maxsize=1024)
def plan(problem: Problem, config: BackwardConfig, device: torch.device, int64: bool, hint: int = 1) -> Plan:
    """The cached plan. A grid whose programs wait for each other is capped at the compiled kernel's occupancy
    (compiling it here, once). `int64`: offsets need 64 bits; `hint`: the row width and strides are multiples of
    it (`heuristics.alignment_hint`). A feature the device lacks runs in its portable form, validated there
    (`capabilities.checked`: a config the call's selection or its explicit `config=` check already validated for
    this problem and device is not validated again)."""
    config = checked(problem, config, device_limits(device))
    p, k1, k2 = problem, config.kernel_1, config.kernel_2
    M, N = p.M, p.N
    phased = interpret_mode()
    reduce = p.has_weight or p.has_bias
    if M == 0:
        return Plan(p, config, 0, 0, phased, 1, {}, None, 0, None, 0)
    if k1.strategy == "columns":
        rb, rc, rw = _row_sums_tile(N)
        k1_kwargs = _columns_kwargs(p, config, int64, hint)
        rs_kwargs = dict(_flags(p, hint), BLOCK_ROW=rb, BLOCK_COL=rc, INT64=int64, num_warps=rw)
        return Plan(p, config, 0, cdiv(N, k1.block_col), phased, 1, k1_kwargs, None, 0, rs_kwargs, cdiv(M, rb),
                    Launcher(kernel_1_columns, k1_kwargs), None, Launcher(row_sums, rs_kwargs),
                    scratch=((M,), (M,)))
    if k1.strategy == "dual":
        k1_kwargs = _dual_kwargs(p, config, int64, hint)
        rows = config.strategy.row_programs(M, config, sm_count(device))
        programs = rows + (cdiv(N, k2.block_n) if reduce else 0)
        return Plan(p, config, 0, programs, phased, 1, k1_kwargs, None, 0, None, 0,
                    Launcher(kernel_1_dual, k1_kwargs), row_programs=rows)
    groups = config.strategy.partial_rows(M, config, sm_count(device))
    fused = k2.fused and reduce
    pdl = pdl_enabled(config, device)
    slots = cdiv(cdiv(M, k1.block_row), groups) if phased else 2
    waits = _waits(config, p)
    if waits and not phased:
        groups = min(groups, _resident_programs(p, config, device, int64, groups, hint) // k1.row_split)
    programs = groups * k1.row_split
    phase = 1 if (phased and k1.row_split > 1) else 0
    k1_kwargs = _rows_kwargs(p, config, int64=int64, pdl=pdl, fused=fused and not phased, phase=phase, slots=slots,
                             hint=hint)
    k2_kwargs, k2_grid = None, 0
    if reduce and (not fused or phased):
        warps = k1.num_warps if fused else k2.num_warps  # the interpreter runs a fused reduction as kernel_2
        k2_kwargs = dict(HAS_WEIGHT=p.has_weight, HAS_BIAS=bool(p.has_bias), BLOCK_M=k2.block_m,
                         BLOCK_N=k2.block_n, NUM_STAGES=k2.num_stages, PDL=pdl, HINT=hint, num_warps=warps)
        if pdl:
            k2_kwargs["launch_pdl"] = True
        k2_grid = programs if fused else cdiv(N, k2.block_n)
    kernel = kernel_1_two_pass if k1.two_pass else kernel_1_single_pass
    partials = (groups, N) if groups else None
    exchange = (groups * slots * k1.row_split * 2 * k1.block_row,) if k1.row_split > 1 else None
    return Plan(p, config, groups, programs, phased, slots, k1_kwargs, k2_kwargs, k2_grid, None, 0,
                Launcher(kernel, k1_kwargs), Launcher(kernel_2, k2_kwargs) if k2_kwargs is not None else None,
                waits=waits, slice=slice_width(N, k1.row_split),
                scratch=(partials if p.has_weight else None, partials if p.has_bias else None, exchange))


def _resident_programs(p: Problem, config: BackwardConfig, device: torch.device, int64: bool, groups: int,
                       hint: int) -> int:
    """Programs of kernel_1 the GPU runs at once (every SM full), from the compiled kernel's resources."""
    k1 = config.kernel_1
    fused = config.kernel_2.fused and (p.has_weight or bool(p.has_bias))  # as `plan` launches it
    kwargs = _rows_kwargs(p, config, int64=int64, pdl=pdl_enabled(config, device), fused=fused, phase=0, slots=2,
                          hint=hint)
    kernel = kernel_1_two_pass if k1.two_pass else kernel_1_single_pass
    args = _placeholder_args(p, int64, k1.row_split)
    compiled = kernel.warmup(*args, grid=(groups * k1.row_split,), **kwargs)
    try:
        compiled._init_handles()
        regs, shared = int(compiled.n_regs), int(compiled.metadata.shared)
    except Exception:  # noqa: BLE001 - unknown compiled-kernel layout: one program per SM always fits
        return sm_count(device)
    per_sm = occupancy(regs, shared, k1.num_warps, limits=device_limits(device))
    return max(k1.row_split, min(per_sm, MAX_PROGRAMS_PER_SM_SYNC) * sm_count(device))


def _placeholder_args(p: Problem, int64: bool, row_split: int = 1) -> tuple:
    """kernel_1 (rows) arguments as dtypes (aligned pointers, as a launch's buffers are) and the integers a launch
    on contiguous rows passes, for compiling without data: the same specialization as that launch. A residual
    problem's saved input (h), grad_input and dh are in the residual dtype; without a residual, dh's place holds
    grad's pointer and stride, as `BackwardLaunch` passes them."""
    act, wdt, f32, i32 = TORCH_DTYPES[p.dtype], TORCH_DTYPES[p.weight_dtype], torch.float32, torch.int32
    res = TORCH_DTYPES[p.residual_dtype] if p.residual else act
    saved = res if p.save == "input" else act
    out_dt = wdt
    return (act, p.N, saved, p.N, res, p.N, res, p.N, wdt if p.has_weight else f32, wdt if p.has_bias else f32, f32,
            f32, f32, f32, out_dt if p.has_weight else f32, out_dt if p.has_bias else f32, f32, i32, i32, i32,
            p.M, p.N, slice_width(p.N, row_split))


class BackwardLaunch:
    """One backward, ready to launch: outputs and buffers allocated, the cached plan looked up.

    `kernel_1()` and `kernel_2()` launch the two stages (the timing harness records events between them; for
    the columns strategy kernel_1 is its two kernels and kernel_2 does nothing; fused, kernel_2 does nothing on
    a GPU); `run()` launches both and returns (dx, dw, db), dw/db None where the problem has no weight/bias.
    Reusable: launching again recomputes the same outputs into the same buffers.
    """

    def __init__(self, problem: Problem, config: BackwardConfig, grad: torch.Tensor, saved: torch.Tensor,
                 weight: torch.Tensor | None, bias: torch.Tensor | None, rstd: torch.Tensor,
                 mean: torch.Tensor | None, *, dx: torch.Tensor | None = None, plans: dict | None = None,
                 dh: torch.Tensor | None = None):
        """`plans`: the caller's memo of `plan` for this (problem, config, device), keyed by the row strides of
        grad, saved, dx and dh (which decide int64 indexing and the alignment hint; the runtime keeps one memo per
        resolved call, so that a call does not hash the problem and config again). `dh`: the residual stream's
        gradient rows, which a residual problem needs (grad_input = dh + the norm's dx, in dh's dtype)."""
        M, N = problem.M, problem.N
        device = grad.device
        if problem.residual != (dh is not None):
            raise ValueError("dh (the residual stream's gradient) is needed exactly when the problem has a residual")
        g_stride, s_stride = grad.stride(0), saved.stride(0)
        dh_arg, dh_stride = (grad, g_stride) if dh is None else (dh, dh.stride(0))
        if dx is None:  # allocated here: contiguous and aligned
            dx = torch.empty(M, N, dtype=dh_arg.dtype, device=device)
            dx_stride, dx_align = N, 0
        else:
            dx_stride, dx_align = dx.stride(0), dx.data_ptr() & 15
        self.dx = dx
        strides = (g_stride, s_stride, dx_stride) if dh is None else (g_stride, s_stride, dx_stride, dh_stride)
        pl = plans.get(strides) if plans is not None else None
        if pl is None:
            pl = plan(problem, config, device, needs_int64(M, N, *strides), alignment_hint(N, *strides))
            if plans is not None:
                if len(plans) >= MAX_PLANS_PER_CALL:  # e.g. rows sliced from ever new widths: start over
                    plans.clear()
                plans[strides] = pl
        self.plan = pl
        self.problem, self.config = problem, config
        has_w, has_b = problem.has_weight, bool(problem.has_bias)
        wdt = weight.dtype if weight is not None else grad.dtype
        self.dw = torch.empty(N, dtype=wdt, device=device) if has_w else None
        self.db = torch.empty(N, dtype=bias.dtype if bias is not None else wdt, device=device) if has_b else None
        # The rows strategy's fp32 partial rows (None where nothing is reduced) and exchange, the columns
        # strategy's row sums: the stream's scratch (`workspace.scratch`), not allocated per call.
        work = scratch(device, pl.scratch) if pl.scratch else ()
        self.partial_dw = self.partial_db = None
        # Absent tensors get a placeholder pointer (rstd) that the kernels never dereference.
        weight_arg = weight if weight is not None else rstd
        bias_arg = bias if bias is not None else rstd
        dw_arg = self.dw if has_w else rstd
        db_arg = self.db if has_b else rstd
        mean_arg = mean if (problem.norm == "layer_norm" and problem.save == "input") else rstd
        # What Triton's specialization of these launches depends on beyond the plan: the row strides and the
        # alignment of the tensors this call did not allocate (see launcher.py).
        self._key = (g_stride, s_stride, dx_stride, grad.data_ptr() & 15, saved.data_ptr() & 15, dx_align,
                     weight_arg.data_ptr() & 15, bias_arg.data_ptr() & 15, rstd.data_ptr() & 15,
                     mean_arg.data_ptr() & 15)
        if dh is not None:
            self._key += (dh_stride, dh.data_ptr() & 15)
        self._k1_args = self._k2_args = self._rs_args = None
        if M == 0:
            return
        strategy = config.kernel_1.strategy
        if strategy == "rows":
            if pl.waits:
                group_a, group_b, global_counters = sync_counters(device)
            else:  # nothing waits: placeholders the kernel never dereferences
                group_a = group_b = global_counters = rstd
            self.partial_dw, self.partial_db, exchange = work
            partial_dw = rstd if self.partial_dw is None else self.partial_dw
            partial_db = rstd if self.partial_db is None else self.partial_db
            sums = rstd if exchange is None else exchange
            self._k1_args = (grad, g_stride, saved, s_stride, dx, dx_stride, dh_arg, dh_stride, weight_arg, bias_arg,
                             rstd, mean_arg, partial_dw, partial_db, dw_arg, db_arg, sums, group_a, group_b,
                             global_counters, M, N, pl.slice)
            self._k2_args = (partial_dw, partial_db, dw_arg, db_arg, pl.groups, N)
        elif strategy == "dual":
            self._k1_args = (grad, g_stride, saved, s_stride, dx, dx_stride, dh_arg, dh_stride, weight_arg, bias_arg,
                             rstd, mean_arg, dw_arg, db_arg, M, N, pl.row_programs)
        else:  # columns
            c0, c1 = work  # per-row sums
            self._rs_args = (grad, g_stride, saved, s_stride, weight_arg, bias_arg, rstd, mean_arg, c0, c1, M, N)
            self._k1_args = (grad, g_stride, saved, s_stride, dx, dx_stride, dh_arg, dh_stride, weight_arg, bias_arg,
                             rstd, mean_arg, c0, c1, dw_arg, db_arg, M, N)

    @property
    def programs(self) -> int:
        """kernel_1's grid (0 for M = 0)."""
        return self.plan.programs

    @property
    def pdl(self) -> bool:
        """kernel_2 is launched with programmatic dependent launch (it then waits inside its own time)."""
        return bool(self.plan.k2_kwargs and self.plan.k2_kwargs.get("PDL"))

    @property
    def has_kernel_2(self) -> bool:
        """A second kernel runs after kernel_1 (not for dual, columns or the fused reduction, nor M = 0)."""
        return self.plan.programs > 0 and self.plan.k2_launch is not None

    @property
    def partial_rows(self) -> int:
        """Rows of the fp32 partial buffers kernel_1 writes and kernel_2 reads (0: none, columns strategy)."""
        return self.plan.groups

    def kernel_1(self) -> None:
        pl = self.plan
        if pl.programs == 0:
            return
        if pl.rs_launch is not None:
            pl.rs_launch(pl.rs_grid, self._rs_args, self._key)
        pl.k1_launch(pl.programs, self._k1_args, self._key)
        if pl.phased and pl.config.kernel_1.strategy == "rows" and pl.config.kernel_1.row_split > 1:
            pl.kernel_1[(pl.programs,)](*self._k1_args, **dict(pl.k1_kwargs, PHASE=2))

    def kernel_2(self) -> None:
        pl, p = self.plan, self.problem
        if pl.programs == 0:  # M = 0: the sums over no rows are zero
            for out in (self.dw, self.db):
                if out is not None:
                    out.zero_()
            return
        if pl.k2_launch is not None:
            pl.k2_launch(pl.k2_grid, self._k2_args, self._key)

    def run(self):
        self.kernel_1()
        self.kernel_2()
        return self.dx, self.dw, self.db


def precompile(problem: Problem, config: BackwardConfig, sms: int, device: torch.device | None = None) -> None:
    """Compile the kernels for (problem, config) without launching them, as the first real launch would
    (contiguous rows, the same integer specialization), so that Triton's on-disk cache serves the launch.
    Used by the tuner's compile-ahead workers; needs the GPU's driver but no data."""
    if problem.M == 0:
        checked(problem, config)
        return
    device = device or torch.device("cuda", torch.cuda.current_device())
    config = checked(problem, config, device_limits(device))
    p, k1, k2 = problem, config.kernel_1, config.kernel_2
    int64, hint = needs_int64(p.M, p.N), alignment_hint(p.N)
    f32 = torch.float32
    wdt = TORCH_DTYPES[p.weight_dtype]
    if k1.strategy == "columns":
        rb, rc, rw = _row_sums_tile(p.N)
        pa = _placeholder_args(p, int64)
        row_sums.warmup(*pa[:4], pa[8], pa[9], f32, f32, f32, f32, p.M, p.N, grid=(cdiv(p.M, rb),),
                        **dict(_flags(p, hint), BLOCK_ROW=rb, BLOCK_COL=rc, INT64=int64, num_warps=rw))
        kernel_1_columns.warmup(*pa[:12], f32, f32, pa[14], pa[15], p.M, p.N, grid=(cdiv(p.N, k1.block_col),),
                                **_columns_kwargs(p, config, int64, hint))
        return
    pl = plan(p, config, device, int64, hint)
    if k1.strategy == "dual":
        pa = _placeholder_args(p, int64)
        kernel_1_dual.warmup(*pa[:12], pa[14], pa[15], p.M, p.N, pl.row_programs, grid=(pl.programs,),
                             **pl.k1_kwargs)
        return
    pl.kernel_1.warmup(*_placeholder_args(p, int64, k1.row_split), grid=(pl.programs,), **pl.k1_kwargs)
    if pl.k2_kwargs is not None:
        out = wdt
        kernel_2.warmup(f32, f32, out if p.has_weight else f32, out if p.has_bias else f32, pl.groups, p.N,
                        grid=(pl.k2_grid,), **pl.k2_kwargs)
