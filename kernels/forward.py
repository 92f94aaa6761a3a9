"""Forward kernel: LayerNorm / RMSNorm over the last dimension, saving what the backward needs.

Math (per row of N columns, fp32): LayerNorm μ = mean(x), r = (mean((x-μ)²) + eps)^-½, x̂ = (x-μ)·r;
RMSNorm r = (mean(x²) + eps)^-½, x̂ = x·r. y = w·x̂ + b with w = 1 + w' when zero-centered.
Saved for the backward: r (fp32) and, for LayerNorm saving from the input, μ (fp32).

Residual form (HAS_RESIDUAL): the row normalized is h = x + residual, added in fp32 and written (in H's dtype:
the residual stream's, which may be fp32 with 16-bit x) before it is normalized; the norm reads h as stored, so y
is exactly the norm of the h returned, as an add followed by the norm would give. 4 passes of M×N (x, residual
read; h, y written) instead of an add's 3 and the norm's 2.

Gated form (HAS_GATE, RMSNorm): a = act(z) (silu, or sigmoid with GATE_SIGMOID), in fp32. After the gate
(GATE_AFTER) the row normalized is x·a, never rounded; before it, y = w·x̂·a. One pass of x and z read, y written.

The forward is not what normtune tunes; it uses one analytic launch: a block of rows per program, the whole row
in registers up to 8192 columns, chunked passes beyond (mean, then variance around the mean, then the output,
so that a large mean never cancels catastrophically). Rows whose values pass 2^50 are scaled by 1/max|x| before
squaring, so that Σ(x−μ)² cannot overflow fp32 (bf16 holds values up to 3e38): such rows normalize exactly
instead of collapsing to y = b. A row holding ±inf or NaN is not scaled (1/inf would make inf·0 = NaN of every
column): its Σx² is inf (r = 0) or NaN, so that y is NaN or inf exactly where the formula in fp32 gives it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

import functools

from .backward.common import assume_multiple, effective_weight, gate_activation
from .heuristics import alignment_hint, cdiv, needs_int64, next_power_of_two
from .launcher import Launcher, data_ptr

SINGLE_PASS_MAX_COLS = 8192
CHUNK_COLS = 4096
# Past this magnitude a row is scaled before squaring (2^50 squared, times up to 2^18 columns, stays in fp32).
LARGE: tl.constexpr = tl.constexpr(2.0 ** 50)
FP32_MAX: tl.constexpr = tl.constexpr(3.4028234663852886e38)


@triton.jit
def _square_scale(amax, SPREAD: tl.constexpr):
    """1/(SPREAD·max|x|) for rows whose squares could overflow (SPREAD·max|x| bounds the values squared), else 1;
    also 1 where max|x| is ±inf or NaN, whose row is not finite to scale (1/inf·inf would be NaN). A select on
    the row's scale: nothing per element."""
    return tl.where((amax > LARGE) & (amax <= FP32_MAX), (1.0 / SPREAD) / tl.maximum(amax, 1.0), 1.0)


@triton.jit
def _rstd(sum_sq_scaled, scale, N, eps):
    """(mean(x²) + eps)^-½ from Σ(x·scale)²: rsqrt(Σ(x·s)²/N + eps·s²)·s (eps·s² underflows harmlessly)."""
    return tl.rsqrt(sum_sq_scaled / N + eps * scale * scale) * scale


@triton.jit
def _load_input(x_rows, r_rows, h_rows, cols, mask, HAS_RESIDUAL: tl.constexpr):
    """fp32 row values to normalize at `cols`: x, or (HAS_RESIDUAL) h = x + residual, written to h's rows in
    their dtype and widened back from that, so that the norm is of the h returned."""
    x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        h = (x + tl.load(r_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)).to(h_rows.dtype.element_ty)
        tl.store(h_rows + cols[None, :], h, mask=mask)
        x = h.to(tl.float32)
    return x


