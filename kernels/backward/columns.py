"""kernel_1, columns strategy (few rows): when M is too small for persistent row programs to fill the GPU, each
program owns a column slice and sweeps every row, so it ends holding the final dw/db of its columns — no
partial buffer, no kernel_2. The rows' two sums (c1, c2) need whole rows, so a small kernel computes them first
(`row_sums`, one program per few rows); the column sweep then re-reads g and the saved activation, which for
such problems come from L2.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import (assume_multiple, column_group, effective_weight, gate_grads, gated, grad_input, group_operands,
                     load_gate, load_rows, normalized, recovery_bias, scaled_normalized, store_column_sums,
                     store_gate_grad, store_rows)


@triton.jit
def row_sums(
    G, stride_g, S, stride_s, Z, stride_z, W, B, RSTD, MEAN, C1, C2, M, N,
    IS_RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, ZERO_CENTERED: tl.constexpr,
    FROM_OUTPUT: tl.constexpr, RECOVER_LIMIT: tl.constexpr, BLOCK_ROW: tl.constexpr, BLOCK_COL: tl.constexpr,
    INT64: tl.constexpr, HINT: tl.constexpr = 1, HAS_GATE: tl.constexpr = False, GATE_AFTER: tl.constexpr = False,
    GATE_SIGMOID: tl.constexpr = False, COLUMN_GROUPS: tl.constexpr = 1,
):
    """c1 = mean(x̂·w·g) and c2 = mean(w·g) of BLOCK_ROW rows per program, over column chunks of BLOCK_COL (with
    a gate, of the gradient and rows the norm sees: `common.gated`)."""
    N, stride_g, stride_s = assume_multiple(N, HINT), assume_multiple(stride_g, HINT), assume_multiple(stride_s, HINT)
    stride_z = assume_multiple(stride_z, HINT)
    pid, _, cgroup = column_group(COLUMN_GROUPS)  # column group c's sums are C1[c·M:], C2[c·M:]
    G, S, _, _, Z, _, W, B, RSTD, MEAN = group_operands(G, S, G, G, Z, Z, W, B, RSTD, MEAN, cgroup, M, N,
                                                        COLUMN_GROUPS)
    C1, C2 = C1 + cgroup * M, C2 + cgroup * M
    rows = pid * BLOCK_ROW + tl.arange(0, BLOCK_ROW)
    chunk = tl.arange(0, BLOCK_COL)
    acc_c1 = tl.zeros((BLOCK_ROW, BLOCK_COL), tl.float32)
    acc_c2 = tl.zeros((BLOCK_ROW, BLOCK_COL), tl.float32)
    for c0 in range(0, N, BLOCK_COL):
        cols = c0 + chunk
        col_mask = cols < N
        g, s, r, mu = load_rows(G, stride_g, S, stride_s, RSTD, MEAN, rows, M, cols, col_mask, IS_RMS, FROM_OUTPUT,
                                "evict_last", INT64)
        w = effective_weight(W, cols, col_mask, HAS_WEIGHT, ZERO_CENTERED)
        b = recovery_bias(B, cols, col_mask, FROM_OUTPUT, HAS_BIAS)
        z = load_gate(Z, stride_z, rows, M, cols, col_mask, HAS_GATE, "evict_last", INT64)
        g, s, a, da = gated(g.to(tl.float32), s.to(tl.float32), z, HAS_GATE, GATE_AFTER, GATE_SIGMOID)
        xhat = normalized(s, w, b, r, mu, IS_RMS, FROM_OUTPUT, HAS_WEIGHT, HAS_BIAS, RECOVER_LIMIT)
        acc_c1 += scaled_normalized(xhat, s, w, b, FROM_OUTPUT, HAS_BIAS) * g
        acc_c2 += w[None, :] * g
    row_mask = rows < M
    tl.store(C1 + rows, tl.sum(acc_c1, axis=1) / N, mask=row_mask)
    tl.store(C2 + rows, tl.sum(acc_c2, axis=1) / N, mask=row_mask)


@triton.jit
def kernel_1_columns(
    G, stride_g, S, stride_s, DX, stride_dx, DH, stride_dh, Z, stride_z, DZ, stride_dz, W, B, RSTD, MEAN, C1, C2, DW,
    DB, M, N,
    IS_RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, ZERO_CENTERED: tl.constexpr,
    FROM_OUTPUT: tl.constexpr, RECOVER_LIMIT: tl.constexpr, BLOCK_ROW: tl.constexpr, BLOCK_COL: tl.constexpr,
    NUM_STAGES: tl.constexpr, PREFETCH: tl.constexpr, EVICTION: tl.constexpr, INT64: tl.constexpr,
    HINT: tl.constexpr = 1, HAS_DRES: tl.constexpr = False, HAS_GATE: tl.constexpr = False,
    GATE_AFTER: tl.constexpr = False, GATE_SIGMOID: tl.constexpr = False, COLUMN_GROUPS: tl.constexpr = 1,
):
    """Program p: columns [p·BLOCK_COL, (p+1)·BLOCK_COL) of every row, BLOCK_ROW rows at a time in row order;
    writes grad_input there (plus dh, HAS_DRES: the residual form) and the columns' final dw/db (fixed order:
    reruns are bitwise identical). HAS_GATE: reads z and writes dz there too (`common.gated`)."""
    N, stride_g, stride_s = assume_multiple(N, HINT), assume_multiple(stride_g, HINT), assume_multiple(stride_s, HINT)
    stride_dx, stride_dh = assume_multiple(stride_dx, HINT), assume_multiple(stride_dh, HINT)
    stride_z, stride_dz = assume_multiple(stride_z, HINT), assume_multiple(stride_dz, HINT)
    pid, _, cgroup = column_group(COLUMN_GROUPS)
    G, S, DX, DH, Z, DZ, W, B, RSTD, MEAN = group_operands(G, S, DX, DH, Z, DZ, W, B, RSTD, MEAN, cgroup, M, N,
                                                          COLUMN_GROUPS)
    if COLUMN_GROUPS > 1:
        C1, C2, DW, DB = C1 + cgroup * M, C2 + cgroup * M, DW + cgroup * N, DB + cgroup * N
    cols = pid * BLOCK_COL + tl.arange(0, BLOCK_COL)
    col_mask = cols < N
    w = effective_weight(W, cols, col_mask, HAS_WEIGHT, ZERO_CENTERED)
    b = recovery_bias(B, cols, col_mask, FROM_OUTPUT, HAS_BIAS)
    acc_dw = tl.zeros((BLOCK_ROW, BLOCK_COL), tl.float32)
    acc_db = tl.zeros((BLOCK_ROW, BLOCK_COL), tl.float32)
    rr = tl.arange(0, BLOCK_ROW)
    if PREFETCH:
        g_next, s_next, r_next, mu_next = load_rows(G, stride_g, S, stride_s, RSTD, MEAN, rr, M, cols, col_mask,
                                                    IS_RMS, FROM_OUTPUT, EVICTION, INT64)
    for m0 in tl.range(0, M, BLOCK_ROW, num_stages=NUM_STAGES):
        rows = m0 + rr
        if PREFETCH:
            g, s, r, mu = g_next, s_next, r_next, mu_next
            g_next, s_next, r_next, mu_next = load_rows(G, stride_g, S, stride_s, RSTD, MEAN, rows + BLOCK_ROW, M,
                                                        cols, col_mask, IS_RMS, FROM_OUTPUT, EVICTION, INT64)
        else:
            g, s, r, mu = load_rows(G, stride_g, S, stride_s, RSTD, MEAN, rows, M, cols, col_mask, IS_RMS,
                                    FROM_OUTPUT, EVICTION, INT64)
        row_mask = rows < M
        c1 = tl.load(C1 + rows, mask=row_mask, other=0.0)
        c2 = tl.load(C2 + rows, mask=row_mask, other=0.0)
        g = g.to(tl.float32)
        s = s.to(tl.float32)
        z = load_gate(Z, stride_z, rows, M, cols, col_mask, HAS_GATE, EVICTION, INT64)
        g_norm, s_norm, a, da = gated(g, s, z, HAS_GATE, GATE_AFTER, GATE_SIGMOID)
        xhat = normalized(s_norm, w, b, r, mu, IS_RMS, FROM_OUTPUT, HAS_WEIGHT, HAS_BIAS, RECOVER_LIMIT)
        if HAS_WEIGHT:
            acc_dw += g_norm * xhat
        if HAS_BIAS:
            acc_db += g_norm
        dx = grad_input(w[None, :] * g_norm, xhat, c1, c2, r, IS_RMS)
        if HAS_GATE:
            dx, dz = gate_grads(dx, g, s, xhat, w, a, da, GATE_AFTER)
            store_gate_grad(DZ, stride_dz, dz, rows, M, cols, col_mask, HAS_GATE, EVICTION, INT64)
        store_rows(DX, stride_dx, DH, stride_dh, dx, rows, M, cols, col_mask, HAS_DRES, EVICTION, INT64)
    store_column_sums(DW, DB, acc_dw, acc_db, cols, col_mask, HAS_WEIGHT, HAS_BIAS)
