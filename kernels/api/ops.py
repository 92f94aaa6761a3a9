"""torch.library custom ops and the autograd Function, one definition for every form (`forms.py`):
`normtune::norm_forward` / `normtune::norm_backward` (the plain norm) and `normtune::norm_residual_forward` /
`normtune::norm_residual_backward` (the fused residual form: h = x + residual, y = norm(h); the backward's d is
h's whole gradient, dh + the norm's grad_input, the gradient of both x and residual), and
`normtune::norm_gated_forward` / `normtune::norm_gated_backward` (the gated RMSNorm: the backward reads the saved
gate z too and returns its gradient after dw and db).

Registered ops (with fake implementations) let `torch.compile(fullgraph=True)` trace through normtune without
looking inside the Triton launches. Inputs here are already checked 2-D views (rows may be strided, the last
dimension is contiguous); `functional.py` does the checking and reshaping. Launch logic lives in `forward.py`
and `backward/`; this module only dispatches between the Triton kernels and the pure-PyTorch path. The backward
saves the rows normalized (x, or the form's stream h; save="input") or y (save="output"), with rstd and mean.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import composite
from .. import forward as _forward
from .. import forward_plans
from . import forward_calls
from . import reference
from . import saving
from .backward_calls import backward_impl
from ..device import use_triton
from .forms import FORMS, GATED, PLAIN, RESIDUAL, Form


def empty_placeholder(like: Tensor) -> Tensor:
    return like.new_empty((0,))


def contiguous_operand(t: Optional[Tensor]) -> Optional[Tensor]:
    """weight or bias as the kernels read it, N contiguous elements: a strided or expanded one is copied (under
    autograd the copy is differentiable, so its gradient reaches the tensor passed, with that tensor's layout)."""
    return t if t is None or t.is_contiguous() else t.contiguous()


def rows_2d(t: Tensor) -> Tensor:
    """`t` as rows of its last dimension: a view where the rows allow one, the last dimension made contiguous."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    return t if t.dim() == 2 else t.reshape(-1, t.shape[-1])


# Each form's math (`forms.py`): its forward, what its backward's d gives back to its inputs, and its composite.
def forward_impl(form: Form, x, extras, weight, bias, eps, is_rms, zero_centered, save_output, stream_dtype=None,
                 outs=None, opts=()):
    """(outputs, rstd, mean) of `form` on rows: outputs = (y, *the form's outputs); mean None unless LayerNorm
    saves from the input (off the Triton path, a tensor). `outs`: rows to write the outputs to (None: allocated
    here). `opts`: the form's options (`Form.options`)."""
    store_mean = not is_rms and not save_output
    if form is GATED:
        return _forward_gated(x, extras[0], weight, eps, zero_centered, *opts)
    if form is PLAIN:
        impl = _forward.forward if use_triton(x) else reference.forward
        y, rstd, mean = impl(x, weight, bias, eps, is_rms=is_rms, zero_centered=zero_centered, store_mean=store_mean)
        return (y,), rstd, mean
    if form is not RESIDUAL:
        raise ValueError(f"form {form!r} has no forward: use one of forms.FORMS")
    (residual,) = extras
    y, h = outs if outs is not None else (None, None)
    if use_triton(x):
        y, h, rstd, mean = _forward.forward_residual(x, residual, weight, bias, eps, h_dtype=stream_dtype,
                                                     is_rms=is_rms, zero_centered=zero_centered,
                                                     store_mean=store_mean, y=y, h=h)
        return (y, h), rstd, mean
    y_ref, h_ref, rstd, mean = reference.forward_residual(x, residual, weight, bias, eps, h_dtype=stream_dtype,
                                                          is_rms=is_rms, zero_centered=zero_centered,
                                                          store_mean=store_mean)
    return ((y_ref, h_ref) if y is None else (y.copy_(y_ref), h.copy_(h_ref))), rstd, mean


def _forward_gated(x, z, weight, eps, zero_centered, gate_after, sigmoid, group):
    """((y,), rstd, None) of the gated form on rows; statistics per group of `group` columns (the whole row, or
    every group in one launch: rstd holds the groups' one after another)."""
    M, N = x.shape
    flags = dict(gate_after=gate_after, sigmoid=sigmoid, zero_centered=zero_centered)
    if use_triton(x):
        y, rstd = _forward.forward_gated(x, z, weight, eps, groups=N // group, **flags)
        return (y,), rstd, None
    if group == N:
        y, rstd = reference.forward_gated(x, z, weight, eps, **flags)
        return (y,), rstd, None
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    rstd = torch.empty(N // group, M, dtype=torch.float32, device=x.device)
    for g, start in enumerate(range(0, N, group)):
        cols = slice(start, start + group)
        w = weight[cols] if weight is not None else None
        y[:, cols], rstd[g] = reference.forward_gated(x[:, cols], z[:, cols], w, eps, **flags)
    return (y,), rstd.view(-1), None


def input_grads(form: Form, d: Tensor, input_dtypes: tuple, own: tuple = ()) -> tuple:
    """The gradients of x and the form's inputs from the backward's d, the gradient of the rows normalized (x, or
    the residual form's h, which is both x's and the residual's: cast only where their dtype differs), and `own`,
    the gradients of the inputs the backward read (`Form.saved`)."""
    if form is PLAIN:
        return (d,)
    if form.saved:
        return (d, *own)
    return tuple(d if d.dtype == dtype else d.to(dtype) for dtype in input_dtypes)


def _gate(saved_extras: tuple, opts: tuple):
    """`backward_impl`'s gate: (z rows, gate after, sigmoid), or None for a form without a gate."""
    return (saved_extras[0], *opts) if saved_extras else None


def _composite_forward(form: Form, x, extras, weight, bias, eps, is_rms, zero_centered, stream_dtype, plan, opts=()):
    """The form's forward as differentiable PyTorch ops (under torch.func's transforms)."""
    if form is GATED:
        return composite.forward_gated(x, extras[0], weight, eps, zero_centered=zero_centered, gate_after=opts[0],
                                       sigmoid=opts[1], group=opts[2])
    if form is PLAIN:
        return composite.forward(x, weight, bias, eps, is_rms=is_rms, zero_centered=zero_centered)
    if stream_dtype is None:  # a planned call: the plan's
        stream_dtype = forward_plans.residual_plan_h_dtype(plan)
    return composite.forward_residual(x, extras[0], weight, bias, eps, is_rms=is_rms, zero_centered=zero_centered,
                                      h_dtype=stream_dtype)


def _composite_backward(grad_y, grads_out, saved, weight, bias, eps, is_rms, zero_centered, save_output,
                        stream_dtypes, saved_extras=(), opts=()):
    """(d, dw, db, *own) as differentiable PyTorch ops (create_graph=True): d adds the stream's gradient, if any;
    own: the gradients of the saved inputs (the gate's)."""
    if saved_extras:
        if save_output:
            raise RuntimeError(composite.SAVE_OUTPUT_MESSAGE.format(norm="rms_norm"))
        return composite.backward_gated(grad_y, saved, saved_extras[0], weight, eps, zero_centered=zero_centered,
                                        gate_after=opts[0], sigmoid=opts[1], group=opts[2])
    if not grads_out:
        return composite.backward(grad_y, saved, weight, bias, eps, is_rms=is_rms, zero_centered=zero_centered,
                                  save_output=save_output)
    dxn, dw, db = composite.backward(grad_y.float(), saved, weight, bias, eps, is_rms=is_rms,
                                     zero_centered=zero_centered, save_output=save_output)
    return (grads_out[0].float() + dxn).to(stream_dtypes[0]), dw, db


# One backward for the custom ops and the Function, whatever the form.
def _gradients(form: Form, flags: tuple, saved_tensors, grad_y, grads_out, run) -> tuple:
    """(grads of x and the form's inputs, dw, db) of a backward, or None where y got no gradient (then the
    stream's gradient passes through as `_passed_through`). `run(grad_y, grads_out, saved, saved_extras, weight,
    bias, rstd, mean)` runs the kernels' backward, giving (d, dw, db, *the saved inputs' gradients)."""
    is_rms, zero_centered, save_output, config, eps, input_dtypes, stream_dtypes, opts = flags
    saved, *rest = saved_tensors
    saved_extras, (weight, bias, rstd, mean) = tuple(rest[:len(form.saved)]), rest[len(form.saved):]
    if form.outputs:  # an output that got no gradient counts as a zero one
        if grad_y is None:
            grad_y = torch.zeros(saved.shape, dtype=input_dtypes[0], device=saved.device)
        grads_out = tuple(torch.zeros(saved.shape, dtype=dtype, device=saved.device) if g is None else g
                          for g, dtype in zip(grads_out, stream_dtypes))
    if composite.needs_graph(grad_y, *grads_out, saved, *saved_extras, weight, bias):  # create_graph=True
        d, dw, db, *own = _composite_backward(grad_y, grads_out, saved, weight, bias, eps, is_rms, zero_centered,
                                              save_output, stream_dtypes, saved_extras, opts)
    else:
        d, dw, db, *own = run(grad_y, grads_out, saved, saved_extras, weight, bias, rstd, mean)
    return (input_grads(form, d, input_dtypes, tuple(own)), dw if weight is not None else None,
            db if bias is not None else None)


def _passed_through(form: Form, flags: tuple, grads_out) -> tuple | None:
    """The input gradients where y got none: the stream's own (all None where it got none too), read from no
    saved tensor (the stream may have been changed in place since the forward: its norm was never used). None for
    a form without a stream (its backward runs only where y got a gradient)."""
    if not form.outputs:
        return None
    if grads_out[0] is None:
        return (None,) * (1 + len(form.inputs))
    return input_grads(form, grads_out[0], flags[5])


def _flags(is_rms, zero_centered, save_output, config, eps, x, extras, stream_dtypes, opts=()) -> tuple:
    return (is_rms, zero_centered, save_output, config, eps, (x.dtype, *(e.dtype for e in extras)),
            tuple(stream_dtypes), tuple(opts))


# The custom ops: normtune::<form.op>_forward and _backward for each form, one definition.
def _schemas(form: Form) -> tuple[str, str]:
    """The forward's and the backward's schema (the names and argument order users' graphs hold)."""
    extras = "".join(f"Tensor {name}, " for name in form.inputs)
    dtypes = "".join(f"ScalarType {name}_dtype, " for name in form.outputs)
    grads = "".join(f"Tensor grad_{name}, " for name in form.outputs)
    saved = "".join(f"Tensor {name}, " for name in form.saved)
    options = "".join(f"{option}, " for option in form.options)
    flags = "bool is_rms, bool zero_centered, bool save_output"
    returns = ", ".join(["Tensor"] * (3 + len(form.outputs)))
    grads_returned = ", ".join(["Tensor"] * (3 + len(form.saved)))
    return (f"(Tensor x, {extras}Tensor? weight, Tensor? bias, float eps, {flags}, {dtypes}{options}str config) -> "
            f"({returns})",
            f"(Tensor grad, {grads}Tensor saved, {saved}Tensor? weight, Tensor? bias, Tensor rstd, Tensor mean, "
            f"{flags}, {options}str config) -> ({grads_returned})")


def define_ops(form: Form):
    """Register the form's custom ops (with fake implementations and autograd); returns (forward, backward)."""
    k, o, s, n = len(form.inputs), len(form.outputs), len(form.saved), len(form.options)
    forward_schema, backward_schema = _schemas(form)
    forward_name, backward_name = f"normtune::{form.op}_forward", f"normtune::{form.op}_backward"

    def forward_op(x, *args):
        extras, (weight, bias, eps, is_rms, zero_centered, save_output) = args[:k], args[k:k + 6]
        dtypes, opts = args[k + 6:k + 6 + o], args[k + 6 + o:-1]
        weight, bias = contiguous_operand(weight), contiguous_operand(bias)
        if save_output and not saving.recovers(weight, bias, x.dtype, zero_centered):
            raise RuntimeError(saving.refusal(f"save='output' under torch.compile ({forward_name})"))
        outputs, rstd, mean = forward_impl(form, x, extras, weight, bias, eps, is_rms, zero_centered, save_output,
                                           dtypes[0] if dtypes else None, opts=opts)
        return (*outputs, rstd, mean if mean is not None else empty_placeholder(rstd))

    def forward_fake(x, *args):
        is_rms, save_output, dtypes = args[k + 3], args[k + 5], args[k + 6:k + 6 + o]
        M = x.shape[0] * (x.shape[1] // args[-2] if form is GATED else 1)  # gated: rstd per group
        store_mean = not is_rms and not save_output
        return (x.new_empty(x.shape), *(x.new_empty(x.shape, dtype=dtype) for dtype in dtypes),
                x.new_empty((M,), dtype=torch.float32), x.new_empty((M if store_mean else 0,), dtype=torch.float32))

    def backward_op(grad, *args):
        grads_out, saved, saved_extras = args[:o], args[o], args[o + 1:o + 1 + s]
        weight, bias, rstd, mean, is_rms, zero_centered, save_output = args[o + 1 + s:o + 8 + s]
        opts, config = args[o + 8 + s:-1], args[-1]
        if save_output and not saving.recovers(weight, bias, grad.dtype, zero_centered):
            raise RuntimeError(saving.refusal(f"{backward_name} from the output"))
        d, dw, db, *own = backward_impl(grad, saved, contiguous_operand(weight), contiguous_operand(bias), rstd, mean,
                                        is_rms, zero_centered, save_output, config, grads_out[0] if o else None,
                                        _gate(saved_extras, opts))
        return (d, dw if dw is not None else empty_placeholder(grad), db if db is not None else empty_placeholder(grad),
                *own)

    def backward_fake(grad, *args):
        grads_out, saved_extras, weight, bias = args[:o], args[o + 1:o + 1 + s], args[o + 1 + s], args[o + 2 + s]
        d = (grads_out[0] if o else grad).new_empty(grad.shape)
        dw = weight.new_empty(weight.shape) if weight is not None else grad.new_empty((0,))
        db = bias.new_empty(bias.shape) if bias is not None else grad.new_empty((0,))
        return (d, dw, db, *(t.new_empty(t.shape) for t in saved_extras))

    forward = torch.library.custom_op(forward_name, forward_op, mutates_args=(), schema=forward_schema)
    backward = torch.library.custom_op(backward_name, backward_op, mutates_args=(), schema=backward_schema)
    forward.register_fake(forward_fake)
    backward.register_fake(backward_fake)

    def setup_context(ctx, inputs, output):
        x, extras, (weight, bias, eps, is_rms, zero_centered, save_output) = inputs[0], inputs[1:k + 1], \
            inputs[k + 1:k + 7]
        saved_extras = tuple(extras[form.inputs.index(name)] for name in form.saved)
        ctx.save_for_backward(output[0] if save_output else (output[1] if o else x), *saved_extras, weight, bias,
                              *output[-2:])
        ctx.flags = _flags(is_rms, zero_centered, save_output, inputs[-1], eps, x, extras, inputs[k + 7:k + 7 + o],
                           inputs[k + 7 + o:-1])
        ctx.mark_non_differentiable(*output[-2:])

    def autograd_backward(ctx, grad_y, *grads):
        grads_out = grads[:o]
        tail = (None,) * (5 + o + n)  # eps, the flags, the stream dtypes, the options and config
        if grad_y is None and o:  # y unused: the stream's gradient passes through, the parameters get none
            return (*_passed_through(form, ctx.flags, grads_out), None, None, *tail)
        flags = ctx.flags

        def run(g, gs, saved, saved_extras, weight, bias, rstd, mean):
            return backward(g, *gs, saved, *saved_extras, weight, bias, rstd, mean, *flags[:3], *flags[7], flags[3])

        grads_in, dw, db = _gradients(form, flags, ctx.saved_tensors, grad_y, grads_out, run)
        return (*grads_in, dw, db, *tail)

    forward.register_autograd(autograd_backward, setup_context=setup_context)
    return forward, backward


# Each form's (forward, backward) custom ops, registered once.
OPS = {form: define_ops(form) for form in FORMS}
norm_forward, norm_backward = OPS[PLAIN]
norm_residual_forward, norm_residual_backward = OPS[RESIDUAL]
norm_gated_forward, norm_gated_backward = OPS[GATED]


# Eager calls: one autograd.Function for every form.
class EagerNorm(torch.autograd.Function):
    """The custom ops' forward and backward for eager calls, any form: a plain autograd.Function skips the custom
    ops' dispatch layers (their host cost is paid on every layer of every step). torch.compile traces the custom
    ops instead (`functional.py` picks). It returns y, or (y, *the form's outputs) in x's shape; rstd and mean are
    saved, never returned, which spares autograd the bookkeeping of two more outputs on every call. `config` is
    what `backward_impl` takes: "" (selected), or the `BackwardCall` of an explicit config, validated once per
    signature. An output of several that gets no gradient counts as a zero one. Under create_graph=True the
    backward runs the differentiable composite (`composite.py`) on the rows normalized (save="output" raises).

    x (and the form's inputs) come as the caller passed them (checked): x's rows where they are a view of it, else
    its rows as a copy. A call with a `forward_calls` plan launches on them in place (stream_dtype None: the
    plan's); a checked call takes their rows and, given the call's signature `sig`, stores the plan for later
    calls. Both save tensors of the same shapes (activation checkpointing's recompute compares them with the
    forward's, and one may be a first call, the other a planned one)."""

    @staticmethod
    def forward(ctx, form, eps, is_rms, zero_centered, save_output, config, stream_dtype, plan, sig, opts, x, weight,
                bias, *extras):
        if plan is not None:
            outputs, rstd, mean = forward_calls.run(plan, form, x, extras, weight, bias, eps)
        elif not form.outputs:
            rows, extra_rows = rows_2d(x), tuple(rows_2d(e) for e in extras)
            outputs, rstd, mean = forward_impl(form, rows, extra_rows, weight, bias, eps, is_rms, zero_centered,
                                               save_output, opts=opts)
            if rows is not x:
                outputs = (outputs[0].view(x.shape),)
            if sig is not None:
                forward_calls.remember(sig, form, x, rows, extras, extra_rows, weight, bias, None, is_rms,
                                       zero_centered, save_output, opts)
        else:
            rows, extra_rows = rows_2d(x), tuple(rows_2d(e) for e in extras)
            # outputs allocated in x's shape, not views of rows: autograd refuses in-place changes of an output
            # that is a view when a Function returns several
            outputs = tuple(torch.empty(x.shape, dtype=dtype, device=x.device)
                            for dtype in (x.dtype,) + (stream_dtype,) * len(form.outputs))
            _, rstd, mean = forward_impl(form, rows, extra_rows, weight, bias, eps, is_rms, zero_centered,
                                         save_output, stream_dtype, tuple(t.view(rows.shape) for t in outputs))
            if sig is not None:
                forward_calls.remember(sig, form, x, rows, extras, extra_rows, weight, bias, stream_dtype, is_rms,
                                       zero_centered, save_output)
        saved_extras = tuple(extras[form.inputs.index(name)] for name in form.saved)
        ctx.save_for_backward(outputs[0] if save_output else (outputs[1] if form.outputs else x), *saved_extras,
                              weight, bias, rstd, mean)
        ctx.form = form
        ctx.flags = _flags(is_rms, zero_centered, save_output, config, eps, x, extras,
                           (t.dtype for t in outputs[1:]), opts)
        if form.outputs:
            ctx.set_materialize_grads(False)
            return outputs
        return outputs[0]

    @staticmethod
    def backward(ctx, grad_y, *grads_out):
        form, flags = ctx.form, ctx.flags
        head = (None,) * 10  # form, eps, the flags, config, stream_dtype, plan, sig, opts
        if grad_y is None:  # y unused: the stream's gradient passes through, the parameters get none
            grads_in = _passed_through(form, flags, grads_out)
            return (*head, grads_in[0], None, None, *grads_in[1:])

        def run(g, gs, saved, saved_extras, weight, bias, rstd, mean):
            shape = saved.shape
            if len(shape) != 2:  # the forward took x with its leading dims: the kernels take rows
                N = shape[-1]
                g, saved, gs = g.reshape(-1, N), saved.reshape(-1, N), tuple(t.reshape(-1, N) for t in gs)
            d, dw, db, *own = backward_impl(g, saved, weight, bias, rstd, mean, *flags[:4], gs[0] if gs else None,
                                            _gate(tuple(rows_2d(t) for t in saved_extras), flags[7]))
            return (d if len(shape) == 2 else d.view(shape)), dw, db, *(t.view(shape) for t in own)

        grads_in, dw, db = _gradients(form, flags, ctx.saved_tensors, grad_y, grads_out, run)
        return (*head, grads_in[0], dw, db, *grads_in[1:])


def _eager_apply():
    """`EagerNorm.apply` without its Python wrapper's per-call work (binding default arguments, a generator over
    all its arguments): the wrapper's own steps for a Function without transforms, done on the tensors. None
    where this torch lacks those entry points (then `EagerNorm.apply` is used)."""
    try:
        apply = super(torch.autograd.Function, EagerNorm).apply
        unwrap = torch._C._functorch.unwrap_if_dead
        active = torch._C._are_functorch_transforms_active
    except AttributeError:
        return None
    return apply, unwrap, active


_EAGER = _eager_apply()


def eager_norm(form: Form, x, extras, weight, bias, eps, is_rms, zero_centered, save_output, config,
               stream_dtype=None, plan=None, sig=None, opts=()):
    """y, or (y, *the form's outputs), = EagerNorm.apply(...), at less host cost per call (see `_eager_apply`);
    under torch.func's transforms, the differentiable composite (`composite.py`), which they can differentiate
    and batch."""
    if _EAGER is None or _EAGER[2]():
        if composite.transforms_active():
            return _composite_forward(form, x, extras, weight, bias, eps, is_rms, zero_centered, stream_dtype, plan,
                                      opts)
        return EagerNorm.apply(form, eps, is_rms, zero_centered, save_output, config, stream_dtype, plan, sig, opts,
                               x, weight, bias, *extras)
    apply, unwrap, _ = _EAGER
    return apply(form, eps, is_rms, zero_centered, save_output, config, stream_dtype, plan, sig, opts, unwrap(x),
                 weight if weight is None else unwrap(weight), bias if bias is None else unwrap(bias),
                 *(unwrap(e) for e in extras))
