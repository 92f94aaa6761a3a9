"""torch.func's transforms over normtune's calls: `torch.func.grad` and `torch.vmap` (and their nestings, jvp,
functional_call) over the plain and the fused residual form, functions and modules, give float64 torch's values;
the functions without autograd refuse in one RuntimeError naming the transform; calls outside transforms still
run the kernels."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, jvp, vmap

from normtune.kernels import FusedAddRMSNorm, RMSNorm, layer_norm, layer_norm_forward, rms_norm

from normtune.kernels.api import forward_calls
from normtune.kernels import rms_norm_backward, rms_norm_forward

B, M, N = 3, 4, 16
BF16, FP32 = torch.bfloat16, torch.float32


@pytest.fixture(autouse=True)
def _fresh_plans():
    forward_calls.clear()
    yield
    forward_calls.clear()


def _y(norm, x, w, b=None, r=None, save=None):
    """y of the norm of x (or of h = x + r): normtune's call (save given), else float64 torch's on float64 inputs."""
    if save is None:
        h = x if r is None else x + r
        if norm == "rms_norm":
            return F.rms_norm(h, (h.shape[-1],), w, 1e-6)
        return F.layer_norm(h, (h.shape[-1],), w, b, 1e-5)
    if norm == "rms_norm":
        out = rms_norm(x, w, residual=r, save=save)
    else:
        out = layer_norm(x, w, b, residual=r, save=save)
    return out if r is None else out[0]


def _h(x, r):
    return x if r is None else x + r


def _close(got, want, tol=1e-5):
    err = ((got.double().cpu() - want.double().cpu()).norm() / want.double().cpu().norm()).item()
    assert err <= tol, f"relative error {err:.3g} > {tol:.3g}"


def _inputs(device):
    x = (torch.randn(B, M, N) + 0.5).to(device)
    r = torch.randn(B, M, N).to(device)
    w = (1 + 0.1 * torch.randn(N)).to(device)
    b = (0.1 * torch.randn(N)).to(device)
    return x, r, w, b


@pytest.mark.parametrize("norm", ["rms_norm", "layer_norm"])
@pytest.mark.parametrize("form", ["plain", "residual"])
def test_grad_and_vmap(norm, form, device):
    """grad of x and of the weight, per-sample gradients (vmap of grad), vmap over x and over stacked weights
    (save="output" too) and jvp, on the plain or the fused call: each as float64 torch's."""
    x, r, w, b = _inputs(device)
    b = b if norm == "layer_norm" else None
    r = r if form == "residual" else None
    x64, r64, w64, b64 = (t.double() if t is not None else None for t in (x, r, w, b))

    def loss(save):
        def f(w_, x_, r_):
            y = _y(norm, x_, w_, b if save else b64, r_, save)
            return (y * y).sum() + (_h(x_, r_) * y).sum()
        return f

    r_dim = None if r is None else 0
    for arg in (0, 1):  # the weight's gradient, x's gradient
        _close(grad(loss("input"), argnums=arg)(w, x, r), grad(loss(None), argnums=arg)(w64, x64, r64))
    got = vmap(grad(loss("input"), argnums=(0, 1)), in_dims=(None, 0, r_dim))(w, x, r)
    want = vmap(grad(loss(None), argnums=(0, 1)), in_dims=(None, 0, r_dim))(w64, x64, r64)
    for g, g64 in zip(got, want):
        _close(g, g64)
    stacked = torch.stack([w, 1.5 * w, 0.5 * w])
    r0, r064 = (None, None) if r is None else (r[0], r64[0])
    for save in ("input", "output"):
        _close(vmap(lambda x_, r_: _y(norm, x_, w, b, r_, save), in_dims=(0, r_dim))(x, r), _y(norm, x64, w64, b64,
                                                                                                r64))
        _close(vmap(lambda w_: _y(norm, x[0], w_, b, r0, save))(stacked),
               torch.stack([_y(norm, x64[0], s, b64, r064) for s in stacked.double()]))
    tangent = torch.randn_like(x)
    _, got = jvp(lambda x_: _y(norm, x_, w, b, r, "input"), (x,), (tangent,))
    _, want = jvp(lambda x_: _y(norm, x_, w64, b64, r64), (x64,), (tangent.double(),))
    _close(got, want)


