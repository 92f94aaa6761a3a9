"""The residual form's torch.library custom ops and autograd: `normtune::norm_residual_forward` and
`normtune::norm_residual_backward`, and `EagerFusedAdd` for eager calls (as `ops.EagerNorm` is for the plain norm).

    h = x + residual  (added in fp32, stored in the residual stream's dtype)
    y = norm(h)
    backward: d = dh + norm_backward(dy), the gradient of both x and residual (one tensor; cast only where x or
    residual has another dtype than h)

Inputs here are checked 2-D views (`residual.py` checks and reshapes). The backward saves h (save="input") or y
(save="output"), with rstd and mean, as the plain norm saves x or y.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import forward as _forward
from . import composite, forward_calls, reference, saving
from .call_checks import rows_2d
from .device import use_triton
from .ops import backward_impl, empty_placeholder, contiguous_operand


def forward_impl(x, residual, weight, bias, eps, is_rms, zero_centered, save_output, h_dtype, y=None, h=None):
    """(y, h, rstd, mean); mean is None unless LayerNorm saves from the input. y and h: rows to write them to
    (both or neither; None: allocated here)."""
    store_mean = not is_rms and not save_output
    if use_triton(x):
        return _forward.forward_residual(x, residual, weight, bias, eps, h_dtype=h_dtype, is_rms=is_rms,
                                         zero_centered=zero_centered, store_mean=store_mean, y=y, h=h)
    y_ref, h_ref, rstd, mean = reference.forward_residual(x, residual, weight, bias, eps, h_dtype=h_dtype,
                                                          is_rms=is_rms, zero_centered=zero_centered,
                                                          store_mean=store_mean)
    if y is None:
        return y_ref, h_ref, rstd, mean
    return y.copy_(y_ref), h.copy_(h_ref), rstd, mean


@torch.library.custom_op("normtune::norm_residual_forward", mutates_args=())
def norm_residual_forward(x: Tensor, residual: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float,
                          is_rms: bool, zero_centered: bool, save_output: bool, h_dtype: torch.dtype,
                          config: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """y, h (in h_dtype), rstd (fp32) and mean (fp32; empty unless LayerNorm saves from the input)."""
    if save_output and not saving.recovers(weight, bias, x.dtype, zero_centered):
        raise RuntimeError(saving.refusal("save='output' under torch.compile (normtune::norm_residual_forward)"))
    y, h, rstd, mean = forward_impl(x, residual, weight, bias, eps, is_rms, zero_centered, save_output, h_dtype)
    return y, h, rstd, mean if mean is not None else empty_placeholder(rstd)


@norm_residual_forward.register_fake
def _(x, residual, weight, bias, eps, is_rms, zero_centered, save_output, h_dtype, config):
    M = x.shape[0]
    store_mean = not is_rms and not save_output
    return (x.new_empty(x.shape), x.new_empty(x.shape, dtype=h_dtype), x.new_empty((M,), dtype=torch.float32),
            x.new_empty((M if store_mean else 0,), dtype=torch.float32))


@torch.library.custom_op("normtune::norm_residual_backward", mutates_args=())
def norm_residual_backward(grad: Tensor, grad_h: Tensor, saved: Tensor, weight: Optional[Tensor],
                           bias: Optional[Tensor], rstd: Tensor, mean: Tensor, is_rms: bool, zero_centered: bool,
                           save_output: bool, config: str) -> tuple[Tensor, Tensor, Tensor]:
    """(d, dw, db): d = grad_h + the norm's grad_input, in grad_h's dtype; dw/db empty where absent."""
    if save_output and not saving.recovers(weight, bias, grad.dtype, zero_centered):
        raise RuntimeError(saving.refusal("normtune::norm_residual_backward from the output"))
    d, dw, db = backward_impl(grad, saved, contiguous_operand(weight), contiguous_operand(bias), rstd, mean, is_rms,
                               zero_centered, save_output, config, dh=grad_h)
    return d, dw if dw is not None else empty_placeholder(grad), db if db is not None else empty_placeholder(grad)


@norm_residual_backward.register_fake
def _(grad, grad_h, saved, weight, bias, rstd, mean, is_rms, zero_centered, save_output, config):
    d = grad_h.new_empty(grad_h.shape)
    dw = weight.new_empty(weight.shape) if weight is not None else grad.new_empty((0,))
    db = bias.new_empty(bias.shape) if bias is not None else grad.new_empty((0,))
    return d, dw, db


def _grads(d: Tensor, x_dtype: torch.dtype, residual_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The gradients of x and residual from d (h's gradient): d itself where the dtypes agree (one tensor)."""
    return (d if d.dtype == x_dtype else d.to(x_dtype)), (d if d.dtype == residual_dtype else d.to(residual_dtype))


