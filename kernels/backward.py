"""Backward kernels: kernel_1 writes grad_input and per-program fp32 partial grad_weight/grad_bias; kernel_2
reduces the partials.

Math (per row, fp32; x̂ normalized input, r = rstd, g = grad_output, w effective weight, N columns):
    wg = w·g
    c1 = mean(x̂·wg)                       # both norms
    c2 = mean(wg)                         # LayerNorm only
    RMSNorm:   dx = r·(wg − x̂·c1)
    LayerNorm: dx = r·(wg − c2 − x̂·c1)
    dw = Σ_rows g·x̂,  db = Σ_rows g      # kernel_1 sums its rows per program, kernel_2 sums the programs
x̂ comes from the input (x̂ = (x−μ)·r, or x·r for RMSNorm) or, when the forward saved its output, from
y: x̂ = (y − b)/w, with |w| clamped away from zero so that a zero weight gives x̂ = 0 instead of NaN.

Determinism: every sum has a fixed order (each program walks its tiles in order, kernel_2 walks the programs in
order), there are no atomics, so reruns are bitwise identical.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .config import BackwardConfig, Problem
from .device import compute_capability, interpret_mode, sm_count

try:  # Programmatic Dependent Launch (Hopper+): kernel_2 launches while kernel_1 drains, then waits on its writes.
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    from triton.backends.nvidia.compiler import CUDAOptions

    PDL_SUPPORTED = "launch_pdl" in CUDAOptions.__dataclass_fields__
except Exception:  # noqa: BLE001 - an older Triton, or no NVIDIA backend: PDL is simply off
    PDL_SUPPORTED = False

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass

# Smallest |w| used to recover x̂ = (y − b)/w. Where w is exactly 0 the forward wrote y = b, so x̂ = 0/±W_TINY = 0;
# no finite answer exists there (x̂ was not saved), and 0 keeps NaN out of dx and dw.
W_TINY: tl.constexpr = tl.constexpr(1e-12)


@triton.jit
def _widen(v, BF16_BITS: tl.constexpr):
    """fp32 from raw values. BF16_BITS: through integer bit operations (bf16 is the top half of an fp32, so this
    is exact) — a different instruction sequence from the plain conversion, which the compiler therefore cannot
    merge with an earlier conversion of the same registers. That keeps only the packed raw tile alive across the
    row reductions (see RECOMPUTE)."""
    if BF16_BITS:
        return (v.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        return v.to(tl.float32)


@triton.jit
def _weight_from_raw(w_raw, mask, HAS_WEIGHT: tl.constexpr, ZERO_CENTERED: tl.constexpr, BF16_BITS: tl.constexpr):
    """Effective weight from a raw weight row loaded by `_load_weight_raw`."""
    if HAS_WEIGHT:
        w = _widen(w_raw, BF16_BITS)
        if ZERO_CENTERED:
            w = w + 1.0
        w = tl.where(mask, w, 1.0)
    else:
        w = tl.full(w_raw.shape, 1.0, tl.float32)
    return w


@triton.jit
def _load_weight_raw(W, cols, mask, HAS_WEIGHT: tl.constexpr):
    if HAS_WEIGHT:
        w_raw = tl.load(W + cols, mask=mask, other=0.0)
    else:
        w_raw = tl.zeros(cols.shape, tl.float32)
    return w_raw


@triton.jit
def _effective_weight(W, cols, mask, HAS_WEIGHT: tl.constexpr, ZERO_CENTERED: tl.constexpr):
    """w (fp32) for the given columns: 1 without a weight, 1 + w' when zero-centered; 1 where masked."""
    return _weight_from_raw(_load_weight_raw(W, cols, mask, HAS_WEIGHT), mask, HAS_WEIGHT, ZERO_CENTERED, False)


