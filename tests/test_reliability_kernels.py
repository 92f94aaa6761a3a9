"""Weights and biases in any layout, on every entry point: a strided, column or expanded weight/bias gives the
same outputs and gradients as its contiguous copy (and its gradient reaches the tensor passed), through the
autograd functions, the modules, the functions without autograd, the custom ops and the planned forward."""

from __future__ import annotations

import pytest
import torch

from normtune.kernels import layer_norm, layer_norm_backward, layer_norm_forward, rms_norm

from normtune.kernels.api import forward_calls
from normtune.kernels import rms_norm_backward, rms_norm_forward
from normtune.kernels.api.modules import LayerNorm, RMSNorm

N = 40


@pytest.fixture(autouse=True)
def _fresh_plans():
    forward_calls.clear()
    yield
    forward_calls.clear()


LAYOUTS = ["step2", "step3", "column", "expanded"]


def _leaf(kind: str, values: torch.Tensor) -> torch.Tensor:
    """A tensor whose `_view_of(kind, ·)` holds `values` (N,): a wider vector sliced with step 2 or 3, a matrix
    whose column 3 it is, or (kind "expanded", values[0] only) one element expanded to N with stride 0."""
    n = values.shape[0]
    if kind == "expanded":
        return values[:1].clone()
    base = torch.zeros({"step2": (2 * n,), "step3": (3 * n + 1,), "column": (n, 5)}[kind], dtype=values.dtype)
    _view_of(kind, base).copy_(values)
    return base


def _operands(kind, dtype, has_bias, device):
    """Leaves (weight, bias) that require grad, in `kind`'s layout (`_view_of` takes the operand from them)."""
    w = _leaf(kind, (0.7 + 0.6 * torch.rand(N)).to(dtype))  # |b| <= |w|: save="output" keeps y (saving.py)
    b = _leaf(kind, (0.5 * torch.rand(N) - 0.25).to(dtype)) if has_bias else None
    return [t.to(device).requires_grad_() if t is not None else None for t in (w, b)]


def _view_of(kind, leaf):
    """The strided view of a leaf, built under autograd (the same layout as `_strided`)."""
    if leaf is None:
        return None
    if kind == "step2":
        return leaf[::2]
    if kind == "step3":
        return leaf[1::3]
    if kind == "column":
        return leaf[:, 3]
    return leaf.expand(N)


def _reference(is_rms, x, w, b, g, eps):
    """float64 torch autograd on contiguous copies: y, dx, dw, db."""
    x64 = x.detach().double().requires_grad_()
    w64 = w.detach().double().contiguous().requires_grad_()
    b64 = b.detach().double().contiguous().requires_grad_() if b is not None else None
    if is_rms:
        y = torch.nn.functional.rms_norm(x64, (N,), w64, eps)
    else:
        y = torch.nn.functional.layer_norm(x64, (N,), w64, b64, eps)
    y.backward(g.double())
    return y.detach(), x64.grad, w64.grad, b64.grad if b64 is not None else None


def _leaf_grad_matches(kind, leaf, view_grad64, assert_close, tol, what):
    """leaf.grad holds the view's gradient at the view's elements (summed for an expanded scalar), zeros
    elsewhere."""
    assert leaf.grad is not None, f"{what}: no gradient reached the tensor passed"
    assert leaf.grad.dtype == leaf.dtype and leaf.grad.shape == leaf.shape
    if kind == "expanded":
        want = view_grad64.sum().reshape(1)
        assert_close(leaf.grad, want, tol, what, floor=view_grad64.abs().sum().item())
        return
    want = torch.zeros(leaf.shape, dtype=torch.float64)
    _view_of(kind, want).copy_(view_grad64)
    assert_close(leaf.grad, want, tol, what, floor=view_grad64.norm().item())


@pytest.mark.parametrize("kind", LAYOUTS)
@pytest.mark.parametrize("norm,dtype,save", [("rms_norm", torch.bfloat16, "input"),
                                             ("layer_norm", torch.bfloat16, "input"),
                                             ("layer_norm", torch.float32, "output")])
