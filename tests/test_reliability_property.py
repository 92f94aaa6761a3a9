"""A property test over memory layouts: random non-contiguous inputs, gradients, weights and biases (slices,
matrix columns, expanded stride-0 tensors, rows that need a copy) through the autograd API, for every backward
strategy, against float64, with every buffer the kernels allocate poisoned with NaN first."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from normtune.kernels import BackwardConfig, Kernel2Config, Problem, kernel_1_config, layer_norm, rms_norm
from normtune.kernels.api import forward_calls, saving
from normtune.kernels.backward import workspace
from normtune.kernels.config import NUM_WARPS
from normtune.kernels.heuristics import next_power_of_two, row_block_col

# kernel_1 strategies (kernels/config.py `Kernel1Config`): the rows strategy's single pass, two-pass, split rows,
# per-column accumulators and the pipelined split exchange; the columns and dual strategies; and the rows
# strategy with the fused reduction. Split rows need slices of at least 256 columns.
STRATEGIES = ["single", "two_pass", "row_split", "column_accumulators", "pipelined_split", "fused", "columns", "dual"]
SPLIT = {"row_split", "pipelined_split"}


def _config(strategy: str, problem: Problem, block_row: int) -> BackwardConfig | None:
    """The smallest-warp valid config of `strategy` for `problem` (None where none is valid)."""
    N = problem.N
    full = next_power_of_two(N)
    k1 = {"single": dict(block_col=full), "two_pass": dict(block_col=max(1, full // 4), two_pass=True),
          "row_split": dict(block_col=row_block_col(N, 2), row_split=2),
          "column_accumulators": dict(block_col=full, column_accumulators=True),
          "pipelined_split": dict(block_col=row_block_col(N, 2), row_split=2, pipelined_split=True, num_stages=2),
          "fused": dict(block_col=full), "columns": dict(block_col=min(16, full), strategy="columns"),
          "dual": dict(block_col=full, strategy="dual")}[strategy]
    k2 = Kernel2Config(block_m=4, block_n=16, num_warps=1, fused=strategy == "fused")
    for rows in (block_row, 1):
        for warps in NUM_WARPS:
            cfg = BackwardConfig(kernel_1_config(block_row=rows, num_warps=warps, programs_per_sm=1, **k1), k2)
            if cfg.is_valid(problem):
                return cfg
    return None


def _layout(kind: str, values: torch.Tensor, leaf_grad: bool):
    """(leaf, view): `view` holds `values` (M, N) in layout `kind`, `leaf` is the tensor it is a view of (what
    requires grad). "expanded" repeats values[0] over the rows (stride 0)."""
    M, N = values.shape
    if kind == "contiguous":
        leaf = values.clone()
        view = lambda t: t  # noqa: E731
    elif kind == "row_strided":
        leaf = torch.zeros(M, N + 3, dtype=values.dtype)
        view = lambda t: t[:, 1:N + 1]  # noqa: E731
    elif kind == "column_strided":  # the last dimension not contiguous: copied by the API
        leaf = torch.zeros(N, M, dtype=values.dtype)
        view = lambda t: t.t()  # noqa: E731
    elif kind == "expanded":
        leaf = values[:1].clone() if M else torch.zeros(1, N, dtype=values.dtype)
        view = lambda t: t.expand(M, N)  # noqa: E731
    elif kind == "three_d":  # leading dims that cannot be flattened in place: copied into rows
        leaf = torch.zeros(M, 2, N, dtype=values.dtype)
        view = lambda t: t[:, 1]  # noqa: E731
    else:
        raise AssertionError(kind)
    if kind != "expanded":
        with torch.no_grad():
            view(leaf).copy_(values)
    leaf.requires_grad_(leaf_grad)
    return leaf, view


def _operand(kind: str, values: torch.Tensor):
    """(leaf, view) of an (N,) weight or bias in layout `kind`."""
    N = values.shape[0]
    if kind == "contiguous":
        leaf, view = values.clone(), (lambda t: t)
    elif kind == "step2":
        leaf, view = torch.zeros(2 * N, dtype=values.dtype), (lambda t: t[::2])
    elif kind == "column":
        leaf, view = torch.zeros(N, 3, dtype=values.dtype), (lambda t: t[:, 2])
    else:  # expanded: one value over every column
        leaf, view = values[:1].clone(), (lambda t: t.expand(N))
    if kind not in ("contiguous", "expanded"):
        view(leaf).copy_(values)
    return leaf.requires_grad_(), view


@pytest.fixture
def poisoned(monkeypatch):
    """torch.empty/empty_like return NaN-filled floating tensors while the test runs: every output and scratch
    buffer a launch allocates starts poisoned, so an element left unwritten fails the finiteness check."""
    real_empty, real_like = torch.empty, torch.empty_like

    def fill(t):
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: fill(real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: fill(real_like(*a, **k)))


DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32),
          (torch.bfloat16, torch.float32), (torch.float16, torch.float16)]


@pytest.mark.parametrize("strategy", STRATEGIES)
# No shrinking: under the interpreter it would take minutes; the failing example is printed as drawn.
@settings(max_examples=6, deadline=None, derandomize=True, database=None,
          phases=[Phase.explicit, Phase.reuse, Phase.generate],
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_every_strategy_in_every_layout_matches_float64(strategy, data, device, poisoned, reference_norm,
                                                        assert_close, tolerance):
    norm = data.draw(st.sampled_from(["layer_norm", "rms_norm"]), label="norm")
    is_rms = norm == "rms_norm"
    dtype, param_dtype = data.draw(st.sampled_from(DTYPES), label="dtypes")
    has_weight = data.draw(st.booleans(), label="has_weight") or strategy == "column_accumulators"
    has_bias = not is_rms and data.draw(st.booleans(), label="has_bias")
    zero_centered = has_weight and data.draw(st.booleans(), label="zero_centered")
    save = data.draw(st.sampled_from(["input", "output"]), label="save")
    M = data.draw(st.integers(0, 5), label="M")
    N = data.draw(st.integers(512, 560) if strategy in SPLIT else st.integers(1, 40), label="N")
    block_row = data.draw(st.sampled_from([1, 2, 4]), label="block_row")
    x_kind = data.draw(st.sampled_from(["contiguous", "row_strided", "column_strided", "expanded", "three_d"]),
                       label="x layout")
    g_kind = data.draw(st.sampled_from(["contiguous", "row_strided", "column_strided", "expanded"]),
                       label="grad layout")
    w_kind = data.draw(st.sampled_from(["contiguous", "step2", "column", "expanded"]), label="weight layout")
    b_kind = data.draw(st.sampled_from(["contiguous", "step2", "column", "expanded"]), label="bias layout")
    torch.manual_seed(data.draw(st.integers(0, 2**31 - 1), label="seed"))

    problem = Problem(norm, max(M, 1), N, dtype, param_dtype if has_weight else None, has_weight, has_bias,
                      zero_centered, save)
    config = _config(strategy, problem, block_row)
    assert config is not None, f"no valid {strategy} config for {problem.key}"
    forward_calls.clear()
    workspace.clear_scratch()
    saving.clear()

    x_values = (torch.randn(M, N) + 0.5).to(dtype)
    g_values = torch.randn(M, N).to(dtype)
    w_values = ((0.1 if zero_centered else 1.0) * torch.ones(N) + 0.1 * torch.randn(N)).to(param_dtype)
    b_values = (0.1 * torch.randn(N)).to(param_dtype)
    x_leaf, x_view = _layout(x_kind, x_values, True)
    g_leaf, g_view = _layout(g_kind, g_values, False)
    w_leaf, w_view = _operand(w_kind, w_values) if has_weight else (None, None)
    b_leaf, b_view = _operand(b_kind, b_values) if has_bias else (None, None)
    x_leaf, g_leaf = x_leaf.to(device).detach().requires_grad_(), g_leaf.to(device)
    w_leaf = w_leaf.to(device).detach().requires_grad_() if w_leaf is not None else None
    b_leaf = b_leaf.to(device).detach().requires_grad_() if b_leaf is not None else None

    x = x_view(x_leaf)
    x.retain_grad()
    g = g_view(g_leaf)
    w = w_view(w_leaf) if w_leaf is not None else None
    b = b_view(b_leaf) if b_leaf is not None else None
    for operand, leaf in ((w, w_leaf), (b, b_leaf)):
        if operand is not None and operand is not leaf:
            operand.retain_grad()
    if is_rms:
        y = rms_norm(x, w, 1e-6, zero_centered=zero_centered, save=save, config=config)
    else:
        y = layer_norm(x, w, b, 1e-5, zero_centered=zero_centered, save=save, config=config)
    y.backward(g)

    ref = reference_norm(x.detach(), w.detach() if w is not None else None, b.detach() if b is not None else None,
                         1e-6 if is_rms else 1e-5, g.detach(), is_rms=is_rms, zero_centered=zero_centered)
    tol = tolerance(dtype, save)
    floor = ref.get("scale", {})
    what = (f"{strategy} {problem.key} x:{x_kind} g:{g_kind} w:{w_kind if has_weight else '-'} "
            f"b:{b_kind if has_bias else '-'}")
    assert_close(y, ref["y"], tol, f"y ({what})")
    assert_close(x.grad, ref["dx"], tol, f"dx ({what})", floor=floor.get("dx", 0.0))
    if w is not None:
        assert_close(w.grad, ref["dw"], tol, f"dw ({what})", floor=floor.get("dw", 0.0))
        assert torch.isfinite(w_leaf.grad).all() and w_leaf.grad.shape == w_leaf.shape
    if b is not None:
        assert_close(b.grad, ref["db"], tol, f"db ({what})", floor=floor.get("db", 0.0))
        assert torch.isfinite(b_leaf.grad).all() and b_leaf.grad.shape == b_leaf.shape
    if M:
        assert math.isfinite(float(x_leaf.grad.double().sum()))
