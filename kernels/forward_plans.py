"""Forward calls planned ahead (`api/forward_calls.py`): what a later forward on inputs like an earlier call's
needs to allocate its outputs and launch without deriving anything again, per form: `call_plan`/`run_plan` (the
plain norm), `residual_call_plan`/`run_residual_plan` (the residual form), `gated_call_plan`/`run_gated_plan` (the
gated form over the whole width)."""

from __future__ import annotations

import torch

from .forward import launch_key, planned
from .launcher import data_ptr


def call_plan(x: torch.Tensor, x2d: torch.Tensor, weight, bias, is_rms: bool, zero_centered: bool,
              store_mean: bool) -> tuple | None:
    """What a later forward on inputs like these (same shape, strides, dtypes, device, alignment) needs to allocate
    its outputs and launch without deriving anything again (`run_plan`): None where `x2d` is a copy of `x`, or
    there are no rows. Outputs: like x where x is contiguous, else (rows, width) viewed as x's shape."""
    M, N = x2d.shape
    if M == 0 or data_ptr(x2d) != data_ptr(x):
        return None
    x_stride = x2d.stride(0)
    rstd = torch.empty(1, dtype=torch.float32, device=x.device)  # stands in for the fresh, aligned outputs
    w = rstd if weight is None else weight
    b = rstd if bias is None else bias
    key = launch_key(x2d, x_stride, w, b, weight is None, bias is None, is_rms, zero_centered, store_mean)
    launch, grid = planned(key, M, N, x_stride, N, weight is not None, bias is not None, is_rms, zero_centered,
                            store_mean)
    contiguous = x.is_contiguous()
    return launch, grid, key, M, N, x_stride, contiguous, None if contiguous or x.dim() == 2 else x.shape, store_mean


def run_plan(plan: tuple, x: torch.Tensor, weight, bias, eps: float, device: torch.device):
    """(y, rstd, mean) of a forward on inputs that match `plan` (see `call_plan`); mean None unless stored."""
    launch, grid, key, M, N, x_stride, contiguous, view_shape, store_mean = plan
    y = torch.empty_like(x) if contiguous else torch.empty(M, N, dtype=x.dtype, device=device)
    rstd = torch.empty(M, dtype=torch.float32, device=device)
    mean = torch.empty(M, dtype=torch.float32, device=device) if store_mean else None
    launch(grid, (x, x_stride, y, N, x, x_stride, y, N, x, x_stride, rstd if weight is None else weight,
                  rstd if bias is None else bias, rstd, mean if store_mean else rstd, M, N, eps), key)
    return (y if view_shape is None else y.view(view_shape)), rstd, mean


def residual_call_plan(x: torch.Tensor, x2d: torch.Tensor, residual: torch.Tensor, residual2d: torch.Tensor,
                       weight, bias, h_dtype: torch.dtype, is_rms: bool, zero_centered: bool,
                       store_mean: bool) -> tuple | None:
    """`call_plan` of the residual form: None where `x2d` or `residual2d` is a copy, or there are no rows. Outputs
    (y and h) are allocated contiguous in x's shape."""
    M, N = x2d.shape
    if M == 0 or data_ptr(x2d) != data_ptr(x) or data_ptr(residual2d) != data_ptr(residual):
        return None
    strides = (x2d.stride(0), N, residual2d.stride(0), N)
    rstd = torch.empty(1, dtype=torch.float32, device=x.device)  # stands in for the fresh, aligned outputs
    w = rstd if weight is None else weight
    b = rstd if bias is None else bias
    key = launch_key(x2d, strides[0], w, b, weight is None, bias is None, is_rms, zero_centered, store_mean)
    key += (strides, residual2d.dtype, h_dtype, 0, data_ptr(residual2d) & 15, 0, 0, 0)
    launch, grid = planned(key, M, N, strides[0], N, weight is not None, bias is not None, is_rms, zero_centered,
                            store_mean, strides[2:])
    return launch, grid, key, M, N, strides[0], strides[2], h_dtype, store_mean


def run_residual_plan(plan: tuple, x: torch.Tensor, residual: torch.Tensor, weight, bias, eps: float,
                      device: torch.device):
    """(y, h, rstd, mean) of a residual forward on inputs that match `plan` (`residual_call_plan`): y and h in
    x's shape; mean None unless stored."""
    launch, grid, key, M, N, x_stride, r_stride, h_dtype, store_mean = plan
    shape = x.shape
    y = torch.empty(shape, dtype=x.dtype, device=device)
    h = torch.empty(shape, dtype=h_dtype, device=device)
    rstd = torch.empty(M, dtype=torch.float32, device=device)
    mean = torch.empty(M, dtype=torch.float32, device=device) if store_mean else None
    launch(grid, (x, x_stride, y, N, residual, r_stride, h, N, x, x_stride, rstd if weight is None else weight,
                  rstd if bias is None else bias, rstd, mean if store_mean else rstd, M, N, eps), key)
    return y, h, rstd, mean


def residual_plan_h_dtype(plan: tuple) -> torch.dtype:
    """The dtype of h that a residual plan (`residual_call_plan`) writes."""
    return plan[7]


def gated_call_plan(x: torch.Tensor, x2d: torch.Tensor, z: torch.Tensor, z2d: torch.Tensor, weight,
                    gate_after: bool, sigmoid: bool, zero_centered: bool, groups: int = 1) -> tuple | None:
    """`call_plan` of the gated form (`forward.forward_gated`, statistics per group of N / `groups` columns, every
    group in one launch): None where `x2d` or `z2d` is a copy, or there are no rows. y is allocated contiguous in
    x's shape."""
    M, N = x2d.shape
    if M == 0 or data_ptr(x2d) != data_ptr(x) or data_ptr(z2d) != data_ptr(z):
        return None
    strides = (x2d.stride(0), N, z2d.stride(0))
    rstd = torch.empty(1, dtype=torch.float32, device=x.device)  # stands in for the fresh, aligned outputs
    w = rstd if weight is None else weight
    key = launch_key(x2d, strides[0], w, rstd, weight is None, True, True, zero_centered, False)
    key += ("gate", gate_after, sigmoid, strides, z2d.dtype, groups, 0, data_ptr(z2d) & 15, 0)
    launch, grid = planned(key, M, N // groups, strides[0], N, weight is not None, False, True, zero_centered, False,
                           (), (gate_after, sigmoid, strides[2]), groups)
    return launch, grid, key, M, N // groups, strides[0], strides[2], N, groups


def run_gated_plan(plan: tuple, x: torch.Tensor, z: torch.Tensor, weight, eps: float, device: torch.device):
    """(y, rstd) of a gated forward on inputs that match `plan` (`gated_call_plan`): y in x's shape, rstd the
    groups' rows one group after another."""
    launch, grid, key, M, width, x_stride, z_stride, N, groups = plan
    y = torch.empty(x.shape, dtype=x.dtype, device=device)
    rstd = torch.empty(groups * M, dtype=torch.float32, device=device)
    launch(grid, (x, x_stride, y, N, x, x_stride, y, N, z, z_stride, rstd if weight is None else weight, rstd, rstd,
                  rstd, M, width, eps), key)
    return y, rstd