@triton.jit
def _normalized(s, w, b, r, mu, IS_RMS: tl.constexpr, FROM_OUTPUT: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                HAS_BIAS: tl.constexpr):
    """x̂ from the saved activation s: the input x, or the output y when FROM_OUTPUT."""
    if FROM_OUTPUT:
        xhat = s
        if HAS_BIAS:
            xhat = xhat - b[None, :]
        if HAS_WEIGHT:
            w_safe = tl.where(tl.abs(w) < W_TINY, tl.where(w < 0, -W_TINY, W_TINY), w)
            xhat = xhat / w_safe[None, :]
    elif IS_RMS:
        xhat = s * r[:, None]
    else:
        xhat = (s - mu[:, None]) * r[:, None]
    return xhat


@triton.jit
def _load_rows(G, stride_g, S, stride_s, RSTD, MEAN, tile, M, cols, col_mask, IS_RMS: tl.constexpr,
               FROM_OUTPUT: tl.constexpr, BLOCK_ROW: tl.constexpr, EVICTION: tl.constexpr, INT64: tl.constexpr,
               CACHE: tl.constexpr):
    """Raw (unconverted) grad and saved tiles of row tile `tile`, with r and μ; rows past M load nothing."""
    rows = tile * BLOCK_ROW + tl.arange(0, BLOCK_ROW)
    row_mask = rows < M
    if INT64:
        rows = rows.to(tl.int64)
    mask = row_mask[:, None] & col_mask[None, :]
    g = tl.load(G + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0, eviction_policy=EVICTION,
                cache_modifier=CACHE)
    s = tl.load(S + rows[:, None] * stride_s + cols[None, :], mask=mask, other=0.0, eviction_policy=EVICTION,
                cache_modifier=CACHE)
    r = tl.load(RSTD + rows, mask=row_mask, other=0.0)
    mu = r
    if not IS_RMS and not FROM_OUTPUT:
        mu = tl.load(MEAN + rows, mask=row_mask, other=0.0)
    return g, s, r, mu


