"""Rows holding ±inf: y, dx and dw are NaN or inf exactly where torch's own formula (float64 autograd on the same
inputs) gives them, and finite values match it elsewhere, for the plain and the fused residual form, under each
kernel_1 strategy (rows, columns, dual, split rows) and both save modes. RMSNorm's r of such a row is 0 (Σx² = inf),
so its other columns' y is 0; LayerNorm's row is NaN throughout, as torch's."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from normtune.kernels import BackwardConfig, Kernel2Config, kernel_1_config, layer_norm, rms_norm

from normtune.kernels.api import forward_calls
from normtune.kernels.api import reference
from normtune.kernels.heuristics import row_block_col

M = 5
INF = float("inf")
BASE = kernel_1_config(block_row=2, block_col=256, num_warps=2, programs_per_sm=2)
K2 = Kernel2Config(block_m=4, block_n=64, num_warps=2)
# (name, N, config): each kernel_1 strategy and the knobs that change how a row's terms are formed.
CONFIGS = [
    ("default", 200, None),
    ("rows", 200, BackwardConfig(BASE, K2)),
    ("rows+two_pass", 200, BackwardConfig(dataclasses.replace(BASE, two_pass=True, block_col=64), K2)),
    ("rows+recompute+column_accumulators", 200,
     BackwardConfig(dataclasses.replace(BASE, recompute=True, column_accumulators=True), K2)),
    ("rows+k2.fused", 200, BackwardConfig(BASE, dataclasses.replace(K2, fused=True))),
    ("columns", 200, BackwardConfig(kernel_1_config(BASE.shared_fields(), strategy="columns", block_col=64,
                                                    programs_per_sm=1), K2)),
    ("dual", 200, BackwardConfig(kernel_1_config(BASE.shared_fields(), strategy="dual"), K2)),
    ("row_split=3", 800, BackwardConfig(dataclasses.replace(BASE, row_split=3, block_col=row_block_col(800, 3),
                                                            num_warps=4), K2)),
    ("row_split=2+pipelined", 600, BackwardConfig(dataclasses.replace(
        BASE, row_split=2, block_col=row_block_col(600, 2), num_warps=4, num_stages=3, pipelined_split=True), K2)),
]


@pytest.fixture(autouse=True)
def _fresh_plans():
    forward_calls.clear()
    yield
    forward_calls.clear()


def _inputs(N, dtype, device):
    """x with +inf in row 1 and −inf in row 3 (other rows finite), weight, dy, dh, residual."""
    x = torch.randn(M, N) + 0.5
    x[1, 7], x[3, N - 1] = INF, -INF
    w = 1.0 + 0.1 * torch.randn(N)
    dy, dh, r = torch.randn(M, N), torch.randn(M, N), torch.randn(M, N)
    return [t.to(device=device, dtype=dtype) for t in (x, w, dy, dh, r)]


def _torch64(is_rms, x, w, dy, dh=None, r=None, eps=1e-6):
    """float64 torch autograd: y, dx, dw (h = x + r when r is given, dh its gradient)."""
    x64 = x.detach().double().cpu().requires_grad_()
    w64 = w.detach().double().cpu().requires_grad_()
    h = x64 if r is None else x64 + r.double().cpu()
    N = h.shape[-1]
    y = F.rms_norm(h, (N,), w64, eps) if is_rms else F.layer_norm(h, (N,), w64, None, eps)
    loss = (y * dy.double().cpu()).sum() + ((h * dh.double().cpu()).sum() if r is not None else 0.0)
    loss.backward()
    return y.detach(), x64.grad, w64.grad


def _matches(out, want, what):
    """Same NaN and ±inf positions as the float64 reference; finite values within fp32 rounding."""
    out = out.detach().double().cpu()
    assert torch.equal(out.isnan(), want.isnan()), f"{what}: NaN at {out.isnan().nonzero().tolist()}, torch has " \
                                                   f"{want.isnan().nonzero().tolist()}"
    assert torch.equal(out.isinf(), want.isinf()) and torch.equal(out[out.isinf()], want[want.isinf()]), \
        f"{what}: ±inf differs from torch's"
    fin = want.isfinite()
    err = (out[fin] - want[fin]).norm() / want[fin].norm().clamp_min(1e-30)
    assert err <= 1e-5, f"{what}: finite values off by {err:.3g}"


@pytest.mark.parametrize("save", ["input", "output"])
@pytest.mark.parametrize("name,N,config", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_rms_norm_row_with_inf_matches_torch(name, N, config, save, device):
    x, w, dy, dh, r = _inputs(N, torch.float32, device)
    ref_y, ref_dx, ref_dw = _torch64(True, x, w, dy)
    assert ref_y[1].isnan().sum() == 1 and ref_y[1].isfinite().sum() == N - 1  # the premise: one NaN per row
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = rms_norm(xg, wg, 1e-6, save=save, config=config)
    y.backward(dy)
    _matches(y, ref_y, "y")
    _matches(xg.grad, ref_dx, "dx")
    _matches(wg.grad, ref_dw, "dw")


@pytest.mark.parametrize("save", ["input", "output"])
@pytest.mark.parametrize("name,N,config", [CONFIGS[0], CONFIGS[5], CONFIGS[6], CONFIGS[7]],
                         ids=["default", "columns", "dual", "row_split=3"])
def test_fused_residual_rms_norm_row_with_inf_matches_torch(name, N, config, save, device):
    """The inf comes from the residual (x finite): h = x + residual is inf there, and the fp32 stream keeps it."""
    x, w, dy, dh, r = _inputs(N, torch.float32, device)
    x, r = r, x  # x finite, the residual holds the infinities
    ref_y, ref_dx, ref_dw = _torch64(True, x, w, dy, dh, r)
    xg, rg, wg = x.clone().requires_grad_(), r.clone().requires_grad_(), w.clone().requires_grad_()
    y, h = rms_norm(xg, wg, 1e-6, residual=rg, save=save, config=config)
    torch.autograd.backward((y, h), (dy, dh))
    _matches(y, ref_y, "y")
    _matches(xg.grad, ref_dx, "dx")
    _matches(rg.grad, ref_dx, "dresidual")
    _matches(wg.grad, ref_dw, "dw")


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_layer_norm_row_with_inf_still_matches_torch(residual, device):
    x, w, dy, dh, r = _inputs(200, torch.float32, device)
    ref_y, ref_dx, ref_dw = _torch64(False, x, w, dy, dh if residual else None, r if residual else None)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    if residual:
        y, h = layer_norm(xg, wg, None, 1e-6, residual=r)
        torch.autograd.backward((y, h), (dy, dh))
    else:
        y = layer_norm(xg, wg, None, 1e-6)
        y.backward(dy)
    _matches(y, ref_y, "y")
    _matches(xg.grad, ref_dx, "dx")
    _matches(wg.grad, ref_dw, "dw")


@pytest.mark.parametrize("N", [40, 8200], ids=["single-pass", "chunked"])
def test_bf16_rows_with_inf_or_huge_values(N, device):
    """bf16 rows: one holding +inf, one of values near 1e36 (scaled before squaring): the first as torch's, the
    second normalized exactly; the pure-PyTorch reference agrees."""
    x = torch.randn(2, N)
    x[0, 3], x[1] = INF, x[1] * 1e36
    x = x.to(device=device, dtype=torch.bfloat16)
    w = (1.0 + 0.1 * torch.randn(N)).to(device)
    want = F.rms_norm(x.double().cpu(), (N,), w.double().cpu(), 1e-6)
    for y in (rms_norm(x, w, 1e-6),
              reference.forward(x, w, None, 1e-6, is_rms=True, zero_centered=False, store_mean=False)[0]):
        y = y.double().cpu()
        assert torch.equal(y.isnan(), want.isnan()) and not y.isinf().any()
        fin = want.isfinite()
        assert ((y[fin] - want[fin]).norm() / want[fin].norm()) < 1e-2
