"""fp32 rows of 8193-16384 columns, on a GPU: what the runtime runs today against split rows of 2-row tiles.

fp32 has no family in the shipped tables, so a problem reads the bf16 rules (`select/adapt.py`). At 16384 columns
the RMSNorm rules hold whole bf16 rows in registers, which does not carry over: fp32 runs the analytic default, a
1 x 16384 tile on 16 warps without prefetch. The LayerNorm rule splits bf16 rows in 4 slices of 4 x 4096 tiles, so
fp32 runs it in 8 slices of 4 x 2048. The unseeded 40-trial reference sweeps of the fp32 validations (runs 250-254)
beat both, 1.08-1.15x on the H100 and the H200, and 7 of their 8 best configs at 1024 and 2048 x 16384 are one
form: 4 slices of 2 x 4096 tiles (the bf16 tile's bytes), 16 warps, prefetch, dw/db per column, one program per
SM. This times that form ("split 2-row"), the same slices with the bf16 rule's pipelined exchange ("split 2-row
pipelined"), and the runtime's choice, on shapes the references did not time (512 and 4096 rows, narrower rows
split in 3 slices of at most 4096 columns). The split is the fewest slices whose power-of-two tile is at most 4096
columns wide ("fitted": the slices that pad the row least, where that differs). Since 310f6e7 the runtime's
choice from 512 rows is this form itself (`heuristics.wide_fp32_rows`); the committed data
(docs/experiments/data/fp32_wide_rows_h200.jsonl) was taken on the tree before, whose choice is described above.

    python docs/experiments/fp32_wide_rows.py OUT_DIR --dtype fp32 [--cases rms_norm:512x16384,...]

Writes OUT_DIR/fp32_wide_rows.jsonl (see `variant_timing.run`).
"""

from __future__ import annotations

import dataclasses
import os
import sys

from normtune.kernels.config import ROW_SPLITS, BackwardConfig, Kernel2Config, kernel_1_config
from normtune.kernels.heuristics import WIDE_FP32_SLICE, row_block_col
from normtune.kernels.select.select import select_config

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from variant_timing import run  # noqa: E402

CASES = ",".join(f"{norm}:{shape}" for norm in ("rms_norm", "layer_norm")
                 for shape in ("512x16384", "1024x16384", "4096x16384", "4096x12288", "2048x10240", "8192x9216"))


def split_two_row(N: int, fitted: bool = False) -> BackwardConfig:
    """The references' form: the fewest slices whose tile is at most WIDE_FP32_SLICE columns, 2-row tiles;
    `fitted`: the slices whose tiles pad the row least (10240 columns: 5 of 2048 rather than 3 of 4096)."""
    fits = [s for s in ROW_SPLITS[1:] if row_block_col(N, s) <= WIDE_FP32_SLICE]
    split = min(fits, key=lambda s: (s * row_block_col(N, s), s)) if fitted else fits[0]
    return BackwardConfig(
        kernel_1_config(block_row=2, block_col=row_block_col(N, split), num_warps=16, num_stages=1, programs_per_sm=1,
                      eviction_policy="", prefetch=True, row_split=split, column_accumulators=True),
        Kernel2Config(block_m=64, block_n=16, num_warps=4, pdl=True))


def variants(p, gpu_name: str) -> dict:
    form = split_two_row(p.N)
    out = {"runtime": select_config(p, gpu_name), "split 2-row": form}
    if split_two_row(p.N, fitted=True) != form:
        out["split 2-row fitted"] = split_two_row(p.N, fitted=True)
    pipelined = dataclasses.replace(form.kernel_1, num_warps=8, num_stages=3, prefetch=False, pipelined_split=True)
    out["split 2-row pipelined"] = BackwardConfig(pipelined, Kernel2Config(block_m=64, block_n=16, num_warps=1,
                                                                           pdl=True))
    return {name: cfg for name, cfg in out.items() if cfg.is_valid(p)}


if __name__ == "__main__":
    run("fp32_wide_rows", variants, CASES, __doc__.split("\n\n")[0])