@triton.jit
def _kernel_1_single_pass(
    G, stride_g,  # grad_output rows; stride: elements between consecutive rows
    S, stride_s,  # saved activation rows: x (save="input") or y (save="output")
    DX, stride_dx,  # grad_input rows
    W, B,  # weight (raw: w' when zero-centered) and bias; B is read only to recover x̂ from y
    RSTD, MEAN,  # per-row fp32 r and μ (μ only for LayerNorm saving from the input)
    PARTIAL_DW, PARTIAL_DB,  # [programs, N] fp32: program p's sum of g·x̂ (and of g) over its rows
    M, N,
    IS_RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, ZERO_CENTERED: tl.constexpr,
    FROM_OUTPUT: tl.constexpr,
    BLOCK_ROW: tl.constexpr, BLOCK_COL: tl.constexpr,
    NUM_STAGES: tl.constexpr,  # Triton software pipelining of the tile loop (async copies through shared memory)
    PREFETCH: tl.constexpr,  # load tile i+1 into registers before computing tile i (register double-buffering)
    RELOAD_WEIGHT: tl.constexpr,  # load w per tile (L1-resident) instead of holding it in registers
    RECOMPUTE: tl.constexpr,  # keep the raw (bf16) tile across the row reductions, widen it again after them
    BF16_BITS: tl.constexpr,  # the activations (and weight, for RECOMPUTE) are bf16: widen by bit operations
    EVICTION: tl.constexpr, INT64: tl.constexpr,
    PDL: tl.constexpr,  # let kernel_2 launch now: it waits (gdc_wait) for this grid's writes before reading
):
    if PDL:
        gdc_launch_dependents()
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_COL)
    col_mask = cols < N
    if not RELOAD_WEIGHT:
        w = _effective_weight(W, cols, col_mask, HAS_WEIGHT, ZERO_CENTERED)
    b = tl.zeros((BLOCK_COL,), tl.float32)
    if FROM_OUTPUT and HAS_BIAS:
        b = tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)
    # dw/db accumulate as whole tiles and are summed over rows once at the end: no cross-warp reduction per tile.
    acc_dw = tl.zeros((BLOCK_ROW, BLOCK_COL), tl.float32)
    acc_db = tl.zeros((BLOCK_ROW, BLOCK_COL), tl.float32)
    num_tiles = tl.cdiv(M, BLOCK_ROW)
    if PREFETCH:
        g_next, s_next, r_next, mu_next = _load_rows(G, stride_g, S, stride_s, RSTD, MEAN, pid, M, cols, col_mask,
                                                     IS_RMS, FROM_OUTPUT, BLOCK_ROW, EVICTION, INT64, "")
    for tile in tl.range(pid, num_tiles, num_programs, num_stages=NUM_STAGES):
        if PREFETCH:
            g, s, r, mu = g_next, s_next, r_next, mu_next
            g_next, s_next, r_next, mu_next = _load_rows(G, stride_g, S, stride_s, RSTD, MEAN, tile + num_programs,
                                                         M, cols, col_mask, IS_RMS, FROM_OUTPUT, BLOCK_ROW,
                                                         EVICTION, INT64, "")
        else:
            g, s, r, mu = _load_rows(G, stride_g, S, stride_s, RSTD, MEAN, tile, M, cols, col_mask, IS_RMS,
                                     FROM_OUTPUT, BLOCK_ROW, EVICTION, INT64, "")
        if RELOAD_WEIGHT:
            w_raw = _load_weight_raw(W, cols, col_mask, HAS_WEIGHT)
            w = _weight_from_raw(w_raw, col_mask, HAS_WEIGHT, ZERO_CENTERED, False)
        g_raw, s_raw = g, s
        g = g_raw.to(tl.float32)
        xhat = _normalized(s_raw.to(tl.float32), w, b, r, mu, IS_RMS, FROM_OUTPUT, HAS_WEIGHT, HAS_BIAS)
        # dw/db do not depend on the row terms: accumulate before the reductions so that g is dead across them.
        if HAS_WEIGHT:
            acc_dw += g * xhat
        if HAS_BIAS:
            acc_db += g
        wg = w[None, :] * g
        c1 = tl.sum(xhat * wg, axis=1) / N
        c2 = tl.sum(wg, axis=1) / N
        if RECOMPUTE:
            # Widen the raw tile again rather than keeping fp32 x̂ and w·g live across the reductions: halves
            # the registers the tile holds there (bf16 packs two per register), so wide LayerNorm rows fit.
            if RELOAD_WEIGHT:
                w = _weight_from_raw(w_raw, col_mask, HAS_WEIGHT, ZERO_CENTERED, BF16_BITS)
            xhat = _normalized(_widen(s_raw, BF16_BITS), w, b, r, mu, IS_RMS, FROM_OUTPUT, HAS_WEIGHT, HAS_BIAS)
            wg = w[None, :] * _widen(g_raw, BF16_BITS)
        if IS_RMS:
            dx = (wg - xhat * c1[:, None]) * r[:, None]
        else:
            dx = (wg - c2[:, None] - xhat * c1[:, None]) * r[:, None]
        rows = tile * BLOCK_ROW + tl.arange(0, BLOCK_ROW)
        mask = (rows < M)[:, None] & col_mask[None, :]
        if INT64:
            rows = rows.to(tl.int64)
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
    partial = pid * N + cols
    if HAS_WEIGHT:
        tl.store(PARTIAL_DW + partial, tl.sum(acc_dw, axis=0), mask=col_mask)
    if HAS_BIAS:
        tl.store(PARTIAL_DB + partial, tl.sum(acc_db, axis=0), mask=col_mask)


@triton.jit
def _load_chunk(g_rows, s_rows, W, B, c0, chunk, N, row_mask, HAS_WEIGHT: tl.constexpr, ZERO_CENTERED: tl.constexpr,
                NEED_BIAS: tl.constexpr, EVICTION: tl.constexpr):
    """Raw grad and saved chunk at columns c0.., with w (and b when recovering x̂ from y); past N loads nothing."""
    cols = c0 + chunk
    col_mask = cols < N
    mask = row_mask[:, None] & col_mask[None, :]
    g = tl.load(g_rows + cols[None, :], mask=mask, other=0.0, eviction_policy=EVICTION)
    s = tl.load(s_rows + cols[None, :], mask=mask, other=0.0, eviction_policy=EVICTION)
    w = _effective_weight(W, cols, col_mask, HAS_WEIGHT, ZERO_CENTERED)
    b = w
    if NEED_BIAS:
        b = tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)
    return g, s, w, b


