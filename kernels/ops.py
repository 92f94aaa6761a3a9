"""torch.library custom ops and their autograd: `normtune::norm_forward` and `normtune::norm_backward`.

Registered ops (with fake implementations) let `torch.compile(fullgraph=True)` trace through normtune without
looking inside the Triton launches. Inputs here are already checked 2-D views (rows may be strided, the last
dimension is contiguous); `functional.py` does the checking and reshaping. Launch logic lives in `forward.py`
and `backward.py`; this module only dispatches between the Triton kernels and the pure-PyTorch path.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch
from torch import Tensor

from . import backward as _backward
from . import composite
from . import forward as _forward
from . import forward_calls
from . import reference
from . import saving
from .config import BackwardConfig, Problem
from .device import compute_capability, device_limits, device_name, use_triton
from .select import on_clear, resolve_config


def empty_placeholder(like: Tensor) -> Tensor:
    return like.new_empty((0,))


def contiguous_operand(t: Optional[Tensor]) -> Optional[Tensor]:
    """weight or bias as the kernels read it, N contiguous elements: a strided or expanded one is copied (under
    autograd the copy is differentiable, so its gradient reaches the tensor passed, with that tensor's layout)."""
    return t if t is None or t.is_contiguous() else t.contiguous()


@functools.lru_cache(maxsize=4096)
def _problem(M, N, dtype, weight_dtype, has_weight, has_bias, is_rms, zero_centered, save_output,
             residual_dtype=None) -> Problem:
    """Built (and validated) once per shape and flags (`resolved`); `residual_dtype`: dh's dtype in the residual
    form (None: no residual)."""
    return Problem(norm="rms_norm" if is_rms else "layer_norm", M=M, N=N, dtype=dtype, weight_dtype=weight_dtype,
                   has_weight=has_weight, has_bias=has_bias, zero_centered=zero_centered,
                   save="output" if save_output else "input", residual=residual_dtype is not None,
                   residual_dtype=residual_dtype)


@torch.library.custom_op("normtune::norm_forward", mutates_args=())
def norm_forward(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float, is_rms: bool,
                 zero_centered: bool, save_output: bool, config: str) -> tuple[Tensor, Tensor, Tensor]:
    """y, rstd (fp32) and mean (fp32; empty unless LayerNorm saves from the input). `config` is carried to the
    backward (JSON text, "" for automatic selection)."""
    weight, bias = contiguous_operand(weight), contiguous_operand(bias)
    if save_output and not saving.recovers(weight, bias, x.dtype, zero_centered):
        raise RuntimeError(saving.refusal("save='output' under torch.compile (normtune::norm_forward)"))
    y, rstd, mean = forward_impl(x, weight, bias, eps, is_rms, zero_centered, save_output)
    return y, rstd, mean if mean is not None else empty_placeholder(rstd)


def forward_impl(x, weight, bias, eps, is_rms, zero_centered, save_output):
    """(y, rstd, mean); mean is None unless LayerNorm saves from the input (and off the Triton path, a tensor)."""
    store_mean = not is_rms and not save_output
    impl = _forward.forward if use_triton(x) else reference.forward
    return impl(x, weight, bias, eps, is_rms=is_rms, zero_centered=zero_centered, store_mean=store_mean)


@norm_forward.register_fake
def _(x, weight, bias, eps, is_rms, zero_centered, save_output, config):
    M = x.shape[0]
    store_mean = not is_rms and not save_output
    return (x.new_empty(x.shape), x.new_empty((M,), dtype=torch.float32),
            x.new_empty((M if store_mean else 0,), dtype=torch.float32))


@torch.library.custom_op("normtune::norm_backward", mutates_args=())
def norm_backward(grad: Tensor, saved: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], rstd: Tensor,
                  mean: Tensor, is_rms: bool, zero_centered: bool, save_output: bool,
                  config: str) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dw, db); dw/db are empty tensors where there is no weight/bias."""
    if save_output and not saving.recovers(weight, bias, grad.dtype, zero_centered):
        raise RuntimeError(saving.refusal("normtune::norm_backward from the output"))
    dx, dw, db = backward_impl(grad, saved, contiguous_operand(weight), contiguous_operand(bias), rstd, mean, is_rms,
                                zero_centered, save_output, config)
    return dx, dw if dw is not None else empty_placeholder(grad), db if db is not None else empty_placeholder(grad)


@dataclasses.dataclass(frozen=True, eq=False)
class BackwardCall:
    """A backward call resolved: its problem, the config that runs it (validated for the problem on the device;
    None off the Triton path, where the reference backward runs) and the launch plans made for it (by row
    strides, `BackwardLaunch`'s memo). One per signature (`resolved`); an eager call with an explicit config
    carries its own from the forward to the backward, where the custom ops carry the config's JSON text."""

    problem: Problem
    config: Optional[BackwardConfig]
    plans: dict


# (rows, width, dtypes, flags, config (JSON text, "" to select, or a BackwardConfig), device) of a backward call
# → its `BackwardCall`. A call's config is resolved (selected or validated) once per key: the per-call host path
# is then a dict lookup.
_RESOLVED: dict[tuple, BackwardCall] = {}
MAX_RESOLVED = 4096


def resolved(rows: Tensor, M: int, N: int, weight, bias, is_rms, zero_centered, save_output, config,
             residual_dtype=None) -> BackwardCall:
    """The `BackwardCall` of a backward on M x N gradient rows with `rows`' dtype and device (the gradient, or
    the forward's input rows, which have its dtype): `config` is JSON text ("" selects one) or a
    `BackwardConfig`. An explicit config that does not fit raises `ConfigError` naming the field."""
    index = rows.get_device()  # -1 on CPU, where the interpreter setting decides the path
    key = (M, N, rows.dtype, weight.dtype if weight is not None else None, bias is not None, is_rms,
           zero_centered, save_output, config, index if index >= 0 else use_triton(rows), residual_dtype)
    hit = _RESOLVED.get(key)
    if hit is None:
        problem = _problem(M, N, rows.dtype, weight.dtype if weight is not None else None, weight is not None,
                           bias is not None, is_rms, zero_centered, save_output, residual_dtype)
        if use_triton(rows):
            cfg = resolve_config(problem, config, device_name(rows.device), compute_capability(rows.device),
                                 device_limits(rows.device) if rows.is_cuda else None)
        else:
            cfg = None
            if config:
                resolve_config(problem, config, None)  # an explicit config is checked on every path
        if len(_RESOLVED) >= MAX_RESOLVED:  # e.g. a new row count every step: start over rather than grow
            _RESOLVED.clear()
        hit = _RESOLVED[key] = BackwardCall(problem, cfg, {})
    return hit


def clear_resolved() -> None:
    """Forget resolved calls (`select.clear_caches` calls this when tables or settings change)."""
    _RESOLVED.clear()


on_clear(clear_resolved)


def backward_impl(grad, saved, weight, bias, rstd, mean, is_rms, zero_centered, save_output, config, dh=None):
    """(dx, dw, db), dw/db None where there is no weight/bias. `config`: JSON text ("" selects one), or the
    `BackwardCall` an explicit config resolved to for these rows (`call_checks.explicit_backward`). `dh`: the
    residual stream's gradient rows (the residual form), added into dx, which then has dh's dtype."""
    if grad.stride(-1) != 1:  # e.g. the expanded gradient of a sum(): give the kernels contiguous columns
        grad = grad.contiguous()
    if dh is not None and dh.stride(-1) != 1:
        dh = dh.contiguous()
    if type(config) is BackwardCall:
        call = config
    else:
        M, N = grad.shape
        call = resolved(grad, M, N, weight, bias, is_rms, zero_centered, save_output, config,
                        None if dh is None else dh.dtype)
    if call.config is not None:
        return _backward.BackwardLaunch(call.problem, call.config, grad, saved, weight, bias, rstd, mean,
                                        plans=call.plans, dh=dh).run()
    return reference.backward(grad, saved, weight, bias, rstd, mean, is_rms=is_rms, zero_centered=zero_centered,
                              from_output=save_output, dh=dh)


@norm_backward.register_fake
def _(grad, saved, weight, bias, rstd, mean, is_rms, zero_centered, save_output, config):
    dx = grad.new_empty(grad.shape)
    dw = weight.new_empty(weight.shape) if weight is not None else grad.new_empty((0,))
    db = bias.new_empty(bias.shape) if bias is not None else grad.new_empty((0,))
    return dx, dw, db


def _setup_context(ctx, inputs, output):
    x, weight, bias, eps, is_rms, zero_centered, save_output, config = inputs
    y, rstd, mean = output
    ctx.save_for_backward(y if save_output else x, weight, bias, rstd, mean)
    ctx.flags = (is_rms, zero_centered, save_output, config, eps)
    ctx.mark_non_differentiable(rstd, mean)


def _autograd_backward(ctx, grad_y, _grad_rstd, _grad_mean):
    saved, weight, bias, rstd, mean = ctx.saved_tensors
    is_rms, zero_centered, save_output, config, eps = ctx.flags
    if composite.needs_graph(grad_y, saved, weight, bias):  # create_graph=True: a differentiable backward
        dx, dw, db = composite.backward(grad_y, saved, weight, bias, eps, is_rms=is_rms, zero_centered=zero_centered,
                                        save_output=save_output)
    else:
        dx, dw, db = norm_backward(grad_y, saved, weight, bias, rstd, mean, is_rms, zero_centered, save_output,
                                   config)
    return (dx, dw if weight is not None else None, db if bias is not None else None,
            None, None, None, None, None)


norm_forward.register_autograd(_autograd_backward, setup_context=_setup_context)


class EagerNorm(torch.autograd.Function):
    """The same forward/backward as the custom ops, for eager calls: a plain autograd.Function skips the custom
    ops' dispatch layers (their host cost is paid on every layer of every step). torch.compile traces the custom
    ops instead (`functional.py` picks). Its one output is y: rstd and mean are saved, never returned, which
    spares autograd the bookkeeping of two more outputs on every call. `config` is what `backward_impl` takes:
    "" (selected), or the `BackwardCall` of an explicit config, validated once per signature."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, is_rms, zero_centered, save_output, config, plan=None):
        """x: rows (2-D), or x as the caller passed it where its rows are a view of it (y then has x's shape).
        A call with a `forward_calls` plan passes x as the caller did; so does the checked call before it, so that
        both save tensors of the same shapes (activation checkpointing's recompute compares them with the
        forward's, and one may be a first call, the other a planned one)."""
        if plan is None:
            rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
            y, rstd, mean = forward_impl(rows, weight, bias, eps, is_rms, zero_centered, save_output)
            if rows is not x:
                y = y.view(x.shape)
        else:
            y, rstd, mean = forward_calls.run(plan, x, weight, bias, eps)
        ctx.save_for_backward(y if save_output else x, weight, bias, rstd, mean)
        ctx.flags = (is_rms, zero_centered, save_output, config, eps)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        saved, weight, bias, rstd, mean = ctx.saved_tensors
        is_rms, zero_centered, save_output, config, eps = ctx.flags
        if composite.needs_graph(grad_y, saved, weight, bias):  # create_graph=True: a differentiable backward
            dx, dw, db = composite.backward(grad_y, saved, weight, bias, eps, is_rms=is_rms,
                                            zero_centered=zero_centered, save_output=save_output)
            return dx, dw, db, None, None, None, None, None, None
        shape = grad_y.shape
        if len(shape) != 2:  # the forward took x with its leading dims: the kernels take rows
            grad_y, saved = grad_y.reshape(-1, shape[-1]), saved.reshape(-1, shape[-1])
        dx, dw, db = backward_impl(grad_y, saved, weight, bias, rstd, mean, is_rms, zero_centered, save_output,
                                    config)
        return (dx if len(shape) == 2 else dx.view(shape), dw if weight is not None else None,
                db if bias is not None else None, None, None, None, None, None, None)


def _eager_apply():
    """`EagerNorm.apply` without its Python wrapper's per-call work (binding default arguments, a generator
    over all eight arguments): the wrapper's own steps for a Function without transforms, done on the three
    tensors. None where this torch lacks those entry points (then `EagerNorm.apply` is used)."""
    try:
        apply = super(torch.autograd.Function, EagerNorm).apply
        unwrap = torch._C._functorch.unwrap_if_dead
        active = torch._C._are_functorch_transforms_active
    except AttributeError:
        return None
    return apply, unwrap, active


_EAGER = _eager_apply()


def eager_norm(x, weight, bias, eps, is_rms, zero_centered, save_output, config, plan=None) -> Tensor:
    """y = EagerNorm.apply(...), at less host cost per call (see `_eager_apply`); under torch.func's transforms,
    the differentiable composite (`composite.forward`), which they can differentiate and batch."""
    if _EAGER is None or _EAGER[2]():
        if composite.transforms_active():
            return composite.forward(x, weight, bias, eps, is_rms=is_rms, zero_centered=zero_centered)
        return EagerNorm.apply(x, weight, bias, eps, is_rms, zero_centered, save_output, config, plan)
    apply, unwrap, _ = _EAGER
    return apply(unwrap(x), weight if weight is None else unwrap(weight), bias if bias is None else unwrap(bias),
                 eps, is_rms, zero_centered, save_output, config, plan)
