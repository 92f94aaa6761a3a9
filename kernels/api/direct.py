"""Forward and backward as plain functions, without autograd: for frameworks that write their own
`autograd.Function` around normalization kernels (as Megatron-style and Fast-LLM-style trainers do), and for
comparing host time with libraries that offer only such functions.

    y, mean, rstd = layer_norm_forward(x, weight, bias, eps=1e-5)
    dx, dw, db = layer_norm_backward(grad, x, weight, bias, mean, rstd)
    y, rstd = rms_norm_forward(x, weight, eps=1e-6)
    dx, dw = rms_norm_backward(grad, x, weight, rstd)

The same kernels, launch configs and checks as `layer_norm` / `rms_norm` (functional.py), over the last
dimension with any leading dims (not under torch.func's transforms: a RuntimeError names the transform and points
to `layer_norm` / `rms_norm`). mean and rstd are fp32, one per row. The backward may recover x̂ from the
forward's output instead of its input (`from_output=True`: pass y where x goes; LayerNorm then needs no mean),
where the weight and bias allow it (`saving.py`'s rule; otherwise a ValueError says to pass x).
dw/db come back as None where there is no weight/bias. Nothing here records an autograd graph.

The residual form (h = x + residual, y = norm(h)): the forwards take `residual=` (and `residual_dtype=`) and
return h after what they return without one; the backwards take the forward's h where x goes and
`grad_residual=` (h's gradient), and their dx is then h's whole gradient — grad_residual plus the norm's — in h's
dtype, the gradient of both x and residual:

    y, rstd, h = rms_norm_forward(x, weight, residual=r)
    dx, dw = rms_norm_backward(grad, h, weight, rstd, grad_residual=dh)

The gated form (`rms_norm(..., gate=z)`): the RMSNorm functions take `gate=` and its options; the backward takes
the forward's x and gate and also returns the gate's gradient:

    y, rstd = rms_norm_forward(x, weight, gate=z, gate_position="after")
    dx, dw, dz = rms_norm_backward(grad, x, weight, rstd, gate=z, gate_position="after")
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import composite, forward_calls, saving
from .backward_calls import backward_impl
from .call_checks import check_form, check_inputs, check_options, dtype_eps, explicit_backward, rows_2d, stream_eps
from .call_checks import check_gate, gate_options, gate_problem
from ..config import BackwardConfig
from .forms import GATED, PLAIN, RESIDUAL, Form, form_of
from .ops import contiguous_operand, forward_impl


def _check_stats(name: str, t, M: int) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor (the forward's fp32 per-row {name}), got {type(t).__name__}")
    if t.dim() != 1 or t.shape[0] != M or t.dtype.itemsize != 4 or not t.dtype.is_floating_point:
        raise ValueError(f"{name} has shape {tuple(t.shape)} and dtype {t.dtype}: pass the forward's fp32 {name} "
                         f"of shape ({M},)")
    if t.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous: pass the forward's {name} (or {name}.contiguous())")


def _stats_fit(t, M: int) -> bool:
    """`_check_stats`'s rules hold (one pass over the attributes)."""
    return isinstance(t, Tensor) and t.shape == (M,) and t.dtype == torch.float32 and t.stride(0) == 1


def _forward(form: Form, x, extras: tuple, weight, bias, eps, is_rms: bool, zero_centered: bool, stream_dtype,
             opts: tuple = ()):
    """(outputs, rstd, mean) of a call of `form`: outputs = (y, *the form's outputs), in x's shape. A call like an
    earlier one that passed the checks runs that call's plan (`forward_calls`)."""
    sig = forward_calls.form_signature(form, x, extras, weight, bias, eps, stream_dtype, is_rms, zero_centered, False,
                                       opts)
    plan = forward_calls.lookup(sig)
    if plan is not None:  # inputs like an earlier call's, which passed the checks
        return forward_calls.run(plan, form, x, extras, weight, bias, eps)
    composite.refuse_wrapped("rms_norm_forward" if is_rms else "layer_norm_forward", x, *extras, weight, bias)
    check_inputs(x, weight, bias, zero_centered)
    check_options(eps, "input")
    stream = check_form(form, x, extras, stream_dtype)
    x2d, extras2d = rows_2d(x), tuple(rows_2d(t) for t in extras)
    w, b = contiguous_operand(weight), contiguous_operand(bias)
    outputs, rstd, mean = forward_impl(form, x2d, extras2d, w, b, float(eps), is_rms, zero_centered, False, stream,
                                       opts=opts)
    if w is weight and b is bias:  # a copied operand gets no plan: the plan would read the strided one
        forward_calls.remember(sig, form, x, x2d, extras, extras2d, weight, bias, stream, is_rms, zero_centered,
                               False, opts)
    return tuple(t if x.dim() == 2 else t.view(x.shape) for t in outputs), rstd, mean


