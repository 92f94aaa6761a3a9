"""fp32 on the bf16 rules of wide rows, on a GPU: where twice a bf16 rule's slices would pass the largest split
(rules in 8 slices: rows of 32768 and 65536 columns), `adapt.carried_over` now keeps 8 slices on tiles of half the
rows; before, such problems ran the analytic default. Both timed cold-L2 in one process against the float64
reference, with the table's config for the GPU as the runtime picks it.

    python docs/experiments/fp32_carry.py OUT_DIR --dtype fp32 [--cases rms_norm:2048x32768,...]
"""

from __future__ import annotations

import os
import sys

from normtune.kernels.config import BackwardConfig, Problem, default_config
from normtune.kernels.select.select import select_config

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from variant_timing import run  # noqa: E402

CASES = ",".join(f"{norm}:{shape}" for norm in ("layer_norm", "rms_norm")
                 for shape in ("512x32768", "2048x32768", "4096x32768", "256x65536", "1024x65536"))


def variants(p: Problem, device_name: str) -> dict[str, BackwardConfig]:
    table, default = select_config(p, device_name), default_config(p)
    return {"table": table, "default": default} if table != default else {"default": default}


if __name__ == "__main__":
    sys.exit(run("fp32_carry", variants, CASES, __doc__))
