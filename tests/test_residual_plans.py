"""Residual calls planned per signature (`forward_calls.form_signature`): a repeated `rms_norm`/`layer_norm`
call with `residual=` skips the checks and still computes, bitwise, the y, h and gradients of x, residual, weight
and bias of the checked first call, in every memory layout, against float64 with every allocation poisoned; a call
that differs in anything its result depends on gets its own plan; activation checkpointing's recompute saves what
the forward saved whichever of the two was planned."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from normtune.kernels import layer_norm, rms_norm, rms_norm_forward

from normtune.kernels.api import forward_calls, functional

BF16, FP32 = torch.bfloat16, torch.float32
N = 37
EPS = {"rms_norm": 1e-6, "layer_norm": 1e-5}


@pytest.fixture(autouse=True)
def _fresh_plans():
    forward_calls.clear()
    yield
    forward_calls.clear()


@pytest.fixture
def poisoned(monkeypatch):
    """Every float tensor torch.empty / empty_like allocates is NaN: an output element left unwritten shows."""
    empty, empty_like = torch.empty, torch.empty_like

    def nan(t):
        return t.fill_(float("nan")) if t.dtype.is_floating_point else t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: nan(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: nan(empty_like(*a, **k)))


def _layouts(device, x_dtype, r_dtype):
    """(id, x, residual, whether a repeated call can reuse the first's plan): 6 rows of N columns, odd N."""
    def base(rows, cols, dtype):
        return (torch.randn(rows, cols) + 0.5).to(device=device, dtype=dtype)

    flat_x, flat_r = base(1, 6 * N + 1, x_dtype)[0], base(1, 6 * N + 1, r_dtype)[0]
    wide_x, wide_r = base(6, N + 5, x_dtype), base(6, N + 9, r_dtype)
    return [
        ("contiguous", flat_x[:6 * N].view(6, N), flat_r[:6 * N].view(6, N), True),
        ("contiguous-3d", flat_x[:6 * N].view(2, 3, N), flat_r[:6 * N].view(2, 3, N), True),
        ("one-row", flat_x[:N].view(1, N), flat_r[:N].view(1, N), True),
        ("one-row-1d", flat_x[:N], flat_r[:N], True),
        ("unaligned-x", flat_x[1:].view(6, N), flat_r[:6 * N].view(6, N), True),
        ("unaligned-residual", flat_x[:6 * N].view(6, N), flat_r[1:].view(6, N), True),
        ("row-strided", wide_x[:, :N], wide_r[:, 2:N + 2], True),
        ("row-strided-3d", wide_x.view(2, 3, N + 5)[..., :N], wide_r.view(2, 3, N + 9)[..., :N], True),
        ("expanded-residual", flat_x[:6 * N].view(6, N), flat_r[:N].expand(6, N), True),
        ("transposed-x", base(N, 6, x_dtype).t(), flat_r[:6 * N].view(6, N), False),  # rows need a copy
        ("copied-residual", flat_x[:6 * N].view(2, 3, N), base(2, 4 * N, r_dtype).view(2, 4, N)[:, :3], False),
        ("no-rows", base(0, N, x_dtype), base(0, N, r_dtype), False),
    ]


def _call(norm, x, r, w, b, save, residual_dtype=None, **kw):
    if norm == "rms_norm":
        return rms_norm(x, w, residual=r, residual_dtype=residual_dtype, save=save, **kw)
    return layer_norm(x, w, b, residual=r, residual_dtype=residual_dtype, save=save, **kw)


def _float64(norm, x, r, w, b, h_dtype, dy, dh):
    """float64 y and gradients (x, r, w, b) of the unfused block on h = x + r rounded once to h's dtype."""
    leaves = [t.detach().double().requires_grad_() if t is not None else None for t in (x, r, w, b)]
    h = leaves[0] + leaves[1]
    h = h + ((h.detach().float().to(h_dtype).double()) - h.detach())  # the stored rounding, gradient passing
    if norm == "rms_norm":
        y = F.rms_norm(h, (N,), leaves[2], EPS[norm])
    else:
        y = F.layer_norm(h, (N,), leaves[2], leaves[3], EPS[norm])
    ((y * dy.double()).sum() + (h * dh.double()).sum()).backward()
    return y.detach(), [t.grad if t is not None else None for t in leaves]


def _run(norm, x, r, w, b, save, h_dtype, dy, dh):
    """[y, h, x.grad, residual.grad, weight.grad, bias.grad] of one call through autograd (fresh leaves with x's
    and residual's memory layout; the residual's leaf is what it expands where it is expanded)."""
    xl = x.detach().requires_grad_()
    r_leaf = r.detach()[0].clone().requires_grad_() if r.dim() == 2 and r.stride(0) == 0 else None
    rl = r_leaf.expand(r.shape) if r_leaf is not None else r.detach().requires_grad_()
    wl = w.detach().clone().requires_grad_()
    bl = b.detach().clone().requires_grad_() if b is not None else None
    y, h = _call(norm, xl, rl, wl, bl, save, residual_dtype=h_dtype)
    torch.autograd.backward([y, h], [dy, dh])
    return [y.detach(), h.detach(), xl.grad, (r_leaf if r_leaf is not None else rl).grad, wl.grad,
            bl.grad if bl is not None else None]


CASES = [("rms_norm", "input", BF16, BF16), ("rms_norm", "output", FP32, BF16), ("layer_norm", "input", FP32, FP32),
         ("layer_norm", "output", BF16, FP32)]


@pytest.mark.parametrize("norm,save,h_dtype,w_dtype", CASES)
def test_planned_residual_calls_match_the_checked_call(norm, save, h_dtype, w_dtype, device, poisoned, monkeypatch):
    """The second call of a signature runs the first's plan without the checks; y, h and every gradient are the
    first call's bitwise, finite, and close to float64, in every layout (bf16 x, the residual stream in h_dtype:
    an fp32 stream with bf16 activations too)."""
    w = (1 + 0.1 * torch.randn(N)).to(device=device, dtype=w_dtype)
    b = (0.1 * torch.randn(N)).to(device=device, dtype=w_dtype) if norm == "layer_norm" else None
    for name, x, r, planned in _layouts(device, BF16, h_dtype):
        forward_calls.clear()
        dy = torch.randn(x.shape).to(device=device, dtype=BF16)
        dh = torch.randn(x.shape).to(device=device, dtype=h_dtype)
        first = _run(norm, x, r, w, b, save, h_dtype, dy, dh)
        assert len(forward_calls._PLANS) == int(planned), name
        with monkeypatch.context() as m:
            if planned:
                m.setattr(functional, "check_inputs", lambda *a, **k: pytest.fail(f"{name}: checked again"))
            again = _run(norm, x, r, w, b, save, h_dtype, dy, dh)
        for what, got, want in zip(("y", "h", "dx", "dr", "dw", "db"), again, first):
            assert (got is None) == (want is None), (name, what)
            if got is not None:
                assert got.shape == want.shape and got.dtype == want.dtype, (name, what)
                assert torch.equal(got, want), (name, what)
        y, h, dx, dr, dw, db = again
        assert y.shape == x.shape and h.shape == x.shape and h.dtype == h_dtype and y.dtype == BF16, name
        if x.shape[0] == 0:
            continue
        y64, grads = _float64(norm, x, r, w, b, h_dtype, dy, dh)
        if r.dim() == 2 and r.stride(0) == 0:
            grads[1] = grads[1].sum(0)
        tol = 4e-2 if save == "output" else 2e-2
        floor = (dy.double().norm() + dh.double().norm()).item()
        for what, got, want in zip(("y", "dx", "dr", "dw", "db"), (y, dx, dr, dw, db), [y64] + grads):
            if want is None:
                continue
            assert torch.isfinite(got).all(), (name, what, "an element left unwritten (poisoned)")
            err = ((got.double() - want).norm() / max(want.norm().item(), floor if what in ("dx", "dr") else 0,
                                                       1e-8)).item()
            assert err <= tol, (name, what, err)


def _outputs(call: dict, grad: bool = True) -> list:
    """y, h and (grad) the gradients of x, residual and weight/bias of one call described by `call`."""
    x = call["x"].detach().requires_grad_(grad)
    r = call["r"].detach().requires_grad_(grad) if isinstance(call["r"], torch.Tensor) else call["r"]
    params = [t.detach().clone().requires_grad_(grad) if t is not None else None for t in (call["w"], call["b"])]
    kw = dict(residual=r, residual_dtype=call["residual_dtype"], save=call["save"],
              zero_centered=call["zero_centered"], config=call.get("config"))
    with torch.set_grad_enabled(grad):
        y, h = (rms_norm(x, params[0], call["eps"], **kw) if call["norm"] == "rms_norm"
                else layer_norm(x, params[0], params[1], call["eps"], **kw))
    out = [y, h]
    if grad:
        leaves = [t for t in (x, r, *params) if t is not None]
        out += torch.autograd.grad([y, h], leaves, [torch.ones_like(y), torch.full_like(h, 0.5)])
    return out


def _base(device) -> dict:
    x = (torch.randn(6, N) + 0.5).to(device=device, dtype=BF16)
    return dict(norm="rms_norm", x=x, r=torch.randn(6, N).to(device=device, dtype=BF16),
                w=(1 + 0.1 * torch.randn(N)).to(device=device, dtype=BF16), b=None, eps=1e-6, save="input",
                residual_dtype=None, zero_centered=False)


def _variants(base: dict, device) -> dict:
    x, r, w = base["x"], base["r"], base["w"]
    wide = torch.randn(6, N + 3).to(device=device, dtype=BF16)
    flat = torch.randn(6 * N + 1).to(device=device, dtype=BF16)
    return {
        "residual fp32 (an fp32 stream)": dict(r=r.float()),
        "residual_dtype=float32": dict(residual_dtype=FP32),
        "residual_dtype='fp32'": dict(residual_dtype="fp32"),
        "residual_dtype=bfloat16 of an fp32 residual": dict(r=r.float(), residual_dtype=BF16),
        "residual strides": dict(r=wide[:, 1:N + 1].copy_(r)),
        "residual alignment": dict(r=flat[1:].view(6, N).copy_(r)),
        "residual expanded": dict(r=r[0].expand(6, N)),
        "x and residual 3-D": dict(x=x.view(2, 3, N), r=r.view(2, 3, N)),
        "x strides": dict(x=wide[:, 2:N + 2].copy_(x)),
        "x alignment": dict(x=flat[1:].view(6, N).copy_(x)),
        "x fp32": dict(x=x.float(), r=r.float(), w=w.float()),
        "x rows": dict(x=x[:5], r=r[:5]),
        "eps": dict(eps=0.25),
        "save=output": dict(save="output"),
        "no weight": dict(w=None),
        "weight fp32": dict(w=w.float()),
        "weight strided": dict(w=torch.stack([w, w], 1)[:, 0]),
        "zero_centered": dict(w=w - 1, zero_centered=True),
        "layer_norm": dict(norm="layer_norm", eps=1e-5),
        "layer_norm with bias": dict(norm="layer_norm", eps=1e-5, b=0.1 * w),
        "layer_norm with bias, save=output": dict(norm="layer_norm", eps=1e-5, b=0.1 * w, save="output"),
        "explicit config (the one selected)": dict(config=_selected_config(x, w)),
    }


def _selected_config(x, w):
    """The backward config selection picks for the base call, to pass explicitly."""
    from normtune.kernels.api.backward_calls import resolved

    return resolved(x, x.shape[0], N, w, None, True, False, False, "", x.dtype).config


def test_a_call_that_differs_does_not_reuse_a_plan(device, poisoned):
    """With the plan of a base call stored (made with gradients on, or off), each call that differs from it in one
    thing its result depends on returns what it returns with no plan stored, bitwise: its first call and its
    repeated (planned) call."""
    base = _base(device)
    for name, change in _variants(base, device).items():
        call = base | change
        forward_calls.clear()
        cold = _outputs(call)
        for warm_grad in (True, False):
            forward_calls.clear()
            _outputs(base, warm_grad)
            _outputs(base, warm_grad)
            for attempt in ("first", "planned"):
                got = _outputs(call)
                assert len(got) == len(cold), (name, attempt)
                for i, (a, c) in enumerate(zip(got, cold)):
                    assert a.shape == c.shape and a.dtype == c.dtype and torch.equal(a, c), (name, attempt, i)


def test_a_plan_made_without_gradients_serves_a_call_with_them(device):
    """Grad mode is no part of the result: the plan of a call made under no_grad gives a later call with
    gradients on its y, h and gradients, those of a call with no plan."""
    base = _base(device)
    forward_calls.clear()
    cold = _outputs(base)
    forward_calls.clear()
    with torch.no_grad():
        _, h = _outputs(base, grad=False)
    assert not h.requires_grad and len(forward_calls._PLANS) == 1
    for a, c in zip(_outputs(base), cold):
        assert torch.equal(a, c)


@pytest.mark.parametrize("change,exc,needle", [
    (dict(r="shape"), ValueError, "residual has shape (5, 37) but x has (6, 37)"),
    (dict(r="int"), TypeError, "residual has dtype torch.int32"),
    (dict(r="fp16"), TypeError, "residual has dtype torch.float16"),
    (dict(r="meta"), ValueError, "residual is on meta"),
    (dict(r="list"), TypeError, "residual must be a torch.Tensor"),
    (dict(residual_dtype=torch.float16), TypeError, "residual_dtype=torch.float16 is not allowed"),
    (dict(residual_dtype="int8"), TypeError, "residual_dtype='int8' is not allowed"),
    (dict(eps=0.0), ValueError, "eps must be a positive finite number"),
    (dict(w="fp16-w"), TypeError, "weight has dtype torch.float16"),
])
def test_residual_plans_never_skip_a_check(change, exc, needle, device):
    """After planned calls, a call that breaks a rule is still refused with the rule named."""
    base = _base(device)
    for _ in range(2):
        _outputs(base)
        rms_norm_forward(base["x"], base["w"], residual=base["r"])
    assert forward_calls._PLANS
    r, w = base["r"], base["w"]
    bad = {"shape": r[:5], "int": r.int(), "fp16": r.half(), "meta": r.to("meta"), "list": r.tolist(),
           "fp16-w": w.half()}
    call = base | {k: bad[v] if k in ("r", "w") else v for k, v in change.items()}
    with pytest.raises(exc) as info:
        _outputs(call, grad=False)
    assert needle in str(info.value)
    with pytest.raises(exc) as info:
        rms_norm_forward(call["x"], call["w"], call["eps"], residual=call["r"], residual_dtype=call["residual_dtype"])
    assert needle in str(info.value)


@pytest.mark.parametrize("save", ["input", "output"])
@pytest.mark.parametrize("plans", ["cold", "warm", "cleared-before-backward"])
def test_checkpoint_recompute_saves_what_the_forward_saved(save, plans, device):
    """Non-reentrant activation checkpointing recomputes the block in the backward and requires it to save tensors
    of the shapes the forward saved. The forward's call may be a first (checked) call and the recompute a planned
    one (cold), both planned (warm), or the other way round (plans cleared between forward and backward): the
    gradients are those of the block without checkpointing."""
    x = (torch.randn(2, 3, N) + 0.5).to(device=device, dtype=BF16)
    r = torch.randn(2, 3, N).to(device=device, dtype=FP32)
    w = (1 + 0.1 * torch.randn(N)).to(device=device, dtype=BF16)

    def block(xs, rs, ws):
        y, h = rms_norm(xs, ws, residual=rs, save=save)
        return (y.float() * y.float()).sum() + (h * h).sum()

    def grads(checkpointed: bool):
        leaves = [t.detach().requires_grad_() for t in (x, r, w)]
        if checkpointed:
            loss = torch.utils.checkpoint.checkpoint(block, *leaves, use_reentrant=False)
        else:
            loss = block(*leaves)
        if plans == "cleared-before-backward":
            forward_calls.clear()
        loss.backward()
        return [t.grad for t in leaves]

    want = grads(False)
    forward_calls.clear()
    if plans != "cold":
        grads(False)
    for got, ref in zip(grads(True), want):
        assert torch.equal(got, ref)


def test_direct_residual_forward_plans(device, monkeypatch):
    """The function without autograd: a repeated residual call runs the first's plan, bitwise, without checks."""
    from normtune.kernels import layer_norm_forward
    from normtune.kernels.api import direct

    x = (torch.randn(2, 3, N) + 0.5).to(device=device, dtype=BF16)
    r = torch.randn(2, 3, N).to(device=device, dtype=FP32)
    w = (1 + 0.1 * torch.randn(N)).to(device=device, dtype=BF16)
    b = (0.1 * torch.randn(N)).to(device=device, dtype=BF16)
    for forward in (lambda: rms_norm_forward(x, w, residual=r, residual_dtype=BF16),
                    lambda: layer_norm_forward(x, w, b, residual=r)):
        forward_calls.clear()
        first = forward()
        assert len(forward_calls._PLANS) == 1
        with monkeypatch.context() as m:
            m.setattr(direct, "check_inputs", lambda *a, **k: pytest.fail("checked again"))
            again = forward()
        assert len(again) == len(first)
        for got, want in zip(again, first):
            assert got.shape == want.shape and got.dtype == want.dtype and torch.equal(got, want)
        assert again[0].shape == x.shape and again[-1].shape == x.shape


def test_a_residual_dtype_given_by_name_is_planned(device, monkeypatch):
    """residual_dtype="fp32" (a module built with a name, say) takes the planned path on repeated calls."""
    base = _base(device)
    first = _outputs(base | {"residual_dtype": "fp32"})
    assert len(forward_calls._PLANS) == 1 and first[1].dtype == FP32
    monkeypatch.setattr(functional, "check_inputs", lambda *a, **k: pytest.fail("checked again"))
    for got, want in zip(_outputs(base | {"residual_dtype": "fp32"}), first):
        assert torch.equal(got, want)
