"""The fused residual form, h = x + residual, y = norm(h), returning (y, h): the forward kernel, kernel_1 of every
strategy with the residual stream's gradient (grad_input = dh + the norm's), the autograd API, the functions
without autograd, the modules and the custom ops, against float64 with outputs poisoned first.

h is compared with x + residual added in fp32 and rounded once to h's dtype (Triton's interpreter rounds fp32 to
16 bits toward zero instead of to nearest: one unit in the last place there, none on a GPU), and y with the
float64 norm of the h returned, which is what an add followed by the norm computes.
"""

from __future__ import annotations

import pytest
import torch

from normtune.kernels import (
    BackwardConfig,
    FusedAddLayerNorm,
    FusedAddRMSNorm,
    Kernel1Config,
    Kernel2Config,
    Problem,
    ProblemFamily,
    kernel_1_config,
    layer_norm,
    layer_norm_backward,
    layer_norm_forward,
    rms_norm,
    rms_norm_backward,
    rms_norm_forward,
)
from normtune.kernels.backward_launch import BackwardLaunch
from normtune.kernels.config import ConfigError
from normtune.kernels.device import interpret_mode
from normtune.kernels.forward import forward_residual

BF16, FP32 = torch.bfloat16, torch.float32
EPS = {"layer_norm": 1e-5, "rms_norm": 1e-6}
K2 = Kernel2Config(block_m=4, block_n=64, num_warps=2)


def _k1(**kw) -> Kernel1Config:
    return kernel_1_config(**{"block_row": 2, "num_warps": 2, "programs_per_sm": 0.125, **kw})


# (strategy label, N, config): every kernel_1 strategy and the knobs that change where grad_input is written.
STRATEGY_CASES = [
    ("rows", 37, BackwardConfig(_k1(block_col=64), K2)),
    ("rows-prefetch-evict", 37, BackwardConfig(_k1(block_col=64, prefetch=True, eviction_policy="evict_first"), K2)),
    ("rows-stages-fused", 37, BackwardConfig(_k1(block_col=64, num_stages=2),
                                             Kernel2Config(block_m=4, block_n=64, num_warps=2, fused=True))),
    ("rows-recompute", 37, BackwardConfig(_k1(block_col=64, block_row=1, recompute=True), K2)),
    ("rows-column-accumulators", 37, BackwardConfig(_k1(block_col=64, column_accumulators=True), K2)),
    ("two-pass", 37, BackwardConfig(_k1(block_col=16, two_pass=True, num_warps=1), K2)),
    ("two-pass-prefetch", 37, BackwardConfig(_k1(block_col=16, two_pass=True, prefetch=True, num_warps=1), K2)),
    ("row-split-2", 600, BackwardConfig(_k1(block_col=512, block_row=1, row_split=2, num_warps=4), K2)),
    ("row-split-3-pipelined", 800, BackwardConfig(_k1(block_col=512, block_row=1, row_split=3, num_warps=4,
                                                      pipelined_split=True, num_stages=2), K2)),
    ("row-split-2-fused", 600, BackwardConfig(_k1(block_col=512, block_row=1, row_split=2, num_warps=4),
                                              Kernel2Config(block_m=4, block_n=64, num_warps=2, fused=True))),
    ("columns", 37, BackwardConfig(_k1(block_col=16, strategy="columns", num_warps=1), K2)),
    ("columns-prefetch", 37, BackwardConfig(_k1(block_col=16, strategy="columns", prefetch=True, num_warps=1), K2)),
    ("dual", 37, BackwardConfig(_k1(block_col=64, strategy="dual"), Kernel2Config(block_m=4, block_n=16,
                                                                                   num_warps=2))),
    ("dual-prefetch", 37, BackwardConfig(_k1(block_col=64, strategy="dual", prefetch=True),
                                         Kernel2Config(block_m=4, block_n=16, num_warps=2))),
]