@triton.jit
def _gate(x, z_rows, cols, mask, HAS_GATE: tl.constexpr, GATE_AFTER: tl.constexpr, SIGMOID: tl.constexpr):
    """(the row to normalize, a): x·a after the gate, else x; a = act(z) at `cols` (HAS_GATE; else x, unused)."""
    if HAS_GATE:
        a, _ = gate_activation(tl.load(z_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32), SIGMOID)
        if GATE_AFTER:
            x = x * a
    else:
        a = x
    return x, a


@triton.jit
def _forward_kernel(
    X, stride_x,  # input rows; stride_x: elements between consecutive rows
    Y, stride_y,  # output rows
    R, stride_r,  # residual rows (HAS_RESIDUAL; else never read)
    H, stride_h,  # h = x + residual rows, in the residual stream's dtype (HAS_RESIDUAL; else never written)
    Z, stride_z,  # gate rows (HAS_GATE; else never read)
    W, B,  # weight and bias, N elements each (ignored when absent)
    RSTD, MEAN,  # per-row fp32 r and μ (MEAN written only when STORE_MEAN)
    M, N, eps,
    IS_RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, ZERO_CENTERED: tl.constexpr,
    STORE_MEAN: tl.constexpr,
    BLOCK_ROW: tl.constexpr, BLOCK_COL: tl.constexpr, SINGLE_PASS: tl.constexpr, INT64: tl.constexpr,
    HINT: tl.constexpr = 1,  # N and the row strides are multiples of this (`assume_multiple`)
    HAS_RESIDUAL: tl.constexpr = False,
    HAS_GATE: tl.constexpr = False, GATE_AFTER: tl.constexpr = False, GATE_SIGMOID: tl.constexpr = False,
):
    N, stride_x, stride_y = assume_multiple(N, HINT), assume_multiple(stride_x, HINT), assume_multiple(stride_y, HINT)
    stride_r, stride_h = assume_multiple(stride_r, HINT), assume_multiple(stride_h, HINT)
    stride_z = assume_multiple(stride_z, HINT)
    pid = tl.program_id(0)
    if HAS_GATE:  # a grouped call: N is the group's width, the grid holds each group's row programs in turn
        row_programs = tl.cdiv(M, BLOCK_ROW)
        group = pid // row_programs
        pid = pid - group * row_programs
        if INT64:
            group = group.to(tl.int64)
        X += group * N
        Y += group * N
        Z += group * N
        W += group * N
        RSTD += group * M
    rows = pid * BLOCK_ROW + tl.arange(0, BLOCK_ROW)
    row_mask = rows < M
    if INT64:
        rows_off = rows.to(tl.int64)
    else:
        rows_off = rows
    x_rows = X + rows_off[:, None] * stride_x
    y_rows = Y + rows_off[:, None] * stride_y
    r_rows = R + rows_off[:, None] * stride_r
    h_rows = H + rows_off[:, None] * stride_h
    z_rows = Z + rows_off[:, None] * stride_z
    if SINGLE_PASS:
        cols = tl.arange(0, BLOCK_COL)
        col_mask = cols < N
        mask = row_mask[:, None] & col_mask[None, :]
        x = _load_input(x_rows, r_rows, h_rows, cols, mask, HAS_RESIDUAL)
        x, a = _gate(x, z_rows, cols, mask, HAS_GATE, GATE_AFTER, GATE_SIGMOID)
        if IS_RMS:
            mean = tl.zeros((BLOCK_ROW,), tl.float32)
            xc = x
        else:
            mean = tl.sum(x, axis=1) / N
            xc = tl.where(mask, x - mean[:, None], 0.0)
        scale = _square_scale(tl.max(tl.abs(xc), axis=1), 1.0)
        xs = xc * scale[:, None]
        rstd = _rstd(tl.sum(xs * xs, axis=1), scale, N, eps)
        w = effective_weight(W, cols, col_mask, HAS_WEIGHT, ZERO_CENTERED)
        y = xc * rstd[:, None] * w[None, :]
        if HAS_GATE and not GATE_AFTER:
            y = y * a
        if HAS_BIAS:
            y += tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(y_rows + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    else:
        chunk = tl.arange(0, BLOCK_COL)
        mean = tl.zeros((BLOCK_ROW,), tl.float32)
        # Pass 1: the mean (LayerNorm) and max|x|, which bounds |x − μ| by 2·max|x|. With a residual it writes h,
        # which the later passes read instead of x, after a barrier (another thread may read what one wrote).
        acc = tl.zeros((BLOCK_ROW, BLOCK_COL), tl.float32)
        amax = tl.zeros((BLOCK_ROW, BLOCK_COL), tl.float32)
        for c0 in range(0, N, BLOCK_COL):
            cols = c0 + chunk
            mask = row_mask[:, None] & (cols < N)[None, :]
            x = _load_input(x_rows, r_rows, h_rows, cols, mask, HAS_RESIDUAL)
            x, a = _gate(x, z_rows, cols, mask, HAS_GATE, GATE_AFTER, GATE_SIGMOID)
            acc += x
            amax = tl.maximum(amax, tl.abs(x))
        if not IS_RMS:
            mean = tl.sum(acc, axis=1) / N
        scale = _square_scale(tl.max(amax, axis=1), 2.0)
        if HAS_RESIDUAL:
            tl.debug_barrier()
            x_rows = h_rows
        acc = tl.zeros((BLOCK_ROW, BLOCK_COL), tl.float32)
        for c0 in range(0, N, BLOCK_COL):
            cols = c0 + chunk
            mask = row_mask[:, None] & (cols < N)[None, :]
            x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            x, a = _gate(x, z_rows, cols, mask, HAS_GATE, GATE_AFTER, GATE_SIGMOID)
            xs = tl.where(mask, x - mean[:, None], 0.0) * scale[:, None]
            acc += xs * xs
        rstd = _rstd(tl.sum(acc, axis=1), scale, N, eps)
        for c0 in range(0, N, BLOCK_COL):
            cols = c0 + chunk
            col_mask = cols < N
            mask = row_mask[:, None] & col_mask[None, :]
            x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            x, a = _gate(x, z_rows, cols, mask, HAS_GATE, GATE_AFTER, GATE_SIGMOID)
            w = effective_weight(W, cols, col_mask, HAS_WEIGHT, ZERO_CENTERED)
            y = (x - mean[:, None]) * rstd[:, None] * w[None, :]
            if HAS_GATE and not GATE_AFTER:
                y = y * a
            if HAS_BIAS:
                y += tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
            tl.store(y_rows + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + rows, rstd, mask=row_mask)
    if STORE_MEAN:
        tl.store(MEAN + rows, mean, mask=row_mask)


def forward_launch_params(N: int) -> tuple[int, int, bool, int]:
    """(block_row, block_col, single_pass, num_warps) for the forward."""
    n_pow2 = next_power_of_two(N)
    if n_pow2 <= SINGLE_PASS_MAX_COLS:
        block_col = n_pow2
        block_row = max(1, min(16, 4096 // block_col))
        single = True
    else:
        block_col, block_row, single = CHUNK_COLS, 1, False
    num_warps = max(1, min(16, block_row * block_col // 256))
    return block_row, block_col, single, num_warps


# Launcher and grid of a forward whose outputs are allocated here, by its launcher key: (rows, width, row stride,
# the dtypes of x, weight and bias, which of weight/bias are absent, flags, the 16-byte alignment of x, weight and
# bias). Every such call would otherwise derive them again (offset width, alignment hint, launcher).
_CALLS: dict[tuple, tuple] = {}
MAX_CALLS = 4096


def forward(x2d: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float, *,
            is_rms: bool, zero_centered: bool, store_mean: bool, y: torch.Tensor | None = None,
            rstd: torch.Tensor | None = None, mean: torch.Tensor | None = None):
    """Run the forward on a 2-D view (rows may be strided, last dim contiguous). Returns (y, rstd, mean);
    `mean` is None unless `store_mean` (or passed in). y/rstd/mean may be passed in (e.g. poisoned, by tests)."""
    M, N = x2d.shape
    device = x2d.device
    given = y is not None or rstd is not None or mean is not None
    if y is None:
        y = torch.empty(M, N, dtype=x2d.dtype, device=device)
    if rstd is None:
        rstd = torch.empty(M, dtype=torch.float32, device=device)
    if mean is None and store_mean:
        mean = torch.empty(M, dtype=torch.float32, device=device)
    if M == 0:
        return y, rstd, mean
    x_stride = x2d.stride(0)
    y_stride = y.stride(0) if given else N
    w = rstd if weight is None else weight  # placeholder pointers for absent tensors: never dereferenced
    b = rstd if bias is None else bias
    mu = mean if store_mean else rstd
    key = launch_key(x2d, x_stride, w, b, weight is None, bias is None, is_rms, zero_centered, store_mean)
    if given:
        key += (y_stride, data_ptr(y) & 15, data_ptr(rstd) & 15, data_ptr(mu) & 15)
    launch, grid = planned(key, M, N, x_stride, y_stride, weight is not None, bias is not None, is_rms,
                            zero_centered, store_mean)
    launch(grid, (x2d, x_stride, y, y_stride, x2d, x_stride, y, y_stride, x2d, x_stride, w, b, rstd, mu, M, N, eps),
           key)
    return y, rstd, mean


def forward_residual(x2d: torch.Tensor, residual2d: torch.Tensor, weight: torch.Tensor | None,
                     bias: torch.Tensor | None, eps: float, *, h_dtype: torch.dtype, is_rms: bool,
                     zero_centered: bool, store_mean: bool, y: torch.Tensor | None = None,
                     h: torch.Tensor | None = None, rstd: torch.Tensor | None = None,
                     mean: torch.Tensor | None = None):
    """The residual form on 2-D views of equal shape (rows may be strided, last dims contiguous): h = x + residual
    in `h_dtype`, y = norm(h). Returns (y, h, rstd, mean), as `forward` (outputs may be passed in)."""
    M, N = x2d.shape
    device = x2d.device
    if y is None:
        y = torch.empty(M, N, dtype=x2d.dtype, device=device)
    if h is None:
        h = torch.empty(M, N, dtype=h_dtype, device=device)
    if rstd is None:
        rstd = torch.empty(M, dtype=torch.float32, device=device)
    if mean is None and store_mean:
        mean = torch.empty(M, dtype=torch.float32, device=device)
    if M == 0:
        return y, h, rstd, mean
    strides = (x2d.stride(0), y.stride(0), residual2d.stride(0), h.stride(0))
    w = rstd if weight is None else weight  # placeholder pointers for absent tensors: never dereferenced
    b = rstd if bias is None else bias
    mu = mean if store_mean else rstd
    key = launch_key(x2d, strides[0], w, b, weight is None, bias is None, is_rms, zero_centered, store_mean)
    key += (strides, residual2d.dtype, h.dtype) + tuple(data_ptr(t) & 15 for t in (y, residual2d, h, rstd, mu))
    launch, grid = planned(key, M, N, strides[0], strides[1], weight is not None, bias is not None, is_rms,
                            zero_centered, store_mean, strides[2:])
    launch(grid, (x2d, strides[0], y, strides[1], residual2d, strides[2], h, strides[3], x2d, strides[0], w, b, rstd,
                  mu, M, N, eps), key)
    return y, h, rstd, mean


def forward_gated(x2d: torch.Tensor, z2d: torch.Tensor, weight: torch.Tensor | None, eps: float, *, gate_after: bool,
                  sigmoid: bool, zero_centered: bool, y: torch.Tensor | None = None,
                  rstd: torch.Tensor | None = None, groups: int = 1):
    """The gated RMSNorm on 2-D views of equal shape (rows may be strided, last dims contiguous): y = w·x̂·act(z)
    (gate before) or y = w·norm(x·act(z)) (`gate_after`), act = silu or sigmoid, with statistics per group of
    N / `groups` columns, every group in one launch. Returns (y, rstd): rstd holds the groups' rows one group after
    another (groups × M); y and rstd may be passed in."""
    M, N = x2d.shape
    device = x2d.device
    if y is None:
        y = torch.empty(M, N, dtype=x2d.dtype, device=device)
    if rstd is None:
        rstd = torch.empty(groups * M, dtype=torch.float32, device=device)
    if M == 0:
        return y, rstd
    width = N // groups
    strides = (x2d.stride(0), y.stride(0), z2d.stride(0))
    w = rstd if weight is None else weight  # placeholder pointer for an absent weight: never dereferenced
    key = launch_key(x2d, strides[0], w, rstd, weight is None, True, True, zero_centered, False)
    key += ("gate", gate_after, sigmoid, strides, z2d.dtype, groups) + tuple(data_ptr(t) & 15 for t in (y, z2d, rstd))
    launch, grid = planned(key, M, width, strides[0], strides[1], weight is not None, False, True, zero_centered,
                           False, (), (gate_after, sigmoid, strides[2]), groups)
    launch(grid, (x2d, strides[0], y, strides[1], x2d, strides[0], y, strides[1], z2d, strides[2], w, rstd, rstd,
                  rstd, M, width, eps), key)
    return y, rstd


def launch_key(x2d, x_stride, w, b, no_weight, no_bias, is_rms, zero_centered, store_mean) -> tuple:
    """The launcher key of a forward on x2d whose outputs are allocated here (Triton specializes on dtypes and
    16-byte alignment: buffers allocated here are aligned, y is contiguous)."""
    M, N = x2d.shape
    return (M, N, x_stride, x2d.dtype, w.dtype, b.dtype, no_weight, no_bias, is_rms, zero_centered, store_mean,
            data_ptr(x2d) & 15, data_ptr(w) & 15, data_ptr(b) & 15)


def planned(key: tuple, M: int, N: int, x_stride: int, y_stride: int, has_weight: bool, has_bias: bool,
             is_rms: bool, zero_centered: bool, store_mean: bool, residual_strides: tuple = (),
             gate: tuple | None = None, groups: int = 1) -> tuple:
    """(launcher, grid) of a launcher key, derived once. `residual_strides`: the residual's and h's row strides
    (the residual form; empty without one). `gate`: (gate after the norm's input, sigmoid, z's row stride) of the
    gated form (None without one)."""
    planned = _CALLS.get(key)
    if planned is None:
        if len(_CALLS) >= MAX_CALLS:  # e.g. a new row count every step: start over rather than grow
            _CALLS.clear()
        more = residual_strides + ((gate[2],) if gate is not None else ())
        int64 = needs_int64(M, N * groups, x_stride, y_stride, *more)
        hint = alignment_hint(N, x_stride, y_stride, *more)
        launch, block_row = _launcher(N, is_rms, has_weight, has_bias, zero_centered, store_mean, int64, hint,
                                      bool(residual_strides), None if gate is None else gate[:2])
        planned = _CALLS[key] = (launch, groups * cdiv(M, block_row))
    return planned


@functools.lru_cache(maxsize=1024)
def _launcher(N: int, is_rms: bool, has_weight: bool, has_bias: bool, zero_centered: bool, store_mean: bool,
              int64: bool, hint: int = 1, has_residual: bool = False,
              gate: tuple | None = None) -> tuple[Launcher, int]:
    """The forward's launcher for one row width, set of flags and alignment hint, and its rows per program.
    `gate`: (after, sigmoid) of the gated form, None without one."""
    block_row, block_col, single, num_warps = forward_launch_params(N)
    after, sigmoid = gate if gate is not None else (False, False)
    return Launcher(_forward_kernel, dict(
        IS_RMS=is_rms, HAS_WEIGHT=has_weight, HAS_BIAS=has_bias, ZERO_CENTERED=zero_centered,
        STORE_MEAN=store_mean, BLOCK_ROW=block_row, BLOCK_COL=block_col, SINGLE_PASS=single, INT64=int64,
        HINT=hint, HAS_RESIDUAL=has_residual, HAS_GATE=gate is not None, GATE_AFTER=after, GATE_SIGMOID=sigmoid,
        num_warps=num_warps)), block_row