@triton.jit
def _kernel_1_two_pass(
    G, stride_g, S, stride_s, DX, stride_dx, W, B, RSTD, MEAN, PARTIAL_DW, PARTIAL_DB, M, N,
    IS_RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, ZERO_CENTERED: tl.constexpr,
    FROM_OUTPUT: tl.constexpr,
    BLOCK_ROW: tl.constexpr, BLOCK_COL: tl.constexpr, NUM_STAGES: tl.constexpr, PREFETCH: tl.constexpr,
    RELOAD_WEIGHT: tl.constexpr, RECOMPUTE: tl.constexpr, BF16_BITS: tl.constexpr, EVICTION: tl.constexpr,
    INT64: tl.constexpr, PDL: tl.constexpr,
):
    """Arguments as `_kernel_1_single_pass` (RELOAD_WEIGHT is implied: w is loaded per chunk; RECOMPUTE does not
    apply: pass 2 re-reads). Rows wider than
    BLOCK_COL: pass 1 reduces c1 (and c2) over column chunks, pass 2 re-reads the chunks (a program's tile is
    block_row rows, so the re-read is served by L2 when the programs' tiles fit there; pass 1 loads with
    evict_last to keep them), writes dx, and adds the tile's g·x̂ and g to the program's partial row
    (read-modify-write: the partial row is this program's alone). PREFETCH loads chunk j+1 before computing j."""
    if PDL:
        gdc_launch_dependents()
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    chunk = tl.arange(0, BLOCK_COL)
    num_tiles = tl.cdiv(M, BLOCK_ROW)
    partial_row = pid * N
    NEED_BIAS: tl.constexpr = FROM_OUTPUT and HAS_BIAS
    for tile in range(pid, num_tiles, num_programs):
        rows = tile * BLOCK_ROW + tl.arange(0, BLOCK_ROW)
        row_mask = rows < M
        if INT64:
            rows = rows.to(tl.int64)
        g_rows = G + rows[:, None] * stride_g
        s_rows = S + rows[:, None] * stride_s
        r = tl.load(RSTD + rows, mask=row_mask, other=0.0)
        mu = r
        if not IS_RMS and not FROM_OUTPUT:
            mu = tl.load(MEAN + rows, mask=row_mask, other=0.0)
        # Pass 1: row terms. Accumulate whole chunks, reduce across columns once.
        acc_c1 = tl.zeros((BLOCK_ROW, BLOCK_COL), tl.float32)
        acc_c2 = tl.zeros((BLOCK_ROW, BLOCK_COL), tl.float32)
        if PREFETCH:
            g_next, s_next, w_next, b_next = _load_chunk(g_rows, s_rows, W, B, 0, chunk, N, row_mask, HAS_WEIGHT,
                                                         ZERO_CENTERED, NEED_BIAS, "evict_last")
        for c0 in tl.range(0, N, BLOCK_COL, num_stages=NUM_STAGES):
            if PREFETCH:
                g, s, w, b = g_next, s_next, w_next, b_next
                g_next, s_next, w_next, b_next = _load_chunk(g_rows, s_rows, W, B, c0 + BLOCK_COL, chunk, N,
                                                             row_mask, HAS_WEIGHT, ZERO_CENTERED, NEED_BIAS,
                                                             "evict_last")
            else:
                g, s, w, b = _load_chunk(g_rows, s_rows, W, B, c0, chunk, N, row_mask, HAS_WEIGHT, ZERO_CENTERED,
                                         NEED_BIAS, "evict_last")
            xhat = _normalized(s.to(tl.float32), w, b, r, mu, IS_RMS, FROM_OUTPUT, HAS_WEIGHT, HAS_BIAS)
            wg = w[None, :] * g.to(tl.float32)
            acc_c1 += xhat * wg
            if not IS_RMS:
                acc_c2 += wg
        c1 = tl.sum(acc_c1, axis=1) / N
        c2 = tl.sum(acc_c2, axis=1) / N
        # Pass 2: grad_input and the partials. A program's first tile starts its partial row from zero, so the
        # previous partial is read only after it (prev_cols = 0 masks the whole read).
        prev_cols = tl.where(tile == pid, 0, N)
        if PREFETCH:
            g_next, s_next, w_next, b_next = _load_chunk(g_rows, s_rows, W, B, 0, chunk, N, row_mask, HAS_WEIGHT,
                                                         ZERO_CENTERED, NEED_BIAS, EVICTION)
        for c0 in tl.range(0, N, BLOCK_COL, num_stages=NUM_STAGES):
            cols = c0 + chunk
            col_mask = cols < N
            # Issue the partial-row reads first so their latency overlaps the math below.
            if HAS_WEIGHT:
                prev_dw = tl.load(PARTIAL_DW + partial_row + cols, mask=cols < prev_cols, other=0.0)
            if HAS_BIAS:
                prev_db = tl.load(PARTIAL_DB + partial_row + cols, mask=cols < prev_cols, other=0.0)
            if PREFETCH:
                g, s, w, b = g_next, s_next, w_next, b_next
                g_next, s_next, w_next, b_next = _load_chunk(g_rows, s_rows, W, B, c0 + BLOCK_COL, chunk, N,
                                                             row_mask, HAS_WEIGHT, ZERO_CENTERED, NEED_BIAS,
                                                             EVICTION)
            else:
                g, s, w, b = _load_chunk(g_rows, s_rows, W, B, c0, chunk, N, row_mask, HAS_WEIGHT, ZERO_CENTERED,
                                         NEED_BIAS, EVICTION)
            g = g.to(tl.float32)
            xhat = _normalized(s.to(tl.float32), w, b, r, mu, IS_RMS, FROM_OUTPUT, HAS_WEIGHT, HAS_BIAS)
            if HAS_WEIGHT:
                tl.store(PARTIAL_DW + partial_row + cols, prev_dw + tl.sum(g * xhat, axis=0), mask=col_mask)
            if HAS_BIAS:
                tl.store(PARTIAL_DB + partial_row + cols, prev_db + tl.sum(g, axis=0), mask=col_mask)
            wg = w[None, :] * g
            if IS_RMS:
                dx = (wg - xhat * c1[:, None]) * r[:, None]
            else:
                dx = (wg - c2[:, None] - xhat * c1[:, None]) * r[:, None]
            mask = row_mask[:, None] & col_mask[None, :]
            tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        # The next tile re-reads this tile's partial-row stores, possibly from other threads: order them.
        tl.debug_barrier()