def _passed_through(grad_h, x_dtype: torch.dtype, residual_dtype: torch.dtype) -> tuple:
    """The gradients of x and residual where y got none: h's own (None where h got none too). The saved tensors
    are not read, so h may have been changed in place since the forward (its norm's result was never used)."""
    return (None, None) if grad_h is None else _grads(grad_h, x_dtype, residual_dtype)


def _materialized(grad_y, grad_h, saved, x_dtype, h_dtype):
    """dy and dh, a zero tensor standing for one that got no gradient."""
    if grad_y is None:
        grad_y = torch.zeros(saved.shape, dtype=x_dtype, device=saved.device)
    if grad_h is None:
        grad_h = torch.zeros(saved.shape, dtype=h_dtype, device=saved.device)
    return grad_y, grad_h


def _setup_context(ctx, inputs, output):
    x, residual, weight, bias, eps, is_rms, zero_centered, save_output, h_dtype, config = inputs
    y, h, rstd, mean = output
    ctx.save_for_backward(y if save_output else h, weight, bias, rstd, mean)
    ctx.flags = (is_rms, zero_centered, save_output, config, x.dtype, residual.dtype, h_dtype)
    ctx.mark_non_differentiable(rstd, mean)


def _autograd_backward(ctx, grad_y, grad_h, _grad_rstd, _grad_mean):
    is_rms, zero_centered, save_output, config, x_dtype, residual_dtype, h_dtype = ctx.flags
    if grad_y is None:  # y unused: h's gradient passes through, the norm's parameters get none
        return _passed_through(grad_h, x_dtype, residual_dtype) + (None,) * 8
    saved, weight, bias, rstd, mean = ctx.saved_tensors
    grad_y, grad_h = _materialized(grad_y, grad_h, saved, x_dtype, h_dtype)
    d, dw, db = norm_residual_backward(grad_y, grad_h, saved, weight, bias, rstd, mean, is_rms, zero_centered,
                                       save_output, config)
    dx, dr = _grads(d, x_dtype, residual_dtype)
    return (dx, dr, dw if weight is not None else None, db if bias is not None else None,
            None, None, None, None, None, None)


norm_residual_forward.register_autograd(_autograd_backward, setup_context=_setup_context)