def _inputs(M, N, device, *, dtype=BF16, residual_dtype=BF16, param_dtype=None, has_bias=False, zc=False):
    """x, residual, weight, bias, dy, dh: drawn in fp32 on the CPU from the test's seed, then cast."""
    pdt = param_dtype or dtype
    cast = lambda t, dt: t.to(device=device, dtype=dt)  # noqa: E731
    x = cast(torch.randn(M, N) + 0.5, dtype)
    r = cast(torch.randn(M, N), residual_dtype)
    w = cast(0.1 * torch.randn(N) if zc else 1.0 + 0.1 * torch.randn(N), pdt)
    b = cast(0.1 * torch.randn(N), pdt) if has_bias else None
    return x, r, w, b, cast(torch.randn(M, N), dtype), cast(torch.randn(M, N), residual_dtype)


def _sum_rounded(x, r, h_dtype):
    return (x.float() + r.float()).to(h_dtype)


def _check_h(h, x, r):
    """h is x + r added in fp32 and rounded once (toward zero allowed under the interpreter)."""
    want = _sum_rounded(x, r, h.dtype)
    if h.dtype == FP32 or not interpret_mode():
        assert torch.equal(h, want), "h must be x + residual rounded once to its dtype"
    else:
        ulp = torch.finfo(h.dtype).eps * want.float().abs()
        assert torch.all((h.float() - want.float()).abs() <= ulp), "h is further than one ulp from x + residual"


def _reference(h, w, b, dy, dh, *, norm, zc):
    """float64 y of the norm of h and the gradients of h (dy through the norm, plus dh), w and b."""
    N = h.shape[-1]
    h64 = h.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_() if w is not None else None
    b64 = b.detach().double().requires_grad_() if b is not None else None
    weff = (1 + w64 if zc else w64) if w64 is not None else None
    if norm == "rms_norm":
        y = torch.nn.functional.rms_norm(h64, (N,), weff, EPS[norm])
    else:
        y = torch.nn.functional.layer_norm(h64, (N,), weff, b64, EPS[norm])
    ((y * dy.double()).sum() + (h64 * dh.double()).sum()).backward()
    h0 = h64.detach()
    mean = h0.mean(-1) if norm == "layer_norm" else torch.zeros_like(h0[:, 0])
    rstd = torch.rsqrt(((h0 - mean[:, None]) ** 2).mean(-1) + EPS[norm])
    return {"y": y.detach(), "d": h64.grad, "dw": None if w is None else w64.grad,
            "db": None if b is None else b64.grad, "rstd": rstd.float(), "mean": mean.float(),
            "floor": (dy.double().norm() * rstd.mean().double() + dh.double().norm()).item()}


def _err(out, ref, floor=0.0):
    ref = ref.double()
    return ((out.double() - ref).norm() / max(ref.norm().item(), floor, 1e-8)).item()


def _close(out, ref, tol, what, floor=0.0):
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} vs {tuple(ref.shape)}"
    assert torch.isfinite(out).all(), f"{what}: not every element written (poisoned NaN left) or not finite"
    assert _err(out, ref, floor) <= tol, f"{what}: relative error {_err(out, ref, floor):.3g} > {tol}"


TOL = {BF16: 2e-2, FP32: 1e-5, torch.float16: 5e-3}


# ------------------------------------------------------------------------------------------------ forward kernel