def test_strided_weight_and_bias_through_autograd(kind, norm, dtype, save, device, assert_close, tolerance):
    is_rms = norm == "rms_norm"
    eps = 1e-6 if is_rms else 1e-5
    wleaf, bleaf = _operands(kind, dtype, not is_rms, device)
    x = (torch.randn(8, N) + 0.5).to(device, dtype)
    g = torch.randn(8, N).to(device, dtype)
    w, b = _view_of(kind, wleaf), _view_of(kind, bleaf)
    assert not w.is_contiguous()
    y_ref, dx_ref, dw_ref, db_ref = _reference(is_rms, x, w, b, g, eps)
    for attempt in range(2):  # the second call may take a planned forward: it must not read the view as contiguous
        xs = x.detach().clone().requires_grad_()
        wleaf.grad = None
        if bleaf is not None:
            bleaf.grad = None
        w, b = _view_of(kind, wleaf), _view_of(kind, bleaf)
        y = rms_norm(xs, w, eps, save=save) if is_rms else layer_norm(xs, w, b, eps, save=save)
        y.backward(g)
        tol = tolerance(dtype, save)
        assert_close(y, y_ref, tol, f"y ({kind}, call {attempt})")
        assert_close(xs.grad, dx_ref, tol, f"dx ({kind}, call {attempt})")
        _leaf_grad_matches(kind, wleaf, dw_ref, assert_close, tol, f"dw ({kind}, call {attempt})")
        if bleaf is not None:
            _leaf_grad_matches(kind, bleaf, db_ref, assert_close, tol, f"db ({kind}, call {attempt})")


def test_planned_forward_is_not_reused_for_a_strided_weight(device, assert_close, tolerance):
    """A plan made for a contiguous weight, then the same call with a strided weight of the same shape, dtype
    and alignment: the strided call must not run the contiguous call's plan."""
    x = (torch.randn(6, N) + 0.5).to(device)
    base = (1.0 + 0.3 * torch.randn(2 * N)).to(device)
    contiguous = base[:N]
    strided = base[::2]  # the same data pointer as `contiguous`
    for _ in range(2):
        rms_norm_forward(x, contiguous)
    assert len(forward_calls._PLANS) == 1
    for w in (strided, strided):
        y, _ = rms_norm_forward(x, w)
        y_ref = _reference(True, x, w, None, torch.ones_like(x), 1e-6)[0]
        assert_close(y, y_ref, tolerance(torch.float32), "y with a strided weight after a planned call")
        y2 = rms_norm(x, w)
        assert_close(y2, y_ref, tolerance(torch.float32), "autograd y with a strided weight after a planned call")


@pytest.mark.parametrize("kind", LAYOUTS)
def test_strided_weight_and_bias_without_autograd(kind, device, assert_close, tolerance):
    x = (torch.randn(5, N) + 0.5).to(device, torch.bfloat16)
    g = torch.randn(5, N).to(device, torch.bfloat16)
    w, b = (_view_of(kind, t.detach()) for t in _operands(kind, torch.float32, True, device))
    y_ref, dx_ref, dw_ref, db_ref = _reference(False, x, w, b, g, 1e-5)
    tol = tolerance(torch.bfloat16)
    y, mean, rstd = layer_norm_forward(x, w, b)
    assert_close(y, y_ref, tol, "layer_norm_forward y")
    dx, dw, db = layer_norm_backward(g, x, w, b, mean, rstd)
    assert dw.shape == db.shape == (N,) and dw.dtype == db.dtype == torch.float32
    assert_close(dx, dx_ref, tol, "dx")
    assert_close(dw, dw_ref, tol, "dw")
    assert_close(db, db_ref, tol, "db")
    dx, dw, db = layer_norm_backward(g, y, w, b, None, rstd, from_output=True)
    assert_close(dx, dx_ref, tolerance(torch.bfloat16, "output"), "dx from y")
    y, rstd = rms_norm_forward(x, w)
    y_ref, dx_ref, dw_ref, _ = _reference(True, x, w, None, g, 1e-6)
    assert_close(y, y_ref, tol, "rms_norm_forward y")
    dx, dw = rms_norm_backward(g, x, w, rstd)
    assert_close(dx, dx_ref, tol, "rms dx")
    assert_close(dw, dw_ref, tol, "rms dw")


