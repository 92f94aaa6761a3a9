"""The backward as differentiable PyTorch ops, for double backward (`torch.autograd.grad(..., create_graph=True)`,
e.g. a gradient penalty): the Triton kernels compute first-order gradients only, so a backward that must itself be
differentiated runs this instead. Same math as `backward/common.py`, in fp32, with x̂ recomputed from x (not read
from the saved rstd, which is a constant to autograd), so second and higher order gradients are exact.
"""

from __future__ import annotations

import torch
from torch import Tensor

SAVE_OUTPUT_MESSAGE = (
    "double backward (create_graph=True) through normtune's {norm} needs save='input': with save='output' the "
    "input x is not kept, and x̂ recovered from y carries no gradient to x; pass save='input' to this layer")


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