@pytest.mark.parametrize("M,N", [(0, 37), (1, 37), (7, 37), (5, 1), (3, 8193)])
@pytest.mark.parametrize("norm", ["rms_norm", "layer_norm"])
@pytest.mark.parametrize("h_dtype", [BF16, FP32], ids=["h-bf16", "h-fp32"])
def test_forward_writes_h_and_the_norm_of_h(M, N, norm, h_dtype, device):
    if N == 8193 and (norm == "layer_norm" or h_dtype == BF16):
        pytest.skip("the chunked forward once per norm is enough on the interpreter")
    x, r, w, b, _, _ = _inputs(M, N, device, residual_dtype=h_dtype, has_bias=norm == "layer_norm")
    nan = float("nan")
    y = torch.full((M, N), nan, dtype=BF16, device=device)
    h = torch.full((M, N), nan, dtype=h_dtype, device=device)
    rstd = torch.full((M,), nan, device=device)
    mean = torch.full((M,), nan, device=device) if norm == "layer_norm" else None
    out = forward_residual(x, r, w, b, EPS[norm], h_dtype=h_dtype, is_rms=norm == "rms_norm", zero_centered=False,
                           store_mean=norm == "layer_norm", y=y, h=h, rstd=rstd, mean=mean)
    assert out[0] is y and out[1] is h
    if M == 0:
        return
    _check_h(h, x, r)
    ref = _reference(h, w, b, torch.zeros_like(x), torch.zeros_like(h), norm=norm, zc=False)
    _close(y, ref["y"], TOL[BF16], "y")
    _close(rstd, ref["rstd"], 1e-5, "rstd")
    if mean is not None:
        _close(mean, ref["mean"], 1e-5, "mean", floor=1.0)


def test_forward_strided_rows(device):
    """x, residual and the outputs may be row slices of wider buffers: each is read and written in place."""
    M, N = 5, 40
    big_x = torch.randn(M, 3 * N, device=device).to(BF16)
    big_r = torch.randn(M, 2 * N, device=device)
    x, r = big_x[:, N:2 * N], big_r[:, :N]
    h_buf = torch.full((M, 2 * N), float("nan"), device=device)
    y_buf = torch.full((M, 2 * N), float("nan"), device=device, dtype=BF16)
    y, h, rstd, _ = forward_residual(x, r, None, None, 1e-6, h_dtype=FP32, is_rms=True, zero_centered=False,
                                     store_mean=False, y=y_buf[:, 8:8 + N], h=h_buf[:, N:], rstd=None)
    _check_h(h, x, r)
    assert torch.isnan(h_buf[:, :N]).all() and torch.isnan(y_buf[:, :8]).all() and torch.isnan(y_buf[:, 8 + N:]).all()
    _close(y, _reference(h, None, None, x * 0, h * 0, norm="rms_norm", zc=False)["y"], TOL[BF16], "y")


# -------------------------------------------------------------------------------------- kernel_1, every strategy

def _launch(problem, config, dy, saved, w, b, rstd, mean, dh):
    launch = BackwardLaunch(problem, config, dy, saved, w, b, rstd, mean, dh=dh)
    for buf in (launch.dx, launch.dw, launch.db, launch.partial_dw, launch.partial_db):
        if buf is not None:
            buf.fill_(float("nan"))
    launch.run()
    return launch


@pytest.mark.parametrize("label,N,config", STRATEGY_CASES, ids=[c[0] for c in STRATEGY_CASES])
@pytest.mark.parametrize("norm,save,h_dtype", [("rms_norm", "input", BF16), ("layer_norm", "input", FP32),
                                               ("layer_norm", "output", BF16), ("rms_norm", "output", FP32)],
                         ids=["rms-in-h16", "ln-in-h32", "ln-out-h16", "rms-out-h32"])
