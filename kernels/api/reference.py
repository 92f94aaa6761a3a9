"""Pure-PyTorch forward and backward, computed in fp32 with the same saving semantics as the Triton kernels.

Used for CPU tensors outside the interpreter, and by the tuner as the correctness gate's reference. The math is
the one in `backward/common.py`'s docstring, written with whole-tensor torch ops. `gated_float64` is the gated
form's float64 reference: torch's autograd through the forward's formula, not the backward's math.
"""

from __future__ import annotations

import torch

from ..config import RECOVER_LIMITS, canonical_dtype


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
    amax = xc.abs().amax(dim=1, keepdim=True) if xc.numel() else xc.new_zeros((xc.shape[0], 1))
    large = (amax > 2.0 ** 50) & amax.isfinite()  # as forward.py: a row holding ±inf is not scaled (inf·0)
    scale = torch.where(large, 1.0 / amax.clamp_min(1.0), torch.ones_like(amax))
    xs = xc * scale
    rstd = torch.rsqrt((xs * xs).mean(dim=1) + eps * scale[:, 0] ** 2) * scale[:, 0]
    y = xc * rstd[:, None]
    w = effective_weight(weight, zero_centered)
    if w is not None:
        y = y * w
    if bias is not None:
        y = y + bias.float()
    return y.to(x2d.dtype), rstd, mean if store_mean else None


def forward_residual(x2d: torch.Tensor, residual2d: torch.Tensor, weight, bias, eps: float, *, h_dtype: torch.dtype,
                     is_rms: bool, zero_centered: bool, store_mean: bool):
    """Returns (y, h, rstd, mean) as `forward.forward_residual` does: h = x + residual added in fp32 and rounded to
    h_dtype, y the norm of that rounded h, in x's dtype."""
    h = (x2d.float() + residual2d.float()).to(h_dtype)
    y, rstd, mean = forward(h, weight, bias, eps, is_rms=is_rms, zero_centered=zero_centered, store_mean=store_mean)
    return y.to(x2d.dtype), h, rstd, mean


def normalized(saved: torch.Tensor, weight, bias, rstd, mean, *, is_rms: bool, zero_centered: bool,
               from_output: bool) -> torch.Tensor:
    """x̂ in fp32 from the saved activation (x, or y when `from_output`)."""
    s = saved.float()
    if from_output:
        b = bias.float() if bias is not None else torch.zeros(s.shape[1], device=s.device)
        s = s - b
        w = effective_weight(weight, zero_centered)
        if w is not None:
            lost = w.abs() * RECOVER_LIMITS[canonical_dtype(saved.dtype)] <= b.abs()
            s = torch.where(lost, float("nan"), s / w)
        return s
    if is_rms:
        return s * rstd[:, None]
    return (s - mean[:, None]) * rstd[:, None]


def backward(grad: torch.Tensor, saved: torch.Tensor, weight, bias, rstd, mean, *, is_rms: bool,
             zero_centered: bool, from_output: bool, dh: torch.Tensor | None = None):
    """Returns (dx, dw, db) with dw/db None where absent, in the dtypes the kernels produce. `dh`: the residual
    stream's gradient, added into dx (which then has dh's dtype)."""
    g = grad.float()
    N = g.shape[1]
    xhat = normalized(saved, weight, bias, rstd, mean, is_rms=is_rms, zero_centered=zero_centered,
                      from_output=from_output)
    w = effective_weight(weight, zero_centered)
    wg = g * w if w is not None else g
    # From y, x̂·w = y − b exactly: columns whose x̂ is lost (NaN) do not spoil the others' grad_input.
    xw = (saved.float() - (bias.float() if bias is not None else 0.0)) if from_output else xhat * (
        w if w is not None else 1.0)
    c1 = (xw * g).sum(dim=1, keepdim=True) / N
    if is_rms:
        dx = (wg - xhat * c1) * rstd[:, None]
    else:
        c2 = wg.sum(dim=1, keepdim=True) / N
        dx = (wg - c2 - xhat * c1) * rstd[:, None]
    dw = (g * xhat).sum(dim=0).to(weight.dtype) if weight is not None else None
    db = g.sum(dim=0).to(bias.dtype) if bias is not None else None
    if dh is not None:
        return (dx + dh.float()).to(dh.dtype), dw, db
    return dx.to(grad.dtype), dw, db


def gate_activation(z: torch.Tensor, sigmoid: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(act(z), act'(z)) in z's dtype: silu or sigmoid (`backward/common.py`'s `gate_activation`)."""
    sig = torch.sigmoid(z)
    if sigmoid:
        return sig, sig * (1.0 - sig)
    return z * sig, sig * (1.0 + z * (1.0 - sig))


def forward_gated(x2d: torch.Tensor, z2d: torch.Tensor, weight, eps: float, *, gate_after: bool, sigmoid: bool,
                  zero_centered: bool):
    """Returns (y, rstd) as `forward.forward_gated` does (in fp32, y in x's dtype)."""
    a, _ = gate_activation(z2d.float(), sigmoid)
    x = x2d.float() * a if gate_after else x2d
    y, rstd, _ = forward(x, weight, None, eps, is_rms=True, zero_centered=zero_centered, store_mean=False)
    if not gate_after:
        y = y.float() * a
    return y.to(x2d.dtype), rstd


def backward_gated(grad: torch.Tensor, x: torch.Tensor, z: torch.Tensor, weight, rstd, *, gate_after: bool,
                   sigmoid: bool, zero_centered: bool):
    """Returns (dx, dw, None, dz) as the kernels do (`backward/common.py`'s gated form), in fp32 math."""
    g, xf = grad.float(), x.float()
    a, da = gate_activation(z.float(), sigmoid)
    s, gn = (xf * a, g) if gate_after else (xf, g * a)
    xhat = s * rstd[:, None]
    w = effective_weight(weight, zero_centered)
    wg = gn * w if w is not None else gn
    ds = (wg - xhat * (xhat * wg).mean(dim=1, keepdim=True)) * rstd[:, None]
    if gate_after:
        dx, dz = ds * a, ds * xf * da
    else:
        dx, dz = ds, g * (w if w is not None else 1.0) * xhat * da
    dw = (gn * xhat).sum(dim=0).to(weight.dtype) if weight is not None else None
    return dx.to(grad.dtype), dw, None, dz.to(z.dtype)


def gated_float64(x: torch.Tensor, z: torch.Tensor, weight, grad: torch.Tensor, eps: float, *, gate_after: bool,
                  sigmoid: bool, zero_centered: bool, group: int | None = None) -> dict:
    """The gated RMSNorm in float64 over the last dimension, statistics per `group` columns (None: the whole
    row): {"y", "dx", "dz", "dw"} (dw None without a weight), the gradients from torch's autograd of y·grad."""
    x64, z64 = (t.detach().double().requires_grad_() for t in (x, z))
    w64 = weight.detach().double().requires_grad_() if weight is not None else None
    a = torch.sigmoid(z64) if sigmoid else torch.nn.functional.silu(z64)
    s = x64 * a if gate_after else x64
    N = s.shape[-1]
    sg = s.unflatten(-1, (N // (group or N), -1))
    y = (sg * torch.rsqrt((sg * sg).mean(-1, keepdim=True) + eps)).flatten(-2)
    if w64 is not None:
        y = y * (w64 + 1.0 if zero_centered else w64)
    if not gate_after:
        y = y * a
    (y * grad.double()).sum().backward()
    return {"y": y.detach(), "dx": x64.grad, "dz": z64.grad, "dw": None if w64 is None else w64.grad}
