"""Pure-PyTorch forward and backward, computed in fp32 with the same saving semantics as the Triton kernels.

Used for CPU tensors outside the interpreter, and by the tuner as the correctness gate's reference. The math is
the one in `backward.py`'s docstring, written with whole-tensor torch ops.
"""

from __future__ import annotations

import torch

from .backward import W_TINY


def effective_weight(weight: torch.Tensor | None, zero_centered: bool) -> torch.Tensor | None:
    if weight is None:
        return None
    w = weight.float()
    return w + 1.0 if zero_centered else w


def forward(x2d: torch.Tensor, weight, bias, eps: float, *, is_rms: bool, zero_centered: bool, store_mean: bool):
    """Returns (y, rstd, mean) as `forward.forward` does."""
    x = x2d.float()
    if is_rms:
        mean = torch.zeros(x.shape[0], dtype=torch.float32, device=x.device)
        xc = x
    else:
        mean = x.mean(dim=1)
        xc = x - mean[:, None]
    rstd = torch.rsqrt((xc * xc).mean(dim=1) + eps)
    y = xc * rstd[:, None]
    w = effective_weight(weight, zero_centered)
    if w is not None:
        y = y * w
    if bias is not None:
        y = y + bias.float()
    if not store_mean:
        mean = mean.new_empty((0,))
    return y.to(x2d.dtype), rstd, mean


def normalized(saved: torch.Tensor, weight, bias, rstd, mean, *, is_rms: bool, zero_centered: bool,
               from_output: bool) -> torch.Tensor:
    """x̂ in fp32 from the saved activation (x, or y when `from_output`)."""
    s = saved.float()
    if from_output:
        if bias is not None:
            s = s - bias.float()
        w = effective_weight(weight, zero_centered)
        if w is not None:
            tiny = torch.where(w < 0, -W_TINY.value, W_TINY.value)
            s = s / torch.where(w.abs() < W_TINY.value, tiny, w)
        return s
    if is_rms:
        return s * rstd[:, None]
    return (s - mean[:, None]) * rstd[:, None]


def backward(grad: torch.Tensor, saved: torch.Tensor, weight, bias, rstd, mean, *, is_rms: bool,
             zero_centered: bool, from_output: bool):
    """Returns (dx, dw, db) with dw/db None where absent, in the dtypes the kernels produce."""
    g = grad.float()
    N = g.shape[1]
    xhat = normalized(saved, weight, bias, rstd, mean, is_rms=is_rms, zero_centered=zero_centered,
                      from_output=from_output)
    w = effective_weight(weight, zero_centered)
    wg = g * w if w is not None else g
    c1 = (xhat * wg).sum(dim=1, keepdim=True) / N
    if is_rms:
        dx = (wg - xhat * c1) * rstd[:, None]
    else:
        c2 = wg.sum(dim=1, keepdim=True) / N
        dx = (wg - c2 - xhat * c1) * rstd[:, None]
    dw = (g * xhat).sum(dim=0).to(weight.dtype) if weight is not None else None
    db = g.sum(dim=0).to(bias.dtype) if bias is not None else None
    return dx.to(grad.dtype), dw, db