class EagerFusedAdd(torch.autograd.Function):
    """The custom ops' forward and backward for eager calls (a plain autograd.Function skips the custom ops'
    dispatch layers); returns (y, h), both in x's shape. An output that gets no gradient counts as a zero one.
    A backward under create_graph=True runs the differentiable composite (`composite.py`) on h, as `EagerNorm`'s
    does on x, so second-order gradients reach x and residual through h (save="output" raises there).

    x and residual come as the caller passed them (checked). A call with a `forward_calls` plan launches on them
    in place (h_dtype None: the plan's); a checked call takes their rows (a view, or a copy where the rows need one) and, given the call's
    signature, stores the plan for later calls. Both save h (or y) in x's shape, so that activation
    checkpointing's recompute, which may be a planned call where the forward was a first one, saves the same
    shapes."""

    @staticmethod
    def forward(ctx, x, residual, weight, bias, eps, is_rms, zero_centered, save_output, config, h_dtype, plan=None,
                sig=None):
        if plan is None:
            x2d, r2d = rows_2d(x), rows_2d(residual)
            # y and h allocated in x's shape, not views of rows: autograd refuses in-place changes of an output
            # that is a view when a Function returns several
            y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
            h = torch.empty(x.shape, dtype=h_dtype, device=x.device)
            _, _, rstd, mean = forward_impl(x2d, r2d, weight, bias, eps, is_rms, zero_centered, save_output,
                                            h_dtype, y.view(x2d.shape), h.view(x2d.shape))
            if sig is not None:
                forward_calls.remember_residual(sig, x, x2d, residual, r2d, weight, bias, h_dtype, is_rms,
                                                zero_centered, save_output)
        else:
            y, h, rstd, mean = forward_calls.run_residual(plan, x, residual, weight, bias, eps)
        ctx.save_for_backward(y if save_output else h, weight, bias, rstd, mean)
        ctx.flags = (is_rms, zero_centered, save_output, config, x.dtype, residual.dtype, h.dtype, eps)
        ctx.set_materialize_grads(False)
        return y, h

    @staticmethod
    def backward(ctx, grad_y, grad_h):
        is_rms, zero_centered, save_output, config, x_dtype, residual_dtype, h_dtype, eps = ctx.flags
        if grad_y is None:  # y unused: h's gradient passes through, the norm's parameters get none
            return _passed_through(grad_h, x_dtype, residual_dtype) + (None,) * 10
        saved, weight, bias, rstd, mean = ctx.saved_tensors
        grad_y, grad_h = _materialized(grad_y, grad_h, saved, x_dtype, h_dtype)
        if composite.needs_graph(grad_y, grad_h, saved, weight, bias):  # create_graph=True: differentiable
            dxn, dw, db = composite.backward(grad_y.float(), saved, weight, bias, eps, is_rms=is_rms,
                                             zero_centered=zero_centered, save_output=save_output)
            dx, dr = _grads((grad_h.float() + dxn).to(h_dtype), x_dtype, residual_dtype)
            return (dx, dr, dw, db) + (None,) * 8
        shape = saved.shape
        if len(shape) != 2:  # the kernels take rows
            N = shape[-1]
            grad_y, grad_h, saved = grad_y.reshape(-1, N), grad_h.reshape(-1, N), saved.view(-1, N)
        d, dw, db = backward_impl(grad_y, saved, weight, bias, rstd, mean, is_rms, zero_centered, save_output,
                                   config, dh=grad_h)
        if len(shape) != 2:
            d = d.view(shape)
        dx, dr = _grads(d, x_dtype, residual_dtype)
        return (dx, dr, dw if weight is not None else None, db if bias is not None else None,
                None, None, None, None, None, None, None, None)


def _eager_apply():
    """`EagerFusedAdd.apply` without its Python wrapper's per-call work, as `ops._eager_apply` for `EagerNorm`;
    None where this torch lacks those entry points."""
    try:
        return super(torch.autograd.Function, EagerFusedAdd).apply, torch._C._functorch.unwrap_if_dead, \
            torch._C._are_functorch_transforms_active
    except AttributeError:
        return None


_EAGER = _eager_apply()


def eager_fused_add(x, residual, weight, bias, eps, is_rms, zero_centered, save_output, config, h_dtype, plan=None,
                    sig=None) -> tuple[Tensor, Tensor]:
    """(y, h) = EagerFusedAdd.apply(...), at less host cost per call; under torch.func's transforms, the
    differentiable composite (`composite.forward_residual`), which they can differentiate and batch."""
    if _EAGER is None or _EAGER[2]():
        if composite.transforms_active():
            if h_dtype is None:  # a planned call: the plan's
                h_dtype = _forward.residual_plan_h_dtype(plan)
            return composite.forward_residual(x, residual, weight, bias, eps, is_rms=is_rms,
                                              zero_centered=zero_centered, h_dtype=h_dtype)
        return EagerFusedAdd.apply(x, residual, weight, bias, eps, is_rms, zero_centered, save_output, config,
                                   h_dtype, plan, sig)
    apply, unwrap, _ = _EAGER
    return apply(unwrap(x), unwrap(residual), weight if weight is None else unwrap(weight),
                 bias if bias is None else unwrap(bias), eps, is_rms, zero_centered, save_output, config, h_dtype,
                 plan, sig)