def test_backward_adds_the_stream_gradient(label, N, config, norm, save, h_dtype, device):
    M = 9
    has_bias = norm == "layer_norm"
    problem = Problem(norm, M, N, "bf16", "fp32", has_bias=has_bias, save=save, residual=True,
                      residual_dtype="fp32" if h_dtype == FP32 else "bf16")
    config.validate(problem)
    x, r, w, b, dy, dh = _inputs(M, N, device, residual_dtype=h_dtype, param_dtype=FP32, has_bias=has_bias)
    h = _sum_rounded(x, r, h_dtype)
    ref = _reference(h, w, b, dy, dh, norm=norm, zc=False)
    saved = h if save == "input" else ref["y"].to(BF16)
    mean = ref["mean"] if (norm == "layer_norm" and save == "input") else torch.empty(0, device=device)
    launch = _launch(problem, config, dy, saved, w, b, ref["rstd"], mean, dh)
    assert launch.dx.dtype == h_dtype, "grad_input of the residual form is in h's dtype"
    tol = TOL[h_dtype] if save == "input" else 4e-2
    _close(launch.dx, ref["d"], tol if h_dtype == BF16 else max(tol, 1e-4), "dx + dh", floor=ref["floor"])
    _close(launch.dw, ref["dw"], 4e-2 if save == "output" else 1e-4, "dw")
    if has_bias:
        _close(launch.db, ref["db"], 1e-4, "db")
    first = [t.clone() for t in (launch.dx, launch.dw) + ((launch.db,) if has_bias else ())]
    launch.run()
    again = [launch.dx, launch.dw] + ([launch.db] if has_bias else [])
    assert all(torch.equal(a, c) for a, c in zip(first, again)), "a rerun must give the same bits"


def test_backward_without_rows_and_with_strided_rows(device):
    """M = 0 writes nothing and gives zero dw; rows read from and written into slices of wider buffers."""
    config = STRATEGY_CASES[0][2]
    problem = Problem("rms_norm", 0, 37, "bf16", residual=True)
    empty = torch.empty(0, 37, dtype=BF16, device=device)
    launch = BackwardLaunch(problem, config, empty, empty, torch.ones(37, dtype=BF16, device=device), None,
                            torch.empty(0, device=device), None, dh=empty)
    dx, dw, _ = launch.run()
    assert dx.shape == (0, 37) and torch.equal(dw, torch.zeros_like(dw))

    M, N = 6, 37
    x, r, w, _, dy, dh = _inputs(M, N, device)
    h = _sum_rounded(x, r, BF16)
    ref = _reference(h, w, None, dy, dh, norm="rms_norm", zc=False)
    wide = lambda t: torch.cat([t, t], dim=1)[:, :N]  # noqa: E731 - rows 2N apart
    dx_buf = torch.full((M, N + 11), float("nan"), dtype=BF16, device=device)
    problem = Problem("rms_norm", M, N, "bf16", residual=True)
    launch = BackwardLaunch(problem, config, wide(dy), wide(h), w, None, ref["rstd"], torch.empty(0, device=device),
                            dx=dx_buf[:, 3:3 + N], dh=wide(dh))
    launch.run()
    _close(dx_buf[:, 3:3 + N], ref["d"], TOL[BF16], "dx", floor=ref["floor"])
    assert torch.isnan(dx_buf[:, :3]).all() and torch.isnan(dx_buf[:, 3 + N:]).all()


def test_backward_launch_needs_dh_exactly_for_residual_problems(device):
    x, r, w, _, dy, dh = _inputs(4, 8, device)
    rstd = torch.ones(4, device=device)
    cfg = STRATEGY_CASES[0][2]
    with pytest.raises(ValueError, match="dh"):
        BackwardLaunch(Problem("rms_norm", 4, 8, "bf16", residual=True), cfg, dy, x, w, None, rstd, None)
    with pytest.raises(ValueError, match="dh"):
        BackwardLaunch(Problem("rms_norm", 4, 8, "bf16"), cfg, dy, x, w, None, rstd, None, dh=dh)


# ------------------------------------------------------------------------------------------ autograd API, modules

def _composite_grads(fn_norm, x, r, w, b, dy, dh, h_dtype):
    """The unfused composite in float64: h = x + r (rounded as the fused form rounds), y = norm(h); gradients of
    x, r, w, b for the loss Σ y·dy + Σ h·dh."""
    leaves = [t.detach().double().requires_grad_() if t is not None else None for t in (x, r, w, b)]
    h = leaves[0] + leaves[1]
    y = fn_norm(h, leaves[2], leaves[3])
    ((y * dy.double()).sum() + (h * dh.double()).sum()).backward()
    return [t.grad if t is not None else None for t in leaves]


