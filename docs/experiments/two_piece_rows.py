"""Rows whose width is not a power of two, held as two power-of-two pieces (e.g. 5120 = 4096 + 1024) instead of
one tile padded to the next power of two (8192: 37.5 % of the lanes masked). A prototype RMSNorm kernel_1 (rows
strategy, persistent programs, fp32 partial dw per program, optional register prefetch), timed cold-L2 in one
process in both forms with the same launch settings, next to the shipped table's kernel_1, and checked against
a float64 reference. The question it answers before the form becomes a config field: is the padding what keeps
N = 1.25·2^k rows below the copy floor fraction of their power-of-two neighbours?

    python docs/experiments/two_piece_rows.py OUT_DIR [--shapes 16384x5120,...]

Prints one line per variant (kernel_1 µs, fraction of the copy floor, errors) and writes OUT_DIR/two_piece_rows.jsonl.
"""

from __future__ import annotations

import os
import sys

import torch
import triton
import triton.language as tl

from normtune.kernels.heuristics import next_power_of_two

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from variant_timing import prototype_baseline, prototype_inputs, prototype_setup, record_prototype  # noqa: E402

SHAPES = "16384x5120,4096x5120,16384x2560,16384x1536,16384x6144,16384x4096"


@triton.jit
def _load_piece(G, S, rows, row_mask, stride, cols, col_mask, EVICTION: tl.constexpr):
    mask = row_mask[:, None] & col_mask[None, :]
    offsets = rows[:, None].to(tl.int64) * stride + cols[None, :]
    g = tl.load(G + offsets, mask=mask, other=0.0, eviction_policy=EVICTION)
    s = tl.load(S + offsets, mask=mask, other=0.0, eviction_policy=EVICTION)
    return g, s


