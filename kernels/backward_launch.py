"""Host side of the backward: `plan` per (problem, config, device) — kernels, compile-time arguments, grids,
scratch shapes — built once by the config's strategy (`Strategy.plan`: `strategies/<name>_launch.py`) and cached, and
`BackwardLaunch`, which allocates one call's outputs, binds its tensors to the plan's launches and launches.

Residual problems (`Problem.residual`) pass the residual stream's gradient dh to kernel_1 (HAS_DRES), which adds
it into grad_input where it writes it; grad_input is then in dh's dtype. Gated problems (`Problem.gate`) pass the
gate z, and kernel_1 writes its gradient dz beside grad_input (HAS_GATE). Every strategy and knob takes them alike.
"""

from __future__ import annotations

import functools

import torch

from .backward.plan import GroupsNotResident  # noqa: F401 - raised by a strategy's plan, caught by the gated call
from .backward.plan import PLACEHOLDER_COUNTERS, TORCH_DTYPES, Plan, Target, placeholder_work, placeholders, reads_mean
from .backward.reduce import PDL_SUPPORTED
from .backward.workspace import scratch, sync_counters
from .config import BackwardConfig, Problem
from .device import device_limits, interpret_mode, sm_count
from .heuristics import MAX_PROGRAMS_PER_SM_SYNC, alignment_hint, needs_int64, occupancy
from .strategies.capabilities import checked

__all__ = ["TORCH_DTYPES", "BackwardLaunch", "Plan", "compile_ahead_args", "pdl_enabled", "plan", "precompile"]

# Row-stride triples remembered per resolved call (`BackwardLaunch`'s `plans`) before the memo starts over.
MAX_PLANS_PER_CALL = 64


def device_pdl(device: torch.device) -> bool:
    """This Triton and the device launch with programmatic dependent launch (`DeviceLimits.pdl`: NVIDIA from
    compute capability 9.0; not a ROCm GPU, whatever major version ROCm reports)."""
    return bool(PDL_SUPPORTED and not interpret_mode() and device.type == "cuda" and device_limits(device).pdl)


def pdl_enabled(config: BackwardConfig, device: torch.device) -> bool:
    """kernel_2 launches with programmatic dependent launch: the config asks for it, its strategy launches a
    kernel_2 it applies to (`Strategy.kernel_2_knobs`), not fused, and the device has it (`device_pdl`)."""
    k2 = config.kernel_2
    return bool(k2.pdl and not k2.fused and "pdl" in config.strategy.kernel_2_knobs and device_pdl(device))


def target(device: torch.device) -> Target:
    """The device facts a plan is built for."""
    return Target(device, sm_count(device), device_limits(device), interpret_mode(), device_pdl(device),
                  functools.partial(_resident_programs, device))


def _resident_programs(device: torch.device, kernel, args: tuple, kwargs: dict, grid: int) -> int:
    """Programs of `kernel` the GPU runs at once (every SM full, at most MAX_PROGRAMS_PER_SM_SYNC per SM), from
    the compiled kernel's resources (compiling it here, once)."""
    compiled = kernel.warmup(*args, grid=(grid,), **kwargs)
    try:
        compiled._init_handles()
        regs, shared = int(compiled.n_regs), int(compiled.metadata.shared)
    except Exception:  # noqa: BLE001 - unknown compiled-kernel layout: one program per SM always fits
        return sm_count(device)
    per_sm = occupancy(regs, shared, kwargs["num_warps"], limits=device_limits(device))
    return min(per_sm, MAX_PROGRAMS_PER_SM_SYNC) * sm_count(device)


