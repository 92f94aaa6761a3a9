"""The norm as differentiable PyTorch ops.

`backward`: for double backward (`torch.autograd.grad(..., create_graph=True)`, e.g. a gradient penalty): the
Triton kernels compute first-order gradients only, so a backward that must itself be differentiated runs this
instead. Same math as `backward/common.py`, in fp32, with x̂ recomputed from x (not read from the saved rstd, which
is a constant to autograd), so second and higher order gradients are exact.

`backward_gated` and `forward_gated`: the same for the gated form.

`forward` and `forward_residual`: the whole norm (and the residual add) for calls under torch.func's transforms
(`torch.func.grad`, `torch.vmap`, `jvp`, `jacrev`, ...). The kernels read raw memory, which the transforms' wrapped
tensors do not have, and an autograd.Function that launches them has no batching rule; these ops have torch's
own, at any order and nesting of transforms. The formula of torch's own norms, in fp32, y in x's dtype (save=
does not apply: the transforms keep what they need).
"""

from __future__ import annotations

import torch
from torch import Tensor

SAVE_OUTPUT_MESSAGE = (
    "double backward (create_graph=True) through normtune's {norm} needs save='input': with save='output' the "
    "input x is not kept, and x̂ recovered from y carries no gradient to x; pass save='input' to this layer")


_ACTIVE = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)


def transforms_active() -> bool:
    """Whether a call runs under torch.func's transforms (then `forward`/`forward_residual` run, not the kernels)."""
    return _ACTIVE()


_TRANSFORM_NAMES = {"Vmap": "torch.vmap", "Grad": "torch.func.grad (or vjp, jacrev)",
                    "Jvp": "torch.func.jvp (or jacfwd)", "Functionalize": "torch.func.functionalize"}


def refuse_wrapped(name: str, *tensors) -> None:
    """Raise one RuntimeError, naming the transform, where a torch.func transform has wrapped one of `tensors`:
    the functions without autograd launch the kernels on raw memory, which wrapped tensors do not have."""
    if not transforms_active():
        return
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    if not any(isinstance(t, Tensor) and wrapped(t) for t in tensors):
        return
    try:
        from torch._functorch.pyfunctorch import retrieve_current_functorch_interpreter
        kind = retrieve_current_functorch_interpreter().key().name
    except (ImportError, AttributeError, RuntimeError):
        kind = ""
    transform = _TRANSFORM_NAMES.get(kind, "a torch.func transform")
    raise RuntimeError(f"{name} does not run under {transform}: it launches the kernels on the tensors' memory, "
                       "which the transform's wrapped tensors do not have; inside the transform call layer_norm / "
                       "rms_norm or the modules instead (they run a differentiable composite of the same math there)")


