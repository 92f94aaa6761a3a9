"""Functional API: `layer_norm` and `rms_norm` over the last dimension, differentiable, any leading dims.

Input rules (each violation raises TypeError/ValueError naming the argument and the fix):
- x: float32, bfloat16 or float16, at least 1-D, last dimension 1..MAX_N.
- weight/bias: shape (N,), dtype x's or float32, on x's device. Any strides (a slice, a column of a matrix, an
  expanded scalar): one that is not contiguous is copied once per call (N elements) and its gradient flows back
  through that copy to the tensor passed.
- Rows may be strided (a slice of a wider tensor) and are read in place. A last dimension that is not
  contiguous (stride != 1) is copied once, as is a tensor whose leading dims cannot be flattened into rows
  without a copy (the same rule as `Tensor.reshape`).

Double backward (`torch.autograd.grad(..., create_graph=True)`, e.g. a gradient penalty): that backward runs a
differentiable fp32 PyTorch composite of the same math (`composite.py`) instead of the kernels, so second-order
gradients are exact. It needs save="input" (save="output" raises a RuntimeError saying so); under torch.compile,
torch itself refuses double backward.

Under torch.func's transforms (`torch.func.grad`, `torch.vmap`, `jvp`, ...) the call runs `composite.forward`, the
same math as differentiable PyTorch ops, which the transforms differentiate and batch (the kernels read raw memory,
which wrapped tensors do not have).
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import composite, forward_calls
from .call_checks import check_form, check_inputs, check_options, dtype_eps, explicit_backward, output_recovers
from .call_checks import gate_options, gate_problem, rows_2d, rows_view, stream_eps
from ..config import BackwardConfig
from .forms import GATED, Form, form_of
from .ops import contiguous_operand, eager_norm


def _norm(form: Form, x, extras: tuple, weight, bias, eps, *, is_rms: bool, zero_centered: bool, save: str, config,
          stream_dtype=None, opts=()):
    """y, or (y, *the form's outputs), of a call of `form` (`forms.py`) on x and the form's tensors `extras`,
    whatever the form: checked (`call_checks`) unless a call with the same signature passed the checks before
    (`forward_calls`: then that call's plan runs), traced as the form's custom op under torch.compile, else run
    through `ops.EagerNorm`. save="output" where y would not determine x̂ as precisely as the rows normalized do
    (saving.py's rule) saves those rows instead; under torch.compile the custom op raises. `opts`: the form's
    options (`Form.options`), checked."""
    compiling = torch.compiler.is_compiling()
    # under torch.func's transforms the composite runs, which saves nothing of its own (and the wrapped weights
    # have no memory to read back)
    if save == "output" and not compiling and not composite.transforms_active() \
            and not output_recovers(x, weight, bias, zero_centered):
        save = "input"
    save_output = save == "output"
    sig = None
    if config is None and not compiling and (save == "input" or save_output):
        sig = forward_calls.form_signature(form, x, extras, weight, bias, eps, stream_dtype, is_rms, zero_centered,
                                           save_output, opts)
        plan = forward_calls.lookup(sig)
        if plan is not None:  # inputs like an earlier call's, which passed the checks
            return eager_norm(form, x, extras, weight, bias, eps, is_rms, zero_centered, save_output, "", None, plan,
                              opts=opts)
    check_inputs(x, weight, bias, zero_centered)
    check_options(eps, save)
    stream = check_form(form, x, extras, stream_dtype)
    x2d = rows_2d(x) if not form.inputs or compiling or config is not None else None
    backward = "" if config is None else explicit_backward(
        config, x2d, weight, bias, is_rms=is_rms, zero_centered=zero_centered, save=save, residual_dtype=stream,
        gate=gate_problem(opts), group=opts[2] if opts else None)
    w, b = contiguous_operand(weight), contiguous_operand(bias)
    args = (float(eps), is_rms, zero_centered, save_output)
    if compiling:
        streams = (stream,) * len(form.outputs)
        traced = getattr(torch.ops.normtune, form.op + "_forward").default  # the form's op (`ops.define_ops`)
        outputs = [t if t.shape == x.shape else t.view(x.shape)
                   for t in traced(x2d, *(rows_2d(t) for t in extras), w, b, *args, *streams, *opts, backward)[:-2]]
        return tuple(outputs) if form.outputs else outputs[0]
    if w is not weight or b is not bias:  # a copied operand gets no plan: the plan would read the strided one
        sig = None
    if not form.inputs:
        # x itself where its rows are a view of it, as a planned call passes it: both save the same shapes (rows
        # that are a copy get no plan)
        view = rows_view(x, x2d)
        y = eager_norm(form, x if view else x2d, extras, w, b, *args, backward, stream, None, sig if view else None)
        return y if y.shape == x.shape else y.view(x.shape)
    return eager_norm(form, x, extras, w, b, *args, backward, stream, None, sig, opts)


def layer_norm(x: Tensor, weight: Tensor | None = None, bias: Tensor | None = None, eps: float = 1e-5, *,
               residual: Tensor | None = None, residual_dtype: torch.dtype | None = None,
               zero_centered: bool = False, save: str = "input",
               config: BackwardConfig | dict | str | None = None,
               gate: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """LayerNorm over the last dimension: y = (x − μ)·r·w + b, r = (var(x) + eps)^-½.

    residual: the fused residual form: h = x + residual (in `residual_dtype`, default residual's dtype: x's or
    float32), y = norm(h); returns (y, h), and the backward adds h's gradient into the gradient of x and residual.

    zero_centered: the weight is stored as w' with w = 1 + w' (Gemma-style).
    save: "input" saves x (with fp32 μ and r) for the backward; "output" saves y and recovers x̂ = (y − b)/w,
    which saves an activation when the next layer keeps y anyway. Where y cannot determine x̂ as precisely as x
    (some column with |w| below the dtype's smallest normal number or |b| > |w|; see `saving.py`), the call
    saves x instead; under torch.compile, where the weights cannot be read while tracing, it raises instead.
    config: a `BackwardConfig` (or its dict/JSON) forcing the backward launch; None picks one for the GPU.
    gate: refused (the gated form is an RMSNorm: `rms_norm(..., gate=z)`).
    """
    if gate is not None:
        raise ValueError("gate with layer_norm: the gated form is an RMSNorm; use rms_norm(x, weight, gate=z)")
    form, extras = form_of(residual, residual_dtype)
    return _norm(form, x, extras, weight, bias, eps, is_rms=False, zero_centered=zero_centered, save=save,
                 config=config, stream_dtype=residual_dtype)


def rms_norm(x: Tensor, weight: Tensor | None = None, eps: float | None = 1e-6, *, residual: Tensor | None = None,
             residual_dtype: torch.dtype | None = None, zero_centered: bool = False, save: str = "input",
             config: BackwardConfig | dict | str | None = None, gate: Tensor | None = None,
             gate_position: str = "before", group_size: int | None = None,
             gate_activation: str = "silu") -> Tensor | tuple[Tensor, Tensor]:
    """RMSNorm over the last dimension: y = x·r·w, r = (mean(x²) + eps)^-½. Arguments as `layer_norm` (with a
    residual: (y, h)). eps=None: torch.finfo's eps of the dtype normalized, as torch's rms_norm: x's, or with a
    residual h's (the residual stream's, `residual_dtype`).

    gate: the gated form, a = act(gate) (gate_activation "silu" or "sigmoid"), gate shaped like x in its dtype:
    gate_position="before" (Qwen3-Next's) y = w·norm(x)·a, "after" (Mamba-2's) y = w·norm(x·a); returns y and
    differentiates gate too. group_size: the columns one set of statistics covers, a divisor of the width (None: the
    whole width; narrower: Mamba-2's n_groups > 1, each group of columns normalized on its own, its weight the
    group's columns of `weight`). save must be "input"."""
    if gate is not None:
        opts = gate_options(x, gate_position, gate_activation, group_size, save=save, residual=residual)
        if eps is None:
            eps = dtype_eps(x, getattr(x, "dtype", None))
        return _norm(GATED, x, (gate,), weight, None, eps, is_rms=True, zero_centered=zero_centered, save=save,
                     config=config, opts=opts)
    if eps is None:
        eps = dtype_eps(x, getattr(x, "dtype", None)) if residual is None else stream_eps(x, residual, residual_dtype)
    form, extras = form_of(residual, residual_dtype)
    return _norm(form, x, extras, weight, None, eps, is_rms=True, zero_centered=zero_centered, save=save,
                 config=config, stream_dtype=residual_dtype)