@pytest.mark.parametrize("norm", ["rms_norm", "layer_norm"])
@pytest.mark.parametrize("save", ["input", "output"])
@pytest.mark.parametrize("h_dtype,zc", [(BF16, False), (FP32, True)], ids=["h-bf16", "h-fp32-zc"])
def test_api_gradients_of_x_and_residual_match_the_composite(norm, save, h_dtype, zc, device):
    M, N = 2 * 3, 45
    x, r, w, b, dy, dh = _inputs(M, N, device, residual_dtype=h_dtype, has_bias=norm == "layer_norm", zc=zc)
    shape = (2, 3, N)
    leaves = [t.reshape(shape).detach().requires_grad_() for t in (x, r)]
    wl = w.detach().requires_grad_()
    bl = b.detach().requires_grad_() if b is not None else None
    if norm == "rms_norm":
        y, h = rms_norm(leaves[0], wl, residual=leaves[1], zero_centered=zc, save=save)
        fn = lambda hh, ww, bb: torch.nn.functional.rms_norm(hh, (N,), (1 + ww) if zc else ww, EPS[norm])  # noqa
    else:
        y, h = layer_norm(leaves[0], wl, bl, residual=leaves[1], zero_centered=zc, save=save)
        fn = lambda hh, ww, bb: torch.nn.functional.layer_norm(hh, (N,), (1 + ww) if zc else ww, bb, EPS[norm])  # noqa
    assert y.shape == shape and h.shape == shape and y.dtype == BF16 and h.dtype == h_dtype
    _check_h(h.reshape(M, N), x, r)
    torch.autograd.backward([y, h], [dy.reshape(shape), dh.reshape(shape)])
    want = _composite_grads(fn, x, r, w, b, dy, dh, h_dtype)
    tol = 4e-2 if save == "output" else 2e-2
    floor = (dy.double().norm() + dh.double().norm()).item()
    _close(leaves[0].grad.reshape(M, N), want[0], tol, "x.grad", floor=floor)
    _close(leaves[1].grad.reshape(M, N), want[1], tol if h_dtype == BF16 else 2e-2, "residual.grad", floor=floor)
    assert leaves[0].grad.dtype == BF16 and leaves[1].grad.dtype == h_dtype
    _close(wl.grad, want[2], tol, "weight.grad")
    if bl is not None:
        _close(bl.grad, want[3], tol, "bias.grad")


def test_api_one_output_used_and_empty_rows(device):
    """Only y (or only h) reaching the loss counts the other's gradient as zero; M = 0 runs."""
    x, r, w, _, dy, dh = _inputs(4, 16, device)
    for used in ("y", "h"):
        xl, rl = x.detach().requires_grad_(), r.detach().requires_grad_()
        y, h = rms_norm(xl, w, residual=rl)
        (y if used == "y" else h).backward(dy if used == "y" else dh)
        if used == "h":
            assert torch.equal(xl.grad, dh) and torch.equal(rl.grad, dh), "h = x + r passes dh to both"
        else:
            want = _composite_grads(lambda hh, ww, bb: torch.nn.functional.rms_norm(hh, (16,), ww, 1e-6), x, r, w,
                                    None, dy, torch.zeros_like(dh), BF16)
            _close(xl.grad, want[0], 2e-2, "x.grad")
    x0 = torch.empty(0, 16, dtype=BF16, device=device, requires_grad=True)
    y, h = layer_norm(x0, None, None, residual=torch.empty(0, 16, dtype=BF16, device=device))
    assert y.shape == h.shape == (0, 16)
    (y.sum() + h.sum()).backward()
    assert x0.grad.shape == (0, 16)