def forward(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, *, is_rms: bool,
            zero_centered: bool) -> Tensor:
    """y over the last dimension of x (any leading dims), in x's dtype; differentiable in x, weight and bias."""
    xf = x.float()
    xc = xf if is_rms else xf - xf.mean(-1, keepdim=True)
    y = xc * torch.rsqrt((xc * xc).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * (weight.float() + 1.0 if zero_centered else weight.float())
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def forward_residual(x: Tensor, residual: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, *,
                     is_rms: bool, zero_centered: bool, h_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(y, h): h = x + residual added in fp32 and stored in h_dtype, y = the norm of that h in x's dtype."""
    h = (x.float() + residual.float()).to(h_dtype)
    return forward(h, weight, bias, eps, is_rms=is_rms, zero_centered=zero_centered).to(x.dtype), h


def needs_graph(*tensors) -> bool:
    """The backward runs under create_graph=True and some operand of it is differentiable: its results must
    carry a graph (a detached gradient would be silently wrong)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def backward(grad: Tensor, x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, *, is_rms: bool,
             zero_centered: bool, save_output: bool):
    """(dx, dw, db) over the last dimension of x (any leading dims), dw/db None where absent, in the dtypes the
    kernels return; differentiable in grad, x, weight and bias. Raises RuntimeError for save='output'."""
    if save_output:
        raise RuntimeError(SAVE_OUTPUT_MESSAGE.format(norm="rms_norm" if is_rms else "layer_norm"))
    N = x.shape[-1]
    xf, g = x.float(), grad.float()
    xc = xf if is_rms else xf - xf.mean(-1, keepdim=True)
    rstd = torch.rsqrt((xc * xc).mean(-1, keepdim=True) + eps)
    xhat = xc * rstd
    w = None
    if weight is not None:
        w = weight.float() + 1.0 if zero_centered else weight.float()
    wg = g * w if w is not None else g
    dx = wg - xhat * (xhat * wg).mean(-1, keepdim=True)
    if not is_rms:
        dx = dx - wg.mean(-1, keepdim=True)
    dx = (dx * rstd).to(grad.dtype)
    dw = (g * xhat).reshape(-1, N).sum(0).to(weight.dtype) if weight is not None else None
    db = g.reshape(-1, N).sum(0).to(bias.dtype) if bias is not None else None
    return dx, dw, db


def _gate(z: Tensor, sigmoid: bool) -> tuple[Tensor, Tensor]:
    """(act(z), act'(z)) in fp32, differentiable."""
    sig = torch.sigmoid(z.float())
    if sigmoid:
        return sig, sig * (1.0 - sig)
    zf = z.float()
    return zf * sig, sig * (1.0 + zf * (1.0 - sig))


def _group_mean(t: Tensor, groups: int) -> Tensor:
    """The mean of each group of the last dimension's columns, repeated over the group's columns."""
    return t.unflatten(-1, (groups, -1)).mean(-1).repeat_interleave(t.shape[-1] // groups, dim=-1)


def forward_gated(x: Tensor, z: Tensor, weight: Tensor | None, eps: float, *, zero_centered: bool, gate_after: bool,
                  sigmoid: bool, group: int | None = None) -> Tensor:
    """The gated RMSNorm's y in x's dtype (`forms.GATED`; statistics per `group` columns, None: the whole row),
    differentiable in x, z and weight."""
    groups = x.shape[-1] // (group or x.shape[-1])
    a, _ = _gate(z, sigmoid)
    s = x.float() * a if gate_after else x.float()
    y = s * torch.rsqrt(_group_mean(s * s, groups) + eps)
    if weight is not None:
        y = y * (weight.float() + 1.0 if zero_centered else weight.float())
    return (y if gate_after else y * a).to(x.dtype)


def backward_gated(grad: Tensor, x: Tensor, z: Tensor, weight: Tensor | None, eps: float, *, zero_centered: bool,
                   gate_after: bool, sigmoid: bool, group: int | None = None):
    """(dx, dw, None, dz) of the gated form (`backward/common.py`'s math per group of `group` columns, fp32, x̂
    recomputed from x), in the dtypes the kernels return; differentiable in grad, x, z and weight."""
    N = x.shape[-1]
    groups = N // (group or N)
    g, xf = grad.float(), x.float()
    a, da = _gate(z, sigmoid)
    s, gn = (xf * a, g) if gate_after else (xf, g * a)
    rstd = torch.rsqrt(_group_mean(s * s, groups) + eps)
    xhat = s * rstd
    w = None
    if weight is not None:
        w = weight.float() + 1.0 if zero_centered else weight.float()
    wg = gn * w if w is not None else gn
    ds = (wg - xhat * _group_mean(xhat * wg, groups)) * rstd
    dx, dz = (ds * a, ds * xf * da) if gate_after else (ds, g * (w if w is not None else 1.0) * xhat * da)
    dw = (gn * xhat).reshape(-1, N).sum(0).to(weight.dtype) if weight is not None else None
    return dx.to(grad.dtype), dw, None, dz.to(z.dtype)