@pytest.mark.parametrize("kind", ["step2", "expanded"])
def test_strided_operands_through_the_custom_ops(kind, device, assert_close, tolerance):
    x = (torch.randn(4, N) + 0.5).to(device)
    g = torch.randn(4, N).to(device)
    w, b = (_view_of(kind, t.detach()) for t in _operands(kind, torch.float32, True, device))
    y_ref, dx_ref, dw_ref, db_ref = _reference(False, x, w, b, g, 1e-5)
    y, rstd, mean = torch.ops.normtune.norm_forward(x, w, b, 1e-5, False, False, False, "")
    assert_close(y, y_ref, tolerance(torch.float32), "custom op y")
    dx, dw, db = torch.ops.normtune.norm_backward(g, x, w, b, rstd, mean, False, False, False, "")
    assert_close(dx, dx_ref, tolerance(torch.float32), "custom op dx")
    assert_close(dw, dw_ref, tolerance(torch.float32), "custom op dw")
    assert_close(db, db_ref, tolerance(torch.float32), "custom op db")


@pytest.mark.parametrize("module_cls", [LayerNorm, RMSNorm])
def test_module_with_strided_parameters(module_cls, device, assert_close, tolerance):
    module = module_cls(N, device=device)
    is_rms = module_cls is RMSNorm
    with torch.no_grad():
        module.weight = torch.nn.Parameter((1.0 + 0.3 * torch.randn(N, 3)).to(device)[:, 1])
        if not is_rms:
            module.bias = torch.nn.Parameter((0.5 * torch.randn(2 * N)).to(device)[::2])
    assert not module.weight.is_contiguous()
    x = (torch.randn(3, 2, N) + 0.5).to(device).requires_grad_()
    g = torch.randn(3, 2, N).to(device)
    module(x).backward(g)
    eps = module.eps if module.eps is not None else torch.finfo(x.dtype).eps
    y_ref, dx_ref, dw_ref, db_ref = _reference(is_rms, x, module.weight, module.bias, g, eps)
    tol = tolerance(torch.float32)
    assert_close(x.grad, dx_ref, tol, "module dx")
    assert_close(module.weight.grad, dw_ref, tol, "module dw")
    if not is_rms:
        assert_close(module.bias.grad, db_ref, tol, "module db")


# ---------------------------------------------------------------------------------------------------------------
# Double backward: create_graph=True gives a gradient with a graph, and second-order gradients match torch's.
# ---------------------------------------------------------------------------------------------------------------
def _penalty_grads(norm_fn, x, w, b, c):
    """A gradient-penalty loss: ‖∂(Σ c·y)/∂x‖² + Σ c·y, differentiated to x, w, b. Returns (gx, grads)."""
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in (x, w, b)]
    y = norm_fn(*leaves)
    loss = (c * y).sum()
    gx, = torch.autograd.grad(loss, leaves[0], create_graph=True)
    assert gx.requires_grad and gx.grad_fn is not None, "create_graph=True returned a gradient without a graph"
    (gx.pow(2).sum() + loss).backward()
    return gx.detach(), [t.grad if t is not None else None for t in leaves]


DOUBLE_CASES = [  # (norm, dtype, has_bias, zero_centered, planned: x 3-D so that a second call runs a plan)
    ("rms_norm", torch.float32, False, False, False),
    ("rms_norm", torch.float32, False, True, True),
    ("layer_norm", torch.float32, True, False, True),
    ("layer_norm", torch.bfloat16, True, True, False),
]