def test_api_strided_inputs(device):
    M, N = 5, 24
    base_x = (torch.randn(M, 2 * N) + 0.5).to(device=device, dtype=BF16)
    base_r = torch.randn(M, 3 * N).to(device=device, dtype=BF16)
    x, r = base_x[:, :N].detach().requires_grad_(), base_r[:, N:2 * N].detach().requires_grad_()
    y, h = rms_norm(x, None, residual=r)
    _check_h(h, x.detach(), r.detach())
    dy, dh = torch.randn_like(y), torch.randn_like(h)
    torch.autograd.backward([y, h], [dy, dh])
    want = _composite_grads(lambda hh, ww, bb: torch.nn.functional.rms_norm(hh, (N,), None, 1e-6), x, r, None, None,
                            dy, dh, BF16)
    _close(x.grad, want[0], 2e-2, "x.grad", floor=dh.double().norm().item())


def test_modules(device):
    N = 32
    x, r, _, _, dy, dh = _inputs(3, N, device)
    for cls, plain in ((FusedAddRMSNorm, rms_norm), (FusedAddLayerNorm, layer_norm)):
        m = cls(N, eps=EPS[plain.__name__], device=device, dtype=BF16)
        y, h = m(x, r)
        want = plain(x, m.weight, *((m.bias,) if cls is FusedAddLayerNorm else ()), residual=r)
        assert torch.equal(y, want[0]) and torch.equal(h, want[1])
    m = FusedAddRMSNorm(N, eps=1e-6, device=device, dtype=BF16, residual_dtype=FP32)
    assert m(x, r)[1].dtype == FP32


def test_residual_runs_bitwise_again(device):
    x, r, w, b, dy, dh = _inputs(7, 33, device, has_bias=True)
    outs = []
    for _ in range(2):
        xl, rl, wl = x.detach().requires_grad_(), r.detach().requires_grad_(), w.detach().requires_grad_()
        y, h = layer_norm(xl, wl, b, residual=rl)
        torch.autograd.backward([y, h], [dy, dh])
        outs.append([y, h, xl.grad, rl.grad, wl.grad])
    assert all(torch.equal(a, c) for a, c in zip(*outs))


@pytest.mark.parametrize("call,exc,needle", [
    (lambda x, r: rms_norm(x, None, residual=r[:, :-1]), ValueError, "residual has shape"),
    (lambda x, r: rms_norm(x, None, residual=r.half()), TypeError, "residual has dtype"),
    (lambda x, r: rms_norm(x, None, residual=r, residual_dtype=torch.float16), TypeError, "residual_dtype"),
    (lambda x, r: rms_norm(x, None, residual_dtype=torch.float32), ValueError, "residual_dtype needs a residual"),
    (lambda x, r: layer_norm(x, residual=r.tolist()), TypeError, "residual must be a torch.Tensor"),
    (lambda x, r: rms_norm_backward(x, r, None, torch.ones(4), grad_residual=r[:2]), ValueError, "grad_residual"),
    (lambda x, r: rms_norm_backward(x, r.float(), None, torch.ones(4), grad_residual=r), ValueError, "h has"),
])
def test_bad_residual_input_raises_naming_the_argument(call, exc, needle, device):
    x = torch.randn(4, 8, dtype=BF16, device=device)
    with pytest.raises(exc, match=needle) as info:
        call(x, torch.randn(4, 8, dtype=BF16, device=device))
    assert "\n" not in str(info.value)


# ------------------------------------------------------------------------------------------- without autograd

