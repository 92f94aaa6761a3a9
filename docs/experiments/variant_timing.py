"""The loop the variant experiments share (`wide_rows.py`, `reduction_tail.py`, `fitting_splits.py`): for each NORM:MxN case,
time every named config of `variants(problem, gpu_name)` cold-L2 in one process against the float64 reference,
print one line per config (total, kernel_1, kernel_2, fraction of the copy floor) and write JSON lines to
OUT_DIR/<name>[-tag].jsonl. The prototypes that carry their own kernels share the helpers at the end (their setup,
inputs with a float64 reference, and one timed line per variant)."""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Callable

import torch

from normtune.kernels.config import BackwardConfig, Problem
from normtune.kernels.select.select import select_config
from normtune.tuner.gpu_info import detect
from normtune.tuner.measure.harness import MeasureSession, Timing
from normtune.tuner.measure.stopwatch import L2Flusher, time_kernels

Variants = Callable[[Problem, str], "dict[str, BackwardConfig]"]


def case_problems(cases: str, dtype: str = "bf16") -> list[Problem]:
    """The problems of a comma-separated NORM:MxN list (LayerNorm with a bias), in `dtype`; NORM may name a gated
    RMSNorm's gate position, as in rms_norm/gate-after:8192x5120 (a silu gate)."""
    out = []
    for item in cases.split(","):
        norm, shape = item.split(":")
        norm, _, gate = norm.partition("/gate-")
        M, N = (int(v) for v in shape.split("x"))
        out.append(Problem(norm, M, N, dtype, has_bias=norm == "layer_norm", gate=gate or None))
    return out


# Timings a caller adds per case beside the variants' (e.g. the forward): (session, case, backward floor µs) →
# {label: {"median_us", "p10_us", "p90_us", "floor_us"}}, written and printed as variant lines of their own.
Extra = Callable[[MeasureSession, object, float], "dict[str, dict]"]


def run(name: str, variants: Variants, cases: str, doc: str | None = None, extra: Extra | None = None) -> None:
    ap = argparse.ArgumentParser(description=doc)
    ap.add_argument("out_dir", help=f"folder for {name}.jsonl")
    ap.add_argument("--cases", default=cases, help="comma-separated NORM:MxN")
    ap.add_argument("--variants", default="", help="comma-separated variant names to keep (default: all)")
    ap.add_argument("--tag", default="", help="written with every line (e.g. which build ran)")
    ap.add_argument("--dtype", default="bf16", help="activations and weights: bf16, fp16 or fp32")
    args = ap.parse_args()
    keep = set(filter(None, args.variants.split(",")))
    info = detect()
    print(json.dumps(info.to_dict()), flush=True)
    session = MeasureSession.for_device(info, timing=Timing(min_reps=10, max_reps=40, budget_s=0.2))
    print(f"copy bandwidth {session.bandwidth_gbps:.0f} GB/s", flush=True)
    os.makedirs(args.out_dir, exist_ok=True)
    t0 = time.time()
    with open(os.path.join(args.out_dir, f"{name}{args.tag and '-' + args.tag}.jsonl"), "w") as out:
        for p in case_problems(args.cases, args.dtype):
            norm, M, N = p.norm, p.M, p.N
            case = session.case(p)
            ref = case.reference()
            floor = session.floor_us(p)
            print(f"\n{norm} {M}x{N} (floor {floor:.1f} us)", flush=True)
            for label, cfg in variants(p, info.name).items():
                if keep and label not in keep:
                    continue
                r = session.measure(case, cfg, reference_grads=ref)
                out.write(json.dumps({"norm": norm, "M": M, "N": N, "dtype": args.dtype, "variant": label, "config": cfg.to_dict(),
                                      "gpu": info.name, "tag": args.tag, **r.to_dict()}) + "\n")
                out.flush()
                if r.status != "ok":
                    print(f"  {label:44s} {r.status}: {str(r.error)[:200]}", flush=True)
                    continue
                print(f"  {label:44s} {r.median_us:8.1f} us  k1 {r.kernel_1_us or 0:7.1f}  k2 {r.kernel_2_us or 0:5.1f}"
                      f"  floor {floor / r.median_us:5.2f}  [{time.time() - t0:4.0f} s]", flush=True)
            for label, fields in (extra(session, case, floor) if extra else {}).items():
                out.write(json.dumps({"norm": norm, "M": M, "N": N, "dtype": args.dtype, "variant": label,
                                      "gpu": info.name, "tag": args.tag, **fields}) + "\n")
                print(f"  {label:44s} {fields['median_us']:8.1f} us  floor "
                      f"{fields['floor_us'] / fields['median_us']:5.2f}", flush=True)
            del case, ref
            torch.cuda.empty_cache()


