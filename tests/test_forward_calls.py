"""Forward calls planned per input signature (`kernels/api/forward_calls.py`): a repeated call skips the checks and
the planning and still computes, bitwise, what the first call computed — through the functions without autograd
and through the autograd API (its gradients too) — in every memory layout; inputs that break a rule are still
refused after a planned call; the plans are bounded."""

from __future__ import annotations

import pytest
import torch

from normtune.kernels import layer_norm, layer_norm_forward, rms_norm

from normtune.kernels.api import direct, forward_calls, functional, reference
from normtune.kernels import rms_norm_forward

N = 200


@pytest.fixture(autouse=True)
def _fresh_plans():
    forward_calls.clear()
    yield
    forward_calls.clear()


def _layouts(device):
    """(id, x of 6 rows of N columns in that memory layout, whether a repeated call can reuse the first's plan)."""
    flat = torch.randn(6 * N + 1, device=device) + 0.5
    wide = torch.randn(6, N + 8, device=device) + 0.5
    lone = torch.empty_strided((6, 1, N), (N, 7, 1), device=device)  # contiguous, with an odd stride of size 1
    return [
        ("contiguous", flat[:6 * N].view(6, N), True),
        ("contiguous-3d", flat[:6 * N].view(2, 3, N), True),
        ("unaligned", flat[1:].view(6, N), True),  # another 16-byte alignment: another signature
        ("row-strided", wide[:, :N], True),
        ("row-strided-3d", wide.view(2, 3, N + 8)[..., :N], True),
        ("lone-middle-dim", lone.copy_(flat[:6 * N].view(6, 1, N)), True),
        ("copied-rows", torch.randn(2, 4, N, device=device)[:, :3], False),  # rows need a copy: no plan
    ]


def _reference_y(x, w, b, is_rms):
    y64, _, _ = reference.forward(x.reshape(-1, N).double(), None if w is None else w.double(),
                                  None if b is None else b.double(), 1e-6 if is_rms else 1e-5, is_rms=is_rms,
                                  zero_centered=False, store_mean=False)
    return y64


OPERANDS = [(True, True), (True, False), (False, False)]


