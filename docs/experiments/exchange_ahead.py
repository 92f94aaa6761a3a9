"""Wide LayerNorm rows split over two programs, with the row-sum exchange one tile ahead. In the shipped
row_split kernel a program publishes its slice's row sums, waits for its partner's, then computes grad_input:
with one program per SM nothing overlaps the wait. Here (AHEAD) a program loads the next tile and publishes its
sums before it waits for the current tile's, so the next tile's loads are in flight during the wait. A prototype
LayerNorm kernel_1 (saved input, weight and bias, dw/db per column, fp32 partial row per group), timed cold-L2
in one process with and without AHEAD, next to the shipped table's kernel_1, and checked against float64.

    python docs/experiments/exchange_ahead.py OUT_DIR [--shapes 2048x16384,...]

Each program counts the tiles it has published in its own flag (one 128-byte line each); a program waits until
its partner's flag reaches the tile it needs, so a program one tile ahead never satisfies a wait for the
current tile. Four slots: a program can publish tile k+1 while its partner still reads tile k−1 (never k−3).
The last program of a group to finish resets the group's flags, so the buffer is zero for the next launch.
Every sum is added in a fixed order (slice 0, then slice 1): reruns are bitwise identical.
"""

from __future__ import annotations

import os
import sys

import torch
import triton
import triton.language as tl

from normtune.kernels.backward.common import unprovable_zero, widen_again

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from variant_timing import prototype_baseline, prototype_inputs, prototype_setup, record_prototype  # noqa: E402

SHAPES = "2048x16384,1024x16384,4096x16384,16384x16384,512x16384"
FLAG_STRIDE = 32  # int32 elements: one L2 line per flag
SLOTS = 4


@triton.jit
def _tile(G, X, RSTD, MEAN, rows, M, stride, cols, col_mask, EVICTION: tl.constexpr):
    row_mask = rows < M
    mask = row_mask[:, None] & col_mask[None, :]
    offsets = rows[:, None].to(tl.int64) * stride + cols[None, :]
    g = tl.load(G + offsets, mask=mask, other=0.0, eviction_policy=EVICTION)
    x = tl.load(X + offsets, mask=mask, other=0.0, eviction_policy=EVICTION)
    r = tl.load(RSTD + rows, mask=row_mask, other=0.0)
    mu = tl.load(MEAN + rows, mask=row_mask, other=0.0)
    return g, x, r, mu


@triton.jit
def _publish(SUMS, FLAGS, group, part, k, g_raw, x_raw, r, mu, w, BLOCK_ROW: tl.constexpr):
    """This slice's row sums of the group's k-th tile into slot k % SLOTS, then count it in this program's flag.
    Returns the tile's dw and db column sums (added to the accumulators by the caller)."""
    g = g_raw.to(tl.float32)
    xhat = (x_raw.to(tl.float32) - mu[:, None]) * r[:, None]
    wg = w[None, :] * g
    rr = tl.arange(0, BLOCK_ROW)
    base = SUMS + ((group * 4 + k % 4) * 2 + part) * (2 * BLOCK_ROW)
    tl.store(base + rr, tl.sum(xhat * wg, axis=1))
    tl.store(base + BLOCK_ROW + rr, tl.sum(wg, axis=1))
    tl.debug_barrier()
    tl.atomic_add(FLAGS + (group * 2 + part) * 32, 1, sem="release")
    return tl.sum(g * xhat, axis=0), tl.sum(g, axis=0)


@triton.jit
def _finish(SUMS, FLAGS, DX, group, part, k, g_raw, x_raw, r, mu, w, rows, M, stride, cols, col_mask, N,
            BLOCK_ROW: tl.constexpr):
    """Wait until the partner has published tile k, add both slices' sums in slice order, store grad_input."""
    other = FLAGS + (group * 2 + (1 - part)) * 32
    count = tl.atomic_add(other, 0, sem="acquire")
    while count < k + 1:
        count = tl.atomic_add(other, 0, sem="acquire")
    tl.debug_barrier()
    rr = tl.arange(0, BLOCK_ROW)
    base = SUMS + ((group * 4 + k % 4) * 2) * (2 * BLOCK_ROW)
    c1 = (tl.load(base + rr, cache_modifier=".cg") + tl.load(base + 2 * BLOCK_ROW + rr, cache_modifier=".cg")) / N
    c2 = (tl.load(base + BLOCK_ROW + rr, cache_modifier=".cg")
          + tl.load(base + 3 * BLOCK_ROW + rr, cache_modifier=".cg")) / N
    # Widen the raw tiles again (see `widen_again`): the compiler cannot merge this with the
    # conversion before the wait, so only the packed bf16 tiles stay live across it (the shipped RECOMPUTE).
    xhat = (widen_again(x_raw, unprovable_zero(M)) - mu[:, None]) * r[:, None]
    dx = (w[None, :] * widen_again(g_raw, unprovable_zero(M)) - c2[:, None] - xhat * c1[:, None]) * r[:, None]
    mask = (rows < M)[:, None] & col_mask[None, :]
    tl.store(DX + rows[:, None].to(tl.int64) * stride + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)


