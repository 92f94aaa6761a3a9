"""Forward kernel: LayerNorm / RMSNorm over the last dimension, saving what the backward needs.

Math (per row of N columns, fp32): LayerNorm μ = mean(x), r = (mean((x-μ)²) + eps)^-½, x̂ = (x-μ)·r;
RMSNorm r = (mean(x²) + eps)^-½, x̂ = x·r. y = w·x̂ + b with w = 1 + w' when zero-centered.
Saved for the backward: r (fp32) and, for LayerNorm saving from the input, μ (fp32).

The forward is not what normtune tunes; it uses one analytic launch: a block of rows per program, the whole row
in registers up to 8192 columns, chunked passes beyond (mean, then variance around the mean, then the output,
so that a large mean never cancels catastrophically).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .backward import _effective_weight
from .config import next_power_of_two

SINGLE_PASS_MAX_COLS = 8192
CHUNK_COLS = 4096


@triton.jit
def _forward_kernel(
    X, stride_x,  # input rows; stride_x: elements between consecutive rows
    Y, stride_y,  # output rows
    W, B,  # weight and bias, N elements each (ignored when absent)
    RSTD, MEAN,  # per-row fp32 r and μ (MEAN written only when STORE_MEAN)
    M, N, eps,
    IS_RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, ZERO_CENTERED: tl.constexpr,
    STORE_MEAN: tl.constexpr,
    BLOCK_ROW: tl.constexpr, BLOCK_COL: tl.constexpr, SINGLE_PASS: tl.constexpr, INT64: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_ROW + tl.arange(0, BLOCK_ROW)
    row_mask = rows < M
    if INT64:
        rows_off = rows.to(tl.int64)
    else:
        rows_off = rows
    x_rows = X + rows_off[:, None] * stride_x
    y_rows = Y + rows_off[:, None] * stride_y
    if SINGLE_PASS:
        cols = tl.arange(0, BLOCK_COL)
        col_mask = cols < N
        mask = row_mask[:, None] & col_mask[None, :]
        x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if IS_RMS:
            mean = tl.zeros((BLOCK_ROW,), tl.float32)
            xc = x
        else:
            mean = tl.sum(x, axis=1) / N
            xc = tl.where(mask, x - mean[:, None], 0.0)
        rstd = tl.rsqrt(tl.sum(xc * xc, axis=1) / N + eps)
        w = _effective_weight(W, cols, col_mask, HAS_WEIGHT, ZERO_CENTERED)
        y = xc * rstd[:, None] * w[None, :]
        if HAS_BIAS:
            y += tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(y_rows + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    else:
        chunk = tl.arange(0, BLOCK_COL)
        mean = tl.zeros((BLOCK_ROW,), tl.float32)
        if not IS_RMS:
            acc = tl.zeros((BLOCK_ROW, BLOCK_COL), tl.float32)
            for c0 in range(0, N, BLOCK_COL):
                cols = c0 + chunk
                mask = row_mask[:, None] & (cols < N)[None, :]
                acc += tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            mean = tl.sum(acc, axis=1) / N
        acc = tl.zeros((BLOCK_ROW, BLOCK_COL), tl.float32)
        for c0 in range(0, N, BLOCK_COL):
            cols = c0 + chunk
            mask = row_mask[:, None] & (cols < N)[None, :]
            x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            xc = tl.where(mask, x - mean[:, None], 0.0)
            acc += xc * xc
        rstd = tl.rsqrt(tl.sum(acc, axis=1) / N + eps)
        for c0 in range(0, N, BLOCK_COL):
            cols = c0 + chunk
            col_mask = cols < N
            mask = row_mask[:, None] & col_mask[None, :]
            x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            w = _effective_weight(W, cols, col_mask, HAS_WEIGHT, ZERO_CENTERED)
            y = (x - mean[:, None]) * rstd[:, None] * w[None, :]
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


def forward(x2d: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float, *,
            is_rms: bool, zero_centered: bool, store_mean: bool, y: torch.Tensor | None = None,
            rstd: torch.Tensor | None = None, mean: torch.Tensor | None = None):
    """Run the forward on a 2-D view (rows may be strided, last dim contiguous). Returns (y, rstd, mean);
    `mean` is an empty tensor unless `store_mean`. y/rstd/mean may be passed in (e.g. poisoned, by tests)."""
    M, N = x2d.shape
    if y is None:
        y = torch.empty((M, N), dtype=x2d.dtype, device=x2d.device)
    if rstd is None:
        rstd = torch.empty((M,), dtype=torch.float32, device=x2d.device)
    if mean is None:
        mean = torch.empty((M if store_mean else 0,), dtype=torch.float32, device=x2d.device)
    if M == 0:
        return y, rstd, mean
    block_row, block_col, single, num_warps = forward_launch_params(N)
    int64 = max(M * x2d.stride(0), M * N) >= 2**31
    dummy = rstd  # pointer placeholder for absent tensors: never dereferenced (the constexpr flags skip it)
    _forward_kernel[(triton.cdiv(M, block_row),)](
        x2d, x2d.stride(0), y, y.stride(0),
        weight if weight is not None else dummy, bias if bias is not None else dummy,
        rstd, mean if store_mean else dummy,
        M, N, eps,
        IS_RMS=is_rms, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, ZERO_CENTERED=zero_centered,
        STORE_MEAN=store_mean, BLOCK_ROW=block_row, BLOCK_COL=block_col, SINGLE_PASS=single, INT64=int64,
        num_warps=num_warps,
    )
    return y, rstd, mean
