"""The residual form's inputs and outputs that could go silently wrong: a residual that is x or overlaps it,
gradients asked of only some inputs, outputs changed in place before the backward, double backward
(create_graph=True), modules over several normalized dims, eps=None on a residual stream wider than x; each on a
first (checked) and a planned call."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from normtune.kernels import FusedAddLayerNorm, FusedAddRMSNorm, layer_norm, rms_norm

from normtune.kernels.api import forward_calls
from normtune.kernels import rms_norm_forward

BF16, FP32 = torch.bfloat16, torch.float32


@pytest.fixture(autouse=True)
def _fresh_plans():
    forward_calls.clear()
    yield
    forward_calls.clear()


def test_modules_return_y_and_h_in_the_input_shape(device):
    """A fused module over a multi-dimensional normalized_shape returns y and h in x's shape, the flat call's
    values; over one dimension, the planned call's outputs themselves."""
    from normtune.kernels import FusedAddLayerNorm, FusedAddRMSNorm

    x = (torch.randn(3, 4, 8) + 0.5).to(device=device, dtype=BF16)
    r = torch.randn(3, 4, 8).to(device=device, dtype=BF16)
    m = FusedAddLayerNorm((4, 8), device=device, dtype=BF16)
    y, h = m(x, r)
    want = layer_norm(x.reshape(3, 32), m.weight.reshape(-1), m.bias.reshape(-1), residual=r.reshape(3, 32))
    assert y.shape == h.shape == x.shape and torch.equal(y.reshape(3, 32), want[0])
    assert torch.equal(h.reshape(3, 32), want[1])
    m = FusedAddRMSNorm(8, eps=1e-6, device=device, dtype=BF16, residual_dtype=FP32)
    for _ in range(2):
        y, h = m(x, r)
        assert y.shape == h.shape == x.shape and h.dtype == FP32
        assert torch.equal(y, rms_norm(x, m.weight, 1e-6, residual=r, residual_dtype=FP32)[0])


def _block64(x, r, w, dy, dh, h_of):
    """float64 gradient of x (and of r) for h = h_of(x, r), y = rms_norm(h)."""
    x64 = x.detach().double().requires_grad_()
    r64 = r.detach().double().requires_grad_() if r is not None else None
    h = h_of(x64, r64)
    y = F.rms_norm(h, (h.shape[-1],), w.double(), 1e-6)
    ((y * dy.double()).sum() + (h * dh.double()).sum()).backward()
    return x64.grad, (r64.grad if r64 is not None else None)


@pytest.mark.parametrize("attempt", ["first", "planned"])
def test_a_residual_that_is_x_or_overlaps_it(attempt, device):
    """residual=x (h = 2x) gives x both gradients; a residual overlapping x's memory reads it as it was."""
    n = 16
    x0 = (torch.randn(4, n) + 0.5).to(device=device, dtype=FP32)
    w = (1 + 0.1 * torch.randn(n)).to(device=device)
    dy, dh = torch.randn(4, n, device=device), torch.randn(4, n, device=device)
    forward_calls.clear()
    for _ in range(1 if attempt == "first" else 2):
        x = x0.clone().requires_grad_()
        y, h = rms_norm(x, w, residual=x)
        torch.autograd.backward([y, h], [dy, dh])
    want, _ = _block64(x0, None, w, dy, dh, lambda a, _: a + a)
    assert torch.equal(h, 2 * x0)
    torch.testing.assert_close(x.grad.double(), want, rtol=1e-4, atol=1e-4)
    buf0 = torch.randn(4, n + 1, device=device)
    for _ in range(1 if attempt == "first" else 2):
        buf = buf0.clone().requires_grad_()
        y, h = rms_norm(buf[:, :n], w, residual=buf[:, 1:])
        torch.autograd.backward([y, h], [dy, dh])
    b64 = buf0.double().requires_grad_()
    h64 = b64[:, :n] + b64[:, 1:]
    ((F.rms_norm(h64, (n,), w.double(), 1e-6) * dy.double()).sum() + (h64 * dh.double()).sum()).backward()
    torch.testing.assert_close(buf.grad.double(), b64.grad, rtol=1e-4, atol=1e-4)


