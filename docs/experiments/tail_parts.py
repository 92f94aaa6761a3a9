"""What the reduction of kernel_1's partial rows costs, piece by piece, on a GPU, without kernel_1's main loop:
a persistent grid whose programs each write one fp32 partial row of N columns (as kernel_1 ends), then

- `write`: nothing more;
- `barrier`: the fused form's grid barrier (`arrive_and_wait`), or its inline-assembly form (`barrier-asm`);
- `fused BMxBN sS`: the barrier, then the fused reduction (`reduce_columns`) on the same grid;
- `kernel_2 BMxBN wW`: `write`, then kernel_2 as its own launch.

Timed cold-L2 in one process, GPU time with the host hidden and the profiler's kernel sum.

    python docs/experiments/tail_parts.py OUT_DIR [--widths 1024,4096,16384] [--programs-per-sm 1,3]

Writes OUT_DIR/tail_parts.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import triton
import triton.language as tl

from normtune.kernels.backward.common import arrive_and_wait, arrive_and_wait_in_loop, leave_and_reset
from normtune.kernels.backward.reduce import kernel_2, reduce_columns
from normtune.tuner.gpu_info import detect
from normtune.tuner.measure.harness import MeasureSession, Timing
from normtune.tuner.measure.views import kernel_sum

FUSED = ((64, 16, 1), (128, 8, 1), (256, 8, 1), (256, 16, 1), (128, 32, 2), (32, 128, 1), (256, 64, 1))
SEPARATE = ((128, 16, 4), (64, 16, 4), (128, 32, 4), (32, 128, 4))


@triton.jit
def tail_probe(PARTIAL, DW, BARRIER, N, MODE: tl.constexpr, ASM: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, STAGES: tl.constexpr, WRITE_BLOCK: tl.constexpr):
    """MODE 0: write this program's partial row; 1: then the grid barrier; 2: then the fused reduction."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    for c0 in range(0, N, WRITE_BLOCK):
        cols = c0 + tl.arange(0, WRITE_BLOCK)
        tl.store(PARTIAL + pid * N + cols, (cols + pid).to(tl.float32), mask=cols < N)
    if MODE >= 1:
        if ASM:
            arrive_and_wait_in_loop(BARRIER, programs)
        else:
            arrive_and_wait(BARRIER, programs)
    if MODE >= 2:
        reduce_columns(PARTIAL, PARTIAL, DW, DW, programs, N, pid, programs, True, False, BLOCK_M, BLOCK_N, STAGES)
    if MODE >= 1:
        leave_and_reset(BARRIER, BARRIER + 1, programs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--widths", default="1024,4096,16384")
    ap.add_argument("--programs-per-sm", default="1,3")
    ap.add_argument("--warps", default="4,16", help="warps of the probe's programs (kernel_1's, in the fused form)")
    args = ap.parse_args()
    info = detect()
    session = MeasureSession.for_device(info, timing=Timing(min_reps=20, max_reps=60, budget_s=0.2,
                                                           profile_reps=20))
    print(f"{info.name}: {info.sm_count} SMs", flush=True)
    os.makedirs(args.out_dir, exist_ok=True)
    barrier = torch.zeros(64, dtype=torch.int32, device="cuda")
    with open(os.path.join(args.out_dir, "tail_parts.jsonl"), "w") as out:
        for N in (int(v) for v in args.widths.split(",")):
            for ppsm in (int(v) for v in args.programs_per_sm.split(",")):
                programs = ppsm * info.sm_count
                partial = torch.empty(programs, N, dtype=torch.float32, device="cuda")
                dw = torch.empty(N, dtype=torch.bfloat16, device="cuda")
                for warps in (int(v) for v in args.warps.split(",")):
                    def probe(mode, asm=False, bm=64, bn=16, s=1):
                        return lambda: tail_probe[(programs,)](partial, dw, barrier, N, mode, asm, bm, bn, s,
                                                               1024, num_warps=warps)
                    fns = {"write": probe(0), "barrier": probe(1), "barrier-asm": probe(1, True)}
                    for bm, bn, s in FUSED:
                        fns[f"fused {bm}x{bn} s{s}"] = probe(2, False, bm, bn, s)
                    for bm, bn, w in SEPARATE:
                        def two(bm=bm, bn=bn, w=w):
                            probe(0)()
                            kernel_2[(triton.cdiv(N, bn),)](partial, partial, dw, dw, programs, N, True, False, bm,
                                                            bn, 1, False, num_warps=w)
                        fns[f"kernel_2 {bm}x{bn} w{w}"] = two
                    for name, fn in fns.items():
                        row = {"gpu": info.name, "N": N, "programs": programs, "warps": warps, "variant": name}
                        try:
                            row["us"] = session.time_callable(fn).median
                            kernels = session.kernel_times(fn)
                            row["kernel_sum_us"], row["kernels"] = kernel_sum(kernels), kernels
                        except Exception as e:  # noqa: BLE001 - a variant that fails is a finding
                            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                        out.write(json.dumps(row) + "\n")
                        out.flush()
                        print(f"N {N:6d} programs {programs:4d} w{warps:<2d} {name:22s} " + (
                            row["error"] if "error" in row else
                            f"{row['us']:6.2f} µs, kernel sum {row['kernel_sum_us']:6.2f}"), flush=True)


if __name__ == "__main__":
    main()
