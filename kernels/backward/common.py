"""Triton helpers shared by the backward kernels: loading rows, the effective weight, x̂, and the counters that
let programs of one launch wait for each other.

Math (per row, fp32; x̂ normalized input, r = rstd, g = grad_output, w effective weight, N columns):
    wg = w·g
    c1 = mean(x̂·wg)                       # both norms
    c2 = mean(wg)                         # LayerNorm only
    RMSNorm:   dx = r·(wg − x̂·c1)
    LayerNorm: dx = r·(wg − c2 − x̂·c1)
    dw = Σ_rows g·x̂,  db = Σ_rows g
Residual form (HAS_DRES): the normalized row was h = x + residual, and the residual stream's gradient dh arrives
beside g. grad_input is then dh + dx: the gradient of both x and residual, written once, in dh's dtype.
Gated form (HAS_GATE, RMSNorm from the input; a = act(z), a' its derivative, act = silu or sigmoid):
    after  (GATE_AFTER): the row normalized is s = x·a, y = w·s·r. The norm's math above runs on (g, s), and
           its grad_input ds gives dx = ds·a, dz = ds·x·a'.
    before: y = w·(x·r)·a. The norm's math runs on (g·a, x): dx is its grad_input, dz = g·w·x̂·a'.
    dw = Σ_rows g'·x̂ with g' the gradient the norm sees (g, or g·a). dx and dz are written in the same pass.

x̂ comes from the input (x̂ = (x−μ)·r, or x·r for RMSNorm) or, when the forward saved its output, from
y: x̂ = (y − b)/w. Where y cannot determine x̂ (w = 0, or |b| ≥ |w|·2^(p−1) for p mantissa bits), that column's
grad_input and grad_weight are NaN rather than silently wrong; the other columns stay exact (c1 uses x̂·w = y − b).

Waiting between programs (row_split's exchange of row sums, the fused reduction's grid barrier) uses an int32
counter per group in a buffer that is all zeros between launches: programs add 1 (release) and poll (acquire)
until the count they need is reached; the last program through resets the counters. Such waits are only safe
when every program of the grid is resident at once; the launcher caps those grids accordingly. Results never go
through atomics: every sum has a fixed order, so reruns are bitwise identical.

Triton's interpreter runs programs one after another, so a program can never wait for a later one there. Kernels
that wait take a PHASE: 0 on GPUs (everything, with the waits); under the interpreter the launcher runs the same
kernel twice, PHASE=1 (publish what others wait for) then PHASE=2 (the rest, reading what was published), which
computes the same values in the same order.
"""

from __future__ import annotations

import triton
import triton.language as tl

# int32 elements from one polled counter to the next: one 128-byte L2 line each, so that programs polling one
# group's counter do not queue behind the polls of other groups (or of the grid barrier) on a shared line.
COUNTER_STRIDE_ELEMENTS = 32
COUNTER_STRIDE = tl.constexpr(COUNTER_STRIDE_ELEMENTS)