@triton.jit
def _kernel_2(
    PARTIAL_DW, PARTIAL_DB,  # [P, N] fp32 partials from kernel_1
    DW, DB,  # [N] outputs, in the weight's dtype
    P, N,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_STAGES: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:
        gdc_wait()  # launched early (programmatic dependent launch): wait until kernel_1's partials are visible
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    acc_dw = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc_db = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for m0 in tl.range(0, P, BLOCK_M, num_stages=NUM_STAGES):
        rows = m0 + tl.arange(0, BLOCK_M)
        mask = (rows < P)[:, None] & col_mask[None, :]
        offsets = rows[:, None] * N + cols[None, :]
        if HAS_WEIGHT:
            acc_dw += tl.load(PARTIAL_DW + offsets, mask=mask, other=0.0)
        if HAS_BIAS:
            acc_db += tl.load(PARTIAL_DB + offsets, mask=mask, other=0.0)
    if HAS_WEIGHT:
        tl.store(DW + cols, tl.sum(acc_dw, axis=0).to(DW.dtype.element_ty), mask=col_mask)
    if HAS_BIAS:
        tl.store(DB + cols, tl.sum(acc_db, axis=0).to(DB.dtype.element_ty), mask=col_mask)


def num_programs(M: int, config: BackwardConfig, sms: int) -> int:
    """Persistent grid of kernel_1: round(programs_per_sm x SMs), never more than the row tiles, at least 1.
    A fraction (e.g. 0.5) leaves SMs idle but halves the partials kernel_2 must read."""
    tiles = triton.cdiv(M, config.kernel_1.block_row)
    return max(1, min(round(config.kernel_1.programs_per_sm * sms), tiles))


_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _pdl_enabled(config: BackwardConfig, device: torch.device) -> bool:
    cc = compute_capability(device)
    return bool(config.kernel_2.pdl and PDL_SUPPORTED and not interpret_mode() and cc is not None and cc >= (9, 0))


def _kernel_1_args(problem: Problem, config: BackwardConfig, grad, saved, dx, weight, bias, rstd, mean, partial_dw,
                   partial_db, *, int64: bool, pdl: bool):
    """(positional args, keyword constexprs/options) of kernel_1. Absent tensors are replaced by `rstd` (an fp32
    placeholder the constexpr flags never dereference); the same substitution is made when compiling ahead."""
    p, k1 = problem, config.kernel_1
    args = (grad, p.N if isinstance(grad, torch.dtype) else grad.stride(0),
            saved, p.N if isinstance(saved, torch.dtype) else saved.stride(0),
            dx, p.N if isinstance(dx, torch.dtype) else dx.stride(0),
            weight if weight is not None else rstd, bias if bias is not None else rstd,
            rstd, mean if (p.norm == "layer_norm" and p.save == "input") else rstd,
            partial_dw if p.has_weight else rstd, partial_db if p.has_bias else rstd, p.M, p.N)
    kwargs = dict(IS_RMS=p.norm == "rms_norm", HAS_WEIGHT=p.has_weight, HAS_BIAS=bool(p.has_bias),
                  ZERO_CENTERED=p.zero_centered, FROM_OUTPUT=p.save == "output",
                  BLOCK_ROW=k1.block_row, BLOCK_COL=k1.block_col, NUM_STAGES=k1.num_stages, PREFETCH=k1.prefetch,
                  RELOAD_WEIGHT=k1.block_row == 1, RECOMPUTE=k1.recompute,
                  BF16_BITS=p.dtype == "bf16" and (p.weight_dtype == "bf16" or not p.has_weight),
                  EVICTION=k1.eviction_policy, INT64=int64,
                  PDL=pdl, num_warps=k1.num_warps)
    return args, kwargs


def _kernel_2_args(problem: Problem, config: BackwardConfig, partial_dw, partial_db, dw, db, placeholder,
                   programs: int, *, pdl: bool):
    p, k2 = problem, config.kernel_2
    args = (partial_dw if p.has_weight else placeholder, partial_db if p.has_bias else placeholder,
            dw if dw is not None else placeholder, db if db is not None else placeholder, programs, p.N)
    kwargs = dict(HAS_WEIGHT=p.has_weight, HAS_BIAS=bool(p.has_bias), BLOCK_M=k2.block_m, BLOCK_N=k2.block_n,
                  NUM_STAGES=k2.num_stages, PDL=pdl, num_warps=k2.num_warps)
    if pdl:
        kwargs["launch_pdl"] = True
    return args, kwargs


def _needs_int64(M: int, N: int, *strides: int) -> bool:
    return max(M * max(strides, default=N), M * N) >= 2**31


class BackwardLaunch:
    """One backward, ready to launch: outputs and partials allocated, grids computed.

    `kernel_1()` and `kernel_2()` launch the two kernels (the timing harness records events between them);
    `run()` launches both and returns (dx, dw, db), dw/db None where the problem has no weight/bias.
    Reusable: launching again recomputes the same outputs into the same buffers.
    """

    def __init__(self, problem: Problem, config: BackwardConfig, grad: torch.Tensor, saved: torch.Tensor,
                 weight: torch.Tensor | None, bias: torch.Tensor | None, rstd: torch.Tensor, mean: torch.Tensor,
                 *, dx: torch.Tensor | None = None):
        config.validate(problem)
        self.problem, self.config = problem, config
        M, N = problem.M, problem.N
        device = grad.device
        self.grad, self.saved, self.weight, self.bias, self.rstd, self.mean = grad, saved, weight, bias, rstd, mean
        self.dx = dx if dx is not None else torch.empty((M, N), dtype=grad.dtype, device=device)
        self.programs = num_programs(M, config, sm_count(device)) if M > 0 else 0
        wdt = weight.dtype if weight is not None else grad.dtype
        has_w, has_b = problem.has_weight, bool(problem.has_bias)
        self.partial_dw = torch.empty((self.programs, N) if has_w else (0,), dtype=torch.float32, device=device)
        self.partial_db = torch.empty((self.programs, N) if has_b else (0,), dtype=torch.float32, device=device)
        self.dw = torch.empty((N,), dtype=wdt, device=device) if has_w else None
        self.db = torch.empty((N,), dtype=bias.dtype if bias is not None else wdt, device=device) if has_b else None
        self.pdl = _pdl_enabled(config, device)
        int64 = _needs_int64(M, N, grad.stride(0), saved.stride(0), self.dx.stride(0))
        self._kernel_1 = _kernel_1_two_pass if config.kernel_1.two_pass else _kernel_1_single_pass
        self._k1_args = _kernel_1_args(problem, config, grad, saved, self.dx, weight, bias, rstd, mean,
                                       self.partial_dw, self.partial_db, int64=int64, pdl=self.pdl)
        self._k2_args = _kernel_2_args(problem, config, self.partial_dw, self.partial_db, self.dw, self.db, rstd,
                                       self.programs, pdl=self.pdl)

    def kernel_1(self) -> None:
        if self.programs == 0:
            return
        args, kwargs = self._k1_args
        self._kernel_1[(self.programs,)](*args, **kwargs)

    def kernel_2(self) -> None:
        p = self.problem
        if not (p.has_weight or p.has_bias):
            return
        if self.programs == 0:  # M = 0: the sums over no rows are zero
            for out in (self.dw, self.db):
                if out is not None:
                    out.zero_()
            return
        args, kwargs = self._k2_args
        _kernel_2[(triton.cdiv(p.N, self.config.kernel_2.block_n),)](*args, **kwargs)

    def run(self):
        self.kernel_1()
        self.kernel_2()
        return self.dx, self.dw, self.db


def precompile(problem: Problem, config: BackwardConfig, sms: int, device: torch.device | None = None) -> None:
    """Compile both kernels for (problem, config) without launching them, as the first real launch would
    (contiguous rows, the same integer specialization), so that Triton's on-disk cache serves the launch.
    Used by the tuner's compile-ahead workers; needs the GPU's driver but no data."""
    config.validate(problem)
    if problem.M == 0:
        return
    device = device or torch.device("cuda", torch.cuda.current_device())
    act = _TORCH_DTYPES[problem.dtype]
    wdt = _TORCH_DTYPES[problem.weight_dtype]
    f32 = torch.float32
    pdl = _pdl_enabled(config, device)
    programs = num_programs(problem.M, config, sms)
    int64 = _needs_int64(problem.M, problem.N)
    kernel_1 = _kernel_1_two_pass if config.kernel_1.two_pass else _kernel_1_single_pass
    args, kwargs = _kernel_1_args(problem, config, act, act, act, wdt if problem.has_weight else None,
                                  wdt if problem.has_bias else None, f32, f32, f32, f32, int64=int64, pdl=pdl)
    kernel_1.warmup(*args, grid=(programs,), **kwargs)
    if problem.has_weight or problem.has_bias:
        args, kwargs = _kernel_2_args(problem, config, f32, f32, wdt if problem.has_weight else None,
                                      wdt if problem.has_bias else None, f32, programs, pdl=pdl)
        _kernel_2.warmup(*args, grid=(triton.cdiv(problem.N, config.kernel_2.block_n),), **kwargs)