@pytest.mark.parametrize("norm", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("has_weight,has_bias", OPERANDS)
def test_direct_forward_plans_serve_repeated_calls_like_first_calls(norm, has_weight, has_bias, device,
                                                                    make_norm_inputs, monkeypatch):
    """Without autograd: a planned call returns, bitwise, what the checked first call returned, close to float64."""
    is_rms = norm == "rms_norm"
    inputs = make_norm_inputs((N,), torch.float32, device, has_weight=has_weight, has_bias=has_bias and not is_rms)
    w, b = inputs["weight"], inputs["bias"]
    forward = (lambda x: rms_norm_forward(x, w)) if is_rms else (lambda x: layer_norm_forward(x, w, b))
    for name, x, planned in _layouts(device):
        forward_calls.clear()
        first = forward(x)
        assert (len(forward_calls._PLANS) == 1) == planned, name
        with monkeypatch.context() as m:  # a planned call must not need the checks again
            if planned:
                m.setattr(direct, "check_inputs", lambda *a, **k: pytest.fail("checked again"))
            again = forward(x)
        assert len(again) == len(first)
        for got, want in zip(again, first):
            assert got.shape == want.shape and torch.equal(got, want), name
        assert first[0].shape == x.shape
        torch.testing.assert_close(again[0].reshape(-1, N).double(), _reference_y(x, w, b, is_rms), rtol=1e-4,
                                   atol=1e-4)


@pytest.mark.parametrize("norm", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("save", ["input", "output"])
@pytest.mark.parametrize("has_weight,has_bias", OPERANDS)
def test_autograd_forward_plans_give_the_same_values_and_gradients(norm, save, has_weight, has_bias, device,
                                                                   make_norm_inputs, monkeypatch):
    """Through autograd: a planned call (x passed with its leading dims, the backward taking rows of them) gives
    bitwise the y, dx, dw and db of the checked first call, in every layout."""
    is_rms = norm == "rms_norm"
    inputs = make_norm_inputs((N,), torch.float32, device, has_weight=has_weight, has_bias=has_bias and not is_rms)
    for name, x, planned in _layouts(device):
        forward_calls.clear()
        grad = torch.randn(x.shape, device=device)
        results = []
        for attempt in range(2):
            leaves = [t.detach().clone().requires_grad_() if t is not None else None
                      for t in (inputs["weight"], inputs["bias"])]
            xs = x.detach().requires_grad_()  # same memory layout as x
            with monkeypatch.context() as m:
                if attempt and planned:
                    m.setattr(functional, "check_inputs", lambda *a, **k: pytest.fail("checked again"))
                y = (rms_norm(xs, leaves[0], save=save) if is_rms
                     else layer_norm(xs, leaves[0], leaves[1], save=save))
            assert y.shape == x.shape
            y.backward(grad)
            results.append([y.detach(), xs.grad] + [t.grad if t is not None else None for t in leaves])
            xs.grad = None
        assert (len(forward_calls._PLANS) == 1) == planned, name
        for got, want in zip(*results):
            assert (got is None) == (want is None)
            assert got is None or (got.shape == want.shape and torch.equal(got, want)), name


def test_forward_plans_never_skip_a_check(device, make_norm_inputs):
    """After planned calls, inputs that break a rule are still refused with the rule named: whatever the checks
    read is in the signature, and eps is checked on every call."""
    inputs = make_norm_inputs((6, N), torch.bfloat16, device, has_bias=True)
    x, w, b = inputs["x"], inputs["weight"], inputs["bias"]
    for _ in range(2):
        layer_norm_forward(x, w, b)
        layer_norm(x, w, b)
    cases = [
        (dict(weight=w.half()), TypeError, "weight has dtype torch.float16"),
        (dict(weight=w[:-1]), ValueError, f"weight has shape ({N - 1},)"),
        (dict(bias=b.to("meta")), ValueError, "bias is on meta"),
        (dict(eps=0.0), ValueError, "eps must be a positive finite number"),
        (dict(eps=float("inf")), ValueError, "eps must be a positive finite number"),
        (dict(x=x.int()), TypeError, "x has dtype torch.int32"),
        (dict(weight=None, zero_centered=True), ValueError, "zero_centered=True needs a weight"),
    ]
    for function in (layer_norm_forward, layer_norm):
        for change, exc, needle in cases:
            args = dict(x=x, weight=w, bias=b, eps=1e-5, zero_centered=False) | change
            with pytest.raises(exc) as info:
                function(args.pop("x"), args.pop("weight"), args.pop("bias"), args.pop("eps"), **args)
            assert needle in str(info.value), (function.__name__, change)
    with pytest.raises(ValueError, match="save='in' is not allowed"):
        layer_norm(x, w, b, save="in")


def test_forward_plans_are_bounded(device, make_norm_inputs, monkeypatch):
    monkeypatch.setattr(forward_calls, "MAX_PLANS", 2)
    for rows in (1, 2, 3, 4):
        x = make_norm_inputs((rows, N), torch.float32, device)["x"]
        rms_norm_forward(x)
        assert len(forward_calls._PLANS) <= 2


def test_tensors_without_storage_get_no_signature(device):
    """Under functorch's transforms x is a wrapper without storage: no signature (and so no plan), and the call
    takes the checked path, which runs the differentiable composite (test_transforms.py), not reading a data
    pointer."""
    x, w = torch.randn(4, N, device=device), torch.ones(N, device=device)
    seen = []

    def probe(t):
        seen.append(forward_calls.signature(t, w, None, 1e-5, True, False, False))
        return t.sum()

    torch.func.grad(probe)(x)
    assert seen == [None]
    assert forward_calls.signature(x, w, None, 1e-5, True, False, False) is not None
    got = torch.func.grad(lambda t: rms_norm(t, w).sum())(x)
    assert got.shape == x.shape and torch.isfinite(got).all()