def _check_residual_grads(grad, saved, grad_residual, weight, bias, zero_centered: bool, from_output: bool) -> None:
    """The residual form's backward inputs: grad (y's gradient, x's dtype) with the weight rules, grad_residual
    (h's gradient, h's dtype: grad's or float32) and the saved h (or y, `from_output`) shaped like grad."""
    check_inputs(grad, weight, bias, zero_centered, name="grad")
    if not isinstance(grad_residual, Tensor):
        raise TypeError(f"grad_residual must be a torch.Tensor (the gradient of h), got {type(grad_residual).__name__}")
    if grad_residual.shape != grad.shape or grad_residual.dtype not in (grad.dtype, torch.float32) \
            or grad_residual.device != grad.device:
        raise ValueError(f"grad_residual has shape {tuple(grad_residual.shape)}, dtype {grad_residual.dtype} on "
                         f"{grad_residual.device}: pass the gradient of h, shaped like grad ({tuple(grad.shape)}), "
                         f"in h's dtype ({grad.dtype} or torch.float32), on {grad.device}")
    want = grad.dtype if from_output else grad_residual.dtype
    name = "y" if from_output else "h"
    if not isinstance(saved, Tensor) or saved.shape != grad.shape or saved.dtype != want or saved.device != grad.device:
        shown = (f"shape {tuple(saved.shape)} and dtype {saved.dtype}" if isinstance(saved, Tensor)
                 else type(saved).__name__)
        raise ValueError(f"{name} has {shown}: pass the forward's {name}, shape {tuple(grad.shape)} and dtype {want}")


def _backward(form: Form, grad, saved, grads_out: tuple, weight, bias, rstd, mean, is_rms: bool,
              zero_centered: bool, from_output: bool, config, saved_extras: tuple = (), opts: tuple = ()):
    """(dx, dw, db, *the saved inputs' gradients) of a call of `form` from the forward's saved rows (x, the form's
    stream, or y), the inputs it read (`saved_extras`: the gate) and the gradients of y and of the form's outputs
    (`grads_out`): dx is the gradient of the rows normalized."""
    composite.refuse_wrapped("rms_norm_backward" if is_rms else "layer_norm_backward", grad, saved, weight, bias,
                             rstd, mean, *grads_out, *saved_extras)
    if form is RESIDUAL:
        _check_residual_grads(grad, saved, grads_out[0], weight, bias, zero_centered, from_output)
    else:
        _check_plain_grads(grad, saved, weight, bias, zero_centered, from_output)
        if form is GATED:
            check_gate(saved, saved_extras[0])
    N = saved.shape[-1]
    M = saved.numel() // N * (N // opts[2] if opts else 1)  # the gated form's statistics: one per row and group
    uses_mean = not is_rms and not from_output
    if not (_stats_fit(rstd, M) and (not uses_mean or _stats_fit(mean, M))):  # fast path; the checks name the rule
        _check_stats("rstd", rstd, M)
        if uses_mean:
            _check_stats("mean", mean, M)
    if from_output and not saving.recovers(weight, bias, saved.dtype, zero_centered):
        raise ValueError(saving.refusal("from_output=True"))
    if not uses_mean:
        mean = rstd  # not read
    grad2d, dh = rows_2d(grad), rows_2d(grads_out[0]) if grads_out else None
    backward = explicit_backward(config, grad2d, weight, bias, is_rms=is_rms, zero_centered=zero_centered,
                                 save="output" if from_output else "input",
                                 residual_dtype=None if dh is None else dh.dtype, gate=gate_problem(opts),
                                 group=opts[2] if opts else None)
    gate = (rows_2d(saved_extras[0]), *opts) if saved_extras else None
    dx, dw, db, *own = backward_impl(grad2d, rows_2d(saved), contiguous_operand(weight), contiguous_operand(bias),
                                     rstd, mean, is_rms, zero_centered, from_output, backward, dh, gate)
    shaped = (lambda t: t) if saved.dim() == 2 else (lambda t: t.view(saved.shape))  # noqa: E731
    return shaped(dx), dw, db, *(shaped(t) for t in own)


def _grads_form(grad_residual) -> tuple[Form, tuple]:
    """The form of a backward call and the gradients of its outputs, from its keyword arguments."""
    return (PLAIN, ()) if grad_residual is None else (RESIDUAL, (grad_residual,))


