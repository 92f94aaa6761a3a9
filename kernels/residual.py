"""The fused residual form of `layer_norm` / `rms_norm` (what pre-norm transformers run):

    h = x + residual          # the residual stream, in `residual_dtype` (default: residual's dtype)
    y = norm(h)
    returns (y, h)

One forward reads x and residual and writes h and y; the backward takes dy and dh and writes dh + the norm's
grad_input once, as the gradient of both x and residual. Input rules are the plain norm's (functional.py) plus:
residual has x's shape and device and x's dtype or float32; residual_dtype is x's dtype or float32.
Double backward (create_graph=True) runs the differentiable composite on h, as the plain norm's does on x (it
needs save="input").
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import composite, forward_calls
from .problem import canonical_dtype
from .call_checks import check_inputs, check_options, dtype_eps, explicit_backward, output_recovers, rows_2d
from .ops import contiguous_operand
from .residual_ops import eager_fused_add, norm_residual_forward

_TORCH = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_ALLOWED = "use x's dtype or torch.float32 (an fp32 residual stream)"


def residual_dtype_of(x: Tensor, residual, residual_dtype) -> torch.dtype:
    """The dtype of h for inputs x and residual (checked: each broken rule raises naming the argument)."""
    if not isinstance(residual, Tensor):
        raise TypeError(f"residual must be a torch.Tensor (the residual stream, shaped like x), got "
                        f"{type(residual).__name__}")
    if residual.shape != x.shape:
        raise ValueError(f"residual has shape {tuple(residual.shape)} but x has {tuple(x.shape)}: pass a residual "
                         "shaped like x")
    if residual.device != x.device:
        raise ValueError(f"residual is on {residual.device} but x is on {x.device}: move them to one device")
    if residual.dtype not in (x.dtype, torch.float32):
        raise TypeError(f"residual has dtype {residual.dtype}: {_ALLOWED}")
    if residual_dtype is None:
        return residual.dtype
    if isinstance(residual_dtype, str) and residual_dtype.lower() in ("fp32", "float32", "bf16", "bfloat16", "fp16",
                                                                      "float16"):
        residual_dtype = _TORCH[canonical_dtype(residual_dtype)]
    if residual_dtype not in (x.dtype, torch.float32):
        raise TypeError(f"residual_dtype={residual_dtype!r} is not allowed: {_ALLOWED}")
    return residual_dtype


def stream_eps(x: Tensor, residual, residual_dtype) -> float:
    """RMSNorm's eps=None in the residual form: the eps of h's dtype, the residual stream's (`residual_dtype`, else
    the residual's), which torch.nn.RMSNorm(eps=None) applied on h would take; not x's (bf16's eps on an fp32
    stream is 2^16 times fp32's). Arguments that break a rule raise as the call's checks would."""
    if residual_dtype is None and type(residual) is Tensor:
        return dtype_eps(x, residual.dtype)
    if type(residual_dtype) is torch.dtype:
        return dtype_eps(x, residual_dtype)
    return dtype_eps(x, residual_dtype_of(x, residual, residual_dtype))


def fused_add_norm(x, residual, weight, bias, eps, *, is_rms: bool, zero_centered: bool, save: str, config,
                   residual_dtype) -> tuple[Tensor, Tensor]:
    """(y, h) of the residual form; arguments as `layer_norm`/`rms_norm` (save="output" follows their rule: where
    y would not determine x̂ the call saves h instead, and under torch.compile the custom op raises). A call like
    an earlier one that passed the checks (`forward_calls.residual_signature`) runs that call's plan."""
    compiling = torch.compiler.is_compiling()
    # under torch.func's transforms the composite runs, which saves nothing of its own (and the wrapped weights
    # have no memory to read back)
    if save == "output" and not compiling and not composite.transforms_active() \
            and not output_recovers(x, weight, bias, zero_centered):
        save = "input"
    sig = None
    if config is None and not compiling and (save == "input" or save == "output"):
        sig = forward_calls.residual_signature(x, residual, weight, bias, eps, residual_dtype, is_rms, zero_centered,
                                               save == "output")
        plan = forward_calls.lookup(sig)
        if plan is not None:  # inputs like an earlier call's, which passed the checks
            return eager_fused_add(x, residual, weight, bias, eps, is_rms, zero_centered, save == "output", "",
                                   None, plan)
    check_inputs(x, weight, bias, zero_centered)
    check_options(eps, save)
    h_dtype = residual_dtype_of(x, residual, residual_dtype)
    backward = "" if config is None else explicit_backward(config, rows_2d(x.detach()), weight, bias, is_rms=is_rms,
                                                           zero_centered=zero_centered, save=save,
                                                           residual_dtype=h_dtype)
    w, b = contiguous_operand(weight), contiguous_operand(bias)
    args = (float(eps), is_rms, zero_centered, save == "output")
    if compiling:
        x2d, r2d = rows_2d(x), rows_2d(residual)
        y, h, _, _ = norm_residual_forward(x2d, r2d, w, b, *args, h_dtype, backward)
        return (y, h) if x.dim() == 2 else (y.view(x.shape), h.view(x.shape))
    # a copied operand gets no plan: the plan would read the strided one
    return eager_fused_add(x, residual, w, b, *args, backward, h_dtype, None,
                           sig if w is weight and b is bias else None)