@triton.jit
def ln_kernel_1_split2(G, X, DX, W, RSTD, MEAN, PARTIAL_DW, PARTIAL_DB, SUMS, FLAGS, DONE, M, N, stride, SLICE,
                       BLOCK_ROW: tl.constexpr, BLOCK_COL: tl.constexpr, AHEAD: tl.constexpr,
                       EVICTION: tl.constexpr):
    pid = tl.program_id(0)
    groups = tl.num_programs(0) // 2
    group = pid // 2
    part = pid % 2
    local = tl.arange(0, BLOCK_COL)
    cols = part * SLICE + local
    col_mask = (local < SLICE) & (cols < N)
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    acc_dw = tl.zeros((BLOCK_COL,), tl.float32)
    acc_db = tl.zeros((BLOCK_COL,), tl.float32)
    rr = tl.arange(0, BLOCK_ROW)
    num_tiles = tl.cdiv(M, BLOCK_ROW)
    mine = tl.cdiv(num_tiles - group, groups)  # tiles of this group: group, group + groups, ...
    if AHEAD:
        rows = group * BLOCK_ROW + rr
        g, x, r, mu = _tile(G, X, RSTD, MEAN, rows, M, stride, cols, col_mask, EVICTION)
        dw, db = _publish(SUMS, FLAGS, group, part, 0, g, x, r, mu, w, BLOCK_ROW)
        acc_dw += dw
        acc_db += db
        for k in range(0, mine):
            rows_next = rows + groups * BLOCK_ROW  # past M on the last tile: masked loads, sums never read
            g_n, x_n, r_n, mu_n = _tile(G, X, RSTD, MEAN, rows_next, M, stride, cols, col_mask, EVICTION)
            if k + 1 < mine:
                dw, db = _publish(SUMS, FLAGS, group, part, k + 1, g_n, x_n, r_n, mu_n, w, BLOCK_ROW)
                acc_dw += dw
                acc_db += db
            _finish(SUMS, FLAGS, DX, group, part, k, g, x, r, mu, w, rows, M, stride, cols, col_mask, N, BLOCK_ROW)
            g, x, r, mu, rows = g_n, x_n, r_n, mu_n, rows_next
    else:
        for k in range(0, mine):
            rows = (group + k * groups) * BLOCK_ROW + rr
            g, x, r, mu = _tile(G, X, RSTD, MEAN, rows, M, stride, cols, col_mask, EVICTION)
            dw, db = _publish(SUMS, FLAGS, group, part, k, g, x, r, mu, w, BLOCK_ROW)
            acc_dw += dw
            acc_db += db
            _finish(SUMS, FLAGS, DX, group, part, k, g, x, r, mu, w, rows, M, stride, cols, col_mask, N, BLOCK_ROW)
    tl.store(PARTIAL_DW + group * N + cols, acc_dw, mask=col_mask)
    tl.store(PARTIAL_DB + group * N + cols, acc_db, mask=col_mask)
    left = tl.atomic_add(DONE + group * 32, 1, sem="acq_rel") + 1
    if left == 2:
        tl.atomic_xchg(FLAGS + (group * 2) * 32, 0, sem="relaxed")
        tl.atomic_xchg(FLAGS + (group * 2 + 1) * 32, 0, sem="relaxed")
        tl.atomic_xchg(DONE + group * 32, 0, sem="relaxed")


def main() -> None:
    args, info, session, flusher, out = prototype_setup("exchange_ahead", __doc__, SHAPES)
    for shape in args.shapes.split(","):
        M, N, _, floor, table = prototype_baseline(session, info, "layer_norm", shape)
        inp = prototype_inputs("layer_norm", M, N)
        x, g, w, rstd, mean = inp["x"], inp["g"], inp["w"], inp["rstd"], inp["mean"]
        dx_ref, dw_ref, db_ref = inp["dx"], inp["dw"], inp["db"]
        dx = torch.empty_like(x)
        slice_ = N // 2
        groups = info.sm_count // 2
        flags = torch.zeros(groups * 2 * FLAG_STRIDE, device="cuda", dtype=torch.int32)
        done = torch.zeros(groups * FLAG_STRIDE, device="cuda", dtype=torch.int32)
        for block_row in (1, 2):
            for warps in (8, 16):
                for ahead in (False, True):
                    tiles = triton.cdiv(M, block_row)
                    grid = 2 * min(groups, tiles)
                    pdw = torch.empty(grid // 2, N, device="cuda", dtype=torch.float32)
                    pdb = torch.empty_like(pdw)
                    sums = torch.empty(grid // 2 * SLOTS * 2 * 2 * block_row, device="cuda", dtype=torch.float32)

                    block_col = triton.next_power_of_2(slice_)

                    def launch():
                        ln_kernel_1_split2[(grid,)](g, x, dx, w, rstd, mean, pdw, pdb, sums, flags, done, M, N, N,
                                                    slice_, BLOCK_ROW=block_row, BLOCK_COL=block_col, AHEAD=ahead,
                                                    EVICTION="evict_first", num_warps=warps)
                    for t in (dx, pdw, pdb):
                        t.fill_(float("nan"))
                    name = f"split2 r{block_row} w{warps} {'ahead' if ahead else 'plain'}"
                    try:
                        launch()
                        torch.cuda.synchronize()
                    except Exception as err:  # noqa: BLE001 - a variant that does not compile is a result too
                        print(f"  {name}: {type(err).__name__}: {err}"[:200], flush=True)
                        continue
                    first = (dx.clone(), pdw.sum(0), pdb.sum(0))
                    refs = (dx_ref, dw_ref, db_ref)
                    errs = [((a.double() - b).norm() / b.norm()).item() for a, b in zip(first, refs)]
                    launch()
                    same = torch.equal(dx, first[0]) and torch.equal(pdw.sum(0), first[1])
                    record_prototype(out, name, launch, flusher, info, M, N, floor, table, rel_err_dx=errs[0],
                                     rel_err_dw=errs[1], rel_err_db=errs[2], bitwise_rerun=same)
    out.close()


if __name__ == "__main__":
    main()
