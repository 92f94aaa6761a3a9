"""Kernel family v2 on a GPU: correctness of every strategy (float64 reference, poisoned outputs, bitwise
reruns), timings of the new strategies against the analytic default on the regimes they target, and host time
per call. Usage: python3 docs/experiments/kernel_family_v2.py OUTDIR [--quick]"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import torch

from normtune.kernels import layer_norm, rms_norm
from normtune.kernels.config import BackwardConfig, Problem
from normtune.kernels.config import default_config
from normtune.kernels.heuristics import row_block_col
from normtune.tuner.measure.harness import host_launch_us, make_case, measure_config
from normtune.tuner.measure.stopwatch import L2Flusher, copy_bandwidth, flush_size


def variant(problem: Problem, k1: dict | None = None, k2: dict | None = None) -> BackwardConfig:
    base = default_config(problem)
    return BackwardConfig(dataclasses.replace(base.kernel_1, **(k1 or {})),
                          dataclasses.replace(base.kernel_2, **(k2 or {})))


def split(problem: Problem, s: int, **kw) -> dict:
    d = dict(row_split=s, block_col=row_block_col(problem.N, s), two_pass=False, recompute=False, block_row=1,
             num_warps=kw.pop("num_warps", 8 if problem.N // s >= 4096 else 4))
    d.update(kw)
    return d


def columns(block_col: int, block_row: int, warps: int = 4, prefetch: bool = False) -> dict:
    return dict(strategy="columns", block_col=block_col, block_row=block_row, num_warps=warps, prefetch=prefetch,
                two_pass=False, recompute=False, row_split=1, num_stages=1)


def candidates(p: Problem) -> list[tuple[str, BackwardConfig]]:
    out = [("default", default_config(p)), ("default+fused", variant(p, None, {"fused": True}))]
    if p.N >= 4096:
        for s in (2, 4, 8):
            if p.N // s < 512:
                continue
            for pps in (1, 2):
                cfg = None
                for pf in (True, False):
                    cand = variant(p, split(p, s, programs_per_sm=pps, prefetch=pf))
                    if cand.is_valid(p):
                        cfg = cand
                        break
                if cfg is None:
                    continue
                out.append((f"split{s} pps{pps}{' pf' if cfg.kernel_1.prefetch else ''}", cfg))
                if pps == 1:
                    out.append((f"split{s} pps{pps}{' pf' if cfg.kernel_1.prefetch else ''} fused",
                                dataclasses.replace(cfg, kernel_2=dataclasses.replace(cfg.kernel_2, fused=True))))
    if p.M <= 512:
        for bc in (64, 128, 256):
            for br in (16, 32):
                cfg = variant(p, columns(bc, br, 4, prefetch=True))
                if cfg.is_valid(p):
                    out.append((f"columns {br}x{bc} w4", cfg))
    return out


def correctness(device) -> list[str]:
    rows = []
    torch.manual_seed(0)
    for norm in ("rms_norm", "layer_norm"):
        for dtype in ("bf16", "fp32"):
            for save in ("input", "output"):
                for M, N in ((1, 4096), (37, 1000), (300, 16384), (1000, 12288), (64, 65536)):
                    p = Problem(norm, M, N, dtype=dtype, save=save)
                    case = make_case(p, device, seed=M + N)
                    ref = case.reference()
                    for name, cfg in candidates(p)[:: max(1, len(candidates(p)) // 6)]:
                        if not cfg.is_valid(p):
                            continue
                        outs = []
                        for _ in range(2):
                            L = case.launch(cfg)
                            L.dx.fill_(math.nan)
                            for o in (L.dw, L.db):
                                if o is not None:
                                    o.fill_(math.nan)
                            outs.append([t.clone() for t in L.run() if t is not None])
                        torch.cuda.synchronize()
                        same = all(torch.equal(a, b) for a, b in zip(*outs))
                        r = measure_config(case, cfg, flusher=None, bandwidth_gbps=1.0, reference_grads=ref,
                                           min_reps=1, max_reps=1, budget_s=0.01)
                        ok = r.status == "ok" and same
                        rows.append(f"{'ok ' if ok else 'BAD'} {p.key} {name}: {r.status} bitwise={same} "
                                    f"{r.errors}")
                        if not ok:
                            print(rows[-1], flush=True)
    return rows


def timings(device, quick: bool) -> list[dict]:
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    flusher = L2Flusher(device, flush_size(l2))
    bw = copy_bandwidth(device)
    shapes = [("layer_norm", 2048, 16384), ("layer_norm", 1024, 16384), ("layer_norm", 512, 16384),
              ("rms_norm", 2048, 16384), ("rms_norm", 100, 8192), ("rms_norm", 256, 32768),
              ("layer_norm", 256, 32768), ("rms_norm", 64, 4096), ("layer_norm", 512, 8192),
              ("rms_norm", 8192, 1024), ("layer_norm", 4096, 2048), ("rms_norm", 32768, 1024),
              ("layer_norm", 128, 65536)]
    out = []
    for norm, M, N in shapes[: 5 if quick else None]:
        p = Problem(norm, M, N)
        case = make_case(p, device)
        ref = case.reference()
        res = []
        for name, cfg in candidates(p):
            r = measure_config(case, cfg, flusher=flusher, bandwidth_gbps=bw, reference_grads=ref, budget_s=0.3)
            res.append((name, str(cfg), r.status, r.median_us, r.kernel_1_us, r.kernel_2_us))
        dflt = res[0][3]
        best = min((x for x in res if x[2] == "ok"), key=lambda x: x[3])
        print(f"{p.key:45s} default {dflt:8.1f}  best {best[3]:8.1f} ({best[0]}) x{dflt / best[3]:.2f}",
              flush=True)
        out.append(dict(problem=p.key, bandwidth=bw, results=res))
    return out


def host_time(device) -> list[str]:
    rows = []
    for norm, M, N in (("rms_norm", 4096, 4096), ("layer_norm", 4096, 4096)):
        x = torch.randn(M, N, device=device, dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(N, device=device, dtype=torch.bfloat16, requires_grad=True)
        b = torch.randn(N, device=device, dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(M, N, device=device, dtype=torch.bfloat16)
        fwd = (lambda: rms_norm(x, w)) if norm == "rms_norm" else (lambda: layer_norm(x, w, b))
        y = fwd()
        y.backward(g)
        f_us = host_launch_us(fwd, device, reps=50)
        ys = [fwd() for _ in range(60)]
        it = iter(ys)
        b_us = host_launch_us(lambda: next(it).backward(g), device, reps=50)
        rows.append(f"host {norm} {M}x{N}: forward {f_us:.1f} µs/call, backward {b_us:.1f} µs/call")
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    quick = "--quick" in sys.argv
    device = torch.device("cuda")
    t0 = time.time()
    res = {"device": torch.cuda.get_device_name(), "host": host_time(device)}
    res["correctness"] = correctness(device)
    bad = [r for r in res["correctness"] if not r.startswith("ok")]
    print(f"correctness: {len(res['correctness']) - len(bad)} ok, {len(bad)} bad ({time.time() - t0:.0f} s)",
          flush=True)
    res["timings"] = timings(device, quick)
    (out / "kernel_family_v2.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
