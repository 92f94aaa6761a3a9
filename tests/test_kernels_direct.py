"""The functions without autograd (`normtune.kernels.api.direct`): the same results as the autograd path, bit for
bit, no graph recorded, the shapes and options of the functional API, and bad input named."""

from __future__ import annotations

import pytest
import torch

from normtune.kernels import (
    BackwardConfig,
    kernel_1_config,
    layer_norm,
    layer_norm_backward,
    layer_norm_forward,
    rms_norm,
    rms_norm_backward,
    rms_norm_forward,
)

N = 200


def _autograd(norm, x, weight, bias, grad, **kw):
    """(y, dx, dw, db) through the autograd path, on fresh leaves."""
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in (x, weight, bias)]
    xs, ws, bs = leaves
    y = layer_norm(xs, ws, bs, **kw) if norm == "layer_norm" else rms_norm(xs, ws, **kw)
    y.backward(grad)
    return y.detach(), xs.grad, ws.grad if ws is not None else None, bs.grad if bs is not None else None


CASES = [  # (norm, shape, dtype, has_weight, has_bias, zero_centered, from_output)
    ("layer_norm", (6, N), torch.bfloat16, True, True, False, False),
    ("layer_norm", (2, 3, N), torch.float32, True, False, True, False),
    ("layer_norm", (5, N), torch.float16, True, True, False, True),
    ("layer_norm", (4, N), torch.float32, False, False, False, False),
    ("rms_norm", (6, N), torch.bfloat16, True, False, False, False),
    ("rms_norm", (3, 2, N), torch.float32, True, False, True, True),
    ("rms_norm", (1, N), torch.float32, False, False, False, False),
]


