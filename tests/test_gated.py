"""The gated RMSNorm's API (`rms_norm(..., gate=z)`, `forms.GATED`): y = w·norm(x)·act(z) (gate before) or
y = w·norm(x·act(z)) (gate after), act = silu or sigmoid. The autograd API, the functions without autograd, the module,
the custom ops under torch.compile and double backward, against float64 (`reference.gated_float64`, autograd of the
forward's formula); bad input. The kernels and the search space are tests/test_gated_kernels.py's.
"""

from __future__ import annotations

import pytest
import torch

from normtune.kernels import (BackwardConfig, GatedRMSNorm, Kernel2Config, kernel_1_config, layer_norm, rms_norm,
                              rms_norm_backward, rms_norm_forward)
from normtune.kernels.api import reference

BF16, FP32, FP16 = torch.bfloat16, torch.float32, torch.float16
EPS = 1e-6
TOL = {BF16: 2e-2, FP32: 1e-5, FP16: 5e-3}
GATES = [("before", "silu"), ("after", "silu"), ("before", "sigmoid"), ("after", "sigmoid")]


def _inputs(M, N, device, dtype=BF16, *, weight_dtype=None, zc=False):
    """x, z, w, dy: drawn in fp32 on the CPU from the test's seed, then cast."""
    cast = lambda t, dt: t.to(device=device, dtype=dt)  # noqa: E731
    w = 0.1 * torch.randn(N) if zc else 1.0 + 0.1 * torch.randn(N)
    return (cast(torch.randn(M, N) + 0.5, dtype), cast(2 * torch.randn(M, N), dtype), cast(w, weight_dtype or dtype),
            cast(torch.randn(M, N), dtype))


def _ref(x, z, w, dy, gate, act, zc=False, group=None):
    return reference.gated_float64(x, z, w, dy, EPS, gate_after=gate == "after", sigmoid=act == "sigmoid",
                                   zero_centered=zc, group=group)


def _close(out, ref, tol, what):
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} vs {tuple(ref.shape)}"
    assert torch.isfinite(out).all(), f"{what}: not finite"
    err = ((out.double() - ref.double()).norm() / max(ref.double().norm().item(), 1e-8)).item()
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol}"


def _check(outs: dict, ref: dict, tol: float):
    for name in ("y", "dx", "dz", "dw"):
        _close(outs[name], ref[name], tol, name)


@pytest.mark.parametrize("gate,act", GATES)
@pytest.mark.parametrize("dtype", [BF16, FP32, FP16])
def test_api_gradients_match_float64(gate, act, dtype, device):
    """16-bit with fp32 weights, fp32 with zero-centred ones; N not a power of two."""
    zc = dtype == FP32
    x, z, w, dy = _inputs(5, 40, device, dtype, weight_dtype=FP32, zc=zc)
    xl, zl, wl = (t.detach().requires_grad_() for t in (x, z, w))
    y = rms_norm(xl, wl, EPS, gate=zl, gate_position=gate, gate_activation=act, zero_centered=zc)
    y.backward(dy)
    _check({"y": y, "dx": xl.grad, "dz": zl.grad, "dw": wl.grad}, _ref(x, z, w, dy, gate, act, zc), TOL[dtype])
    assert y.dtype == zl.grad.dtype == dtype and wl.grad.dtype == FP32


