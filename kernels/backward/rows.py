"""kernel_1, rows strategy: persistent programs walk row tiles, write grad_input and one fp32 partial dw/db row
per row group (see `common.py` for the math and the waiting rules).

- single pass: a program holds its tile's whole row (row_split = 1) or one column slice of it (row_split > 1:
  the row_split programs of a group exchange their slices' row sums through global memory, two slots deep);
- two-pass: rows wider than the tile are walked in column chunks twice (pass 2 re-reads from L2).
Either may end with the fused reduction (`FUSED`): a grid-wide barrier, then kernel_2's loop on the same grid.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import (
    COUNTER_STRIDE,
    arrive_and_wait,
    arrive_and_wait_in_loop,
    assume_multiple,
    column_group,
    effective_weight,
    gate_grads,
    gated,
    grad_input,
    group_operands,
    leave_and_reset,
    load_after_wait,
    load_gate,
    load_rows,
    load_weight_raw,
    normalized,
    recovery_bias,
    scaled_normalized,
    store_gate_grad,
    store_rows,
    unprovable_zero,
    weight_from_raw,
    widen_again,
)
from .reduce import gdc_launch_dependents, reduce_columns


@triton.jit
def _exchange_row_sums(SUMS, COUNTER, group, part, k, c1_part, c2_part, ROW_SPLIT: tl.constexpr,
                       SLOTS: tl.constexpr, BLOCK_ROW: tl.constexpr, PHASE: tl.constexpr, PIPELINED: tl.constexpr):
    """Publish this slice's row sums of the group's k-th tile, wait for the group's other slices, and return
    the full sums added in slice order (the same bits in every program of the group). Slot k % SLOTS: with
    two slots a program cannot overwrite a slot before every member has read it (it would first have to pass
    the wait of the tile in between, which needs every member to have arrived there). PIPELINED waits and reads
    through inline assembly, which keeps the tile loop software-pipelined (see `arrive_and_wait_in_loop`); the
    slices are added in the same order."""
    rr = tl.arange(0, BLOCK_ROW)
    base = SUMS + ((group * SLOTS + k % SLOTS) * ROW_SPLIT) * (2 * BLOCK_ROW)
    if PHASE != 2:
        tl.store(base + part * (2 * BLOCK_ROW) + rr, c1_part)
        tl.store(base + part * (2 * BLOCK_ROW) + BLOCK_ROW + rr, c2_part)
    token = 0
    if PHASE == 0:
        if PIPELINED:
            token = arrive_and_wait_in_loop(COUNTER + group * COUNTER_STRIDE, ROW_SPLIT * (k + 1))
        else:
            arrive_and_wait(COUNTER + group * COUNTER_STRIDE, ROW_SPLIT * (k + 1))
    AFTER_WAIT: tl.constexpr = PHASE == 0 and PIPELINED
    if (ROW_SPLIT & (ROW_SPLIT - 1)) == 0:
        parts = tl.arange(0, ROW_SPLIT)[:, None] * (2 * BLOCK_ROW) + rr[None, :]
        c1 = tl.sum(_published(base + parts, token, AFTER_WAIT), axis=0)
        c2 = tl.sum(_published(base + BLOCK_ROW + parts, token, AFTER_WAIT), axis=0)
    else:  # 3, 5, 6, 7 slices (no power-of-two block spans them): added one after another, in slice order
        c1 = _published(base + rr, token, AFTER_WAIT)
        c2 = _published(base + BLOCK_ROW + rr, token, AFTER_WAIT)
        for i in tl.static_range(1, ROW_SPLIT):
            c1 += _published(base + i * (2 * BLOCK_ROW) + rr, token, AFTER_WAIT)
            c2 += _published(base + i * (2 * BLOCK_ROW) + BLOCK_ROW + rr, token, AFTER_WAIT)
    return c1, c2


@triton.jit
def _published(pointers, token, AFTER_WAIT: tl.constexpr):
    """Published row sums, read from L2 (the other programs wrote them): behind the inline-assembly wait that
    returned `token` (`load_after_wait`), or as a plain load after `arrive_and_wait`."""
    if AFTER_WAIT:
        return load_after_wait(pointers, token)
    else:
        return tl.load(pointers, cache_modifier=".cg")


@triton.jit
def kernel_1_single_pass(
    G, stride_g,  # grad_output rows; stride: elements between consecutive rows
    S, stride_s,  # saved activation rows: x (save="input") or y (save="output")
    DX, stride_dx,  # grad_input rows
    DH, stride_dh,  # residual-stream gradient rows, added into grad_input (HAS_DRES; else never read)
    Z, stride_z, DZ, stride_dz,  # gate rows and their gradient's (HAS_GATE; else never read or written)
    W, B,  # weight (raw: w' when zero-centered) and bias; B is read only to recover x̂ from y
    RSTD, MEAN,  # per-row fp32 r and μ (μ only for LayerNorm saving from the input)
    PARTIAL_DW, PARTIAL_DB,  # [groups, N] fp32: group g's sum of g·x̂ (and of g) over its rows
    DW, DB,  # final dw/db (FUSED only)
    SUMS, COUNTERS, DONE, BARRIER,  # row_split exchange slots (fp32); int32 counters, zero between launches
    M, N, SLICE,  # SLICE: columns per program of a group (N when ROW_SPLIT = 1)
    IS_RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, ZERO_CENTERED: tl.constexpr,
    FROM_OUTPUT: tl.constexpr, RECOVER_LIMIT: tl.constexpr,
    BLOCK_ROW: tl.constexpr, BLOCK_COL: tl.constexpr,
    NUM_STAGES: tl.constexpr,  # Triton software pipelining of the tile loop (async copies through shared memory)
    PREFETCH: tl.constexpr,  # load tile i+1 into registers before computing tile i (register double-buffering)
    RELOAD_WEIGHT: tl.constexpr,  # load w per tile (L1-resident) instead of holding it in registers
    RECOMPUTE: tl.constexpr,  # keep the raw (16-bit) tile across the row reductions, widen it again after them
    EVICTION: tl.constexpr, INT64: tl.constexpr,
    PDL: tl.constexpr,  # let kernel_2 launch now: it waits (gdc_wait) for this grid's writes before reading
    ROW_SPLIT: tl.constexpr, SLOTS: tl.constexpr, PHASE: tl.constexpr,
    FUSED: tl.constexpr, RED_BLOCK_M: tl.constexpr, RED_BLOCK_N: tl.constexpr, RED_STAGES: tl.constexpr,
    COLUMN_ACC: tl.constexpr = False,  # dw/db: one fp32 value per column, each tile's rows added in as it is done
    PIPELINED: tl.constexpr = False,  # ROW_SPLIT: the exchange waits through inline assembly (pipelined loop)
    HINT: tl.constexpr = 1,  # N, SLICE and the row strides are multiples of this (`assume_multiple`)
    HAS_DRES: tl.constexpr = False,  # residual form: grad_input = dh + the norm's dx
    HAS_GATE: tl.constexpr = False,  # gated form (common.py): writes dz beside grad_input
    GATE_AFTER: tl.constexpr = False,  # the gate multiplies x before the norm (else its output)
    GATE_SIGMOID: tl.constexpr = False,  # the gate's activation is sigmoid (else silu)
    COLUMN_GROUPS: tl.constexpr = 1,  # groups of N columns in one launch (`common.column_group`)
):
    if PDL:
        gdc_launch_dependents()
    N, SLICE = assume_multiple(N, HINT), assume_multiple(SLICE, HINT)
    stride_g, stride_s, stride_dx = (assume_multiple(stride_g, HINT), assume_multiple(stride_s, HINT),
                                     assume_multiple(stride_dx, HINT))
    stride_dh = assume_multiple(stride_dh, HINT)
    stride_z, stride_dz = assume_multiple(stride_z, HINT), assume_multiple(stride_dz, HINT)
    pid, programs, cgroup = column_group(COLUMN_GROUPS)
    G, S, DX, DH, Z, DZ, W, B, RSTD, MEAN = group_operands(G, S, DX, DH, Z, DZ, W, B, RSTD, MEAN, cgroup, M, N,
                                                          COLUMN_GROUPS)
    group = pid // ROW_SPLIT
    part = pid % ROW_SPLIT
    groups = programs // ROW_SPLIT
    sync = cgroup * groups + group  # this row group's exchange slots and counters, over every column group
    local = tl.arange(0, BLOCK_COL)
    if ROW_SPLIT > 1:
        cols = tl.multiple_of(part * SLICE, 16) + local
    else:
        cols = local
    col_mask = (cols < N) & (local < SLICE)
    if not RELOAD_WEIGHT:
        w = effective_weight(W, cols, col_mask, HAS_WEIGHT, ZERO_CENTERED)
    b = recovery_bias(B, cols, col_mask, FROM_OUTPUT, HAS_BIAS)
    # dw/db accumulate as whole tiles and are summed over rows once at the end (no reduction across warps per
    # tile), or per column (COLUMN_ACC: block_row times fewer registers; the tile's rows are summed each tile,
    # within a thread when the layout gives each thread a column's rows, as on wide tiles).
    if COLUMN_ACC:
        acc_dw = tl.zeros((BLOCK_COL,), tl.float32)
        acc_db = tl.zeros((BLOCK_COL,), tl.float32)
    else:
        acc_dw = tl.zeros((BLOCK_ROW, BLOCK_COL), tl.float32)
        acc_db = tl.zeros((BLOCK_ROW, BLOCK_COL), tl.float32)
    num_tiles = tl.cdiv(M, BLOCK_ROW)
    rr = tl.arange(0, BLOCK_ROW)
    if PREFETCH:
        g_next, s_next, r_next, mu_next = load_rows(G, stride_g, S, stride_s, RSTD, MEAN, group * BLOCK_ROW + rr,
                                                    M, cols, col_mask, IS_RMS, FROM_OUTPUT, EVICTION, INT64)
    for tile in tl.range(group, num_tiles, groups, num_stages=NUM_STAGES):
        rows = tile * BLOCK_ROW + rr
        if PREFETCH:
            g, s, r, mu = g_next, s_next, r_next, mu_next
            g_next, s_next, r_next, mu_next = load_rows(G, stride_g, S, stride_s, RSTD, MEAN,
                                                        rows + groups * BLOCK_ROW, M, cols, col_mask, IS_RMS,
                                                        FROM_OUTPUT, EVICTION, INT64)
        else:
            g, s, r, mu = load_rows(G, stride_g, S, stride_s, RSTD, MEAN, rows, M, cols, col_mask, IS_RMS,
                                    FROM_OUTPUT, EVICTION, INT64)
        z_raw = load_gate(Z, stride_z, rows, M, cols, col_mask, HAS_GATE, EVICTION, INT64)
        if RELOAD_WEIGHT:
            w_raw = load_weight_raw(W, cols, col_mask, HAS_WEIGHT)
            w = weight_from_raw(w_raw, col_mask, HAS_WEIGHT, ZERO_CENTERED, False, 0)
        g_raw, s_raw = g, s
        g = g_raw.to(tl.float32)
        s = s_raw.to(tl.float32)
        g_norm, s_norm, a, da = gated(g, s, z_raw, HAS_GATE, GATE_AFTER, GATE_SIGMOID)
        xhat = normalized(s_norm, w, b, r, mu, IS_RMS, FROM_OUTPUT, HAS_WEIGHT, HAS_BIAS, RECOVER_LIMIT)
        if PHASE != 1:
            # dw/db do not depend on the row terms: accumulate before the reductions so g is dead across them.
            if COLUMN_ACC:
                if HAS_WEIGHT:
                    acc_dw += tl.sum(g_norm * xhat, axis=0)
                if HAS_BIAS:
                    acc_db += tl.sum(g_norm, axis=0)
            else:
                if HAS_WEIGHT:
                    acc_dw += g_norm * xhat
                if HAS_BIAS:
                    acc_db += g_norm
        wg = w[None, :] * g_norm
        c1 = tl.sum(scaled_normalized(xhat, s_norm, w, b, FROM_OUTPUT, HAS_BIAS) * g_norm, axis=1)
        c2 = tl.sum(wg, axis=1)
        if ROW_SPLIT > 1:
            c1, c2 = _exchange_row_sums(SUMS, COUNTERS, sync, part, (tile - group) // groups, c1, c2, ROW_SPLIT,
                                        SLOTS, BLOCK_ROW, PHASE, PIPELINED)
        c1 = c1 / N
        c2 = c2 / N
        if PHASE != 1:
            if RECOMPUTE:
                # Widen the raw tile again rather than keeping fp32 x̂ and w·g live across the reductions: halves
                # the registers the tile holds there (16-bit values pack two per register), so wide rows fit.
                zero = unprovable_zero(M)
                if RELOAD_WEIGHT:
                    w = weight_from_raw(w_raw, col_mask, HAS_WEIGHT, ZERO_CENTERED, True, zero)
                g = widen_again(g_raw, zero)
                s = widen_again(s_raw, zero)
                if HAS_GATE:
                    g_norm, s_norm, a, da = gated(g, s, widen_again(z_raw, zero), HAS_GATE, GATE_AFTER, GATE_SIGMOID)
                else:
                    g_norm, s_norm = g, s
                xhat = normalized(s_norm, w, b, r, mu, IS_RMS, FROM_OUTPUT, HAS_WEIGHT, HAS_BIAS, RECOVER_LIMIT)
                wg = w[None, :] * g_norm
            dx = grad_input(wg, xhat, c1, c2, r, IS_RMS)
            if HAS_GATE:
                dx, dz = gate_grads(dx, g, s, xhat, w, a, da, GATE_AFTER)
                store_gate_grad(DZ, stride_dz, dz, rows, M, cols, col_mask, HAS_GATE, EVICTION, INT64)
            store_rows(DX, stride_dx, DH, stride_dh, dx, rows, M, cols, col_mask, HAS_DRES, EVICTION, INT64)
    if PHASE != 1:
        partial = group * (N * COLUMN_GROUPS) + cgroup * N + cols  # partial rows span every column group
        if not COLUMN_ACC:
            acc_dw = tl.sum(acc_dw, axis=0)
            acc_db = tl.sum(acc_db, axis=0)
        if HAS_WEIGHT:
            tl.store(PARTIAL_DW + partial, acc_dw, mask=col_mask)
        if HAS_BIAS:
            tl.store(PARTIAL_DB + partial, acc_db, mask=col_mask)
    if ROW_SPLIT > 1 and PHASE == 0:
        leave_and_reset(COUNTERS + sync * COUNTER_STRIDE, DONE + sync, ROW_SPLIT)
    if FUSED:  # every program of the grid, every column group's columns
        arrive_and_wait(BARRIER, tl.num_programs(0))
        reduce_columns(PARTIAL_DW, PARTIAL_DB, DW, DB, groups, N * COLUMN_GROUPS, tl.program_id(0),
                       tl.num_programs(0), HAS_WEIGHT, HAS_BIAS, RED_BLOCK_M, RED_BLOCK_N, RED_STAGES)
        leave_and_reset(BARRIER, BARRIER + 1, tl.num_programs(0))


@triton.jit
def _load_chunk(g_rows, s_rows, d_rows, W, B, c0, chunk, N, row_mask, HAS_WEIGHT: tl.constexpr,
                ZERO_CENTERED: tl.constexpr, NEED_BIAS: tl.constexpr, LOAD_DRES: tl.constexpr, EVICTION: tl.constexpr):
    """Raw grad, saved and (LOAD_DRES) residual-gradient chunk at columns c0.., with w (and b when recovering x̂
    from y); past N loads nothing. Without LOAD_DRES the third chunk is g again (never used)."""
    cols = c0 + chunk
    col_mask = cols < N
    mask = row_mask[:, None] & col_mask[None, :]
    g = tl.load(g_rows + cols[None, :], mask=mask, other=0.0, eviction_policy=EVICTION)
    s = tl.load(s_rows + cols[None, :], mask=mask, other=0.0, eviction_policy=EVICTION)
    d = g
    if LOAD_DRES:
        d = tl.load(d_rows + cols[None, :], mask=mask, other=0.0, eviction_policy=EVICTION)
    w = effective_weight(W, cols, col_mask, HAS_WEIGHT, ZERO_CENTERED)
    b = tl.zeros(w.shape, tl.float32)
    if NEED_BIAS:
        b = tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)
    return g, s, d, w, b


@triton.jit
def _load_gate_chunk(z_rows, c0, chunk, N, row_mask, HAS_GATE: tl.constexpr, EVICTION: tl.constexpr):
    """The raw gate chunk at columns c0.. (HAS_GATE; else a 0 that is never used); past N loads nothing."""
    if HAS_GATE:
        cols = c0 + chunk
        z = tl.load(z_rows + cols[None, :], mask=row_mask[:, None] & (cols < N)[None, :], other=0.0,
                    eviction_policy=EVICTION)
    else:
        z = 0.0
    return z


@triton.jit
def kernel_1_two_pass(
    G, stride_g, S, stride_s, DX, stride_dx, DH, stride_dh, Z, stride_z, DZ, stride_dz, W, B, RSTD, MEAN,
    PARTIAL_DW, PARTIAL_DB, DW, DB,
    SUMS, COUNTERS, DONE, BARRIER, M, N, SLICE,
    IS_RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, ZERO_CENTERED: tl.constexpr,
    FROM_OUTPUT: tl.constexpr, RECOVER_LIMIT: tl.constexpr,
    BLOCK_ROW: tl.constexpr, BLOCK_COL: tl.constexpr, NUM_STAGES: tl.constexpr, PREFETCH: tl.constexpr,
    RELOAD_WEIGHT: tl.constexpr, RECOMPUTE: tl.constexpr, EVICTION: tl.constexpr,
    INT64: tl.constexpr, PDL: tl.constexpr, ROW_SPLIT: tl.constexpr, SLOTS: tl.constexpr, PHASE: tl.constexpr,
    FUSED: tl.constexpr, RED_BLOCK_M: tl.constexpr, RED_BLOCK_N: tl.constexpr, RED_STAGES: tl.constexpr,
    COLUMN_ACC: tl.constexpr = False, PIPELINED: tl.constexpr = False, HINT: tl.constexpr = 1,
    HAS_DRES: tl.constexpr = False, HAS_GATE: tl.constexpr = False, GATE_AFTER: tl.constexpr = False,
    GATE_SIGMOID: tl.constexpr = False, COLUMN_GROUPS: tl.constexpr = 1,
):
    """Arguments as `kernel_1_single_pass` (RELOAD_WEIGHT is implied: w is loaded per chunk; RECOMPUTE,
    ROW_SPLIT, SUMS, COUNTERS, DONE, SLICE, COLUMN_ACC and PIPELINED do not apply: pass 2 adds each chunk's rows
    to the partial row directly). Rows wider than BLOCK_COL: pass 1 reduces c1 (and c2) over column chunks, pass 2 re-reads the chunks (served by L2 when the programs' tiles fit there;
    pass 1 loads with evict_last to keep them), writes dx, and adds the tile's g·x̂ and g to the program's
    partial row (read-modify-write: the partial row is this program's alone). PREFETCH loads chunk j+1 before
    computing j. HAS_DRES: pass 2 reads dh with each chunk and writes grad_input = dh + dx. HAS_GATE: both passes
    read z with each chunk (not prefetched), pass 2 writes dz beside dx."""
    if PDL:
        gdc_launch_dependents()
    N = assume_multiple(N, HINT)
    stride_g, stride_s, stride_dx = (assume_multiple(stride_g, HINT), assume_multiple(stride_s, HINT),
                                     assume_multiple(stride_dx, HINT))
    stride_dh = assume_multiple(stride_dh, HINT)
    stride_z, stride_dz = assume_multiple(stride_z, HINT), assume_multiple(stride_dz, HINT)
    pid, programs, cgroup = column_group(COLUMN_GROUPS)
    G, S, DX, DH, Z, DZ, W, B, RSTD, MEAN = group_operands(G, S, DX, DH, Z, DZ, W, B, RSTD, MEAN, cgroup, M, N,
                                                          COLUMN_GROUPS)
    chunk = tl.arange(0, BLOCK_COL)
    num_tiles = tl.cdiv(M, BLOCK_ROW)
    partial_row = pid * (N * COLUMN_GROUPS) + cgroup * N  # partial rows span every column group
    NEED_BIAS: tl.constexpr = FROM_OUTPUT and HAS_BIAS
    for tile in range(pid, num_tiles, programs):
        rows = tile * BLOCK_ROW + tl.arange(0, BLOCK_ROW)
        row_mask = rows < M
        if INT64:
            rows = rows.to(tl.int64)
        g_rows = G + rows[:, None] * stride_g
        s_rows = S + rows[:, None] * stride_s
        d_rows = DH + rows[:, None] * stride_dh
        z_rows = Z + rows[:, None] * stride_z
        r = tl.load(RSTD + rows, mask=row_mask, other=0.0)
        mu = r
        if not IS_RMS and not FROM_OUTPUT:
            mu = tl.load(MEAN + rows, mask=row_mask, other=0.0)
        # Pass 1: row terms. Accumulate whole chunks, reduce across columns once.
        acc_c1 = tl.zeros((BLOCK_ROW, BLOCK_COL), tl.float32)
        acc_c2 = tl.zeros((BLOCK_ROW, BLOCK_COL), tl.float32)
        if PREFETCH:
            g_next, s_next, _, w_next, b_next = _load_chunk(g_rows, s_rows, d_rows, W, B, 0, chunk, N, row_mask,
                                                            HAS_WEIGHT, ZERO_CENTERED, NEED_BIAS, False, "evict_last")
        for c0 in tl.range(0, N, BLOCK_COL, num_stages=NUM_STAGES):
            if PREFETCH:
                g, s, w, b = g_next, s_next, w_next, b_next
                g_next, s_next, _, w_next, b_next = _load_chunk(g_rows, s_rows, d_rows, W, B, c0 + BLOCK_COL, chunk,
                                                                N, row_mask, HAS_WEIGHT, ZERO_CENTERED, NEED_BIAS,
                                                                False, "evict_last")
            else:
                g, s, _, w, b = _load_chunk(g_rows, s_rows, d_rows, W, B, c0, chunk, N, row_mask, HAS_WEIGHT,
                                            ZERO_CENTERED, NEED_BIAS, False, "evict_last")
            s = s.to(tl.float32)
            g = g.to(tl.float32)
            z = _load_gate_chunk(z_rows, c0, chunk, N, row_mask, HAS_GATE, "evict_last")
            g, s, _act, _act_grad = gated(g, s, z, HAS_GATE, GATE_AFTER, GATE_SIGMOID)
            xhat = normalized(s, w, b, r, mu, IS_RMS, FROM_OUTPUT, HAS_WEIGHT, HAS_BIAS, RECOVER_LIMIT)
            acc_c1 += scaled_normalized(xhat, s, w, b, FROM_OUTPUT, HAS_BIAS) * g
            if not IS_RMS:
                acc_c2 += w[None, :] * g
        c1 = tl.sum(acc_c1, axis=1) / N
        c2 = tl.sum(acc_c2, axis=1) / N
        # Pass 2: grad_input and the partials. A program's first tile starts its partial row from zero, so the
        # previous partial is read only after it (prev_cols = 0 masks the whole read).
        prev_cols = tl.where(tile == pid, 0, N)
        if PREFETCH:
            g_next, s_next, d_next, w_next, b_next = _load_chunk(g_rows, s_rows, d_rows, W, B, 0, chunk, N,
                                                                 row_mask, HAS_WEIGHT, ZERO_CENTERED, NEED_BIAS,
                                                                 HAS_DRES, EVICTION)
        for c0 in tl.range(0, N, BLOCK_COL, num_stages=NUM_STAGES):
            cols = c0 + chunk
            col_mask = cols < N
            # Issue the partial-row reads first so their latency overlaps the math below.
            if HAS_WEIGHT:
                prev_dw = tl.load(PARTIAL_DW + partial_row + cols, mask=cols < prev_cols, other=0.0)
            if HAS_BIAS:
                prev_db = tl.load(PARTIAL_DB + partial_row + cols, mask=cols < prev_cols, other=0.0)
            if PREFETCH:
                g, s, d, w, b = g_next, s_next, d_next, w_next, b_next
                g_next, s_next, d_next, w_next, b_next = _load_chunk(g_rows, s_rows, d_rows, W, B, c0 + BLOCK_COL,
                                                                     chunk, N, row_mask, HAS_WEIGHT, ZERO_CENTERED,
                                                                     NEED_BIAS, HAS_DRES, EVICTION)
            else:
                g, s, d, w, b = _load_chunk(g_rows, s_rows, d_rows, W, B, c0, chunk, N, row_mask, HAS_WEIGHT,
                                            ZERO_CENTERED, NEED_BIAS, HAS_DRES, EVICTION)
            g = g.to(tl.float32)
            s = s.to(tl.float32)
            z = _load_gate_chunk(z_rows, c0, chunk, N, row_mask, HAS_GATE, EVICTION)
            g_norm, s_norm, a, da = gated(g, s, z, HAS_GATE, GATE_AFTER, GATE_SIGMOID)
            xhat = normalized(s_norm, w, b, r, mu, IS_RMS, FROM_OUTPUT, HAS_WEIGHT, HAS_BIAS, RECOVER_LIMIT)
            if HAS_WEIGHT:
                tl.store(PARTIAL_DW + partial_row + cols, prev_dw + tl.sum(g_norm * xhat, axis=0), mask=col_mask)
            if HAS_BIAS:
                tl.store(PARTIAL_DB + partial_row + cols, prev_db + tl.sum(g_norm, axis=0), mask=col_mask)
            dx = grad_input(w[None, :] * g_norm, xhat, c1, c2, r, IS_RMS)
            mask = row_mask[:, None] & col_mask[None, :]
            if HAS_GATE:
                dx, dz = gate_grads(dx, g, s, xhat, w, a, da, GATE_AFTER)
                tl.store(DZ + rows[:, None] * stride_dz + cols[None, :], dz.to(DZ.dtype.element_ty), mask=mask)
            if HAS_DRES:
                dx += d.to(tl.float32)
            tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        # The next tile re-reads this tile's partial-row stores, possibly from other threads: order them.
        tl.debug_barrier()
    if FUSED:
        arrive_and_wait(BARRIER, tl.num_programs(0))
        reduce_columns(PARTIAL_DW, PARTIAL_DB, DW, DB, programs, N * COLUMN_GROUPS, tl.program_id(0),
                       tl.num_programs(0), HAS_WEIGHT, HAS_BIAS, RED_BLOCK_M, RED_BLOCK_N, RED_STAGES)
        leave_and_reset(BARRIER, BARRIER + 1, tl.num_programs(0))