@pytest.mark.parametrize("norm,dtype,has_bias,zero_centered,planned", DOUBLE_CASES)
def test_double_backward_matches_torch(norm, dtype, has_bias, zero_centered, planned, device, assert_close,
                                       tolerance):
    is_rms = norm == "rms_norm"
    shape = (2, 3, N) if planned else (6, N)
    x = (torch.randn(shape) + 0.5).to(device, dtype)
    c = torch.randn(shape).to(device, dtype)
    w = ((0.2 if zero_centered else 1.0) + 0.3 * torch.randn(N)).to(device)
    b = (0.5 * torch.randn(N)).to(device) if has_bias else None
    eps = 1e-5

    def ours(x, w, b):
        if is_rms:
            return rms_norm(x, w, eps, zero_centered=zero_centered)
        return layer_norm(x, w, b, eps, zero_centered=zero_centered)

    def theirs(x, w, b):
        w_eff = 1.0 + w if zero_centered else w
        if is_rms:
            return torch.nn.functional.rms_norm(x, (N,), w_eff, eps)
        return torch.nn.functional.layer_norm(x, (N,), w_eff, b, eps)

    ref_gx, ref = _penalty_grads(theirs, x.double(), w.double(), b.double() if b is not None else None, c.double())
    for attempt in range(2 if planned else 1):
        gx, got = _penalty_grads(ours, x, w, b, c)
        tol = 2 * tolerance(dtype)
        assert_close(gx, ref_gx, tol, f"first-order dx (call {attempt})")
        for name, a, r in zip(("x.grad", "w.grad", "b.grad"), got, ref):
            assert_close(a, r, tol, f"second-order {name} (call {attempt})", floor=r.norm().item() if r is not None
                         else 0.0)


def test_double_backward_through_module_and_third_order(device, assert_close):
    module = RMSNorm(N, eps=1e-6, device=device)
    with torch.no_grad():
        module.weight.copy_(1.0 + 0.3 * torch.randn(N))
    x = (torch.randn(4, N) + 0.5).to(device).requires_grad_()
    c = torch.randn(4, N).to(device)
    gx, = torch.autograd.grad((c * module(x)).sum(), x, create_graph=True)
    ggx, = torch.autograd.grad(gx.pow(2).sum(), x, create_graph=True)
    gggx, = torch.autograd.grad(ggx.sum(), x)
    x64 = x.detach().double().requires_grad_()
    w64 = module.weight.detach().double()
    r1, = torch.autograd.grad((c.double() * torch.nn.functional.rms_norm(x64, (N,), w64, 1e-6)).sum(), x64,
                              create_graph=True)
    r2, = torch.autograd.grad(r1.pow(2).sum(), x64, create_graph=True)
    r3, = torch.autograd.grad(r2.sum(), x64)
    assert_close(ggx, r2, 1e-4, "second order")
    assert_close(gggx, r3, 1e-3, "third order")


def test_double_backward_through_the_custom_op(device, assert_close):
    x = (torch.randn(5, N) + 0.5).to(device)
    w = (1.0 + 0.3 * torch.randn(N)).to(device)
    b = (0.5 * torch.randn(N)).to(device)
    c = torch.randn(5, N).to(device)

    def op(x, w, b):
        return torch.ops.normtune.norm_forward(x, w, b, 1e-5, False, False, False, "")[0]

    def ref(x, w, b):
        return torch.nn.functional.layer_norm(x, (N,), w, b, 1e-5)

    gx, got = _penalty_grads(op, x, w, b, c)
    ref_gx, want = _penalty_grads(ref, x.double(), w.double(), b.double(), c.double())
    for name, a, r in zip(("x.grad", "w.grad", "b.grad"), got, want):
        assert_close(a, r, 1e-4, f"custom op second-order {name}")


@pytest.mark.parametrize("norm", ["layer_norm", "rms_norm"])
def test_double_backward_with_save_output_raises_clearly(norm, device):
    x = (torch.randn(4, N) + 0.5).to(device).requires_grad_()
    w = (1.0 + 0.3 * torch.randn(N)).to(device).requires_grad_()
    y = rms_norm(x, w, save="output") if norm == "rms_norm" else layer_norm(x, w, None, save="output")
    with pytest.raises(RuntimeError, match="double backward.*save='input'"):
        torch.autograd.grad(y.sum(), x, create_graph=True)
    # first order is unaffected
    y = rms_norm(x, w, save="output") if norm == "rms_norm" else layer_norm(x, w, None, save="output")
    gx, = torch.autograd.grad(y.pow(2).sum(), x)
    assert torch.isfinite(gx).all()


# ---------------------------------------------------------------------------------------------------------------
# save="output" near zero weights: exact (the call saves x where y cannot determine x̂), never NaN, never silent.
# ---------------------------------------------------------------------------------------------------------------
SMALL_WEIGHTS = [0.0, 1e-9, 1e-3, 0.01]