def test_api_rows_edges_and_layouts(device):
    """No rows, one row, leading dims, rows strided inside wider tensors, an expanded weight."""
    N = 24
    for shape in ((0, N), (1, N), (2, 3, N)):
        x, z = (torch.randn(*shape, device=device, dtype=BF16, requires_grad=True) for _ in range(2))
        w = torch.ones(1, device=device, requires_grad=True)
        y = rms_norm(x, w.expand(N), EPS, gate=z, gate_position="after")
        y.sum().backward()
        assert y.shape == x.shape and x.grad.shape == z.grad.shape == x.shape and w.grad.shape == (1,)
        if x.numel():
            ref = _ref(x.reshape(-1, N), z.reshape(-1, N), torch.ones(N), torch.ones(x.numel() // N, N), "after",
                       "silu")
            _close(x.grad.reshape(-1, N), ref["dx"], TOL[BF16], "dx")
            _close(w.grad, ref["dw"].sum().reshape(1), TOL[BF16], "dw through the expanded weight")
        else:
            assert torch.equal(w.grad, torch.zeros(1, device=device))
    base_x = (torch.randn(5, 2 * N) + 0.5).to(device=device, dtype=BF16)
    base_z = torch.randn(5, 3 * N).to(device=device, dtype=BF16)
    x, z = base_x[:, :N].detach().requires_grad_(), base_z[:, N:2 * N].detach().requires_grad_()
    w, dy = torch.rand(N, device=device) + 0.5, torch.randn(5, N, device=device, dtype=BF16)
    rms_norm(x, w, EPS, gate=z, gate_activation="sigmoid").backward(dy)
    ref = _ref(x, z, w, dy, "before", "sigmoid")
    _close(x.grad, ref["dx"], TOL[BF16], "strided dx")
    _close(z.grad, ref["dz"], TOL[BF16], "strided dz")


def test_module_direct_functions_and_reruns(device):
    N = 32
    x, z, w, dy = _inputs(6, N, device)
    m = GatedRMSNorm(N, eps=EPS, device=device, dtype=BF16, gate_position="after")
    assert set(m.state_dict()) == {"weight"} and "gate_position='after'" in repr(m)
    with torch.no_grad():
        m.weight.copy_(w)
    grads = []
    for _ in range(2):
        xl, zl = x.detach().requires_grad_(), z.detach().requires_grad_()
        m.weight.grad = None
        y = m(xl, zl)
        y.backward(dy)
        grads.append((y, xl.grad, zl.grad, m.weight.grad))
    assert all(torch.equal(a, b) for a, b in zip(*grads)), "reruns must be bitwise identical"
    y, rstd = rms_norm_forward(x, w, EPS, gate=z, gate_position="after")
    dx, dw, dz = rms_norm_backward(dy, x, w, rstd, gate=z, gate_position="after")
    for got, want in zip((y, dx, dz, dw), grads[0]):
        assert torch.equal(got, want)


def test_compile_fullgraph_and_opcheck(device):
    torch._dynamo.reset()

    def block(x, z, w):
        return rms_norm(x, w, EPS, gate=z, gate_position="after", gate_activation="sigmoid") * 2

    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    x, z, w, dy = _inputs(5, 24, device)
    results = []
    for fn in (block, compiled):
        xl, zl, wl = (t.detach().requires_grad_() for t in (x, z, w))
        fn(xl, zl, wl).backward(dy)
        results.append([xl.grad, zl.grad, wl.grad])
    for a, c in zip(*results):
        assert torch.equal(a, c)
    args = (x, z, w, None, EPS, True, False, False, True, False, 24, "")
    torch.library.opcheck(torch.ops.normtune.norm_gated_forward.default, args)
    y, rstd, mean = torch.ops.normtune.norm_gated_forward(*args)
    torch.library.opcheck(torch.ops.normtune.norm_gated_backward.default,
                          (dy, x, z, w, None, rstd, mean, True, False, False, True, False, 24, ""))


def test_double_backward_runs_the_composite(device):
    x, z, w, _ = _inputs(4, 16, device, FP32)
    got, want = [], []
    for out, cast in ((got, lambda t: t), (want, lambda t: t.double())):
        xl, zl, wl = (cast(t).detach().requires_grad_() for t in (x, z, w))
        if out is got:
            y = rms_norm(xl, wl, EPS, gate=zl, gate_position="before")
        else:
            y = xl * torch.rsqrt((xl * xl).mean(-1, keepdim=True) + EPS) * wl * torch.nn.functional.silu(zl)
        gx, gz = torch.autograd.grad((y * y).sum(), (xl, zl), create_graph=True)
        (gx.square().sum() + gz.square().sum()).backward()
        out += [gx, gz, xl.grad, zl.grad, wl.grad]
    for a, b in zip(got, want):
        _close(a, b, 1e-4, "double backward")


@pytest.mark.parametrize("call,exc,needle", [
    (lambda x, z, w: rms_norm(x, w, gate=z[:, :-1]), ValueError, "gate has shape"),
    (lambda x, z, w: rms_norm(x, w, gate=z.float()), TypeError, "gate has dtype"),
    (lambda x, z, w: rms_norm(x, w, gate=z, group_size=7), ValueError, "group_size=7 does not divide"),
    (lambda x, z, w: rms_norm(x, w, gate=z, group_size=0), ValueError, "group_size=0 must be a positive integer"),
    (lambda x, z, w: rms_norm(x, w, gate=z, gate_position="middle"), ValueError, "gate_position='middle'"),
    (lambda x, z, w: rms_norm(x, w, gate=z, gate_activation="gelu"), ValueError, "gate_activation='gelu'"),
    (lambda x, z, w: rms_norm(x, w, gate=z, save="output"), ValueError, "save='output' with a gate"),
    (lambda x, z, w: rms_norm(x, w, gate=z, residual=z), ValueError, "gate with residual"),
    (lambda x, z, w: layer_norm(x, w, gate=z), ValueError, "gate with layer_norm"),
    (lambda x, z, w: GatedRMSNorm(16, group_size=5), ValueError, "group_size=5 does not divide"),
])
def test_bad_input_raises_one_line_naming_the_argument(call, exc, needle, device):
    x, z, w, _ = _inputs(2, 16, device)
    with pytest.raises(exc, match=needle) as info:
        call(x, z, w)
    assert "\n" not in str(info.value)


def test_torch_func_transforms_run_the_composite(device):
    x, z, w, _ = _inputs(3, 16, device, FP32)

    def loss(x, z, w):
        return rms_norm(x, w, EPS, gate=z, gate_position="after").square().sum()

    got = torch.func.grad(loss, argnums=(0, 1, 2))(x, z, w)
    xl, zl, wl = (t.detach().requires_grad_() for t in (x, z, w))
    loss(xl, zl, wl).backward()
    for a, b in zip(got, (xl.grad, zl.grad, wl.grad)):
        _close(a, b, 1e-5, "torch.func.grad")
    batched = torch.vmap(lambda x, z: rms_norm(x, w, EPS, gate=z))(x[None], z[None])
    _close(batched[0], rms_norm(x, w, EPS, gate=z), 1e-6, "vmap")


# ------------------------------------------------------------------------------------------------------- groups

@pytest.mark.parametrize("gate,act,dtype", [("after", "silu", BF16), ("before", "sigmoid", FP32)])
def test_groups_normalize_each_group_of_columns(gate, act, dtype, device):
    """group_size < width (Mamba-2's n_groups > 1): autograd, an explicit config (sized for a group's columns),
    the functions without autograd, the module, against float64 per group."""
    M, N, group = 5, 24, 8
    x, z, w, dy = _inputs(M, N, device, dtype, weight_dtype=FP32)
    ref = _ref(x, z, w, dy, gate, act, group=group)
    kw = dict(gate_position=gate, gate_activation=act, group_size=group)
    config = BackwardConfig(kernel_1_config(strategy="rows", block_row=2, block_col=8, num_warps=1),
                            Kernel2Config(block_m=4, block_n=8, num_warps=1))
    for cfg in (None, config):
        xl, zl, wl = (t.detach().requires_grad_() for t in (x, z, w))
        y = rms_norm(xl, wl, EPS, gate=zl, config=cfg, **kw)
        y.backward(dy)
        _check({"y": y, "dx": xl.grad, "dz": zl.grad, "dw": wl.grad}, ref, TOL[dtype])
    y2, rstd = rms_norm_forward(x, w, EPS, gate=z, **kw)
    assert rstd.shape == (M * N // group,) and torch.equal(y2, y)
    dx, dw, dz = rms_norm_backward(dy, x, w, rstd, gate=z, **kw)
    _check({"y": y2, "dx": dx, "dz": dz, "dw": dw}, ref, TOL[dtype])
    m = GatedRMSNorm(N, eps=EPS, device=device, dtype=dtype, gate_position=gate, group_size=group, activation=act)
    assert "group_size=8" in repr(m)
    torch.testing.assert_close(m(x, z), rms_norm(x, m.weight, EPS, gate=z, **kw), rtol=0, atol=0)


def test_groups_under_compile_and_double_backward(device):
    torch._dynamo.reset()
    kw = dict(gate_position="after", group_size=4)
    x, z, w, dy = _inputs(3, 16, device, FP32)
    compiled = torch.compile(lambda x, z, w: rms_norm(x, w, EPS, gate=z, **kw), fullgraph=True, backend="aot_eager")
    xl, zl, wl = (t.detach().requires_grad_() for t in (x, z, w))
    compiled(xl, zl, wl).backward(dy)
    ref = _ref(x, z, w, dy, "after", "silu", group=4)
    _check({"y": compiled(x, z, w), "dx": xl.grad, "dz": zl.grad, "dw": wl.grad}, ref, TOL[FP32])
    got, want = [], []
    for out, cast in ((got, lambda t: t), (want, lambda t: t.double())):
        xl, zl, wl = (cast(t).detach().requires_grad_() for t in (x, z, w))
        if out is got:
            y = rms_norm(xl, wl, EPS, gate=zl, **kw)
        else:
            s = (xl * torch.nn.functional.silu(zl)).unflatten(-1, (4, 4))
            y = (s * torch.rsqrt((s * s).mean(-1, keepdim=True) + EPS)).flatten(-2) * wl
        (gx,) = torch.autograd.grad((y * y).sum(), (xl,), create_graph=True)
        gx.square().sum().backward()
        out += [gx, xl.grad, zl.grad, wl.grad]
    for a, b in zip(got, want):
        _close(a, b, 1e-4, "double backward per group")


def test_a_call_like_an_earlier_one_runs_its_plan(device, monkeypatch):
    """The whole-width gated call is planned per signature (forward_calls): a second call like the first launches
    without the checks or forward_impl and gives bitwise the same results; a gate with other strides takes the
    checked path; a call with groups is planned under its own signature."""
    from normtune.kernels.api import direct, forward_calls, ops

    forward_calls.clear()
    x, z, w, dy = _inputs(4, 24, device)
    kw = dict(gate_position="after", gate_activation="sigmoid")
    runs, seen = [], []
    real = ops.forward_impl
    for call in range(2):
        if call:  # from the second call on, forward_impl counts its calls
            for module in (ops, direct):
                monkeypatch.setattr(module, "forward_impl", lambda *a, **k: seen.append(1) or real(*a, **k))
        xl, zl, wl = (t.detach().requires_grad_() for t in (x, z, w))
        y = rms_norm(xl, wl, EPS, gate=zl, **kw)
        y.backward(dy)
        runs.append([y, xl.grad, zl.grad, wl.grad])
    assert not seen, "the second call must run the plan"
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    _check({"y": runs[1][0], "dx": runs[1][1], "dz": runs[1][2], "dw": runs[1][3]}, _ref(x, z, w, dy, "after",
                                                                                          "sigmoid"), TOL[BF16])
    wide = torch.zeros(4, 48, device=device, dtype=BF16)
    wide[:, 8:32] = z
    torch.testing.assert_close(rms_norm(x, w, EPS, gate=wide[:, 8:32], **kw), runs[0][0], rtol=0, atol=0)
    assert len(seen) == 1
    y2, _ = rms_norm_forward(x, w, EPS, gate=z, **kw)
    assert torch.equal(y2, runs[0][0]) and len(seen) == 1  # the direct function reads the same plan
    first = rms_norm(x, w, EPS, gate=z, group_size=8, **kw)
    assert len(seen) == 2  # a grouped call's own signature: checked once
    again = rms_norm(x, w, EPS, gate=z, group_size=8, **kw)
    assert len(seen) == 2, "a grouped call like an earlier one runs its plan"
    assert torch.equal(first, again)
    _close(again, _ref(x, z, w, dy, "after", "sigmoid", group=8)["y"], TOL[BF16], "grouped y")
