"""The loop the variant experiments share (`wide_rows.py`, `reduction_tail.py`, `fitting_splits.py`): for each NORM:MxN case,
time every named config of `variants(problem, gpu_name)` cold-L2 in one process against the float64 reference,
print one line per config (total, kernel_1, kernel_2, fraction of the copy floor) and write JSON lines to
OUT_DIR/<name>[-tag].jsonl."""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Callable

import torch

from normtune.kernels.config import BackwardConfig, Problem
from normtune.tuner.device import detect
from normtune.tuner.measure import MeasureSession, Timing

Variants = Callable[[Problem, str], "dict[str, BackwardConfig]"]


def run(name: str, variants: Variants, cases: str, doc: str | None = None) -> None:
    ap = argparse.ArgumentParser(description=doc)
    ap.add_argument("out_dir", help=f"folder for {name}.jsonl")
    ap.add_argument("--cases", default=cases, help="comma-separated NORM:MxN")
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
    with open(os.path.join(args.out_dir, f"{name}{args.tag and '-' + args.tag}.jsonl"), "w") as out:
        for item in args.cases.split(","):
            norm, shape = item.split(":")
            M, N = (int(v) for v in shape.split("x"))
            p = Problem(norm, M, N, "bf16", has_bias=norm == "layer_norm")
            case = session.case(p)
            ref = case.reference()
            floor = session.floor_us(p)
            print(f"\n{norm} {M}x{N} (floor {floor:.1f} us)", flush=True)
            for label, cfg in variants(p, info.name).items():
                if keep and label not in keep:
                    continue
                r = session.measure(case, cfg, reference_grads=ref)
                out.write(json.dumps({"norm": norm, "M": M, "N": N, "variant": label, "config": cfg.to_dict(),
                                      "gpu": info.name, "tag": args.tag, **r.to_dict()}) + "\n")
                out.flush()
                if r.status != "ok":
                    print(f"  {label:44s} {r.status}: {str(r.error)[:200]}", flush=True)
                    continue
                print(f"  {label:44s} {r.median_us:8.1f} us  k1 {r.kernel_1_us or 0:7.1f}  k2 {r.kernel_2_us or 0:5.1f}"
                      f"  floor {floor / r.median_us:5.2f}  [{time.time() - t0:4.0f} s]", flush=True)
            del case, ref
            torch.cuda.empty_cache()
