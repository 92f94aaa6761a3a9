"""How close a plain streaming kernel gets to the copy-bandwidth floor at the seed sizes, on a GPU: torch's
elementwise add of two bf16 M×N tensors into a third moves exactly the backward's minimum bytes (read grad and x,
write dx: 3·M·N·2), with no reduction, no weight and no second kernel. Timed beside normtune's backward (the
shipped table's config) in one process, cold L2, in both views (GPU time with the host hidden, and the profiler's
kernel sum), so that the floor fraction normtune reaches can be read against what streaming the same bytes costs.

    python docs/experiments/streaming_floor.py OUT_DIR [--cases rms_norm:8192x1024,...]

Writes OUT_DIR/streaming_floor.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from normtune.kernels.select.select import select_config
from normtune.tuner.gpu_info import detect
from normtune.tuner.measure.harness import MeasureSession, Timing
from normtune.tuner.measure.views import kernel_sum

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from variant_timing import case_problems  # noqa: E402

SEED = ",".join(f"rms_norm:{M}x{N}" for M, N in (
    (32768, 1024), (16384, 2048), (8192, 4096), (4096, 8192), (2048, 16384),
    (16384, 1024), (8192, 2048), (4096, 4096), (2048, 8192), (1024, 16384),
    (8192, 1024), (4096, 2048), (2048, 4096), (1024, 8192), (512, 16384)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--cases", default=SEED, help="comma-separated NORM:MxN")
    args = ap.parse_args()
    info = detect()
    session = MeasureSession.for_device(info, timing=Timing(min_reps=20, max_reps=60, budget_s=0.3,
                                                           profile_reps=20))
    print(f"{info.name}: copy bandwidth {session.bandwidth_gbps:.0f} GB/s", flush=True)
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "streaming_floor.jsonl"), "w") as out:
        for p in case_problems(args.cases):
            norm, M, N = p.norm, p.M, p.N
            floor = session.floor_us(p)
            case = session.case(p)
            a, b = case.grad, case.x
            c = torch.empty_like(a)
            add = lambda: torch.add(a, b, out=c)  # noqa: E731
            config = select_config(p, info.name)
            launch = case.launch(config)
            row = {"gpu": info.name, "norm": norm, "M": M, "N": N, "floor_us": floor, "config": config.to_dict()}
            for name, fn in (("add", add), ("normtune", launch.run)):
                gpu = session.time_callable(fn).median
                ksum = kernel_sum(session.kernel_times(fn))
                row[f"{name}_us"], row[f"{name}_kernel_sum_us"] = gpu, ksum
            out.write(json.dumps(row) + "\n")
            out.flush()
            print(f"{norm} {M}x{N}: floor {floor:5.1f} µs | add {row['add_us']:6.1f} (kernel sum "
                  f"{row['add_kernel_sum_us']:6.1f}, {floor / row['add_kernel_sum_us']:.2f} of floor) | normtune "
                  f"{row['normtune_us']:6.1f} (kernel sum {row['normtune_kernel_sum_us']:6.1f}, "
                  f"{floor / row['normtune_kernel_sum_us']:.2f} of floor)", flush=True)
            del case, launch, a, b, c
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
