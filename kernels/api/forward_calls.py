"""Forward calls planned once per input signature: the host path that a layer's forward takes on every step.

A forward call checks its inputs (`functional.check_inputs`, `check_options`), flattens x into rows and derives its
launch (`forward.forward`). The second call on inputs with the same *signature* — x's shape, strides, dtype,
device and 16-byte alignment, the same of weight and bias (and their types and strides), and the flags — would
repeat all of it and reach the same answers. So the first call stores a plan under that signature (`remember`), and
later calls only look the signature up (`lookup`) and run the plan (`forward_plans.run_plan`: allocate, launch).

Why no check is skipped wrongly: only signatures whose call passed every check are stored, and every attribute the
checks read is part of the signature. eps is a runtime argument, so a fast call checks it itself (a positive
finite float; anything else takes the checked path). Inputs whose rows need a copy (a last dimension that is
not contiguous, leading dims that cannot be flattened in place) get no plan, nor do calls whose weight or bias is
not contiguous (the call copies it; a plan would launch on the strided tensor).

Every form (`forms.py`) is planned alike (`form_signature`, `remember`, `run`): the residual form's signature adds
the residual's shape, strides, dtype, device and alignment, `residual_dtype` as passed and the save mode, and both
x and the residual must be read in place. Its outputs y and h are allocated in x's shape, on the checked path as on
the planned one, so that both save tensors of the same shapes for the backward.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .. import forward_plans as _plans
from ..device import use_triton
from .forms import GATED, PLAIN, Form
from ..launcher import data_ptr

_PLANS: dict[tuple, tuple] = {}
MAX_PLANS = 4096

_ABSENT = (None,)


def _operand(t) -> tuple:
    """The part of a signature that describes weight or bias."""
    if t is None:
        return _ABSENT
    return type(t), t.shape, t.stride(), t.dtype, t.device, data_ptr(t) & 15


def signature(x, weight, bias, eps, is_rms: bool, zero_centered: bool, store_mean: bool) -> tuple | None:
    """The call's signature, or None where it cannot have a plan (x not a plain tensor, weight/bias not tensors,
    eps not a positive finite float, a tensor without storage)."""
    if (type(x) is not Tensor or type(eps) is not float or not 0.0 < eps < math.inf
            or not (weight is None or isinstance(weight, Tensor)) or not (bias is None or isinstance(bias, Tensor))):
        return None
    try:
        return (x.shape, x.stride(), x.dtype, x.device, data_ptr(x) & 15, _operand(weight), _operand(bias), is_rms,
                zero_centered, store_mean)
    except RuntimeError:  # a tensor without storage (e.g. functorch's wrappers): the checked path says what fails
        return None


def form_signature(form: Form, x, extras: tuple, weight, bias, eps, stream_dtype, is_rms: bool,
                   zero_centered: bool, save_output: bool, opts: tuple = ()) -> tuple | None:
    """The signature of a call of `form`: the plain `signature`, and for a form with tensors of its own, the form's
    name, each such tensor's shape, strides, dtype, device and alignment, the stream dtype as passed, the save
    mode and the form's options (`opts`, checked). None where the call cannot have a plan (as `signature`; also a
    form's tensor that is not a plain tensor, a stream dtype that is not None, a torch.dtype or a str)."""
    sig = signature(x, weight, bias, eps, is_rms, zero_centered, not is_rms and not save_output)
    if sig is None or form is PLAIN:
        return sig
    if any(type(t) is not Tensor for t in extras) or not (stream_dtype is None
                                                          or type(stream_dtype) in (torch.dtype, str)):
        return None
    try:
        return sig + (form.name,) + tuple(part for t in extras for part in (t.shape, t.stride(), t.dtype, t.device,
                                                                            data_ptr(t) & 15)) \
            + (stream_dtype, save_output, *opts)
    except RuntimeError:
        return None


def lookup(sig: tuple | None) -> tuple | None:
    """The plan stored under `sig` (None: none yet, or no signature)."""
    return _PLANS.get(sig) if sig is not None else None


def remember(sig: tuple | None, form: Form, x: Tensor, x2d: Tensor, extras: tuple, extras2d: tuple, weight, bias,
             stream_dtype, is_rms: bool, zero_centered: bool, save_output: bool, opts: tuple = ()) -> None:
    """Store the plan of a call that passed every check (x2d, extras2d: the rows it launched on)."""
    if sig is None or not use_triton(x):
        return
    store_mean = not is_rms and not save_output
    if form is PLAIN:
        plan = _plans.call_plan(x, x2d, weight, bias, is_rms, zero_centered, store_mean)
    elif form is GATED:
        gate_after, sigmoid, group = opts
        plan = _plans.gated_call_plan(x, x2d, extras[0], extras2d[0], weight, gate_after, sigmoid, zero_centered,
                                      x2d.shape[1] // group)
    else:
        plan = _plans.residual_call_plan(x, x2d, extras[0], extras2d[0], weight, bias, stream_dtype, is_rms,
                                           zero_centered, store_mean)
    if plan is None:
        return
    if len(_PLANS) >= MAX_PLANS:  # e.g. a new row count every step: start over rather than grow
        _PLANS.clear()
    _PLANS[sig] = plan


def run(plan: tuple, form: Form, x: Tensor, extras: tuple, weight, bias, eps: float):
    """(outputs, rstd, mean) of a planned call: outputs = (y, *the form's outputs), shaped like x; mean None unless
    the plan stores it."""
    if form is PLAIN:
        y, rstd, mean = _plans.run_plan(plan, x, weight, bias, eps, x.device)
        return (y,), rstd, mean
    if form is GATED:
        y, rstd = _plans.run_gated_plan(plan, x, extras[0], weight, eps, x.device)
        return (y,), rstd, None
    y, h, rstd, mean = _plans.run_residual_plan(plan, x, extras[0], weight, bias, eps, x.device)
    return (y, h), rstd, mean


def clear() -> None:
    _PLANS.clear()
