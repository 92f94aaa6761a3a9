"""Rows whose width is not a multiple of 16 (3000, 5000, 1000, 12296 columns…), on a GPU: the backward under the
analytic default, under the table's rule for the nearest width that is a multiple of 16 (adapted to the problem),
and under the held-out validation's reference config where it has one; and the forward. Run once per build
(PYTHONPATH pointing at another checkout's parent folder, `--tag`), so that a kernel change is read in the same
process against the same configs: before the kernels assumed the multiple of 8 (or 4, 2) that such rows share,
their loads and stores moved one 16-bit element at a time.

    python docs/experiments/unaligned_rows.py OUT_DIR [--tag TAG] [--cases layer_norm:20000x3000,...]

Writes OUT_DIR/unaligned_rows[-TAG].jsonl: one line per (problem, variant), the forward's as variant "forward".
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch

from normtune.kernels import direct
from normtune.kernels.adapt import adapt
from normtune.kernels.config import BackwardConfig, default_config
from normtune.kernels.select import select_config
from normtune.kernels.table_chain import table_for
from normtune.tuner.device import detect
from normtune.tuner.measure import MeasureSession, Timing

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from variant_timing import case_problems  # noqa: E402

CASES = ("layer_norm:20000x3000,rms_norm:20000x3000,layer_norm:4096x5000,rms_norm:4096x5000,"
         "layer_norm:16384x1000,rms_norm:16384x1000,layer_norm:2048x12296,rms_norm:1024x12296,"
         "layer_norm:8192x1004,rms_norm:8192x1002")
VALIDATION = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "validate", "{gpu}", "validate.json")


def references(gpu_key: str) -> dict:
    """The held-out validation's reference configs by problem key (empty where there is no validation)."""
    try:
        with open(VALIDATION.format(gpu=gpu_key)) as f:
            rows = json.load(f)["rows"]
    except (OSError, KeyError, ValueError):
        return {}
    return {r["problem"]: BackwardConfig.from_dict(r["configs"]["reference"]) for r in rows}


def variants(p, gpu_name: str, refs: dict) -> dict:
    out = {"default": default_config(p), "table": select_config(p, gpu_name)}
    table = table_for(gpu_name)
    aligned = dataclasses.replace(p, N=-(-p.N // 16) * 16)
    rule = table.lookup(aligned) if table is not None else None
    if rule is not None:
        out[f"rule of {aligned.N}"] = adapt(rule, p, table.sm_count)
    if p.key in refs:
        out["reference"] = refs[p.key]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--cases", default=CASES, help="comma-separated NORM:MxN")
    ap.add_argument("--tag", default="", help="written with every line (e.g. which build ran)")
    args = ap.parse_args()
    info = detect()
    session = MeasureSession.for_device(info, timing=Timing(min_reps=10, max_reps=40, budget_s=0.2))
    refs = references("h200" if "H200" in info.name else "h100")
    print(f"{info.name}: copy bandwidth {session.bandwidth_gbps:.0f} GB/s; {len(refs)} reference configs", flush=True)
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, f"unaligned_rows{args.tag and '-' + args.tag}.jsonl"), "w") as out:
        for p in case_problems(args.cases):
            case = session.case(p)
            ref = case.reference()
            floor = session.floor_us(p)
            print(f"\n{p.norm} {p.M}x{p.N} (floor {floor:.1f} us)", flush=True)
            row = {"gpu": info.name, "norm": p.norm, "M": p.M, "N": p.N, "tag": args.tag, "floor_us": floor}
            for label, cfg in variants(p, info.name, refs).items():
                r = session.measure(case, cfg, reference_grads=ref)
                out.write(json.dumps({**row, "variant": label, "config": cfg.to_dict(), **r.to_dict()}) + "\n")
                out.flush()
                if r.status != "ok":
                    print(f"  {label:24s} {r.status}: {str(r.error)[:200]}", flush=True)
                    continue
                print(f"  {label:24s} {r.median_us:8.1f} us  k1 {r.kernel_1_us or 0:7.1f}  k2 {r.kernel_2_us or 0:5.1f}"
                      f"  floor {floor / r.median_us:5.2f}  {cfg}", flush=True)
            x, w, b = case.x, case.weight, case.bias
            if p.norm == "layer_norm":
                fwd = lambda: direct.layer_norm_forward(x, w, b)  # noqa: E731
            else:
                fwd = lambda: direct.rms_norm_forward(x, w)  # noqa: E731
            t = session.time_callable(fwd)
            fwd_floor = floor * 2 / 3  # read x, write y: two of the backward's three M x N streams
            out.write(json.dumps({**row, "variant": "forward", "median_us": t.median, "p10_us": t.p10,
                                  "p90_us": t.p90, "floor_us": fwd_floor}) + "\n")
            print(f"  {'forward':24s} {t.median:8.1f} us  floor {fwd_floor / t.median:5.2f}", flush=True)
            del case, ref
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