@triton.jit
def assume_multiple(v, HINT: tl.constexpr):
    """v (a row width or row stride), told to the compiler to be a multiple of HINT, which the host checked
    (`heuristics.alignment_hint`; 1: no hint). Triton marks integer arguments divisible by 16 itself, and only
    those: rows of other widths whose starts still fall on 16-byte boundaries (bf16 rows of 3000 columns) would
    load and store one element at a time instead of 16 bytes at a time."""
    if HINT > 1:
        v = (v // HINT) * HINT
    return v


@triton.jit
def unprovable_zero(M):
    """An int16 0 that the compiler cannot prove is 0 (M, a row count, is never negative): see `widen_again`."""
    return tl.cast(M < 0, tl.int16)


@triton.jit
def widen_again(v, zero):
    """fp32 from raw values that were widened once already (RECOMPUTE), through an instruction sequence the
    compiler cannot merge with that first plain conversion — merged, the first conversion's fp32 registers stay
    live across the row reductions, which is what RECOMPUTE avoids. bf16: integer bit operations (exact: bf16 is
    the top half of an fp32); fp16: its bits xor `zero` (`unprovable_zero`), then the conversion, one
    instruction more; fp32: as it is (the raw tile is the fp32 tile). sm_90 compile of RMSNorm fp16 2048x16384
    on a 1x16384 recompute tile: 72 bytes of stack with the plain conversion, none with this (bf16: none)."""
    if v.dtype == tl.bfloat16:
        return (v.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    elif v.dtype == tl.float16:
        return (v.to(tl.int16, bitcast=True) ^ zero).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        return v.to(tl.float32)


@triton.jit
def weight_from_raw(w_raw, mask, HAS_WEIGHT: tl.constexpr, ZERO_CENTERED: tl.constexpr, AGAIN: tl.constexpr, zero):
    """Effective weight from a raw weight row loaded by `load_weight_raw`: 1 without a weight, 1 + w' when
    zero-centered; 1 where masked. AGAIN: this row was widened before (`widen_again`, with `zero`)."""
    if HAS_WEIGHT:
        if AGAIN:
            w = widen_again(w_raw, zero)
        else:
            w = w_raw.to(tl.float32)
        if ZERO_CENTERED:
            w = w + 1.0
        w = tl.where(mask, w, 1.0)
    else:
        w = tl.full(w_raw.shape, 1.0, tl.float32)
    return w


@triton.jit
def load_weight_raw(W, cols, mask, HAS_WEIGHT: tl.constexpr):
    if HAS_WEIGHT:
        w_raw = tl.load(W + cols, mask=mask, other=0.0)
    else:
        w_raw = tl.zeros(cols.shape, tl.float32)
    return w_raw


@triton.jit
def effective_weight(W, cols, mask, HAS_WEIGHT: tl.constexpr, ZERO_CENTERED: tl.constexpr):
    """w (fp32) for the given columns."""
    return weight_from_raw(load_weight_raw(W, cols, mask, HAS_WEIGHT), mask, HAS_WEIGHT, ZERO_CENTERED, False, 0)


@triton.jit
def recovery_bias(B, cols, mask, FROM_OUTPUT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """b (fp32) for the given columns where x̂ is recovered from the saved output (x̂ = (y − b)/w); zeros where
    it is not needed (saved input, or no bias)."""
    if FROM_OUTPUT and HAS_BIAS:
        b = tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    else:
        b = tl.zeros(cols.shape, tl.float32)
    return b


@triton.jit
def normalized(s, w, b, r, mu, IS_RMS: tl.constexpr, FROM_OUTPUT: tl.constexpr, HAS_WEIGHT: tl.constexpr,
               HAS_BIAS: tl.constexpr, RECOVER_LIMIT: tl.constexpr):
    """x̂ from the saved activation s: the input x, or the output y when FROM_OUTPUT. From y, x̂ = (y − b)/w is
    NaN in a column where y cannot determine it: |w|·RECOVER_LIMIT <= |b| (w = 0, or a bias so much larger than
    w that y's rounding swamps x̂·w; RECOVER_LIMIT = 2^(mantissa bits − 1) of the activation dtype)."""
    if FROM_OUTPUT:
        xhat = s
        if HAS_BIAS:
            xhat = xhat - b[None, :]
        if HAS_WEIGHT:
            lost = tl.abs(w) * RECOVER_LIMIT <= tl.abs(b)
            xhat = tl.where(lost[None, :], float("nan"), xhat / w[None, :])
    elif IS_RMS:
        xhat = s * r[:, None]
    else:
        xhat = (s - mu[:, None]) * r[:, None]
    return xhat


@triton.jit
def load_rows(G, stride_g, S, stride_s, RSTD, MEAN, rows, M, cols, col_mask, IS_RMS: tl.constexpr,
              FROM_OUTPUT: tl.constexpr, EVICTION: tl.constexpr, INT64: tl.constexpr):
    """Raw (unconverted) grad and saved tiles of `rows`, with r and μ; rows past M load nothing."""
    row_mask = rows < M
    if INT64:
        rows = rows.to(tl.int64)
    mask = row_mask[:, None] & col_mask[None, :]
    g = tl.load(G + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0, eviction_policy=EVICTION)
    s = tl.load(S + rows[:, None] * stride_s + cols[None, :], mask=mask, other=0.0, eviction_policy=EVICTION)
    r = tl.load(RSTD + rows, mask=row_mask, other=0.0)
    mu = r
    if not IS_RMS and not FROM_OUTPUT:
        mu = tl.load(MEAN + rows, mask=row_mask, other=0.0)
    return g, s, r, mu


@triton.jit
def load_gate(Z, stride_z, rows, M, cols, col_mask, HAS_GATE: tl.constexpr, EVICTION: tl.constexpr,
              INT64: tl.constexpr):
    """The raw gate tile z of `rows` (HAS_GATE; else a 0 that is never used); rows past M load nothing."""
    if HAS_GATE:
        mask = (rows < M)[:, None] & col_mask[None, :]
        if INT64:
            rows = rows.to(tl.int64)
        z = tl.load(Z + rows[:, None] * stride_z + cols[None, :], mask=mask, other=0.0, eviction_policy=EVICTION)
    else:
        z = 0.0
    return z


@triton.jit
def gate_activation(z, SIGMOID: tl.constexpr):
    """(act(z), act'(z)) in fp32: silu z·σ(z), σ(z)·(1 + z·(1 − σ(z))), or (SIGMOID) σ(z),
    σ(z)·(1 − σ(z))."""
    sig = 1.0 / (1.0 + tl.exp(-z))
    if SIGMOID:
        a = sig
        da = sig * (1.0 - sig)
    else:
        a = z * sig
        da = sig * (1.0 + z * (1.0 - sig))
    return a, da


@triton.jit
def gated(g, s, z_raw, HAS_GATE: tl.constexpr, GATE_AFTER: tl.constexpr, SIGMOID: tl.constexpr):
    """(g', s', a, a'): the fp32 gradient and rows the norm's math runs on (g and x·a after the gate, g·a and x
    before it), with the gate's activation and its derivative. Without a gate: (g, s) as they are (a, a' unused)."""
    if HAS_GATE:
        a, da = gate_activation(z_raw.to(tl.float32), SIGMOID)
        if GATE_AFTER:
            s_norm = s * a
            g_norm = g
        else:
            s_norm = s
            g_norm = g * a
    else:
        s_norm = s
        g_norm = g
        a = g
        da = g
    return g_norm, s_norm, a, da


@triton.jit
def gate_grads(ds, g, x, xhat, w, a, da, GATE_AFTER: tl.constexpr):
    """(dx, dz) of the gated form from the norm's grad_input `ds` (of the rows it normalized), the raw gradient g,
    the input x, x̂ and w (see the module doc)."""
    if GATE_AFTER:
        dx = ds * a
        dz = ds * x * da
    else:
        dx = ds
        dz = g * w[None, :] * xhat * da
    return dx, dz


@triton.jit
def store_gate_grad(DZ, stride_dz, dz, rows, M, cols, col_mask, HAS_GATE: tl.constexpr, EVICTION: tl.constexpr,
                    INT64: tl.constexpr):
    """The gate's gradient dz of `rows`, in DZ's dtype (HAS_GATE; else nothing)."""
    if HAS_GATE:
        mask = (rows < M)[:, None] & col_mask[None, :]
        if INT64:
            rows = rows.to(tl.int64)
        tl.store(DZ + rows[:, None] * stride_dz + cols[None, :], dz.to(DZ.dtype.element_ty), mask=mask,
                 eviction_policy=EVICTION)


@triton.jit
def scaled_normalized(xhat, s, w, b, FROM_OUTPUT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """x̂·w for the row term c1. From y it is y − b exactly (no division), so a column whose x̂ is lost (NaN in
    `normalized`) does not spoil the other columns' grad_input."""
    if FROM_OUTPUT:
        xw = s
        if HAS_BIAS:
            xw = xw - b[None, :]
    else:
        xw = xhat * w[None, :]
    return xw


@triton.jit
def grad_input(wg, xhat, c1, c2, r, IS_RMS: tl.constexpr):
    if IS_RMS:
        dx = (wg - xhat * c1[:, None]) * r[:, None]
    else:
        dx = (wg - c2[:, None] - xhat * c1[:, None]) * r[:, None]
    return dx


@triton.jit
def store_rows(DX, stride_dx, DH, stride_dh, dx, rows, M, cols, col_mask, HAS_DRES: tl.constexpr,
               EVICTION: tl.constexpr, INT64: tl.constexpr):
    """grad_input of `rows`: dx (fp32), plus (HAS_DRES) the residual stream's gradient dh, rounded once to DX's
    dtype. dh is loaded here, after the row reductions, rather than with g and the saved tile: held across the
    reductions it would be one more live tile, and single-pass tiles sized for the plain norm would spill
    (tests/test_hopper_compile.py compiles the residual cases and reads their stack)."""
    mask = (rows < M)[:, None] & col_mask[None, :]
    if INT64:
        rows = rows.to(tl.int64)
    if HAS_DRES:
        dx = dx + tl.load(DH + rows[:, None] * stride_dh + cols[None, :], mask=mask, other=0.0,
                          eviction_policy=EVICTION).to(tl.float32)
    tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)


@triton.jit
def store_column_sums(DW, DB, acc_dw, acc_db, cols, col_mask, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """The final dw/db of `cols`: the [rows, cols] accumulators summed over rows, in the outputs' dtype."""
    if HAS_WEIGHT:
        tl.store(DW + cols, tl.sum(acc_dw, axis=0).to(DW.dtype.element_ty), mask=col_mask)
    if HAS_BIAS:
        tl.store(DB + cols, tl.sum(acc_db, axis=0).to(DB.dtype.element_ty), mask=col_mask)


@triton.jit
def arrive_and_wait(COUNTER, target):
    """Add 1 to *COUNTER, then wait until it reaches `target`. The barrier before the add orders this program's
    earlier stores (made by all its threads) before the release; the one after the wait makes every thread see
    what the others published."""
    tl.debug_barrier()
    count = tl.atomic_add(COUNTER, 1, sem="release") + 1
    while count < target:
        count = tl.atomic_add(COUNTER, 0, sem="acquire")
    tl.debug_barrier()


# `arrive_and_wait` as one block of PTX, for waits inside a software-pipelined loop: Triton's pipeliner leaves a
# loop holding `tl.debug_barrier` unpipelined, so a split row's exchange inside the tile loop would cost it every
# async copy. The CTA barrier is `barrier.sync 0` here (ordering this program's stores before the release, and the
# acquired sums before every thread's reads; not `.aligned`, since warp 0 reaches the second one after thread 0
# alone has polled); thread 0 alone adds and polls. The block yields 0, a token that the reads of the published
# sums take as an operand, so that nothing moves them ahead of the wait.
_ARRIVE_AND_WAIT_PTX = tl.constexpr("""{
.reg .pred %p_wait;
.reg .u32 %tid_wait;
.reg .s32 %count_wait;
barrier.sync 0;
mov.u32 %tid_wait, %tid.x;
setp.ne.u32 %p_wait, %tid_wait, 0;
@%p_wait bra DONE_WAIT;
red.release.gpu.global.add.s32 [$1], 1;
POLL_WAIT:
ld.acquire.gpu.global.s32 %count_wait, [$1];
setp.lt.s32 %p_wait, %count_wait, $2;
@%p_wait bra POLL_WAIT;
DONE_WAIT:
barrier.sync 0;
mov.u32 $0, 0;
}""")


@triton.jit
def arrive_and_wait_in_loop(COUNTER, target):
    """`arrive_and_wait` that Triton's pipeliner accepts inside its loop (see `_ARRIVE_AND_WAIT_PTX`); returns
    an int32 zero for `load_after_wait`. GPU only: the interpreter runs no inline assembly (its PHASEs never
    wait)."""
    address = tl.full([1], 0, tl.int64) + COUNTER.to(tl.int64, bitcast=True)
    return tl.inline_asm_elementwise(_ARRIVE_AND_WAIT_PTX, "=r,l,r", [address, tl.full([1], target, tl.int32)],
                                     dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def load_after_wait(pointers, token):
    """fp32 values at `pointers`, read from L2 (`ld.global.cg`) after the wait that returned `token`: inline
    assembly that takes the token as an operand, which the pipeliner neither hoists nor turns into an early
    asynchronous copy (a plain load of the published sums was moved ahead of the wait)."""
    address = pointers.to(tl.int64, bitcast=True) + tl.max(token, axis=0).to(tl.int64)
    return tl.inline_asm_elementwise("ld.global.cg.f32 $0, [$1];", "=r,l", [address], dtype=tl.float32,
                                     is_pure=False, pack=1)


@triton.jit
def leave_and_reset(COUNTER, DONE, members):
    """Called once per program after its last wait on COUNTER: the last of `members` programs to leave resets
    COUNTER and DONE to zero for the next launch (all others are past their waits by then)."""
    left = tl.atomic_add(DONE, 1, sem="acq_rel") + 1
    if left == members:
        tl.atomic_xchg(COUNTER, 0, sem="relaxed")
        tl.atomic_xchg(DONE, 0, sem="relaxed")


@triton.jit
def column_group(COLUMN_GROUPS: tl.constexpr):
    """(this program's index within its column group, the programs per column group, the column group's index).
    A grouped problem (COLUMN_GROUPS > 1: the gated form's statistics per group of N columns of rows N x
    COLUMN_GROUPS wide) runs every group in one launch: the grid is COLUMN_GROUPS blocks of equally many
    programs, block c computing group c as a problem N wide of its own."""
    if COLUMN_GROUPS == 1:
        return tl.program_id(0), tl.num_programs(0), 0
    else:
        per = tl.num_programs(0) // COLUMN_GROUPS
        return tl.program_id(0) % per, per, tl.program_id(0) // per


@triton.jit
def group_operands(G, S, DX, DH, Z, DZ, W, B, RSTD, MEAN, group, M, N, COLUMN_GROUPS: tl.constexpr):
    """The operands of column group `group` (`column_group`): the rows' pointers moved to its first column,
    weight and bias to its slice, rstd and mean to its statistics (the forward stores them group by group, each
    M long). Placeholder pointers move too; they are never dereferenced."""
    if COLUMN_GROUPS > 1:
        col0 = group * N
        stats = group * M
        G, S, DX, DH, Z, DZ, W, B = G + col0, S + col0, DX + col0, DH + col0, Z + col0, DZ + col0, W + col0, B + col0
        RSTD, MEAN = RSTD + stats, MEAN + stats
    return G, S, DX, DH, Z, DZ, W, B, RSTD, MEAN