@pytest.mark.parametrize("norm,shape,dtype,has_weight,has_bias,zero_centered,from_output", CASES)
def test_direct_matches_the_autograd_path_bitwise(norm, shape, dtype, has_weight, has_bias, zero_centered,
                                                  from_output, device, make_norm_inputs):
    inputs = make_norm_inputs(shape, dtype, device, has_weight=has_weight, has_bias=has_bias,
                              zero_centered=zero_centered)
    x, w, b, g = inputs["x"], inputs["weight"], inputs["bias"], inputs["grad"]
    y_ref, dx_ref, dw_ref, db_ref = _autograd(norm, x, w, b, g, zero_centered=zero_centered,
                                              save="output" if from_output else "input")
    saved = y_ref  # from_output: the y the autograd backward recovered x̂ from
    if norm == "layer_norm":
        y, mean, rstd = layer_norm_forward(x, w, b, zero_centered=zero_centered)
        assert mean.dtype == rstd.dtype == torch.float32 and mean.shape == rstd.shape == (x.numel() // N,)
        dx, dw, db = layer_norm_backward(g, saved if from_output else x, w, b, None if from_output else mean, rstd,
                                         zero_centered=zero_centered, from_output=from_output)
        if from_output:  # the direct forward stores the mean, an autograd forward saving y does not: compiled
            # apart, their y may differ in the last bit (fp16 on an H100); compare with the one that stores it
            y_ref = _autograd(norm, x, w, b, g, zero_centered=zero_centered, save="input")[0]
    else:
        y, rstd = rms_norm_forward(x, w, zero_centered=zero_centered)
        dx, dw = rms_norm_backward(g, saved if from_output else x, w, rstd, zero_centered=zero_centered,
                                   from_output=from_output)
        db = None
    assert y.shape == x.shape and dx.shape == x.shape
    assert torch.equal(y, y_ref) and torch.equal(dx, dx_ref)
    for got, ref in ((dw, dw_ref), (db, db_ref)):
        assert (got is None) == (ref is None) and (got is None or torch.equal(got, ref))


def test_direct_records_no_graph(device, make_norm_inputs):
    inputs = make_norm_inputs((4, N), torch.float32, device, has_bias=True)
    x, w, b = (inputs[k].requires_grad_() for k in ("x", "weight", "bias"))
    y, mean, rstd = layer_norm_forward(x, w, b)
    dx, dw, db = layer_norm_backward(inputs["grad"], x, w, b, mean, rstd)
    for t in (y, mean, rstd, dx, dw, db):
        assert not t.requires_grad and t.grad_fn is None


def test_backward_plans_are_remembered_per_row_strides(device, make_norm_inputs, monkeypatch):
    """A resolved call remembers its launch plan per (grad, x, dx) row strides, which decide int64 indexing and the
    alignment hint: rows sliced from tensors of other widths (strides 200, 203, 204, 208) each get their own plan and
    compute what contiguous rows compute, and the memo starts over when full."""
    from normtune.kernels.api import backward_calls
    from normtune.kernels import backward_launch as launch

    monkeypatch.setattr(launch, "MAX_PLANS_PER_CALL", 3)
    backward_calls.clear_resolved()  # only this test's calls: earlier ones may hold memos made under the real limit
    inputs = make_norm_inputs((6, N), torch.float32, device, has_bias=True)
    x, w, b, g = inputs["x"], inputs["weight"], inputs["bias"], inputs["grad"]
    _, mean, rstd = layer_norm_forward(x, w, b)
    want = layer_norm_backward(g, x, w, b, mean, rstd)
    memos = []
    for width in (N, N + 3, N + 4, N + 8, N + 3):
        xs, gs = (torch.zeros(6, width, dtype=x.dtype, device=x.device)[:, :N] for _ in range(2))
        xs.copy_(x)
        gs.copy_(g)
        got = layer_norm_backward(gs, xs, w, b, mean, rstd)
        for out, ref in zip(got, want):
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        memos = [call.plans for call in backward_calls._RESOLVED.values() if call.config is not None and call.plans]
    assert memos and all(len(plans) <= 3 for plans in memos)
    assert all(len(key) == 3 for plans in memos for key in plans)


# (id, change to layer_norm_backward's arguments, exception, substrings of the message)
BAD = [
    ("grad-shape", lambda a: a.update(grad=a["grad"][:5]), ValueError, ["grad has shape (5, 200)", "shape (6, 200)"]),
    ("rstd-dtype", lambda a: a.update(rstd=a["rstd"].bfloat16()), ValueError,
     ["rstd has shape (6,) and dtype torch.bfloat16", "fp32 rstd"]),
    ("rstd-shape", lambda a: a.update(rstd=a["rstd"][:5]), ValueError, ["rstd has shape (5,)", "of shape (6,)"]),
    ("mean-missing", lambda a: a.update(mean=None), TypeError, ["mean must be a torch.Tensor", "NoneType"]),
    ("config-fit", lambda a: a.update(config=BackwardConfig(kernel_1_config(block_col=128))), ValueError,
     ["config does not fit this input (6x200)", "kernel_1.block_col=128 < N=200"]),
    ("x-dtype", lambda a: a.update(x=a["x"].int()), TypeError, ["x has dtype torch.int32"]),
    ("y-dtype", lambda a: a.update(x=a["x"].int(), from_output=True), TypeError, ["y has dtype torch.int32"]),
]


@pytest.mark.parametrize("change,exc,needles", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_direct_bad_input_names_the_argument(change, exc, needles, device, make_norm_inputs):
    inputs = make_norm_inputs((6, N), torch.float32, device, has_bias=True)
    x, w, b = inputs["x"], inputs["weight"], inputs["bias"]
    _, mean, rstd = layer_norm_forward(x, w, b)
    args = dict(grad=inputs["grad"], x=x, weight=w, bias=b, mean=mean, rstd=rstd)
    change(args)
    with pytest.raises(exc) as info:
        layer_norm_backward(args.pop("grad"), args.pop("x"), args.pop("weight"), args.pop("bias"), args.pop("mean"),
                            args.pop("rstd"), **args)
    message = str(info.value)
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"
