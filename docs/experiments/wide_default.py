"""The analytic default for wide 16-bit LayerNorm rows (8192 < N <= 16384), on a GPU: today's one-program-per-row
tile (1 x 16384, recompute) against the split rows that both shipped tables chose for every LayerNorm width from
9216 to 16384 columns at M >= 2048 (4 slices of 4 x 4096 tiles on 8 warps, 3 stages, dw/db per column, the
pipelined exchange), in their two forms: 4 programs per SM with recompute (the tables' rule at 9216-12288) and 1
per SM without (at 16384); for RMSNorm also the whole-row tile with prefetch and recompute (the tables' rule at
16384). The default is what runs where no table answers: other GPUs, shapes outside a table's
box, and widths that are not multiples of 16 (LayerNorm 2048x12296 lost to quack on the H100, 106.4 against 100.2
µs, on the default).

    python docs/experiments/wide_default.py OUT_DIR [--cases layer_norm:2048x12296,...]

Writes OUT_DIR/wide_default.jsonl (see `variant_timing.run`).
"""

from __future__ import annotations

import dataclasses
import os
import sys

from normtune.kernels.config import BackwardConfig, Kernel2Config, default_config, kernel_1_config
from normtune.kernels.heuristics import row_block_col

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from variant_timing import run  # noqa: E402

CASES = ("layer_norm:512x12296,layer_norm:1024x12296,layer_norm:2048x12296,layer_norm:8192x12296,"
         "layer_norm:2048x9000,layer_norm:4096x10000,layer_norm:4096x14336,layer_norm:2048x16000,"
         "layer_norm:1024x16384,layer_norm:4096x16384,rms_norm:512x12296,rms_norm:2048x12296,"
         "rms_norm:4096x10000,rms_norm:2048x16000,rms_norm:4096x16384")


def variants(p, gpu_name: str) -> dict:
    out = {"default": default_config(p)}
    k1 = kernel_1_config(block_row=4, block_col=row_block_col(p.N, 4), num_warps=8, num_stages=3, programs_per_sm=4,
                       eviction_policy="evict_first", recompute=True, row_split=4, column_accumulators=True,
                       pipelined_split=True)
    forms = {
        "split4 pps4 recompute": BackwardConfig(k1, Kernel2Config(block_m=128, block_n=64, num_warps=4, pdl=True)),
        "split4 pps1": BackwardConfig(dataclasses.replace(k1, programs_per_sm=1, recompute=False, eviction_policy=""),
                                      Kernel2Config(block_m=64, block_n=16, num_warps=1, pdl=True)),
    }
    if p.norm == "rms_norm":  # the shipped tables' RMSNorm rules at 16384 columns keep whole rows, with prefetch
        d = out["default"]
        forms["prefetch recompute"] = BackwardConfig(dataclasses.replace(d.kernel_1, prefetch=True, recompute=True),
                                                     d.kernel_2)
    out.update({name: cfg for name, cfg in forms.items() if cfg.is_valid(p)})
    return out


if __name__ == "__main__":
    run("wide_default", variants, CASES, __doc__.split("\n\n")[0])