@functools.lru_cache(maxsize=1024)
def plan(problem: Problem, config: BackwardConfig, device: torch.device, int64: bool, hint: int = 1,
         column_groups: int = 1) -> Plan:
    """The cached plan. `int64`: offsets need 64 bits; `hint`: the row width and strides are multiples of it
    (`heuristics.alignment_hint`); `column_groups`: groups of `problem.N` columns side by side, each a problem
    of its own, run in the same launches (`Strategy.plan`). A feature the device lacks runs in its portable form,
    validated there (`capabilities.checked`: a config the call's selection or its explicit `config=` check
    already validated for this problem and device is not validated again)."""
    config = checked(problem, config, device_limits(device))
    if problem.M == 0:
        return Plan(problem, config, 0, interpret_mode(), {}, reads_mean=reads_mean(problem))
    if column_groups > 1:
        return config.strategy.plan(problem, config, target(device), int64, hint, column_groups)
    return config.strategy.plan(problem, config, target(device), int64, hint)


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
                 dh: torch.Tensor | None = None, z: torch.Tensor | None = None, dz: torch.Tensor | None = None,
                 column_groups: int = 1):
        """`plans`: the caller's memo of `plan` for this (problem, config, device), keyed by the row strides of
        grad, saved, dx and dh (which decide int64 indexing and the alignment hint; the runtime keeps one memo per
        resolved call, so that a call does not hash the problem and config again). `dh`: the residual stream's
        gradient rows, which a residual problem needs (grad_input = dh + the norm's dx, in dh's dtype). `z`: the
        gate rows, which a gated problem needs; its gradient goes to `dz` (allocated here where not given: `.dz`).
        `column_groups` > 1: the rows (and weight, outputs) are that many groups of `problem.N` columns side by
        side, each normalized on its own with its statistics in `rstd` group by group (each M long, as the gated
        forward stores them); every group runs in the same launch of each kernel."""
        M, N = problem.M, problem.N * column_groups
        device = grad.device
        if problem.residual != (dh is not None):
            raise ValueError("dh (the residual stream's gradient) is needed exactly when the problem has a residual")
        if (problem.gate is not None) != (z is not None):
            raise ValueError("z (the gate) is needed exactly when the problem has a gate")
        g_stride, s_stride = grad.stride(0), saved.stride(0)
        dh_arg, dh_stride = (grad, g_stride) if dh is None else (dh, dh.stride(0))
        if dx is None:  # allocated here: contiguous and aligned
            dx = torch.empty(M, N, dtype=dh_arg.dtype, device=device)
            dx_stride, dx_align = N, 0
        else:
            dx_stride, dx_align = dx.stride(0), dx.data_ptr() & 15
        self.dx = dx
        strides = (g_stride, s_stride, dx_stride) if dh is None else (g_stride, s_stride, dx_stride, dh_stride)
        if z is None:
            z_arg, z_stride, dz_arg, dz_stride = grad, g_stride, dx, dx_stride
        else:
            if dz is None:
                dz = torch.empty(M, N, dtype=z.dtype, device=device)
            z_arg, z_stride, dz_arg, dz_stride = z, z.stride(0), dz, dz.stride(0)
            strides += (z_stride, dz_stride)
        self.dz = dz
        memo = strides if column_groups == 1 else (*strides, "column_groups", column_groups)
        pl = plans.get(memo) if plans is not None else None
        if pl is None:
            pl = plan(problem, config, device, needs_int64(M, N, *strides), alignment_hint(problem.N, *strides),
                      column_groups)
            if plans is not None:
                if len(plans) >= MAX_PLANS_PER_CALL:  # e.g. rows sliced from ever new widths: start over
                    plans.clear()
                plans[memo] = pl
        self.plan = pl
        self.problem, self.config = problem, config
        has_w, has_b = problem.has_weight, bool(problem.has_bias)
        wdt = weight.dtype if weight is not None else grad.dtype
        self.dw = dw = torch.empty(N, dtype=wdt, device=device) if has_w else None
        self.db = db = torch.empty(N, dtype=bias.dtype if bias is not None else wdt, device=device) if has_b else None
        # Absent tensors get a placeholder pointer (rstd) that the kernels never dereference.
        weight_arg = weight if weight is not None else rstd
        bias_arg = bias if bias is not None else rstd
        mean_arg = mean if pl.reads_mean else rstd
        # What Triton's specialization of these launches depends on beyond the plan: the row strides and the
        # alignment of the tensors this call did not allocate (see launcher.py).
        self._key = (g_stride, s_stride, dx_stride, grad.data_ptr() & 15, saved.data_ptr() & 15, dx_align,
                     weight_arg.data_ptr() & 15, bias_arg.data_ptr() & 15, rstd.data_ptr() & 15,
                     mean_arg.data_ptr() & 15)
        if dh is not None:
            self._key += (dh_stride, dh.data_ptr() & 15)
        if z is not None:
            self._key += (z_stride, dz_stride, z.data_ptr() & 15, dz.data_ptr() & 15)
        if M == 0:
            self._args_1 = self._args_2 = ()
            self.partial_dw = self.partial_db = None
            return
        # The plan's fp32 scratch (partial rows, a split row's exchange, per-row sums): the stream's, not
        # allocated per call (`workspace.scratch`).
        self._args_1, self._args_2, self.partial_dw, self.partial_db = pl.bind(
            grad, g_stride, saved, s_stride, dx, dx_stride, dh_arg, dh_stride, z_arg, z_stride, dz_arg, dz_stride,
            weight_arg, bias_arg, rstd, mean_arg,
            rstd if dw is None else dw, rstd if db is None else db,
            scratch(device, pl.scratch) if pl.scratch else (), sync_counters(device) if pl.waits else None)

    @property
    def programs(self) -> int:
        """kernel_1's grid (0 for M = 0)."""
        return self.plan.programs

    @property
    def pdl(self) -> bool:
        """kernel_2 is launched with programmatic dependent launch (it then waits inside its own time)."""
        return self.plan.pdl

    @property
    def has_kernel_2(self) -> bool:
        """A second kernel runs after kernel_1 (not for dual, columns or the fused reduction, nor M = 0)."""
        return self.plan.programs > 0 and bool(self.plan.stage_2)

    @property
    def partial_rows(self) -> int:
        """Rows of the fp32 partial buffers kernel_1 writes and kernel_2 reads (0: none)."""
        return self.plan.partial_rows

    @property
    def arguments(self) -> tuple:
        """The runtime arguments of each launch: kernel_1's stage, then kernel_2's."""
        return self._args_1 + self._args_2

    def kernel_1(self) -> None:
        pl = self.plan
        if pl.programs == 0:
            return
        for step, args in zip(pl.stage_1, self._args_1):
            step.launch(step.grid, args, self._key)

    def kernel_2(self) -> None:
        pl = self.plan
        if pl.programs == 0:  # M = 0: the sums over no rows are zero
            for out in (self.dw, self.db):
                if out is not None:
                    out.zero_()
            return
        for step, args in zip(pl.stage_2, self._args_2):
            step.launch(step.grid, args, self._key)

    def run(self):
        self.kernel_1()
        self.kernel_2()
        return self.dx, self.dw, self.db


