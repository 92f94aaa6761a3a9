"""The reduction after kernel_1 on a GPU: for each case, the shipped table's kernel_1 with kernel_2 as its own
launch (several tiles, with and without programmatic dependent launch) and fused into kernel_1's tail (several
tiles and stages), timed cold-L2 in one process. Prints one line per config (total, kernel_1, kernel_2,
fraction of the copy floor) and writes JSON lines.

    python docs/experiments/reduction_tail.py OUT_DIR [--cases layer_norm:2048x16384,...]
"""

from __future__ import annotations

import os
import sys

from normtune.kernels.config import BackwardConfig, Kernel2Config, Problem, default_config
from normtune.kernels.select.select import select_config

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from variant_timing import run  # noqa: E402

CASES = ("layer_norm:2048x16384,layer_norm:1024x16384,layer_norm:512x16384,rms_norm:2048x16384,"
         "rms_norm:512x16384,layer_norm:1024x8192,rms_norm:1024x8192,layer_norm:2048x4096,layer_norm:4096x2048")

SEPARATE = ((128, 16, 4), (128, 32, 4), (64, 64, 4), (32, 128, 4), (64, 128, 8), (128, 64, 8), (16, 256, 4),
            (32, 256, 8), (256, 32, 8))
FUSED = ((32, 128, 1), (64, 128, 1), (128, 128, 1), (16, 128, 1), (64, 64, 1), (128, 64, 1), (256, 64, 1),
         (32, 256, 1), (64, 256, 1), (32, 128, 2), (64, 128, 2), (128, 16, 1))


def variants(p: Problem, device_name: str) -> dict[str, BackwardConfig]:
    table = select_config(p, device_name)
    out = {"table": table, "default": default_config(p)}
    if table.kernel_1.strategy != "rows":
        return out
    k1 = table.kernel_1
    for bm, bn, w in SEPARATE:
        for pdl in (False, True):
            out[f"k2 {bm}x{bn} w{w}{' pdl' if pdl else ''}"] = BackwardConfig(
                k1, Kernel2Config(block_m=bm, block_n=bn, num_warps=w, pdl=pdl))
    for bm, bn, stages in FUSED:
        out[f"fused {bm}x{bn} s{stages}"] = BackwardConfig(
            k1, Kernel2Config(block_m=bm, block_n=bn, num_warps=1, num_stages=stages, fused=True))
    return {name: cfg for name, cfg in out.items() if cfg.is_valid(p)}


if __name__ == "__main__":
    sys.exit(run("reduction_tail", variants, CASES, __doc__))
