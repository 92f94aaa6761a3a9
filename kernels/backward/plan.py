"""What a backward's launch plan is, whatever the strategy: the device facts it is built for (`Target`), its
launches (`Step`: a kernel, its compile-time arguments and grid, in two stages: kernel_1's, then kernel_2's), the
fp32 scratch it needs, and how one call's tensors bind to each launch's arguments (`Plan.bind`). Each strategy's
plan is built in its own module (`strategies/<name>_launch.py`); `launch.py` looks it up by strategy and launches.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import torch

from ..launcher import Launcher
from ..limits import DeviceLimits
from ..problem import RECOVER_LIMITS, Problem

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class GroupsNotResident(ValueError):
    """A config whose programs wait for each other (split rows, the fused reduction) cannot run every column group
    of a grouped call in one launch: their programs do not all fit the GPU at once. The call runs group by group."""


@dataclasses.dataclass(frozen=True)
class Target:
    """The device a plan is built for, read once per plan (`launch.plan`)."""

    device: torch.device
    sms: int
    limits: DeviceLimits
    phased: bool  # interpreter: kernels whose programs wait for each other run as two launches (common.py)
    pdl: bool  # this Triton and this device launch a kernel with programmatic dependent launch
    # (kernel, args, kwargs, grid) -> programs of that compiled kernel the device runs at once (every SM full)
    resident: Callable[[Any, tuple, dict, int], int]


class Operands(NamedTuple):
    """The arguments every kernel_1 takes first, in this order (`Plan.bind` takes them first). Absent
    tensors hold a placeholder pointer the kernels never dereference (rstd); without a residual, dh's place holds
    grad and its stride; without a gate, z's holds grad and dz's dx, with their strides."""

    grad: Any
    g_stride: int
    saved: Any
    s_stride: int
    dx: Any
    dx_stride: int
    dh: Any
    dh_stride: int
    z: Any
    z_stride: int
    dz: Any
    dz_stride: int
    weight: Any
    bias: Any
    rstd: Any
    mean: Any


@dataclasses.dataclass(frozen=True)
class Step:
    """One launch: `kernel` on `grid` programs with compile-time arguments `kwargs`, through `launch`."""

    kernel: Any
    kwargs: dict
    grid: int
    launch: Launcher

    @classmethod
    def of(cls, kernel: Any, kwargs: dict, grid: int) -> "Step":
        return cls(kernel, kwargs, grid, Launcher(kernel, kwargs))


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything about one backward that does not depend on the tensors' addresses. A strategy's plan (a
    subclass) adds what its `bind` needs."""

    problem: Problem
    config: Any  # the strategy's BackwardConfig (strategies/configs.py; the strategies import this module)
    programs: int  # kernel_1's grid (0: nothing to launch, M = 0)
    phased: bool
    k1_kwargs: dict  # kernel_1's compile-time arguments
    stage_1: tuple[Step, ...] = ()  # kernel_1's launches, in order
    stage_2: tuple[Step, ...] = ()  # kernel_2's (none: nothing launched after kernel_1)
    scratch: tuple = ()  # fp32 scratch shapes (`workspace.scratch`), None where absent
    partial_rows: int = 0  # rows of the fp32 partial dw/db buffers kernel_1 writes and kernel_2 reads
    waits: bool = False  # kernel_1's programs wait for each other: it takes the stream's sync counters
    pdl: bool = False  # kernel_2 launches with programmatic dependent launch
    reads_mean: bool = False  # the kernels read the saved mean (LayerNorm from its input); else rstd holds its place

    def bind(self, grad, g_stride, saved, s_stride, dx, dx_stride, dh, dh_stride, z, z_stride, dz, dz_stride, weight,
             bias, rstd, mean, dw, db, work: tuple, counters: tuple | None) -> tuple:
        """(stage_1's arguments, stage_2's arguments, partial_dw, partial_db) for one call: the `Operands`, then
        dw/db (rstd where absent), `work` the scratch tensors of `scratch`, `counters` the sync counters where
        `waits`. Placeholder dtypes in place of the tensors give the arguments a compile ahead specializes on
        (`launch.precompile`)."""
        return (), (), None, None


def reads_mean(p: Problem) -> bool:
    """The backward reads the saved row means (LayerNorm recomputing x̂ from its input)."""
    return p.norm == "layer_norm" and p.save == "input"


def flags(p: Problem, hint: int) -> dict:
    """The problem's compile-time flags, as every backward kernel that reads rows takes them (the gate's too)."""
    return dict(IS_RMS=p.norm == "rms_norm", HAS_WEIGHT=p.has_weight, HAS_BIAS=bool(p.has_bias),
                ZERO_CENTERED=p.zero_centered, FROM_OUTPUT=p.save == "output", RECOVER_LIMIT=RECOVER_LIMITS[p.dtype],
                HINT=hint, HAS_GATE=p.gate is not None, GATE_AFTER=p.gate == "after",
                GATE_SIGMOID=p.gate_activation == "sigmoid")


def k1_flags(p: Problem, hint: int) -> dict:
    """`flags` of the kernels that write grad_input (kernel_1 of every strategy), with the residual's."""
    return dict(flags(p, hint), HAS_DRES=p.residual)


def placeholders(p: Problem) -> tuple[Operands, Any, Any]:
    """(operands, dw, db) as dtypes (aligned pointers, as a launch's buffers are) and the strides of contiguous
    rows, for compiling without data: the same specialization as a launch on them. A residual problem's saved
    input (h), grad_input and dh are in the residual dtype; a gated problem's z and dz in the activation dtype."""
    act, wdt, f32 = TORCH_DTYPES[p.dtype], TORCH_DTYPES[p.weight_dtype], torch.float32
    res = TORCH_DTYPES[p.residual_dtype] if p.residual else act
    saved = res if p.save == "input" else act
    ops = Operands(act, p.N, saved, p.N, res, p.N, res, p.N, act, p.N, res, p.N, wdt if p.has_weight else f32,
                   wdt if p.has_bias else f32, f32, f32)
    return ops, wdt if p.has_weight else f32, wdt if p.has_bias else f32


def placeholder_work(shapes: tuple) -> tuple:
    """fp32 placeholders for the scratch of `shapes` (None stays None)."""
    return tuple(None if shape is None else torch.float32 for shape in shapes)


PLACEHOLDER_COUNTERS = (torch.int32, torch.int32, torch.int32)