def _weights_with_small_columns(value, zero_centered, *, big_bias: bool):
    """A weight of ~1 whose columns 3, 7 and 11 hold `value` (stored as w' = value − 1 when zero-centered), and a
    bias of 0.1·randn with 10s in those columns (None unless big_bias)."""
    w = 1.0 + 0.1 * torch.randn(N)
    w[[3, 7, 11]] = value
    b = None
    if big_bias:
        b = 0.1 * torch.randn(N)
        b[[3, 7, 11]] = torch.tensor([10.0, -8.0, 12.0])
    return (w - 1.0 if zero_centered else w), b


def _saved_activation(y):
    """The activation the autograd node of y saved (y or x), looking through the views a module adds."""
    node = y.grad_fn
    while not hasattr(node, "saved_tensors"):
        node = node.next_functions[0][0]
    return node.saved_tensors[0]


@pytest.mark.parametrize("value", SMALL_WEIGHTS)
@pytest.mark.parametrize("norm,dtype,param_dtype,zero_centered", [
    ("layer_norm", torch.bfloat16, torch.float32, False),
    ("layer_norm", torch.float16, torch.float16, True),
    ("rms_norm", torch.float16, torch.float32, False),
    ("rms_norm", torch.bfloat16, torch.bfloat16, True),
])
def test_save_output_near_zero_weights_matches_float64(value, norm, dtype, param_dtype, zero_centered, device,
                                                       reference_norm, assert_close, tolerance):
    is_rms = norm == "rms_norm"
    w, b = _weights_with_small_columns(value, zero_centered, big_bias=not is_rms)
    w = w.to(device, param_dtype)
    b = b.to(device, param_dtype) if b is not None else None
    x = (torch.randn(7, N) + 0.5).to(device, dtype)
    g = torch.randn(7, N).to(device, dtype)
    eps = 1e-5
    ref = reference_norm(x, w, b, eps, g, is_rms=is_rms, zero_centered=zero_centered)
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in (x, w, b)]
    xs, ws, bs = leaves
    if is_rms:
        y = rms_norm(xs, ws, eps, zero_centered=zero_centered, save="output")
    else:
        y = layer_norm(xs, ws, bs, eps, zero_centered=zero_centered, save="output")
    y.backward(g)
    tol = tolerance(dtype, "output")
    assert_close(y, ref["y"], tol, "y")
    assert_close(xs.grad, ref["dx"], tol, "dx", floor=ref["scale"]["dx"])
    assert_close(ws.grad, ref["dw"], tol, "dw", floor=ref["scale"]["dw"])
    if bs is not None:
        assert_close(bs.grad, ref["db"], tol, "db", floor=ref["scale"]["db"])
    # per column too: the small-weight columns are where recovery from y went wrong
    cols = [3, 7, 11]
    assert_close(ws.grad[cols], ref["dw"][cols], tol, "dw of the small-weight columns",
                 floor=ref["scale"]["dw"] / N ** 0.5)


@pytest.mark.parametrize("norm", ["layer_norm", "rms_norm"])
def test_save_output_keeps_y_where_it_determines_the_input(norm, device):
    """The rule only falls back where it must: ordinary weights still save y (the memory save="output" is for)."""
    is_rms = norm == "rms_norm"
    x = (torch.randn(4, N) + 0.5).to(device, torch.bfloat16).requires_grad_()
    w, b = _weights_with_small_columns(1.0, False, big_bias=False)
    w = w.to(device).requires_grad_()
    b = None if is_rms else (0.5 * torch.randn(N)).clamp(-0.5, 0.5).to(device)

    def call(weight):
        return rms_norm(x, weight, save="output") if is_rms else layer_norm(x, weight, b, save="output")

    y = call(w)
    assert _saved_activation(y).data_ptr() == y.data_ptr()
    small = w.detach().clone()
    small[5] = 0.0
    y = call(small.requires_grad_())
    assert _saved_activation(y).data_ptr() == x.data_ptr()


