"""Wide rows on a GPU: the shipped table's config, the analytic default and single-pass variants (row_split 1-8,
row tiles of 1-8 rows, dw/db accumulated per tile element or per column) on wide LayerNorm/RMSNorm shapes, timed cold-L2 in one process.
Prints one line per config (total, kernel_1, kernel_2, fraction of the copy floor) and writes JSON lines.

    python docs/experiments/wide_rows.py OUT_DIR [--cases layer_norm:2048x16384,rms_norm:4096x32768,...]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys
import time

import torch

from normtune.kernels.config import BackwardConfig, Kernel1Config, Problem, default_config
from normtune.kernels.heuristics import MAX_SINGLE_PASS, max_warps, row_block_col, slice_width
from normtune.kernels.select import select_config
from normtune.tuner.device import detect
from normtune.tuner.measure import MeasureSession, Timing

CASES = ("layer_norm:2048x16384,layer_norm:1024x16384,layer_norm:512x16384,layer_norm:4096x32768,"
         "rms_norm:4096x32768,rms_norm:2048x16384")


def variants(p: Problem, device_name: str) -> dict[str, BackwardConfig]:
    table = select_config(p, device_name)
    out = {"table": table, "default": default_config(p)}
    k2 = table.kernel_2 if table.kernel_1.strategy == "rows" else out["default"].kernel_2
    for split, block_row, colacc in itertools.product((1, 2, 4, 8), (1, 2, 4, 8), (False, True)):
        width = row_block_col(p.N, split)
        if width > MAX_SINGLE_PASS or (split > 1 and slice_width(p.N, split) < 256) or (colacc and block_row == 1):
            continue
        tile = block_row * width
        for warps in sorted({min(16, max_warps(tile)), min(32, max_warps(tile))}):
            k1 = Kernel1Config(block_row=block_row, block_col=width, num_warps=warps, programs_per_sm=1,
                               eviction_policy="evict_first", prefetch=True, row_split=split,
                               column_accumulators=colacc)
            for cand in (k1, dataclasses.replace(k1, prefetch=False, recompute=True)):
                cfg = BackwardConfig(cand, k2)
                if cfg.is_valid(p):
                    name = (f"split{split} {block_row}x{width} w{warps}{' colacc' if colacc else ''}"
                            f"{' recompute' if cand.recompute else ''}")
                    out[name] = cfg
                    break
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out_dir", help="folder for wide_rows.jsonl")
    ap.add_argument("--cases", default=CASES, help="comma-separated NORM:MxN")
    args = ap.parse_args()
    info = detect()
    print(json.dumps(info.to_dict()), flush=True)
    session = MeasureSession.for_device(info, timing=Timing(min_reps=10, max_reps=40, budget_s=0.2))
    print(f"copy bandwidth {session.bandwidth_gbps:.0f} GB/s", flush=True)
    os.makedirs(args.out_dir, exist_ok=True)
    t0 = time.time()
    with open(os.path.join(args.out_dir, "wide_rows.jsonl"), "w") as out:
        for item in args.cases.split(","):
            norm, shape = item.split(":")
            M, N = (int(v) for v in shape.split("x"))
            p = Problem(norm, M, N, "bf16", has_bias=norm == "layer_norm")
            case = session.case(p)
            ref = case.reference()
            floor = session.floor_us(p)
            print(f"\n{norm} {M}x{N} (floor {floor:.1f} us)", flush=True)
            for name, cfg in variants(p, info.name).items():
                r = session.measure(case, cfg, reference_grads=ref)
                out.write(json.dumps({"norm": norm, "M": M, "N": N, "variant": name, "config": cfg.to_dict(),
                                      "gpu": info.name, **r.to_dict()}) + "\n")
                out.flush()
                if r.status != "ok":
                    print(f"  {name:40s} {r.status}: {str(r.error)[:200]}", flush=True)
                    continue
                print(f"  {name:40s} {r.median_us:8.1f} us  k1 {r.kernel_1_us or 0:7.1f}  k2 {r.kernel_2_us or 0:5.1f}"
                      f"  floor {floor / r.median_us:5.2f}  [{time.time() - t0:4.0f} s]", flush=True)
            del case, ref
            torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
