"""Numerical correctness of the forward kernel, kernel_1/kernel_2 and the public autograd API against float64.

Launcher-level tests preallocate every output and partial buffer, fill it with NaN, run, and require each element
to be written and within tolerance of a float64 autograd reference (see conftest.py). The backward launcher is fed
float64-derived saved tensors (x or the once-rounded y, fp32 rstd and mean), so it is tested independently of the
forward kernel; the public API tests then run both kernels end to end.

CPU runs go through the Triton interpreter, so CPU shapes stay small; `gpu`-marked tests repeat the checks on
real kernels and large shapes.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from normtune.kernels import BackwardConfig, Kernel2Config, Problem, kernel_1_config, layer_norm, rms_norm
from normtune.kernels import backward_launch as backward_module
from normtune.kernels import forward as forward_module
from normtune.kernels.backward_launch import TORCH_DTYPES, BackwardLaunch
from normtune.kernels.config import NUM_WARPS
from normtune.kernels.heuristics import next_power_of_two
from normtune.kernels.forward import forward
from normtune.kernels.select.select import select_config

# (norm, has_weight, has_bias, zero_centered): every combination the API accepts (rms_norm has no bias,
# zero-centering needs a weight).
FLAGS = [
    ("layer_norm", True, True, False),
    ("layer_norm", True, False, False),
    ("layer_norm", False, True, False),
    ("layer_norm", False, False, False),
    ("layer_norm", True, True, True),
    ("layer_norm", True, False, True),
    ("rms_norm", True, False, False),
    ("rms_norm", False, False, False),
    ("rms_norm", True, False, True),
]
FLAG_IDS = [f"{n[:3]}-{'w' if w else 'now'}-{'b' if b else 'nob'}{'-zc' if zc else ''}" for n, w, b, zc in FLAGS]
# (activation dtype, weight/bias dtype)
DTYPES = [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float16),
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.float32),
]
DTYPE_IDS = ["fp32", "bf16", "fp16", "bf16-w32", "fp16-w32"]
SAVES = ["input", "output"]


def _flag_dtype_cases(dtypes=tuple(zip(DTYPES, DTYPE_IDS))):
    """FLAGS x DTYPES, leaving out fp32 parameters where there is no weight and no bias (nothing to apply to)."""
    return [pytest.param(*flags, dtype, pdt, id=f"{fid}-{did}")
            for flags, fid in zip(FLAGS, FLAG_IDS) for (dtype, pdt), did in dtypes
            if dtype == pdt or flags[1] or flags[2]]


FLAG_DTYPE_CASES = _flag_dtype_cases()
DEFAULT_EPS = {"layer_norm": 1e-5, "rms_norm": 1e-6}


def small_config(N: int, dtype: torch.dtype, *, two_pass: bool, block_row: int = 2, programs_per_sm: int = 2,
                 norm: str = "layer_norm", recompute: bool = False, problem: Problem | None = None) -> BackwardConfig:
    """A small-tile config for N columns: single pass holds the whole row; two-pass walks ~4 column chunks
    (block_col < N whenever N > 1), the narrowest warp count valid for `problem` (default: `norm` on N columns,
    saving its input): fastest under the interpreter. Recovering x̂ from the output with a bias holds one more
    value per column, so a config valid for one family need not be for another."""
    block_col = max(1, next_power_of_two(N) // 4) if two_pass else next_power_of_two(N)
    k2 = Kernel2Config(block_m=4, block_n=64, num_warps=2)
    problem = problem or Problem(norm, 1, N, dtype)
    for rows in (block_row, 1):  # whole wide rows fit the register budget only one at a time
        for warps in NUM_WARPS:
            k1 = kernel_1_config(block_row=rows, block_col=block_col, num_warps=warps, programs_per_sm=programs_per_sm,
                               two_pass=two_pass, recompute=recompute)
            cfg = BackwardConfig(k1, k2)
            if cfg.is_valid(problem):
                return cfg
    raise AssertionError(f"no valid small config for N={N}")


def make_problem(norm, M, N, dtype, param_dtype, has_weight, has_bias, zero_centered, save) -> Problem:
    return Problem(norm, M, N, dtype, param_dtype if has_weight else None, has_weight, has_bias, zero_centered,
                   save)


def saved_for_backward(inputs: dict, ref: dict, *, norm: str, save: str):
    """(saved, rstd, mean) as the forward would leave them: x or y (the float64 y rounded once to x's dtype),
    fp32 rstd, and fp32 mean only for LayerNorm saving its input (an empty tensor otherwise, as ops.py passes)."""
    x = inputs["x"]
    N = x.shape[-1]
    saved = x.reshape(-1, N) if save == "input" else ref["y"].reshape(-1, N).to(x.dtype)
    rstd = ref["rstd"].reshape(-1).float()
    if norm == "layer_norm" and save == "input":
        mean = ref["mean"].reshape(-1).float()
    else:
        mean = torch.empty((0,), dtype=torch.float32, device=x.device)
    return saved, rstd, mean


def poisoned_launch(problem: Problem, config: BackwardConfig, grad2d, saved, weight, bias, rstd, mean,
                    dx=None) -> BackwardLaunch:
    launch = BackwardLaunch(problem, config, grad2d, saved, weight, bias, rstd, mean, dx=dx)
    for buf in (launch.dx, launch.dw, launch.db, launch.partial_dw, launch.partial_db):
        if buf is not None:
            buf.fill_(float("nan"))
    launch.run()
    return launch


def expected_partials(rows64: torch.Tensor, groups: int, block_row: int) -> torch.Tensor:
    """Row group g's partial row: the sum of its rows, where row tile t = row // block_row belongs to group
    t mod groups (the persistent grid-stride; a group is row_split programs sharing the row's columns)."""
    M, N = rows64.shape
    owner = (torch.arange(M, device=rows64.device) // block_row) % max(groups, 1)
    return torch.zeros((groups, N), dtype=torch.float64, device=rows64.device).index_add_(0, owner, rows64)


def check_backward(launch: BackwardLaunch, ref: dict, grad2d, tol: float, assert_close) -> None:
    p = launch.problem
    N = p.N
    scale = ref["scale"]
    assert_close(launch.dx, ref["dx"].reshape(-1, N), tol, "dx", floor=scale["dx"])
    assert_close(launch.dw, ref["dw"], tol, "dw", floor=scale["dw"])
    assert_close(launch.db, ref["db"], tol, "db", floor=scale["db"])
    if p.has_weight:
        assert launch.dw.dtype == TORCH_DTYPES[p.weight_dtype], "dw must come back in the weight's dtype"
    # Every row group's partial row was written (no NaN left) and holds exactly its rows' sums.
    g64 = grad2d.double()
    k1 = launch.config.kernel_1
    if p.has_weight and launch.partial_rows:
        want = expected_partials(g64 * ref["xhat"].reshape(-1, N), launch.partial_rows, k1.block_row)
        assert_close(launch.partial_dw, want, tol, "partial_dw", floor=scale["dw"])
    if p.has_bias and launch.partial_rows:
        assert_close(launch.partial_db, expected_partials(g64, launch.partial_rows, k1.block_row), tol,
                     "partial_db", floor=scale["db"])


def run_and_check_backward(problem, config, inputs, tolerance, assert_close, reference_norm, eps=None):
    norm = problem.norm
    eps = DEFAULT_EPS[norm] if eps is None else eps
    x, w, b, g = inputs["x"], inputs["weight"], inputs["bias"], inputs["grad"]
    ref = reference_norm(x, w, b, eps, g, is_rms=norm == "rms_norm", zero_centered=problem.zero_centered)
    saved, rstd, mean = saved_for_backward(inputs, ref, norm=norm, save=problem.save)
    g2d = g.reshape(-1, problem.N)
    launch = poisoned_launch(problem, config, g2d, saved, w, b, rstd, mean)
    check_backward(launch, ref, g2d, tolerance(x.dtype, problem.save), assert_close)
    return launch


# ---------------------------------------------------------------------------------------------------------------
# Backward launcher: every flag combination x saving mode x dtype, single pass (keeping the widened tile, or
# widening the raw tile again after the row reductions: recompute), two-pass and dual.
# ---------------------------------------------------------------------------------------------------------------
def _launcher_flag_cases():
    """Every flag combination in bf16, and every other dtype on the two common flag sets (LayerNorm with weight and
    bias, RMSNorm with weight): each (flags, mode, save) and each (dtype, mode, save) pair is run. The full flags x
    dtypes product runs through the API below (`test_api_end_to_end`), and for the forward launcher."""
    common = {("layer_norm", True, True, False), ("rms_norm", True, False, False)}
    return [case for case in FLAG_DTYPE_CASES if case.values[4] == case.values[5] == torch.bfloat16
            or tuple(case.values[:4]) in common]


@pytest.mark.parametrize("mode", ["1pass", "1pass-recompute", "2pass", "dual"])
@pytest.mark.parametrize("save", SAVES)
@pytest.mark.parametrize("norm,has_weight,has_bias,zero_centered,dtype,param_dtype", _launcher_flag_cases())
def test_backward_launcher_flags(norm, has_weight, has_bias, zero_centered, dtype, param_dtype, save, mode,
                                 device, tolerance, assert_close, reference_norm, make_norm_inputs):
    M, N = 17, 200  # 9 row tiles of 2 (the last one row) on 8 programs: one program loops over two
    inputs = make_norm_inputs((M, N), dtype, device, has_weight=has_weight, has_bias=has_bias,
                              zero_centered=zero_centered, param_dtype=param_dtype)
    problem = make_problem(norm, M, N, dtype, param_dtype, has_weight, has_bias, zero_centered, save)
    config = small_config(N, dtype, two_pass=mode == "2pass", recompute=mode == "1pass-recompute", norm=norm,
                          problem=problem)
    if mode == "2pass":
        assert config.kernel_1.block_col < N
    if mode == "dual":  # no weight and no bias: no column programs at all
        config = BackwardConfig(kernel_1_config(config.kernel_1.shared_fields(), strategy="dual"), Kernel2Config(block_m=4))
    launch = run_and_check_backward(problem, config, inputs, tolerance, assert_close, reference_norm)
    assert launch.programs > 1
    if mode == "dual":
        assert launch.partial_rows == 0 and launch.pdl is False


# ---------------------------------------------------------------------------------------------------------------
# Forward launcher.
# ---------------------------------------------------------------------------------------------------------------
def check_forward(inputs, *, norm, zero_centered, eps, tolerance, assert_close, reference_norm, y_out=None):
    x, w, b = inputs["x"], inputs["weight"], inputs["bias"]
    M, N = x.shape
    is_rms = norm == "rms_norm"
    store_mean = not is_rms
    y = y_out if y_out is not None else torch.empty_like(x)
    y.fill_(float("nan"))
    rstd = torch.full((M,), float("nan"), dtype=torch.float32, device=x.device)
    mean = torch.full((M if store_mean else 0,), float("nan"), dtype=torch.float32, device=x.device)
    y_ret, rstd_ret, mean_ret = forward(x, w, b, eps, is_rms=is_rms, zero_centered=zero_centered,
                                        store_mean=store_mean, y=y, rstd=rstd, mean=mean)
    assert y_ret.data_ptr() == y.data_ptr() and rstd_ret is rstd and mean_ret is mean, "outputs not used in place"
    ref = reference_norm(x, w, b, eps, is_rms=is_rms, zero_centered=zero_centered)
    assert_close(y, ref["y"], tolerance(x.dtype), "y")
    # rstd and mean are fp32 statistics of exactly representable inputs: fp32 accuracy whatever x's dtype.
    assert_close(rstd, ref["rstd"], tolerance(torch.float32), "rstd")
    if store_mean:
        assert_close(mean, ref["mean"], tolerance(torch.float32), "mean")


FORWARD_CASES = ([pytest.param(*case.values, 37, 200, id=f"{case.id}-37x200") for case in FLAG_DTYPE_CASES]
                 + [pytest.param(*case.values, M, N, id=f"{case.id}-{M}x{N}")
                    for case in _flag_dtype_cases(tuple(zip(DTYPES, DTYPE_IDS))[:2])
                    for M, N in [(1, 1), (0, 7), (5, 300), (9, 202), (64, 1000), (3, 10000)]])  # 10000: chunked


@pytest.mark.parametrize("norm,has_weight,has_bias,zero_centered,dtype,param_dtype,M,N", FORWARD_CASES)
def test_forward_launcher(norm, has_weight, has_bias, zero_centered, dtype, param_dtype, M, N, device, tolerance,
                          assert_close, reference_norm, make_norm_inputs):
    inputs = make_norm_inputs((M, N), dtype, device, has_weight=has_weight, has_bias=has_bias,
                              zero_centered=zero_centered, param_dtype=param_dtype)
    eps = 0.1 if N == 1 else DEFAULT_EPS[norm]
    check_forward(inputs, norm=norm, zero_centered=zero_centered, eps=eps, tolerance=tolerance,
                  assert_close=assert_close, reference_norm=reference_norm)


@pytest.mark.parametrize("width,y_width", [(264, 272), (202, 206)], ids=["hint8", "hint2"])
@pytest.mark.parametrize("norm", ["layer_norm", "rms_norm"])
def test_forward_writes_only_its_columns(norm, width, y_width, device, tolerance, assert_close, reference_norm,
                                         make_norm_inputs):
    """Strided rows in and out: x is a column slice of a wider tensor and y a slice of a NaN-filled wider buffer;
    the forward must read and write exactly the N columns of each row (with row strides that are multiples of 8,
    or of 2 only, as the kernel is told)."""
    M, N = 19, 200
    inputs = make_norm_inputs((M, width), torch.bfloat16, device, has_bias=norm == "layer_norm")
    inputs["x"] = inputs["x"][:, :N]
    inputs["weight"] = inputs["weight"][:N]
    inputs["bias"] = inputs["bias"][:N] if inputs["bias"] is not None else None
    y_buffer = torch.empty((M, y_width), dtype=torch.bfloat16, device=device)
    y_buffer.fill_(float("nan"))
    y_view = y_buffer[:, :N]
    check_forward(inputs, norm=norm, zero_centered=False, eps=1e-5, tolerance=tolerance, assert_close=assert_close,
                  reference_norm=reference_norm, y_out=y_view)
    assert torch.isnan(y_buffer[:, N:]).all(), "the forward wrote past the row's N columns"


# ---------------------------------------------------------------------------------------------------------------
# Shapes: empty, single rows and columns, widths that are not powers of two, two-pass with narrow chunks.
# ---------------------------------------------------------------------------------------------------------------
# Widths 200, 1000, 5000 are multiples of 8 (the kernels assume it: `alignment_hint`), 300 of 4, 202 of 2 only.
# 19 x 1000: several row tiles of a wide, non-power-of-two row (the interpreter's cost grows with the rows). More
# row tiles of 200 columns than programs are test_backward_launcher_flags' shape (17 x 200): its cases hold these
# tests' LayerNorm and RMSNorm in both dtypes, both saves, single pass, two-pass and dual.
SHAPES = [(0, 200), (1, 200), (1, 1), (6, 1), (7, 3), (5, 300), (9, 202), (19, 1000), (3, 5000)]


@pytest.mark.parametrize("two_pass", [False, True], ids=["1pass", "2pass"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("save", SAVES)
@pytest.mark.parametrize("norm", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("M,N", SHAPES, ids=[f"{m}x{n}" for m, n in SHAPES])
def test_backward_launcher_shapes(M, N, norm, save, dtype, two_pass, device, tolerance, assert_close,
                                  reference_norm, make_norm_inputs):
    has_bias = norm == "layer_norm"
    inputs = make_norm_inputs((M, N), dtype, device, has_bias=has_bias)
    problem = make_problem(norm, M, N, dtype, dtype, True, has_bias, False, save)
    config = small_config(N, dtype, two_pass=two_pass, norm=norm, problem=problem)
    if two_pass and N > 1:
        assert config.kernel_1.block_col < N
    # With N = 1, RMSNorm's dx = r·w·g·(1 − x̂²) = r·w·g·eps/(x² + eps): a cancellation that fp32 (or x̂ recovered
    # from a rounded y) resolves only when eps is not tiny next to x²; LayerNorm's dx is exactly 0. eps = 1 keeps
    # 1 − x̂² of order one, so the relative comparison stays meaningful.
    eps = 1.0 if N == 1 else None
    launch = run_and_check_backward(problem, config, inputs, tolerance, assert_close, reference_norm, eps=eps)
    if M == 0:
        assert launch.programs == 0 and launch.dx.shape == (0, N)
        assert bool((launch.dw == 0).all()), "the sum over no rows is zero"


@pytest.mark.parametrize("save", SAVES)
@pytest.mark.parametrize("norm", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("M,N", SHAPES[:-1], ids=[f"{m}x{n}" for m, n in SHAPES[:-1]])
def test_dual_strategy_shapes(M, N, norm, save, device, tolerance, assert_close, reference_norm, make_norm_inputs):
    """The dual strategy (row programs write dx, column programs dw/db, one launch) on the same odd shapes."""
    has_bias = norm == "layer_norm"
    dtype = torch.bfloat16
    inputs = make_norm_inputs((M, N), dtype, device, has_bias=has_bias)
    problem = make_problem(norm, M, N, dtype, dtype, True, has_bias, False, save)
    rows = small_config(N, dtype, two_pass=False, norm=norm, problem=problem)
    config = BackwardConfig(kernel_1_config(rows.kernel_1.shared_fields(), strategy="dual"), Kernel2Config(block_m=4, block_n=64))
    config.validate(problem)
    launch = run_and_check_backward(problem, config, inputs, tolerance, assert_close, reference_norm,
                                    eps=1.0 if N == 1 else None)
    assert launch.partial_rows == 0 and launch.pdl is False
    if M == 0:
        assert launch.programs == 0 and bool((launch.dw == 0).all())


# (columns past N in the inputs' rows, in dx's rows; the multiple of N and the three strides the kernels assume)
STRIDED = [(56, 24, 8), (4, 24, 4), (2, 6, 2), (56, 1, 1)]


@pytest.mark.parametrize("extra,dx_extra,hint", STRIDED, ids=[f"hint{h}-{e}-{d}" for e, d, h in STRIDED])
@pytest.mark.parametrize("norm", ["layer_norm", "rms_norm"])
def test_backward_launcher_strided_rows_and_output_view(norm, extra, dx_extra, hint, device, tolerance, assert_close,
                                                        reference_norm, make_norm_inputs):
    """grad and the saved x are column slices of wider tensors (row stride > N), and dx is written into a slice
    of a NaN-filled wider buffer: the kernels (single pass, two-pass, dual) use each tensor's row stride and never
    touch columns past N; the multiple they assume of the strides is the one the strides have, not N's."""
    M, N = 17, 200
    has_bias = norm == "layer_norm"
    wide = make_norm_inputs((M, N + extra), torch.float32, device, has_bias=has_bias)
    shift = min(8, extra)  # grad starts a few columns into its wider rows
    inputs = {"x": wide["x"][:, :N], "grad": wide["grad"][:, shift:N + shift], "weight": wide["weight"][:N],
              "bias": wide["bias"][:N] if has_bias else None}
    problem = make_problem(norm, M, N, torch.float32, torch.float32, True, has_bias, False, "input")
    ref = reference_norm(inputs["x"], inputs["weight"], inputs["bias"], 1e-5, inputs["grad"],
                         is_rms=norm == "rms_norm")
    saved, rstd, mean = saved_for_backward(inputs, ref, norm=norm, save="input")
    assert saved.stride(0) == N + extra and inputs["grad"].stride(0) == N + extra
    single = small_config(N, torch.float32, two_pass=False)
    dual = BackwardConfig(kernel_1_config(single.kernel_1.shared_fields(), strategy="dual"), Kernel2Config(block_m=4))
    for config in (single, small_config(N, torch.float32, two_pass=True), dual):
        dx_buffer = torch.full((M, N + dx_extra), float("nan"), dtype=torch.float32, device=device)
        launch = poisoned_launch(problem, config, inputs["grad"], saved,
                                 inputs["weight"], inputs["bias"], rstd, mean, dx=dx_buffer[:, :N])
        assert launch.plan.k1_kwargs["HINT"] == hint
        check_backward(launch, ref, inputs["grad"], tolerance(torch.float32), assert_close)
        assert torch.isnan(dx_buffer[:, N:]).all(), "kernel_1 wrote past the row's N columns"


@pytest.mark.parametrize("norm,dtype", [("layer_norm", torch.bfloat16), ("rms_norm", torch.float32)],
                         ids=["layer_norm-bf16", "rms_norm-fp32"])
def test_wide_row_65536_two_pass(norm, dtype, device, tolerance, assert_close, reference_norm, make_norm_inputs):
    """The widest rows the seed shapes need (65536 columns) through the chunked forward and two-pass kernel_1."""
    M, N = 2, 65536
    has_bias = norm == "layer_norm"
    inputs = make_norm_inputs((M, N), dtype, device, has_bias=has_bias)
    check_forward(inputs, norm=norm, zero_centered=False, eps=1e-5, tolerance=tolerance, assert_close=assert_close,
                  reference_norm=reference_norm)
    config = BackwardConfig(kernel_1_config(block_row=1, block_col=4096, num_warps=4, two_pass=True),
                            Kernel2Config(block_m=4, block_n=1024, num_warps=4))
    for save in SAVES:
        problem = make_problem(norm, M, N, dtype, dtype, True, has_bias, False, save)
        run_and_check_backward(problem, config, inputs, tolerance, assert_close, reference_norm, eps=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# Public autograd API end to end (forward kernel + backward kernels), default config selection.
# ---------------------------------------------------------------------------------------------------------------
def api_call(norm, x, w, b, eps, **kwargs):
    if norm == "layer_norm":
        return layer_norm(x, w, b, eps, **kwargs)
    assert b is None
    return rms_norm(x, w, eps, **kwargs)


def check_api(norm, inputs, *, zero_centered=False, save="input", eps=None, tolerance, assert_close,
              reference_norm, config=None):
    eps = DEFAULT_EPS[norm] if eps is None else eps
    x = inputs["x"].detach().requires_grad_()
    w = inputs["weight"].detach().requires_grad_() if inputs["weight"] is not None else None
    b = inputs["bias"].detach().requires_grad_() if inputs["bias"] is not None else None
    y = api_call(norm, x, w, b, eps, zero_centered=zero_centered, save=save, config=config)
    y.backward(inputs["grad"])
    ref = reference_norm(inputs["x"], inputs["weight"], inputs["bias"], eps, inputs["grad"],
                         is_rms=norm == "rms_norm", zero_centered=zero_centered)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert_close(y, ref["y"], tolerance(x.dtype), "y")
    tol = tolerance(x.dtype, save)
    scale = ref["scale"]
    assert_close(x.grad, ref["dx"], tol, "x.grad", floor=scale["dx"])
    assert_close(w.grad if w is not None else None, ref["dw"], tol, "weight.grad", floor=scale["dw"])
    assert_close(b.grad if b is not None else None, ref["db"], tol, "bias.grad", floor=scale["db"])
    if w is not None:
        assert w.grad.dtype == w.dtype


@pytest.mark.parametrize("save", SAVES)
@pytest.mark.parametrize("norm,has_weight,has_bias,zero_centered,dtype,param_dtype", FLAG_DTYPE_CASES)
def test_api_end_to_end(norm, has_weight, has_bias, zero_centered, dtype, param_dtype, save, device, tolerance,
                        assert_close, reference_norm, make_norm_inputs):
    # 3-D input: leading dims flatten into 2 x 9 = 18 rows.
    inputs = make_norm_inputs((2, 9, 200), dtype, device, has_weight=has_weight, has_bias=has_bias,
                              zero_centered=zero_centered, param_dtype=param_dtype)
    check_api(norm, inputs, zero_centered=zero_centered, save=save, tolerance=tolerance, assert_close=assert_close,
              reference_norm=reference_norm)


@pytest.mark.parametrize("shape", [(0, 64), (1, 1), (3, 1, 5), (4, 1000), (2, 3, 4, 40)],
                         ids=["0x64", "1x1", "3x1x5", "4x1000", "2x3x4x40"])
@pytest.mark.parametrize("norm", ["layer_norm", "rms_norm"])
def test_api_shapes(shape, norm, device, tolerance, assert_close, reference_norm, make_norm_inputs):
    inputs = make_norm_inputs(shape, torch.float32, device, has_bias=norm == "layer_norm")
    check_api(norm, inputs, eps=0.1 if shape[-1] == 1 else None, tolerance=tolerance, assert_close=assert_close,
              reference_norm=reference_norm)


@pytest.mark.parametrize("norm", ["layer_norm", "rms_norm"])
def test_api_strided_rows_read_in_place(norm, device, tolerance, assert_close, reference_norm, make_norm_inputs,
                                        monkeypatch):
    """x and grad are column slices x[..., :N] of wider tensors: correct results, and the kernels receive the
    original storage with its row stride (no copy for strided rows)."""
    B, T, N, width = 3, 5, 200, 264
    has_bias = norm == "layer_norm"
    wide = make_norm_inputs((B, T, width), torch.float32, device, has_bias=has_bias)
    x_wide = wide["x"].detach().requires_grad_()
    grad_wide = wide["grad"]
    x, grad = x_wide[..., :N], grad_wide[..., :N]
    w = wide["weight"][:N].detach().requires_grad_()
    b = wide["bias"][:N].detach().requires_grad_() if has_bias else None

    seen = {}
    real_forward, real_launch = forward_module.forward, backward_module.BackwardLaunch

    def spy_forward(x2d, *args, **kwargs):
        seen["x"] = (x2d.data_ptr(), x2d.stride(0))
        return real_forward(x2d, *args, **kwargs)

    class SpyLaunch(real_launch):
        def __init__(self, problem, config, grad2d, saved, *args, **kwargs):
            seen["grad"] = (grad2d.data_ptr(), grad2d.stride(0))
            seen["saved"] = (saved.data_ptr(), saved.stride(0))
            super().__init__(problem, config, grad2d, saved, *args, **kwargs)

    monkeypatch.setattr(forward_module, "forward", spy_forward)
    monkeypatch.setattr(backward_module, "BackwardLaunch", SpyLaunch)
    y = api_call(norm, x, w, b, 1e-5)
    y.backward(grad)

    assert seen["x"] == (x_wide.data_ptr(), width), "strided rows of x were copied before the forward"
    assert seen["saved"] == (x_wide.data_ptr(), width), "strided rows of x were copied before the backward"
    assert seen["grad"] == (grad_wide.data_ptr(), width), "strided rows of grad were copied before the backward"
    ref = reference_norm(x, w, b, 1e-5, grad, is_rms=norm == "rms_norm")
    tol = tolerance(torch.float32)
    assert_close(y, ref["y"], tol, "y")
    assert_close(x_wide.grad[..., :N], ref["dx"], tol, "x.grad")
    assert bool((x_wide.grad[..., N:] == 0).all()), "gradient leaked into the columns outside the slice"
    assert_close(w.grad, ref["dw"], tol, "weight.grad")
    assert_close(b.grad if b is not None else None, ref["db"], tol, "bias.grad")


@pytest.mark.parametrize("save", SAVES)
@pytest.mark.parametrize("norm", ["layer_norm", "rms_norm"])
def test_api_noncontiguous_last_dim(norm, save, device, tolerance, assert_close, reference_norm, make_norm_inputs):
    """x and grad whose last dimension has stride != 1 (a transpose) are copied, and the result is still right."""
    has_bias = norm == "layer_norm"
    base = make_norm_inputs((2, 200, 13), torch.bfloat16, device, has_bias=False)
    inputs = make_norm_inputs((200,), torch.bfloat16, device, has_bias=has_bias)
    inputs["x"] = base["x"].transpose(-1, -2)  # (2, 13, 200), last-dim stride 13
    inputs["grad"] = base["grad"].transpose(-1, -2)
    assert inputs["x"].stride(-1) != 1 and inputs["grad"].stride(-1) != 1
    check_api(norm, inputs, save=save, tolerance=tolerance, assert_close=assert_close, reference_norm=reference_norm)


def test_api_explicit_two_pass_config(device, tolerance, assert_close, reference_norm, make_norm_inputs):
    inputs = make_norm_inputs((11, 1000), torch.bfloat16, device, has_bias=True, zero_centered=True)
    config = small_config(1000, torch.bfloat16, two_pass=True)
    check_api("layer_norm", inputs, zero_centered=True, save="output", tolerance=tolerance,
              assert_close=assert_close, reference_norm=reference_norm, config=config)


# ---------------------------------------------------------------------------------------------------------------
# GPU: real kernels on large shapes (run on an H100 in CI).
# ---------------------------------------------------------------------------------------------------------------
SEED_SHAPES = [
    (32768, 1024), (16384, 2048), (8192, 4096), (4096, 8192), (2048, 16384),
    (16384, 1024), (8192, 2048), (4096, 4096), (2048, 8192), (1024, 16384),
    (8192, 1024), (4096, 2048), (2048, 4096), (1024, 8192), (512, 16384),
]


def free_gpu_bytes() -> int:
    free, _total = torch.cuda.mem_get_info()
    return free


def check_launch_large(norm, M, N, dtype, save, config, tolerance, assert_close, reference_norm, make_norm_inputs,
                       param_dtype=None):
    has_bias = norm == "layer_norm"
    inputs = make_norm_inputs((M, N), dtype, "cuda", has_bias=has_bias, param_dtype=param_dtype)
    problem = make_problem(norm, M, N, dtype, param_dtype or dtype, True, has_bias, False, save)
    config = config or select_config(problem, torch.cuda.get_device_name())
    run_and_check_backward(problem, config, inputs, tolerance, assert_close, reference_norm)


@pytest.mark.gpu
@pytest.mark.parametrize("norm", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("M,N", SEED_SHAPES, ids=[f"{m}x{n}" for m, n in SEED_SHAPES])
def test_gpu_seed_shapes_default_config(M, N, norm, tolerance, assert_close, reference_norm, make_norm_inputs):
    check_launch_large(norm, M, N, torch.bfloat16, "input", None, tolerance, assert_close, reference_norm,
                       make_norm_inputs)


@pytest.mark.gpu
@pytest.mark.parametrize("save", SAVES)
@pytest.mark.parametrize("dtype,param_dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("norm", ["layer_norm", "rms_norm"])
def test_gpu_4096x16384(norm, dtype, param_dtype, save, tolerance, assert_close, reference_norm, make_norm_inputs):
    check_launch_large(norm, 4096, 16384, dtype, save, None, tolerance, assert_close, reference_norm,
                       make_norm_inputs, param_dtype=param_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("norm", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("M", [1, 7, 512])
def test_gpu_65536_columns(M, norm, tolerance, assert_close, reference_norm, make_norm_inputs):
    check_launch_large(norm, M, 65536, torch.bfloat16, "input", None, tolerance, assert_close, reference_norm,
                       make_norm_inputs)
    inputs = make_norm_inputs((M, 65536), torch.bfloat16, "cuda", has_bias=norm == "layer_norm")
    check_api(norm, inputs, tolerance=tolerance, assert_close=assert_close, reference_norm=reference_norm)


@pytest.mark.gpu
@pytest.mark.parametrize("norm", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("dtype,param_dtype", DTYPES, ids=DTYPE_IDS)
def test_gpu_api_large(norm, dtype, param_dtype, tolerance, assert_close, reference_norm, make_norm_inputs):
    inputs = make_norm_inputs((8, 512, 4000), dtype, "cuda", has_bias=norm == "layer_norm", param_dtype=param_dtype)
    check_api(norm, inputs, tolerance=tolerance, assert_close=assert_close, reference_norm=reference_norm)


@pytest.mark.gpu
@pytest.mark.parametrize("norm", ["layer_norm", "rms_norm"])
def test_gpu_int64_offsets(norm, tolerance, assert_close, reference_norm):
    """M·N > 2³¹ elements: row offsets past the int32 range (rows ≥ 32768 of 65536 columns). Forward and backward
    are checked in float64 chunks of rows (a whole float64 reference would not fit), dw/db over all rows."""
    M, N, dtype = 32768 + 256, 65536, torch.bfloat16
    tensor_bytes = M * N * 2
    if free_gpu_bytes() < 5 * tensor_bytes:  # x, grad, y, dx, and float64 chunks of the reference
        pytest.skip(f"needs ~{5 * tensor_bytes / 2**30:.0f} GiB of free GPU memory")
    is_rms, has_bias = norm == "rms_norm", norm == "layer_norm"
    torch.cuda.empty_cache()
    gen = torch.Generator(device="cuda").manual_seed(1234)
    x = torch.empty((M, N), dtype=dtype, device="cuda")
    grad = torch.empty_like(x)
    for t in (x, grad):  # fill in row chunks to keep the fp32 temporaries small
        for r0 in range(0, M, 4096):
            t[r0:r0 + 4096] = torch.randn((min(4096, M - r0), N), generator=gen, device="cuda") + 0.5
    weight = (1 + 0.1 * torch.randn(N, generator=gen, device="cuda")).to(dtype)
    bias = (0.1 * torch.randn(N, generator=gen, device="cuda")).to(dtype) if has_bias else None
    y = torch.full_like(x, float("nan"))
    y, rstd, mean = forward(x, weight, bias, 1e-5, is_rms=is_rms, zero_centered=False, store_mean=has_bias, y=y)
    problem = Problem(norm, M, N, dtype, has_bias=has_bias)
    launch = BackwardLaunch(problem, select_config(problem, torch.cuda.get_device_name()), grad, x, weight, bias,
                            rstd, mean)
    assert (M - 1) * N >= 2**31, "the last rows must start past the int32 range"
    launch.dx.fill_(float("nan"))
    dx, dw, db = launch.run()
    dw_ref = torch.zeros(N, dtype=torch.float64, device="cuda")
    db_ref = torch.zeros(N, dtype=torch.float64, device="cuda")
    tol = tolerance(dtype)
    for r0 in range(0, M, 1024):
        rows = slice(r0, min(M, r0 + 1024))
        ref = reference_norm(x[rows], weight, bias, 1e-5, grad[rows], is_rms=is_rms)
        assert_close(y[rows], ref["y"], tol, f"y rows {r0}..")
        assert_close(rstd[rows], ref["rstd"], tolerance(torch.float32), f"rstd rows {r0}..")
        assert_close(dx[rows], ref["dx"], tol, f"dx rows {r0}..")
        dw_ref += ref["dw"]
        if has_bias:
            db_ref += ref["db"]
    assert_close(dw, dw_ref, tol, "dw")
    assert_close(db, db_ref if has_bias else None, tol, "db")