def prototype_inputs(norm: str, M: int, N: int, device: str = "cuda") -> dict:
    """For the prototypes that carry their own kernels (`two_piece_rows.py`, `exchange_ahead.py`): bf16 x, grad
    and weight (seed 0), fp32 rstd and mean as the forward saves them, and the float64 reference dx, dw, db."""
    torch.manual_seed(0)
    x = torch.randn(M, N, device=device, dtype=torch.bfloat16)
    g = torch.randn(M, N, device=device, dtype=torch.bfloat16)
    w = (1 + 0.1 * torch.randn(N, device=device)).to(torch.bfloat16)
    x64, g64, w64 = x.double(), g.double(), w.double()
    mu64 = x64.mean(1, keepdim=True) if norm == "layer_norm" else torch.zeros_like(x64[:, :1])
    r64 = torch.rsqrt((x64 - mu64).pow(2).mean(1, keepdim=True) + (1e-5 if norm == "layer_norm" else 1e-6))
    xhat = (x64 - mu64) * r64
    wg = w64 * g64
    c2 = wg.mean(1, keepdim=True) if norm == "layer_norm" else 0.0
    return {"x": x, "g": g, "w": w, "rstd": r64.squeeze(1).float().contiguous(),
            "mean": mu64.squeeze(1).float().contiguous(),
            "dx": r64 * (wg - c2 - xhat * (xhat * wg).mean(1, keepdim=True)),
            "dw": (g64 * xhat).sum(0), "db": g64.sum(0)}


def record_prototype(out, label: str, launch: Callable[[], None], flusher, info, M: int, N: int, floor_us: float,
                     table, **fields) -> None:
    """Time a prototype's kernel_1 (`launch`, cold L2, host hidden), write one JSON line (the common fields, the
    table's figures from the same process, and `fields`) and print it."""
    k1 = time_kernels([launch], flusher=flusher, split=False, device=torch.device("cuda"), min_reps=10,
                      max_reps=60, budget_s=0.3)[0]
    out.write(json.dumps({"gpu": info.name, "M": M, "N": N, "variant": label, "kernel_1_us": k1.median,
                          "p10_us": k1.p10, "p90_us": k1.p90, "floor_us": floor_us, "table_us": table.median_us,
                          "table_kernel_1_us": table.kernel_1_us, **fields}) + "\n")
    out.flush()
    notes = "; ".join(f"{k} {v:.1e}" if isinstance(v, float) else f"{k} {v}" for k, v in fields.items())
    print(f"  {label}: kernel_1 {k1.median:7.1f} us [{k1.p10:.1f}-{k1.p90:.1f}] {floor_us / k1.median:5.2f} of "
          f"floor; {notes}", flush=True)


def prototype_baseline(session, info, norm: str, shape: str):
    """One prototype case: (M, N, problem, floor µs, the shipped table's measurement), the table's line printed."""
    M, N = (int(v) for v in shape.split("x"))
    p = Problem(norm, M, N, "bf16", has_bias=norm == "layer_norm")
    floor = session.floor_us(p)
    cfg = select_config(p, info.name)
    table = session.measure(session.case(p), cfg)
    print(f"\n{norm} {M}x{N} floor {floor:.1f} us; table {table.median_us:.1f} (kernel_1 {table.kernel_1_us:.1f}) "
          f"{cfg}", flush=True)
    return M, N, p, floor, table


def prototype_setup(name: str, doc: str, shapes: str):
    """A prototype's command line (OUT_DIR [--shapes MxN,...]), the device, a measuring session for the table's
    figures, an L2 flusher and OUT_DIR/<name>.jsonl open for writing: (args, info, session, flusher, out)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--shapes", default=shapes)
    args = ap.parse_args()
    info = detect()
    session = MeasureSession.for_device(info, timing=Timing(min_reps=10, max_reps=60, budget_s=0.3))
    flusher = L2Flusher(torch.device("cuda"), info.l2_bytes)
    print(f"{info.name}: copy bandwidth {session.bandwidth_gbps:.0f} GB/s", flush=True)
    os.makedirs(args.out_dir, exist_ok=True)
    return args, info, session, flusher, open(os.path.join(args.out_dir, f"{name}.jsonl"), "w")
