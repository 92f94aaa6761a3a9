"""kernel_1, dual strategy (few rows): one launch in which the first ROW_PROGRAMS programs write grad_input
(each holds whole rows, as the rows strategy's single pass does, and computes their two sums itself) and the
others write the final dw/db, each sweeping every row of one column slice in row order. No partial buffer, no
kernel_2 and no wait between programs: dw/db need only the inputs and the saved statistics, not grad_input. The
column programs re-read g and the saved activation, which for such problems come from L2; the rows strategy
would instead write and re-read fp32 partials that outweigh the inputs when each program holds a row or two.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import (assume_multiple, column_group, effective_weight, gate_grads, gated, grad_input, group_operands,
                     load_gate, load_rows, normalized, recovery_bias, scaled_normalized, store_column_sums,
                     store_gate_grad, store_rows)


@triton.jit
def _write_grad_input(G, stride_g, S, stride_s, DX, stride_dx, DH, stride_dh, Z, stride_z, DZ, stride_dz, W, B, RSTD,
                      MEAN, M, N, pid, ROW_PROGRAMS, IS_RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                      HAS_BIAS: tl.constexpr, ZERO_CENTERED: tl.constexpr, FROM_OUTPUT: tl.constexpr,
                      RECOVER_LIMIT: tl.constexpr, BLOCK_ROW: tl.constexpr, BLOCK_COL: tl.constexpr,
                      NUM_STAGES: tl.constexpr, PREFETCH: tl.constexpr, EVICTION: tl.constexpr, INT64: tl.constexpr,
                      HAS_DRES: tl.constexpr, HAS_GATE: tl.constexpr, GATE_AFTER: tl.constexpr,
                      GATE_SIGMOID: tl.constexpr):
    """Row program `pid`: row tiles pid, pid + ROW_PROGRAMS, …, each whole row's two sums, then grad_input (plus
    dh, HAS_DRES: the residual form; and dz, HAS_GATE: the gated form)."""
    cols = tl.arange(0, BLOCK_COL)
    col_mask = cols < N
    w = effective_weight(W, cols, col_mask, HAS_WEIGHT, ZERO_CENTERED)
    b = recovery_bias(B, cols, col_mask, FROM_OUTPUT, HAS_BIAS)
    rr = tl.arange(0, BLOCK_ROW)
    if PREFETCH:
        g_next, s_next, r_next, mu_next = load_rows(G, stride_g, S, stride_s, RSTD, MEAN, pid * BLOCK_ROW + rr, M,
                                                    cols, col_mask, IS_RMS, FROM_OUTPUT, EVICTION, INT64)
    for tile in tl.range(pid, tl.cdiv(M, BLOCK_ROW), ROW_PROGRAMS, num_stages=NUM_STAGES):
        rows = tile * BLOCK_ROW + rr
        if PREFETCH:
            g, s, r, mu = g_next, s_next, r_next, mu_next
            g_next, s_next, r_next, mu_next = load_rows(G, stride_g, S, stride_s, RSTD, MEAN,
                                                        rows + ROW_PROGRAMS * BLOCK_ROW, M, cols, col_mask, IS_RMS,
                                                        FROM_OUTPUT, EVICTION, INT64)
        else:
            g, s, r, mu = load_rows(G, stride_g, S, stride_s, RSTD, MEAN, rows, M, cols, col_mask, IS_RMS,
                                    FROM_OUTPUT, EVICTION, INT64)
        g = g.to(tl.float32)
        s = s.to(tl.float32)
        z = load_gate(Z, stride_z, rows, M, cols, col_mask, HAS_GATE, EVICTION, INT64)
        g_norm, s_norm, a, da = gated(g, s, z, HAS_GATE, GATE_AFTER, GATE_SIGMOID)
        xhat = normalized(s_norm, w, b, r, mu, IS_RMS, FROM_OUTPUT, HAS_WEIGHT, HAS_BIAS, RECOVER_LIMIT)
        wg = w[None, :] * g_norm
        c1 = tl.sum(scaled_normalized(xhat, s_norm, w, b, FROM_OUTPUT, HAS_BIAS) * g_norm, axis=1) / N
        c2 = tl.sum(wg, axis=1) / N
        dx = grad_input(wg, xhat, c1, c2, r, IS_RMS)
        if HAS_GATE:
            dx, dz = gate_grads(dx, g, s, xhat, w, a, da, GATE_AFTER)
            store_gate_grad(DZ, stride_dz, dz, rows, M, cols, col_mask, HAS_GATE, EVICTION, INT64)
        store_rows(DX, stride_dx, DH, stride_dh, dx, rows, M, cols, col_mask, HAS_DRES, EVICTION, INT64)


@triton.jit
def _write_column_sums(G, stride_g, S, stride_s, Z, stride_z, W, B, RSTD, MEAN, DW, DB, M, N, slice_index,
                       IS_RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
                       ZERO_CENTERED: tl.constexpr, FROM_OUTPUT: tl.constexpr, RECOVER_LIMIT: tl.constexpr,
                       INT64: tl.constexpr, RED_BLOCK_M: tl.constexpr, RED_BLOCK_N: tl.constexpr,
                       HAS_GATE: tl.constexpr, GATE_AFTER: tl.constexpr, GATE_SIGMOID: tl.constexpr):
    """Column program: dw = Σ g·x̂ and db = Σ g over every row of its RED_BLOCK_N columns, in row order (with a
    gate, of the gradient and rows the norm sees: `common.gated`)."""
    cols = slice_index * RED_BLOCK_N + tl.arange(0, RED_BLOCK_N)
    col_mask = cols < N
    w = effective_weight(W, cols, col_mask, HAS_WEIGHT, ZERO_CENTERED)
    b = recovery_bias(B, cols, col_mask, FROM_OUTPUT, HAS_BIAS)
    acc_dw = tl.zeros((RED_BLOCK_M, RED_BLOCK_N), tl.float32)
    acc_db = tl.zeros((RED_BLOCK_M, RED_BLOCK_N), tl.float32)
    for m0 in range(0, M, RED_BLOCK_M):
        rows = m0 + tl.arange(0, RED_BLOCK_M)
        g, s, r, mu = load_rows(G, stride_g, S, stride_s, RSTD, MEAN, rows, M, cols, col_mask, IS_RMS, FROM_OUTPUT,
                                "", INT64)
        z = load_gate(Z, stride_z, rows, M, cols, col_mask, HAS_GATE, "", INT64)
        g, s, a, da = gated(g.to(tl.float32), s.to(tl.float32), z, HAS_GATE, GATE_AFTER, GATE_SIGMOID)
        if HAS_WEIGHT:
            acc_dw += g * normalized(s, w, b, r, mu, IS_RMS, FROM_OUTPUT, HAS_WEIGHT, HAS_BIAS, RECOVER_LIMIT)
        if HAS_BIAS:
            acc_db += g
    store_column_sums(DW, DB, acc_dw, acc_db, cols, col_mask, HAS_WEIGHT, HAS_BIAS)


@triton.jit
def kernel_1_dual(
    G, stride_g, S, stride_s, DX, stride_dx, DH, stride_dh, Z, stride_z, DZ, stride_dz, W, B, RSTD, MEAN, DW, DB, M,
    N, ROW_PROGRAMS,
    IS_RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, ZERO_CENTERED: tl.constexpr,
    FROM_OUTPUT: tl.constexpr, RECOVER_LIMIT: tl.constexpr,
    BLOCK_ROW: tl.constexpr, BLOCK_COL: tl.constexpr,  # the row programs' tile (BLOCK_COL covers a row)
    NUM_STAGES: tl.constexpr, PREFETCH: tl.constexpr, EVICTION: tl.constexpr, INT64: tl.constexpr,
    RED_BLOCK_M: tl.constexpr, RED_BLOCK_N: tl.constexpr,  # the column programs' tile: rows per step, columns
    HINT: tl.constexpr = 1, HAS_DRES: tl.constexpr = False, HAS_GATE: tl.constexpr = False,
    GATE_AFTER: tl.constexpr = False, GATE_SIGMOID: tl.constexpr = False, COLUMN_GROUPS: tl.constexpr = 1,
):
    """Arguments as `kernel_1_columns`, without the row sums (the row programs compute them) and with the number
    of row programs; programs past it own RED_BLOCK_N columns each (of each column group: `common.column_group`)."""
    N, stride_g, stride_s = assume_multiple(N, HINT), assume_multiple(stride_g, HINT), assume_multiple(stride_s, HINT)
    stride_dx, stride_dh = assume_multiple(stride_dx, HINT), assume_multiple(stride_dh, HINT)
    stride_z, stride_dz = assume_multiple(stride_z, HINT), assume_multiple(stride_dz, HINT)
    pid, _, cgroup = column_group(COLUMN_GROUPS)
    G, S, DX, DH, Z, DZ, W, B, RSTD, MEAN = group_operands(G, S, DX, DH, Z, DZ, W, B, RSTD, MEAN, cgroup, M, N,
                                                          COLUMN_GROUPS)
    if COLUMN_GROUPS > 1:
        DW, DB = DW + cgroup * N, DB + cgroup * N
    if pid < ROW_PROGRAMS:
        _write_grad_input(G, stride_g, S, stride_s, DX, stride_dx, DH, stride_dh, Z, stride_z, DZ, stride_dz, W, B,
                          RSTD, MEAN, M, N, pid, ROW_PROGRAMS, IS_RMS, HAS_WEIGHT, HAS_BIAS, ZERO_CENTERED,
                          FROM_OUTPUT, RECOVER_LIMIT, BLOCK_ROW, BLOCK_COL, NUM_STAGES, PREFETCH, EVICTION, INT64,
                          HAS_DRES, HAS_GATE, GATE_AFTER, GATE_SIGMOID)
    else:
        _write_column_sums(G, stride_g, S, stride_s, Z, stride_z, W, B, RSTD, MEAN, DW, DB, M, N, pid - ROW_PROGRAMS,
                           IS_RMS, HAS_WEIGHT, HAS_BIAS, ZERO_CENTERED, FROM_OUTPUT, RECOVER_LIMIT, INT64,
                           RED_BLOCK_M, RED_BLOCK_N, HAS_GATE, GATE_AFTER, GATE_SIGMOID)
