"""Split rows with their exchange pipelined, on a GPU: the shipped table's config for each wide row (and the
analytic default) as it is, then with `pipelined_split` at 2 and 3 stages (prefetch off: the two pipeline the same
loop), timed cold-L2 in one process against the float64 reference. Without `pipelined_split` a split row's tile
loop compiles to no asynchronous copy whatever its num_stages (sm_90 compile: LayerNorm 2048x16384 split 2 on
1x8192 tiles, 8 warps, recompute, 3 stages: 0 cp.async; pipelined: 42), so this measures what the pipeliner buys
once it can run.
Prints one line per config (total, kernel_1, kernel_2, fraction of the copy floor) and writes JSON lines.

    python docs/experiments/pipelined_split.py OUT_DIR [--cases layer_norm:2048x16384,...] [--variants …] [--tag …]
"""

from __future__ import annotations

import dataclasses
import os
import sys

from normtune.kernels.config import BackwardConfig, Problem, default_config
from normtune.kernels.select.select import select_config

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from variant_timing import run  # noqa: E402

CASES = ("layer_norm:2048x16384,layer_norm:1024x16384,layer_norm:512x16384,rms_norm:1024x28672,"
         "layer_norm:4096x32768,rms_norm:4096x32768,layer_norm:16384x12288,rms_norm:512x65536")
STAGES = (2, 3)


def variants(p: Problem, device_name: str) -> dict[str, BackwardConfig]:
    out = {}
    for name, base in (("table", select_config(p, device_name)), ("default", default_config(p))):
        if base.kernel_1.row_split == 1 or base in out.values():
            continue
        out[name] = base
        for stages in STAGES:
            k1 = dataclasses.replace(base.kernel_1, pipelined_split=True, prefetch=False, num_stages=stages)
            out[f"{name} pipelined s{stages}"] = BackwardConfig(k1, base.kernel_2)
    return {name: cfg for name, cfg in out.items() if cfg.is_valid(p)}


if __name__ == "__main__":
    sys.exit(run("pipelined_split", variants, CASES, __doc__))
