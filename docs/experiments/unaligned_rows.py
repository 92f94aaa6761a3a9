"""Rows whose width is not a multiple of 16 (3000, 5000, 1000, 12296 columns…), on a GPU: the backward under the
analytic default, under the table's rule for the nearest width that is a multiple of 16 (adapted to the problem),
and under the held-out validation's reference config where it has one; and the forward. Run once per build
(PYTHONPATH pointing at another checkout's parent folder, `--tag`), so that a kernel change is read in the same
process against the same configs: before the kernels assumed the multiple of 8 (or 4, 2) that such rows share,
their loads and stores moved one 16-bit element at a time.

    python docs/experiments/unaligned_rows.py OUT_DIR [--tag TAG] [--cases layer_norm:20000x3000,...]

Writes OUT_DIR/unaligned_rows[-TAG].jsonl (see `variant_timing.run`), the forward's lines as variant "forward".
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys

from normtune.kernels.api import direct
from normtune.kernels.select.adapt import adapt
from normtune.kernels.config import BackwardConfig, default_config
from normtune.kernels.select.select import select_config
from normtune.kernels.select.table_chain import table_for

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from variant_timing import run  # noqa: E402

CASES = ("layer_norm:20000x3000,rms_norm:20000x3000,layer_norm:4096x5000,rms_norm:4096x5000,"
         "layer_norm:16384x1000,rms_norm:16384x1000,layer_norm:2048x12296,rms_norm:1024x12296,"
         "layer_norm:8192x1004,rms_norm:8192x1002")
VALIDATION = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "validate", "{gpu}", "validate.json")


@functools.lru_cache(maxsize=None)
def references(gpu_key: str) -> dict:
    """The held-out validation's reference configs by problem key (empty where there is no validation)."""
    try:
        with open(VALIDATION.format(gpu=gpu_key)) as f:
            rows = json.load(f)["rows"]
    except (OSError, KeyError, ValueError):
        return {}
    return {r["problem"]: BackwardConfig.from_dict(r["configs"]["reference"]) for r in rows}


def variants(p, gpu_name: str) -> dict:
    out = {"default": default_config(p), "table": select_config(p, gpu_name)}
    table = table_for(gpu_name)
    aligned = dataclasses.replace(p, N=-(-p.N // 16) * 16)
    rule = table.lookup(aligned) if table is not None else None
    if rule is not None:
        out[f"rule of {aligned.N}"] = adapt(rule, p, table.sm_count)
    refs = references("h200" if "H200" in gpu_name else "h100")
    if p.key in refs:
        out["reference"] = refs[p.key]
    return out


def forward(session, case, floor_us: float) -> dict:
    """The forward of the case's input, timed like a peer's call; its floor is two of the backward's three M x N
    streams (read x, write y)."""
    x, w, b = case.x, case.weight, case.bias
    if case.problem.norm == "layer_norm":
        call = lambda: direct.layer_norm_forward(x, w, b)  # noqa: E731
    else:
        call = lambda: direct.rms_norm_forward(x, w)  # noqa: E731
    t = session.time_callable(call)
    return {"forward": {"median_us": t.median, "p10_us": t.p10, "p90_us": t.p90, "floor_us": floor_us * 2 / 3}}


if __name__ == "__main__":
    run("unaligned_rows", variants, CASES, __doc__.split("\n\n")[0], extra=forward)