@triton.jit
def rms_kernel_1_pieces(G, S, DX, W, RSTD, PARTIAL_DW, M, N, stride,
                        HEAD: tl.constexpr, TAIL: tl.constexpr, TAIL_WIDTH: tl.constexpr, BLOCK_ROW: tl.constexpr,
                        PREFETCH: tl.constexpr, EVICTION: tl.constexpr):
    """Columns [0, HEAD) and, when TAIL > 0, [HEAD, HEAD + TAIL): two register tiles per row tile (TAIL_WIDTH:
    max(TAIL, 1), the tail's arange; with TAIL = 0 the head covers N, so the tail is all masked and unused)."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    rr = tl.arange(0, BLOCK_ROW)
    ch = tl.arange(0, HEAD)
    mh = ch < N
    wh = tl.load(W + ch, mask=mh, other=0.0).to(tl.float32)
    acc_h = tl.zeros((BLOCK_ROW, HEAD), tl.float32)
    ct = HEAD + tl.arange(0, TAIL_WIDTH)
    mt = ct < N
    wt = tl.load(W + ct, mask=mt, other=0.0).to(tl.float32)
    acc_t = tl.zeros((BLOCK_ROW, TAIL_WIDTH), tl.float32)
    num_tiles = tl.cdiv(M, BLOCK_ROW)
    if PREFETCH:
        rows = pid * BLOCK_ROW + rr
        gh_n, sh_n = _load_piece(G, S, rows, rows < M, stride, ch, mh, EVICTION)
        if TAIL > 0:
            gt_n, st_n = _load_piece(G, S, rows, rows < M, stride, ct, mt, EVICTION)
    for tile in tl.range(pid, num_tiles, programs):
        rows = tile * BLOCK_ROW + rr
        row_mask = rows < M
        if PREFETCH:
            gh, sh = gh_n, sh_n
            nxt = rows + programs * BLOCK_ROW
            gh_n, sh_n = _load_piece(G, S, nxt, nxt < M, stride, ch, mh, EVICTION)
            if TAIL > 0:
                gt, st = gt_n, st_n
                gt_n, st_n = _load_piece(G, S, nxt, nxt < M, stride, ct, mt, EVICTION)
        else:
            gh, sh = _load_piece(G, S, rows, row_mask, stride, ch, mh, EVICTION)
            if TAIL > 0:
                gt, st = _load_piece(G, S, rows, row_mask, stride, ct, mt, EVICTION)
        r = tl.load(RSTD + rows, mask=row_mask, other=0.0)
        gh = gh.to(tl.float32)
        xh = sh.to(tl.float32) * r[:, None]
        acc_h += gh * xh
        wgh = wh[None, :] * gh
        c1 = tl.sum(xh * wgh, axis=1)
        if TAIL > 0:
            gt = gt.to(tl.float32)
            xt = st.to(tl.float32) * r[:, None]
            acc_t += gt * xt
            wgt = wt[None, :] * gt
            c1 += tl.sum(xt * wgt, axis=1)
        c1 = c1 / N
        out = rows[:, None].to(tl.int64) * stride
        tl.store(DX + out + ch[None, :], ((wgh - xh * c1[:, None]) * r[:, None]).to(DX.dtype.element_ty),
                 mask=row_mask[:, None] & mh[None, :])
        if TAIL > 0:
            tl.store(DX + out + ct[None, :], ((wgt - xt * c1[:, None]) * r[:, None]).to(DX.dtype.element_ty),
                     mask=row_mask[:, None] & mt[None, :])
    tl.store(PARTIAL_DW + pid * N + ch, tl.sum(acc_h, axis=0), mask=mh)
    if TAIL > 0:
        tl.store(PARTIAL_DW + pid * N + ct, tl.sum(acc_t, axis=0), mask=mt)


def pieces(N: int, two: bool) -> tuple[int, int]:
    """(head, tail): one padded tile, or the largest power of two <= N plus the smallest one covering the rest."""
    if not two or N & (N - 1) == 0:
        return next_power_of_two(N), 0
    head = 1 << (N.bit_length() - 1)
    return head, next_power_of_two(N - head)


def main() -> None:
    args, info, session, flusher, out = prototype_setup("two_piece_rows", __doc__, SHAPES)
    for shape in args.shapes.split(","):
        M, N, _, floor, table = prototype_baseline(session, info, "rms_norm", shape)
        inp = prototype_inputs("rms_norm", M, N)
        x, g, w, rstd = inp["x"], inp["g"], inp["w"], inp["rstd"]
        dx_ref, dw_ref = inp["dx"], inp["dw"]
        dx = torch.empty_like(x)
        for two in (False, True):
            head, tail = pieces(N, two)
            if two and tail == 0:
                continue
            for warps, block_row, prefetch in ((8, 1, True), (16, 1, True), (32, 1, True), (16, 2, True),
                                               (8, 2, True), (16, 1, False), (32, 1, False)):
                programs = min(triton.cdiv(M, block_row), info.sm_count)
                partial = torch.empty(programs, N, device="cuda", dtype=torch.float32)

                def launch():
                    rms_kernel_1_pieces[(programs,)](g, x, dx, w, rstd, partial, M, N, N, HEAD=head, TAIL=tail,
                                                     TAIL_WIDTH=max(tail, 1),
                                                     BLOCK_ROW=block_row, PREFETCH=prefetch, EVICTION="evict_first",
                                                     num_warps=warps)
                dx.fill_(float("nan"))
                partial.fill_(float("nan"))
                try:
                    launch()
                    torch.cuda.synchronize()
                except Exception as err:  # noqa: BLE001 - a variant that does not compile is a result too
                    print(f"  {head}+{tail} w{warps} r{block_row} pf{int(prefetch)}: {type(err).__name__}: {err}"[:200],
                          flush=True)
                    continue
                err_dx = ((dx.double() - dx_ref).norm() / dx_ref.norm()).item()
                err_dw = ((partial.double().sum(0) - dw_ref).norm() / dw_ref.norm()).item()
                record_prototype(out, f"{head}+{tail} w{warps} r{block_row} pf{int(prefetch)}", launch, flusher, info,
                                 M, N, floor, table, head=head, tail=tail, num_warps=warps, block_row=block_row,
                                 prefetch=prefetch, err_dx=err_dx, err_dw=err_dw)
    out.close()


if __name__ == "__main__":
    main()