def _check_plain_grads(grad, saved, weight, bias, zero_centered: bool, from_output: bool) -> None:
    check_inputs(saved, weight, bias, zero_centered, name="y" if from_output else "x")
    if not isinstance(grad, Tensor) or grad.shape != saved.shape or grad.dtype != saved.dtype:
        shown = f"shape {tuple(grad.shape)} and dtype {grad.dtype}" if isinstance(grad, Tensor) else type(grad).__name__
        raise ValueError(f"grad has {shown}: pass the gradient of y, shape {tuple(saved.shape)} and dtype "
                         f"{saved.dtype}")


def layer_norm_forward(x: Tensor, weight: Tensor | None = None, bias: Tensor | None = None, eps: float = 1e-5, *,
                       residual: Tensor | None = None, residual_dtype: torch.dtype | None = None,
                       zero_centered: bool = False):
    """(y, mean, rstd) of LayerNorm over the last dimension, without autograd; with a residual, (y, mean, rstd, h)
    of the norm of h = x + residual."""
    form, extras = form_of(residual, residual_dtype)
    outputs, rstd, mean = _forward(form, x, extras, weight, bias, eps, False, zero_centered, residual_dtype)
    return outputs[0], mean, rstd, *outputs[1:]


def layer_norm_backward(grad: Tensor, x: Tensor, weight: Tensor | None, bias: Tensor | None, mean: Tensor | None,
                        rstd: Tensor, *, grad_residual: Tensor | None = None, zero_centered: bool = False,
                        from_output: bool = False, config: BackwardConfig | dict | str | None = None):
    """(dx, dw, db) of LayerNorm from the forward's x (or y, `from_output=True`), mean and rstd; dw/db None where
    there is no weight/bias. config: a `BackwardConfig` (or its dict/JSON) forcing the launch; None picks one.
    Residual form: pass h where x goes and `grad_residual` (h's gradient); dx is then grad_residual plus the
    norm's grad_input, in h's dtype."""
    form, grads_out = _grads_form(grad_residual)
    return _backward(form, grad, x, grads_out, weight, bias, rstd, mean, False, zero_centered, from_output, config)


def rms_norm_forward(x: Tensor, weight: Tensor | None = None, eps: float | None = 1e-6, *,
                     residual: Tensor | None = None, residual_dtype: torch.dtype | None = None,
                     zero_centered: bool = False, gate: Tensor | None = None, gate_position: str = "before",
                     group_size: int | None = None, gate_activation: str = "silu"):
    """(y, rstd) of RMSNorm over the last dimension, without autograd; with a residual, (y, rstd, h) of the norm
    of h = x + residual. eps=None: the eps of the dtype normalized (x's, or h's), as `rms_norm`. gate: the gated
    form, with its options as `rms_norm` takes them; (y, rstd), rstd one per row and group of columns, group by
    group (width // group_size groups of rows each)."""
    if gate is not None:
        opts = gate_options(x, gate_position, gate_activation, group_size, residual=residual)
        if eps is None:
            eps = dtype_eps(x, getattr(x, "dtype", None))
        outputs, rstd, _ = _forward(GATED, x, (gate,), weight, None, eps, True, zero_centered, None, opts)
        return outputs[0], rstd
    if eps is None:
        eps = dtype_eps(x, getattr(x, "dtype", None)) if residual is None else stream_eps(x, residual, residual_dtype)
    form, extras = form_of(residual, residual_dtype)
    outputs, rstd, _ = _forward(form, x, extras, weight, None, eps, True, zero_centered, residual_dtype)
    return outputs[0], rstd, *outputs[1:]


def rms_norm_backward(grad: Tensor, x: Tensor, weight: Tensor | None, rstd: Tensor, *,
                      grad_residual: Tensor | None = None, zero_centered: bool = False, from_output: bool = False,
                      config: BackwardConfig | dict | str | None = None, gate: Tensor | None = None,
                      gate_position: str = "before", group_size: int | None = None, gate_activation: str = "silu"):
    """(dx, dw) of RMSNorm from the forward's x (or y, `from_output=True`) and rstd; dw None without a weight.
    Residual form: pass h where x goes and `grad_residual`; dx is then h's whole gradient (as layer_norm_backward).
    Gated form: pass the forward's gate and its options; returns (dx, dw, dz)."""
    if gate is not None:
        opts = gate_options(x, gate_position, gate_activation, group_size,
                            save="output" if from_output else "input", residual=grad_residual)
        dx, dw, _, dz = _backward(GATED, grad, x, (), weight, None, rstd, None, True, zero_centered, False, config,
                                  (gate,), opts)
        return dx, dw, dz
    form, grads_out = _grads_form(grad_residual)
    dx, dw, _ = _backward(form, grad, x, grads_out, weight, None, rstd, None, True, zero_centered, from_output,
                          config)
    return dx, dw
