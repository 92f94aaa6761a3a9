"""Where kernel_1's time goes against a plain stream, and whether tensor-memory-accelerator (TMA) loads stream
faster than pointer loads, on a GPU. For each case, in one process, cold L2, both views (GPU time with the host
hidden, profiler kernel sum):

- `torch add`: torch's elementwise add of two bf16 M×N tensors into a third (the backward's minimum bytes);
- `ptr add` / `tma add`: a persistent Triton kernel on the table's kernel_1 tile and grid, adding the two tiles
  (pointer loads, or loads and stores through device-side tensor descriptors);
- `ptr rows` / `tma rows`: the same with a row reduction between load and store (out = a − b·mean(a·b)), the
  dependency kernel_1 has;
- `normtune`: the shipped table's backward, with its kernel_1's own kernel time.

    python docs/experiments/stream_loads.py OUT_DIR [--cases rms_norm:8192x1024,...] [--stages 1,2,3,4]

Writes OUT_DIR/stream_loads.jsonl.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch
import triton
import triton.language as tl

from normtune.kernels.heuristics import num_groups
from normtune.kernels.select.select import select_config
from normtune.tuner.gpu_info import detect
from normtune.tuner.measure.harness import MeasureSession, Timing
from normtune.tuner.measure.views import kernel_sum

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from variant_timing import case_problems  # noqa: E402

CASES = ",".join(f"rms_norm:{M}x{N}" for M, N in (
    (32768, 1024), (4096, 8192), (16384, 1024), (2048, 8192), (8192, 1024), (4096, 2048), (512, 16384)))


@triton.jit
def stream_pointers(A, B, C, M, N, BLOCK_ROW: tl.constexpr, BLOCK_COL: tl.constexpr, NUM_STAGES: tl.constexpr,
                    ROWS: tl.constexpr):
    cols = tl.arange(0, BLOCK_COL)
    rr = tl.arange(0, BLOCK_ROW)
    for tile in tl.range(tl.program_id(0), tl.cdiv(M, BLOCK_ROW), tl.num_programs(0), num_stages=NUM_STAGES):
        rows = tile * BLOCK_ROW + rr
        mask = (rows < M)[:, None] & (cols < N)[None, :]
        offsets = rows[:, None] * N + cols[None, :]
        a = tl.load(A + offsets, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(B + offsets, mask=mask, other=0.0).to(tl.float32)
        if ROWS:
            out = a - b * (tl.sum(a * b, axis=1) / N)[:, None]
        else:
            out = a + b
        tl.store(C + offsets, out.to(C.dtype.element_ty), mask=mask)


@triton.jit
def stream_descriptors(A, B, C, M, N, BLOCK_ROW: tl.constexpr, BLOCK_COL: tl.constexpr, NUM_STAGES: tl.constexpr,
                       ROWS: tl.constexpr):
    da = tl.make_tensor_descriptor(A, shape=[M, N], strides=[N, 1], block_shape=[BLOCK_ROW, BLOCK_COL])
    db = tl.make_tensor_descriptor(B, shape=[M, N], strides=[N, 1], block_shape=[BLOCK_ROW, BLOCK_COL])
    dc = tl.make_tensor_descriptor(C, shape=[M, N], strides=[N, 1], block_shape=[BLOCK_ROW, BLOCK_COL])
    for tile in tl.range(tl.program_id(0), tl.cdiv(M, BLOCK_ROW), tl.num_programs(0), num_stages=NUM_STAGES):
        a = da.load([tile * BLOCK_ROW, 0]).to(tl.float32)
        b = db.load([tile * BLOCK_ROW, 0]).to(tl.float32)
        if ROWS:
            out = a - b * (tl.sum(a * b, axis=1) / N)[:, None]
        else:
            out = a + b
        dc.store([tile * BLOCK_ROW, 0], out.to(C.dtype.element_ty))


class _Scratch:
    """Triton's allocator for device-side descriptors: one buffer per size, kept (no allocation per launch)."""

    def __init__(self):
        self.buffers: dict[int, torch.Tensor] = {}

    def __call__(self, size: int, alignment: int, stream):
        if size not in self.buffers:
            self.buffers[size] = torch.empty(size, dtype=torch.int8, device="cuda")
        return self.buffers[size]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--cases", default=CASES, help="comma-separated NORM:MxN")
    ap.add_argument("--stages", default="1,2,3", help="software-pipelining depths of the streaming kernels")
    ap.add_argument("--programs-per-sm", default="", help="grids of the streaming kernels (default: the table's)")
    args = ap.parse_args()
    triton.set_allocator(_Scratch())
    info = detect()
    session = MeasureSession.for_device(info, timing=Timing(min_reps=20, max_reps=60, budget_s=0.3,
                                                           profile_reps=20))
    print(f"{info.name}: copy bandwidth {session.bandwidth_gbps:.0f} GB/s", flush=True)
    os.makedirs(args.out_dir, exist_ok=True)
    stages = [int(s) for s in args.stages.split(",")]
    with open(os.path.join(args.out_dir, "stream_loads.jsonl"), "w") as out:
        for p in case_problems(args.cases):
            floor = session.floor_us(p)
            case = session.case(p)
            a, b = case.grad, case.x
            c = torch.empty_like(a)
            config = select_config(p, info.name)
            k1 = config.kernel_1
            block_col = triton.next_power_of_2(p.N)
            grids = [float(g) for g in args.programs_per_sm.split(",") if g] or [k1.programs_per_sm]
            fns = {"torch add": lambda: torch.add(a, b, out=c), "normtune": case.launch(config).run}
            for ppsm in grids:
                # whole rows per program: the table's row programs (a dual table's column programs, a split
                # table's slices are not streams of whole rows)
                grid = (num_groups(p.M, k1.block_row, ppsm, info.sm_count),)
                for s in stages:
                    for kind, kernel in (("ptr", stream_pointers), ("tma", stream_descriptors)):
                        for rows in (False, True):
                            name = f"{kind} {'rows' if rows else 'add'} s{s} ppsm{ppsm:g}"
                            fns[name] = (lambda kernel=kernel, grid=grid, s=s, rows=rows: kernel[grid](
                                a, b, c, p.M, p.N, k1.block_row, block_col, s, rows, num_warps=k1.num_warps))
            for name, fn in fns.items():
                row = {"gpu": info.name, "norm": p.norm, "M": p.M, "N": p.N, "floor_us": floor, "variant": name,
                       "tile": f"{k1.block_row}x{block_col} w{k1.num_warps}", "config": config.to_dict()}
                try:
                    row["us"] = session.time_callable(fn).median
                    kernels = session.kernel_times(fn)
                    row["kernel_sum_us"], row["kernels"] = kernel_sum(kernels), kernels
                except Exception as e:  # noqa: BLE001 - a variant that does not compile is a finding, not a stop
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                out.write(json.dumps(row) + "\n")
                out.flush()
                if "error" in row:
                    print(f"{p.norm} {p.M}x{p.N} {name:22s} {row['error']}", flush=True)
                    continue
                k1_us = row["kernels"].get("kernel_1_single_pass", row["kernels"].get("kernel_1_dual", 0.0))
                print(f"{p.norm} {p.M}x{p.N} {name:22s} {row['us']:7.1f} µs, kernel sum {row['kernel_sum_us']:7.1f}"
                      f" ({floor / row['kernel_sum_us']:.3f} of floor)"
                      + (f", kernel_1 {k1_us:.1f}" if name == "normtune" else ""), flush=True)
            del case, a, b, c
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
