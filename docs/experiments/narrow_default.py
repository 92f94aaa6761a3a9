"""The analytic default on narrow rows (N <= 256), before and after lifting its 16-row cap on block_row, timed head to
head on shapes that are not in the held-out set (cold L2, the validate timing preset, interleaved rounds).

    python3 docs/experiments/narrow_default.py [OUT_DIR]
"""

from __future__ import annotations

import dataclasses
import statistics
import sys

import torch

from normtune.kernels.config import Problem
from normtune.kernels.config import default_config
from normtune.kernels.heuristics import max_warps
from normtune.tuner.measure.harness import TIMING, MeasureSession

SHAPES = ((131072, 128), (262144, 128), (1048576, 128), (65536, 256), (131072, 256), (524288, 256))


def capped(problem: Problem):
    """The default as it was: at most 16 rows per tile, warps from that tile."""
    config = default_config(problem)
    k1 = config.kernel_1
    rows = min(16, k1.block_row)
    tile = rows * k1.block_col
    warps = min(max(4, min(8, tile // 1024)), max_warps(tile))
    return dataclasses.replace(config, kernel_1=dataclasses.replace(k1, block_row=rows, num_warps=warps))


def main(out: str) -> None:
    dev = torch.device("cuda")
    session = MeasureSession(dev, l2_bytes=torch.cuda.get_device_properties(dev).L2_cache_size,
                             timing=TIMING["validate"])
    lines = [f"GPU: {torch.cuda.get_device_name()}", "",
             "| problem | 16-row cap µs | default now µs | cap ÷ now | rows (cap → now) |", "|---|---:|---:|---:|---|"]
    for norm in ("rms_norm", "layer_norm"):
        for M, N in SHAPES:
            problem = Problem(norm, M, N, "bf16", has_bias=norm == "layer_norm")
            old, new = capped(problem), default_config(problem)
            case = session.case(problem)
            times = {"old": [], "new": []}
            for _ in range(3):
                for name, cfg in (("old", old), ("new", new)):
                    res = session.measure(case, cfg)
                    if res.status != "ok":
                        raise SystemExit(f"{problem.key} {name}: {res.status} {res.error}")
                    times[name].append(res.median_us)
            o, n = statistics.median(times["old"]), statistics.median(times["new"])
            lines.append(f"| {problem.key} | {o:.1f} | {n:.1f} | {o / n:.3f} | "
                         f"{old.kernel_1.block_row} → {new.kernel_1.block_row} |")
            print(lines[-1], flush=True)
            del case
    with open(f"{out}/narrow_default.md", "w") as fh:
        fh.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