def test_save_output_check_is_cached_per_weight_version(device, monkeypatch):
    """The weights are read once per data version (on a GPU, a read of the device), not on every call; an in-place
    update (an optimizer step) is seen."""
    from normtune.kernels.api import saving

    saving.clear()
    calls = []
    real = saving._read_back
    monkeypatch.setattr(saving, "_read_back", lambda flags: calls.append(1) or real(flags))
    x = (torch.randn(4, N) + 0.5).to(device).requires_grad_()
    w = torch.nn.Parameter((1.0 + 0.1 * torch.randn(N)).to(device))
    for _ in range(3):
        y = rms_norm(x, w, save="output")
        assert _saved_activation(y).data_ptr() == y.data_ptr()
    assert len(calls) == 1
    with torch.no_grad():
        w[9] = 0.0  # an in-place update: a new version, checked again, and now y cannot stand in for x
    for _ in range(2):
        y = rms_norm(x, w, save="output")
        assert _saved_activation(y).data_ptr() == x.data_ptr()
    assert len(calls) == 2
    w2 = torch.nn.Parameter((1.0 + 0.1 * torch.randn(N)).to(device))  # another tensor: checked on its own
    rms_norm(x, w2, save="output")
    assert len(calls) == 3


def test_backward_from_output_refuses_weights_that_lose_the_input(device):
    x = (torch.randn(4, N) + 0.5).to(device, torch.bfloat16)
    g = torch.randn(4, N).to(device, torch.bfloat16)
    w, b = _weights_with_small_columns(0.01, False, big_bias=True)
    w, b = w.to(device), b.to(device)
    y, mean, rstd = layer_norm_forward(x, w, b)
    with pytest.raises(ValueError, match="from_output=True.*save the input"):
        layer_norm_backward(g, y, w, b, None, rstd, from_output=True)
    dx, dw, db = layer_norm_backward(g, x, w, b, mean, rstd)  # from x it is exact
    assert torch.isfinite(dx).all() and torch.isfinite(dw).all()
    with pytest.raises(RuntimeError, match="save='output' under torch.compile"):
        torch.ops.normtune.norm_forward(x, w, b, 1e-5, False, False, True, "")
    with pytest.raises(RuntimeError, match="norm_backward from the output"):
        torch.ops.normtune.norm_backward(g, y, w, b, rstd, mean, False, False, True, "")


def test_save_output_under_compile_refuses_weights_that_lose_the_input(device):
    """torch.compile cannot read the weights while tracing: the call that y cannot serve raises, naming the fix."""
    torch._dynamo.reset()
    fn = torch.compile(lambda x, w: rms_norm(x, w, 1e-6, save="output"), fullgraph=True, backend="aot_eager")
    x = (torch.randn(4, N) + 0.5).to(device).requires_grad_()
    w = (1.0 + 0.1 * torch.randn(N)).to(device)
    fn(x, w.requires_grad_()).sum().backward()  # ordinary weights: y stands in for x
    small = w.detach().clone()
    small[4] = 0.0
    with pytest.raises(RuntimeError, match="save='output' under torch.compile.*save='input'"):
        fn(x, small.requires_grad_()).sum().backward()


def test_save_output_reads_back_once_per_weight_update_for_all_layers(device, monkeypatch):
    """After an optimizer-like in-place update of every layer, the first layer's check serves them all: one
    read-back per step, not one per layer; and a layer whose update broke the rule still saves x."""
    from normtune.kernels.api import saving

    saving.clear()
    reads = []
    real = saving._read_back
    monkeypatch.setattr(saving, "_read_back", lambda flags: reads.append(len(flags)) or real(flags))
    layers = [LayerNorm(N, device=device, save="output") for _ in range(3)]
    x = (torch.randn(4, N) + 0.5).to(device).requires_grad_()

    def forward():
        saved = []
        h = x
        for layer in layers:
            y = layer(h)
            saved.append(_saved_activation(y).data_ptr() == y.data_ptr())
            h = y
        h.sum().backward()
        return saved

    assert forward() == [True, True, True]
    assert len(reads) == 3  # first sight of each layer
    for step in range(2):
        reads.clear()
        with torch.no_grad():
            for layer in layers:
                layer.weight.add_(0.01)
                layer.bias.sub_(0.01)
        assert forward() == [True, True, True]
        assert reads == [3], f"step {step}: read-backs {reads}"
    reads.clear()
    with torch.no_grad():
        for layer in layers:
            layer.weight.mul_(1.0)
        layers[1].weight[7] = 0.0
    assert forward() == [True, False, True]
    assert reads == [3]
