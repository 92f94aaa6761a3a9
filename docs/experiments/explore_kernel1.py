"""First look at the backward on a GPU: gate + cold-L2 timing of the default config and of one-knob variants
around it, on the 15 seed shapes x both norms (bf16). Prints a table; writes JSON lines to OUT_DIR/explore.jsonl.

    python docs/experiments/explore_kernel1.py OUT_DIR [--shapes 8192x1024,...] [--quick]
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
from normtune.tuner.gpu_info import detect
from normtune.tuner.measure.harness import MeasureSession, Timing
from normtune.tuner.shapes import SEED, parse_shapes


def variants(p: Problem):
    base = default_config(p)
    k1, k2 = base.kernel_1, base.kernel_2
    out = {"default": base}

    def add(name, **kw):
        k1kw = {k: v for k, v in kw.items() if k in type(k1).__dataclass_fields__}
        k2kw = {k[3:]: v for k, v in kw.items() if k.startswith("k2_")}
        cfg = BackwardConfig(dataclasses.replace(k1, **k1kw), dataclasses.replace(k2, **k2kw))
        if cfg.is_valid(p):
            out[name] = cfg

    # round 7: recompute (raw bf16 tile across the reductions, widened again after)
    if not k1.two_pass:
        for w in sorted({k1.num_warps, min(32, k1.num_warps * 2)}):
            add(f"rc_w{w}", recompute=True, prefetch=False, num_warps=w)
            add(f"rc+pf_w{w}", recompute=True, prefetch=True, num_warps=w)
            add(f"rc_w{w}_s3", recompute=True, prefetch=False, num_warps=w, num_stages=3)
        add("s3", prefetch=False, num_stages=3)
        add("2pass_4x2048_w8", two_pass=True, block_row=4, block_col=2048, num_warps=8, prefetch=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out_dir", help="folder for explore.jsonl")
    ap.add_argument("--shapes", default="")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--min-n", type=int, default=0)
    args = ap.parse_args()
    shapes = parse_shapes(args.shapes) if args.shapes else list(SEED)
    if args.min_n:
        shapes = [s for s in shapes if s[1] >= args.min_n]
    info = detect()
    print(json.dumps(info.to_dict()), flush=True)
    session = MeasureSession.for_device(info, timing=Timing(min_reps=15, max_reps=60, budget_s=0.3))
    print(f"copy bandwidth {session.bandwidth_gbps:.0f} GB/s", flush=True)
    os.makedirs(args.out_dir, exist_ok=True)
    out = open(os.path.join(args.out_dir, "explore.jsonl"), "w")
    rows = []
    t_start = time.time()
    for norm in ("layer_norm", "rms_norm"):
        for M, N in shapes:
            p = Problem(norm, M, N, "bf16")
            case = session.case(p)
            ref = case.reference()
            vs = variants(p) if not args.quick else {"default": default_config(p)}
            best = None
            for name, cfg in vs.items():
                r = session.measure(case, cfg, reference_grads=ref)
                rec = {"norm": norm, "M": M, "N": N, "variant": name, "config": cfg.to_dict(), **r.to_dict()}
                out.write(json.dumps(rec) + "\n")
                out.flush()
                if r.status == "ok" and (best is None or r.median_us < best[1].median_us):
                    best = (name, r)
                if name == "default":
                    default = r
                if r.status != "ok":
                    print(f"  {norm} {M}x{N} {name}: {r.status} {str(r.error)[:300]}", flush=True)
            floor = session.floor_us(p)
            line = (f"{norm:10s} {M:6d}x{N:<6d} floor {floor:6.1f}  default {default.median_us or float('nan'):7.1f} "
                    f"(k1 {default.kernel_1_us or float('nan'):6.1f} k2 {default.kernel_2_us or float('nan'):5.1f}) "
                    f"best {best[0] if best else '-':12s} {best[1].median_us if best else float('nan'):7.1f} "
                    f"(k1 {best[1].kernel_1_us if best else float('nan'):6.1f} k2 {best[1].kernel_2_us if best else float('nan'):5.1f})"
                    f"  [{time.time() - t_start:5.0f}s]")
            print(line, flush=True)
            rows.append(line)
            del case, ref
            torch.cuda.empty_cache()
    print("\n".join(rows))


if __name__ == "__main__":
    sys.exit(main())