def compile_ahead_args(problem: Problem, config: BackwardConfig, device: torch.device) -> tuple:
    """(plan, each launch's arguments as a compile ahead passes them): placeholder dtypes for the tensors and
    the integers of contiguous rows, the specialization of a launch on such inputs."""
    int64, hint = needs_int64(problem.M, problem.N), alignment_hint(problem.N)
    pl = plan(problem, config, device, int64, hint)
    ops, dw, db = placeholders(problem)
    args_1, args_2, _, _ = pl.bind(*ops, dw, db, placeholder_work(pl.scratch),
                                   PLACEHOLDER_COUNTERS if pl.waits else None)
    return pl, args_1 + args_2


def precompile(problem: Problem, config: BackwardConfig, sms: int, device: torch.device | None = None) -> None:
    """Compile the kernels for (problem, config) without launching them, as the first real launch would
    (contiguous rows, the same integer specialization), so that Triton's on-disk cache serves the launch.
    Used by the tuner's compile-ahead workers; needs the GPU's driver but no data."""
    if problem.M == 0:
        checked(problem, config)
        return
    device = device or torch.device("cuda", torch.cuda.current_device())
    pl, args = compile_ahead_args(problem, config, device)
    for step, step_args in zip(pl.stage_1 + pl.stage_2, args):
        step.kernel.warmup(*step_args, grid=(step.grid,), **step.kwargs)