@pytest.mark.parametrize("h_dtype", [BF16, FP32], ids=["h-bf16", "h-fp32"])
def test_direct_functions_match_autograd(h_dtype, device):
    M, N = 6, 40
    x, r, w, b, dy, dh = _inputs(M, N, device, residual_dtype=h_dtype, has_bias=True)
    y, mean, rstd, h = layer_norm_forward(x, w, b, residual=r)
    assert h.dtype == h_dtype
    dx, dw, db = layer_norm_backward(dy, h, w, b, mean, rstd, grad_residual=dh)
    assert dx.dtype == h_dtype
    xl, rl, wl, bl = (t.detach().requires_grad_() for t in (x, r, w, b))
    ya, ha = layer_norm(xl, wl, bl, residual=rl)
    torch.autograd.backward([ya, ha], [dy, dh])
    assert torch.equal(y, ya) and torch.equal(h, ha)
    assert torch.equal(dx, rl.grad) and torch.equal(dw, wl.grad) and torch.equal(db, bl.grad)

    y, rstd, h = rms_norm_forward(x, w, residual=r, residual_dtype=h_dtype)
    dx, dw = rms_norm_backward(dy, h, w, rstd, grad_residual=dh)
    ref = _reference(h, w, None, dy, dh, norm="rms_norm", zc=False)
    _close(dx, ref["d"], TOL[BF16], "dx", floor=ref["floor"])
    dx_out, _ = rms_norm_backward(dy, y, w, rstd, grad_residual=dh, from_output=True)
    _close(dx_out, ref["d"], 4e-2, "dx from y", floor=ref["floor"])


# -------------------------------------------------------------------------------------------- custom ops, compile

def test_compile_fullgraph_matches_eager(device):
    torch._dynamo.reset()

    def block(x, r, w):
        y, h = rms_norm(x, w, residual=r, residual_dtype=torch.float32)
        return y * 2, h

    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    x, r, w, _, dy, dh = _inputs(5, 24, device)
    results = []
    for fn in (block, compiled):
        xl, rl, wl = (t.detach().requires_grad_() for t in (x, r, w))
        y, h = fn(xl, rl, wl)
        torch.autograd.backward([y, h], [dy, dh.float()])
        results.append([y, h, xl.grad, rl.grad, wl.grad])
    for a, c in zip(*results):
        assert torch.equal(a, c)


@pytest.mark.parametrize("is_rms,save_output,h_dtype", [(True, False, FP32), (False, True, BF16)])
def test_opcheck(is_rms, save_output, h_dtype, device):
    x, r, w, b, dy, dh = _inputs(6, 24, device, residual_dtype=h_dtype, has_bias=not is_rms)
    flags = (is_rms, False, save_output)
    args = (x, r, w, b, 1e-5, *flags, h_dtype, "")
    torch.library.opcheck(torch.ops.normtune.norm_residual_forward.default, args)
    y, h, rstd, mean = torch.ops.normtune.norm_residual_forward(*args)
    saved = y if save_output else h
    torch.library.opcheck(torch.ops.normtune.norm_residual_backward.default,
                          (dy, dh, saved, w, b, rstd, mean, *flags, ""))


# ---------------------------------------------------------------------------------------------- problem and keys

def test_residual_is_part_of_the_problem_and_family():
    plain = Problem("rms_norm", 4, 8, "bf16")
    assert "residual" not in plain.to_dict() and plain.family.key == "rms_norm/bf16/wbf16/nobias/save-input"
    res = Problem("rms_norm", 4, 8, "bf16", residual=True)
    assert res.residual_dtype == "bf16" and res.family.key == "rms_norm/bf16/wbf16/nobias/save-input/res-bf16"
    wide = Problem("layer_norm", 4, 8, "bf16", residual=True, residual_dtype="float32")
    assert wide.key == "layer_norm/bf16/wbf16/bias/save-input/res-fp32/4x8"
    for p in (plain, res, wide):
        assert Problem.from_dict(p.to_dict()) == p and ProblemFamily.from_key(p.family.key) == p.family
        assert p.family.problem(4, 8) == p
    with pytest.raises(ConfigError, match="residual_dtype"):
        Problem("rms_norm", 4, 8, "fp32", residual=True, residual_dtype="bf16")
    with pytest.raises(ConfigError, match="needs residual=True"):
        Problem("rms_norm", 4, 8, "bf16", residual_dtype="fp32")
    with pytest.raises(ConfigError, match="malformed"):
        ProblemFamily.from_key("rms_norm/bf16/wbf16/nobias/save-input/res-bf16/res-fp32")