def test_fused_module_on_an_fp32_stream_under_grad_and_vmap(device):
    """FusedAddRMSNorm (bf16 x, fp32 residual stream) under functional_call: the weight's gradient and per-sample
    outputs as float64 torch's, h in fp32."""
    x, r, w, _ = _inputs(device)
    x = x.to(BF16)
    m = FusedAddRMSNorm(N, eps=1e-6, device=device, dtype=BF16, residual_dtype=FP32)
    with torch.no_grad():
        m.weight.copy_(w)
    params = {"weight": m.weight.detach()}

    def loss(p, x_, r_):
        y, h = functional_call(m, p, (x_, r_))
        assert h.dtype == FP32
        return (y.float() * h).sum()

    got = grad(loss)(params, x, r)["weight"]
    w64 = w.to(BF16).double().requires_grad_()
    h64 = x.double() + r.double()
    (_y("rms_norm", h64, w64) * h64).sum().backward()
    _close(got, w64.grad, 2e-2)
    ys, hs = vmap(lambda x_, r_: m(x_, r_))(x, r)
    assert hs.dtype == FP32 and torch.equal(hs, x.float() + r)
    _close(ys, _y("rms_norm", x.double() + r.double(), w.to(BF16).double()), 2e-2)
    plain = RMSNorm(N, device=device, dtype=FP32)
    _close(vmap(plain)(x.float()), F.rms_norm(x.double(), (N,), plain.weight.detach().double()))


def test_planned_inputs_under_a_transform_and_kernels_outside(device):
    """Inputs the transform does not wrap (constants) may match an earlier call's plan: the call still runs under
    the transform. Calls outside transforms keep the kernels' autograd Functions."""
    x, r, w, _ = _inputs(device)
    for _ in range(2):  # the second call stores nothing new: it runs the first call's plan
        rms_norm(x[0], w)
        rms_norm(x[0], w, residual=r[0])

    def f(s):
        return (s * rms_norm(x[0], w)).sum() + (s * rms_norm(x[0], w, residual=r[0])[0]).sum()

    got = grad(f)(torch.tensor(1.0, device=device))
    want = rms_norm(x[0], w).sum() + rms_norm(x[0], w, residual=r[0])[0].sum()
    _close(got.reshape(1), want.reshape(1))
    xg = x.clone().requires_grad_()
    assert type(rms_norm(xg, w).grad_fn).__name__ == "EagerNormBackward"
    assert type(rms_norm(xg, w, residual=r)[0].grad_fn).__name__ == "EagerNormBackward"  # one Function, any form


def test_functions_without_autograd_name_the_transform(device):
    x, r, w, b = _inputs(device)
    y, rstd = rms_norm_forward(x[0], w)
    cases = [
        ("torch.vmap", "rms_norm_forward", lambda: vmap(lambda t: rms_norm_forward(t, w)[0])(x)),
        ("torch.vmap", "rms_norm_forward", lambda: vmap(lambda t, s: rms_norm_forward(t, w, residual=s)[0])(x, r)),
        ("torch.func.grad", "layer_norm_forward", lambda: grad(lambda t: layer_norm_forward(t, w, b)[0].sum())(x)),
        ("torch.vmap", "rms_norm_backward", lambda: vmap(lambda g: rms_norm_backward(g, x[0], w, rstd)[0])(x)),
    ]
    for transform, name, call in cases:
        with pytest.raises(RuntimeError) as info:
            call()
        message = str(info.value)
        assert f"{name} does not run under {transform}" in message and "rms_norm or the modules" in message, message
