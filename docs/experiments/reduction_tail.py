"""The reduction after kernel_1 on a GPU: for each case, the shipped table's kernel_1 with kernel_2 as its own
launch (several tiles, with and without programmatic dependent launch) and fused into kernel_1's tail (several
tiles and stages), timed cold-L2 in one process. Prints one line per config (total, kernel_1, kernel_2,
fraction of the copy floor) and writes JSON lines.

    python docs/experiments/reduction_tail.py OUT_DIR [--cases layer_norm:2048x16384,...]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch

from normtune.kernels.config import BackwardConfig, Kernel2Config, Problem, default_config
from normtune.kernels.select import select_config
from normtune.tuner.device import detect
from normtune.tuner.measure import MeasureSession, Timing

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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out_dir", help="folder for reduction_tail.jsonl")
    ap.add_argument("--cases", default=CASES, help="comma-separated NORM:MxN")
    ap.add_argument("--variants", default="", help="comma-separated variant names to keep (default: all)")
    ap.add_argument("--tag", default="", help="written with every line (e.g. which build ran)")
    args = ap.parse_args()
    keep = set(filter(None, args.variants.split(",")))
    info = detect()
    print(json.dumps(info.to_dict()), flush=True)
    session = MeasureSession.for_device(info, timing=Timing(min_reps=10, max_reps=40, budget_s=0.2))
    print(f"copy bandwidth {session.bandwidth_gbps:.0f} GB/s", flush=True)
    os.makedirs(args.out_dir, exist_ok=True)
    t0 = time.time()
    with open(os.path.join(args.out_dir, f"reduction_tail{args.tag and '-' + args.tag}.jsonl"), "w") as out:
        for item in args.cases.split(","):
            norm, shape = item.split(":")
            M, N = (int(v) for v in shape.split("x"))
            p = Problem(norm, M, N, "bf16", has_bias=norm == "layer_norm")
            case = session.case(p)
            ref = case.reference()
            floor = session.floor_us(p)
            print(f"\n{norm} {M}x{N} (floor {floor:.1f} us)", flush=True)
            for name, cfg in variants(p, info.name).items():
                if keep and name not in keep:
                    continue
                r = session.measure(case, cfg, reference_grads=ref)
                out.write(json.dumps({"norm": norm, "M": M, "N": N, "variant": name, "config": cfg.to_dict(),
                                      "gpu": info.name, "tag": args.tag, **r.to_dict()}) + "\n")
                out.flush()
                if r.status != "ok":
                    print(f"  {name:28s} {r.status}: {str(r.error)[:200]}", flush=True)
                    continue
                print(f"  {name:28s} {r.median_us:8.1f} us  k1 {r.kernel_1_us or 0:7.1f}  k2 {r.kernel_2_us or 0:5.1f}"
                      f"  floor {floor / r.median_us:5.2f}  [{time.time() - t0:4.0f} s]", flush=True)
            del case, ref
            torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