def test_a_table_without_residual_families_answers_them_with_the_plain_rules():
    """A residual problem reads its own family where the table has one (the H100 table has bf16-stream ones), the
    residual family of another stream dtype where only that one is tuned (an fp32 stream on the H100: the same
    knobs run it), and the plain family's rules where the table has no residual family (the H200 table)."""
    from normtune.kernels.select.tables import shipped_tables

    tables = shipped_tables()
    tables = list(tables.values()) if isinstance(tables, dict) else list(tables)
    assert tables
    plain = Problem("rms_norm", 4096, 4096, "bf16")
    for table in tables:
        key = table.family_key(plain.family)
        for rd in ("bf16", "fp32"):
            res = Problem("rms_norm", 4096, 4096, "bf16", residual=True, residual_dtype=rd)
            own = res.family.key
            tuned = [k for k in table.families if k.startswith(key + "/res-")]
            expected = own if own in table.families else (tuned[0] if tuned else key)
            assert table.family_key(res.family) == expected, (rd, own)
    assert any(Problem("rms_norm", 1, 1, "bf16", residual=True).family.key in t.families for t in tables)


# ------------------------------------------------------------------------------------------- CUDA graphs (GPU)

GRAPH_STRATEGIES = {
    "rows": lambda c: c.kernel_1.strategy == "rows" and c.kernel_1.row_split == 1 and not c.kernel_2.fused,
    "columns": lambda c: c.kernel_1.strategy == "columns",
    "dual": lambda c: c.kernel_1.strategy == "dual",
    "row_split": lambda c: c.kernel_1.strategy == "rows" and c.kernel_1.row_split > 1,
    "fused": lambda c: c.kernel_2.fused,
}


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", list(GRAPH_STRATEGIES))
@pytest.mark.parametrize("M,N,h_dtype", [(256, 4096, BF16), (96, 12288, FP32), (1024, 16384, BF16)])
def test_graph_capture_replays_like_eager(M, N, h_dtype, strategy):
    from normtune.kernels.device import sm_count
    from normtune.tuner.space import Space

    problem = Problem("rms_norm", M, N, "bf16", residual=True, residual_dtype="fp32" if h_dtype == FP32 else "bf16")
    config = next((c for c in Space(problem, sm_count(torch.device("cuda"))).seeds()
                   if GRAPH_STRATEGIES[strategy](c)), None)
    if config is None:
        pytest.skip(f"the search space has no {strategy} seed for {problem.key}")
    x, r, w, _, dy, dh = _inputs(M, N, "cuda", residual_dtype=h_dtype)
    x.requires_grad_()
    r.requires_grad_()
    w.requires_grad_()

    def step():
        y, h = rms_norm(x, w, residual=r, config=config)
        return [y, h, *torch.autograd.grad([y, h], [x, r, w], [dy, dh])]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for _ in range(2):
        with torch.no_grad():
            x.copy_(torch.randn_like(x))
            dh.copy_(torch.randn_like(dh))
        graph.replay()
        torch.cuda.synchronize()
        for name, c, e in zip(("y", "h", "dx", "dr", "dw"), captured, step()):
            assert torch.equal(c, e), f"{name}: the replayed graph differs from eager ({strategy}, {problem.key})"


def test_save_output_that_cannot_recover_saves_h(device):
    """save="output" follows the plain norm's rule: a weight with a zero column cannot give x̂ back from y, so the
    call saves h instead, and the gradients are those of save="input" (finite, bitwise the same)."""
    x, r, w, _, dy, dh = _inputs(4, 24, device)
    w = w.clone()
    w[5] = 0
    grads = []
    for save in ("output", "input"):
        xl, rl = x.detach().requires_grad_(), r.detach().requires_grad_()
        y, h = rms_norm(xl, w, residual=rl, save=save)
        torch.autograd.backward([y, h], [dy, dh])
        grads.append(xl.grad)
    assert torch.isfinite(grads[0]).all() and torch.equal(grads[0], grads[1])