def test_gradients_flow_only_where_asked(device):
    """A residual without requires_grad gets no gradient while x gets its whole one; with neither, y and h need
    none; with only the residual, the residual gets it."""
    x0 = (torch.randn(4, 16) + 0.5).to(device=device)
    r0, w = torch.randn(4, 16, device=device), torch.ones(16, device=device)
    dy, dh = torch.randn(4, 16, device=device), torch.randn(4, 16, device=device)
    want_x, want_r = _block64(x0, r0, w, dy, dh, lambda a, b: a + b)
    for _ in range(2):
        y, h = rms_norm(x0, w, residual=r0)
        assert not y.requires_grad and not h.requires_grad
        x, r = x0.clone().requires_grad_(), r0.clone()
        torch.autograd.backward(rms_norm(x, w, residual=r), [dy, dh])
        assert r.grad is None
        torch.testing.assert_close(x.grad.double(), want_x, rtol=1e-4, atol=1e-4)
        x, r = x0.clone(), r0.clone().requires_grad_()
        torch.autograd.backward(rms_norm(x, w, residual=r), [dy, dh])
        assert x.grad is None
        torch.testing.assert_close(r.grad.double(), want_r, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("attempt", ["first", "planned"])
def test_an_output_the_backward_needs_cannot_be_changed_in_place(attempt, device):
    """save="input" keeps h, save="output" keeps y: changing that output in place before a backward that reads it
    raises autograd's in-place error instead of computing gradients from the changed values; changing the other
    one is harmless (its gradient does not read it), and so is changing y when only h gets a gradient (h's
    gradient then passes through without the saved tensors)."""
    x0 = (torch.randn(2, 3, 16) + 0.5).to(device=device)
    r, w = torch.randn(2, 3, 16, device=device), torch.ones(16, device=device)
    forward_calls.clear()
    if attempt == "planned":
        for save in ("input", "output"):
            rms_norm(x0, w, residual=r, save=save)
    for save, kept in (("input", 1), ("output", 0)):
        x = x0.clone().requires_grad_()
        outs = rms_norm(x, w, residual=r, save=save)
        outs[kept].add_(1.0)
        if save == "input":
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                outs[1 - kept].sum().backward(retain_graph=True)
        else:
            outs[1 - kept].sum().backward(retain_graph=True)
            assert torch.equal(x.grad, torch.ones_like(x))
        x = x0.clone().requires_grad_()
        outs = rms_norm(x, w, residual=r, save=save)
        ref = x0.clone().requires_grad_()
        rms_norm(ref, w, residual=r, save=save)[kept].sum().backward()
        outs[1 - kept].mul_(3.0)
        outs[kept].sum().backward()
        assert torch.equal(x.grad, ref.grad), save


def _penalty_grads(norm, x, r, w, b, a, c, save="input"):
    """Gradients of x, r, w (and b) of the gradient penalty Σ(∂L/∂x)² + Σ(∂L/∂w)², L = Σ y·a + Σ h·c."""
    leaves = [t for t in (x, r, w, b) if t is not None]
    if norm == "rms_norm":
        y, h = rms_norm(x, w, residual=r, save=save) if save else _block(norm, x, r, w, b)
    else:
        y, h = layer_norm(x, w, b, residual=r, save=save) if save else _block(norm, x, r, w, b)
    gx, gw = torch.autograd.grad((y * a).sum() + (h * c).sum(), (x, w), create_graph=True)
    ((gx * gx).sum() + (gw * gw).sum()).backward()
    return [t.grad for t in leaves]


def _block(norm, x, r, w, b):
    """The unfused block, in x's dtype (float64 for the reference)."""
    h = x + r
    n = (h.shape[-1],)
    return (F.rms_norm(h, n, w, 1e-6) if norm == "rms_norm" else F.layer_norm(h, n, w, b, 1e-5)), h


@pytest.mark.parametrize("norm", ["rms_norm", "layer_norm"])
def test_double_backward_reaches_x_and_residual(norm, device):
    """A gradient penalty (create_graph=True) differentiates the backward: x, residual, weight and bias get the
    float64 block's second-order gradients on a first and on a planned call, not gradients of a detached
    backward (which drop the penalty's terms); save="output" refuses, naming save='input'."""
    n = 24
    x0 = (torch.randn(2, 3, n) + 0.5).to(device)
    r0, a, c = (torch.randn(2, 3, n, device=device) for _ in range(3))
    w0 = (1 + 0.1 * torch.randn(n)).to(device)
    b0 = (0.1 * torch.randn(n)).to(device) if norm == "layer_norm" else None

    def leaves(dtype):
        return [t.detach().to(dtype).requires_grad_() if t is not None else None for t in (x0, r0, w0, b0)]

    want = _penalty_grads(norm, *leaves(torch.float64), a.double(), c.double(), save=None)
    for attempt in ("first", "planned"):
        got = _penalty_grads(norm, *leaves(FP32), a, c)
        for what, g, ref in zip(("x", "residual", "weight", "bias"), got, want):
            if ref is None:  # the penalty does not depend on it (LayerNorm's bias): float64 autograd leaves None
                if g is None:
                    continue
                ref = torch.zeros_like(g, dtype=torch.float64)
            assert g is not None, (attempt, what)
            torch.testing.assert_close(g.double(), ref, rtol=1e-3, atol=1e-3, msg=f"{attempt}: {what}")
    with pytest.raises(RuntimeError, match="save='input'"):
        _penalty_grads(norm, *leaves(FP32), a, c, save="output")


def _rel(out, want) -> float:
    return ((out.double().cpu() - want.double().cpu()).norm() / want.double().cpu().norm()).item()


@pytest.mark.parametrize("stream", ["residual_dtype", "residual", "str"])
def test_eps_none_follows_the_residual_streams_dtype(stream, device):
    """bf16 x on an fp32 stream, activations of 0.02 (mean(h²) ~ 1e-3, below bf16's eps 2^-7): eps=None is fp32's
    eps, as torch.nn.RMSNorm(eps=None) applied on h takes it, in the module, the functional and the function
    without autograd; the fp32 stream is asked for by residual_dtype (as a dtype or "fp32") or by an fp32
    residual."""
    n = 64
    x = (0.02 * torch.randn(4, n)).to(device=device, dtype=BF16)
    r = 0.02 * torch.randn(4, n)
    r = r.to(device=device, dtype=FP32 if stream == "residual" else BF16)
    residual_dtype = {"residual_dtype": FP32, "residual": None, "str": "fp32"}[stream]
    h = x.float() + r.float()
    torch_norm = torch.nn.RMSNorm(n, eps=None, device=device, dtype=FP32)
    with torch.no_grad():
        torch_norm.weight.copy_(1 + 0.1 * torch.randn(n))
        want = torch_norm(h)
    m = FusedAddRMSNorm(n, eps=None, device=device, dtype=BF16, residual_dtype=residual_dtype)
    m.load_state_dict(torch_norm.state_dict())
    w = m.weight.detach()
    for attempt in ("first", "planned"):
        y, got_h = m(x, r)
        assert got_h.dtype == FP32 and torch.equal(got_h, h), attempt
        assert _rel(y, want) < 2e-2, f"module ({attempt}): relative error {_rel(y, want):.3g}"
        y, _ = rms_norm(x, w, None, residual=r, residual_dtype=residual_dtype)
        assert _rel(y, want) < 2e-2, f"rms_norm ({attempt}): relative error {_rel(y, want):.3g}"
        y, _, _ = rms_norm_forward(x, w, None, residual=r, residual_dtype=residual_dtype)
        assert _rel(y, want) < 2e-2, f"rms_norm_forward ({attempt}): relative error {_rel(y, want):.3g}"
    # eps=None of the plain norm is x's dtype's, as torch.nn.functional.rms_norm's
    want = F.rms_norm(x.float(), (n,), w, torch.finfo(BF16).eps)
    assert _rel(rms_norm(x, w, None), want) < 2e-2 and _rel(rms_norm_forward(x, w, None)[0], want) < 2e-2


def test_eps_none_with_a_broken_residual_names_the_argument(device):
    x = torch.randn(2, 8, device=device, dtype=BF16)
    with pytest.raises(TypeError, match="residual has dtype torch.float16"):
        rms_norm(x, None, None, residual=torch.randn(2, 8, device=device, dtype=torch.float16))
    with pytest.raises(TypeError, match="residual_dtype=torch.float16"):
        rms_norm(x, None, None, residual=x, residual_dtype=torch.float16)
    with pytest.raises(TypeError, match="x has dtype torch.int64"):
        rms_norm(torch.ones(2, 8, dtype=torch.int64, device=device), None, None)


def test_fused_layer_norm_eps_is_torch_layer_norms(device):
    """LayerNorm's eps has no dtype rule (torch.nn.LayerNorm's is a number, 1e-5 by default): on an fp32 stream
    the fused module matches torch.nn.LayerNorm applied on h, and eps=None is refused in one line naming eps."""
    n = 64
    x = (0.02 * torch.randn(4, n)).to(device=device, dtype=BF16)
    r = (0.02 * torch.randn(4, n)).to(device=device, dtype=BF16)
    torch_norm = torch.nn.LayerNorm(n, device=device, dtype=FP32)
    m = FusedAddLayerNorm(n, device=device, dtype=BF16, residual_dtype=FP32)
    with torch.no_grad():
        torch_norm.weight.copy_(1 + 0.1 * torch.randn(n))
        torch_norm.bias.copy_(0.1 * torch.randn(n))
        want = torch_norm(x.float() + r.float())
    m.load_state_dict(torch_norm.state_dict())
    assert m.eps == torch_norm.eps == 1e-5
    for _ in range(2):
        y, h = m(x, r)
        assert h.dtype == FP32 and _rel(y, want) < 2e-2
    with pytest.raises(ValueError, match="eps must be a positive finite number"):
        FusedAddLayerNorm(n, eps=None)
