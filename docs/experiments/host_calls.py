"""Host µs per call on a CUDA host, as `normtune bench` measures it (calls issued back to back while a spin keeps
the GPU busy): normtune's direct functions and autograd API (plain and fused residual), quack's and Liger's calls, and the pieces a call is
made of (an allocation, one launch through normtune's launcher). Meant to be run more than once, alternating
builds (PYTHONPATH pointing at another checkout's parent folder), so that two builds are compared on one host
within minutes: the host's speed drifts more than the differences measured.

    python docs/experiments/host_calls.py OUT_DIR [--tag TAG] [--shapes 4096x4096,...] [--rounds 3] [--peers quack,liger]
                                          [--wrapper]

--wrapper launches through the compiled kernel's Python launcher object instead of its C function
(`launcher.RAW_LAUNCH`), to measure what calling the C function straight saves.

Writes OUT_DIR/host_calls[-TAG].jsonl: one line per (norm, shape, call, round).
"""

from __future__ import annotations

import argparse
import json
import os

import torch

import normtune
from normtune.kernels import launcher, layer_norm, rms_norm
from normtune.kernels.api import direct
from normtune.kernels.config import Problem
from normtune.tuner.measure.peers import NormtuneAPI, PeerUnavailable, make_peer
from normtune.tuner.measure.views import host_us_per_call

EPS = 1e-5


def residual_calls(norm: str, x, w, b, g) -> dict:
    """The fused residual form through the autograd API (bf16 stream, and an fp32 stream), forward alone and
    forward + backward (`torch.autograd.grad`: no gradient accumulation), beside the plain call's."""
    xl, wl = x.detach().requires_grad_(), w.detach().requires_grad_()
    params = (wl,) if b is None else (wl, b.detach().requires_grad_())
    call = rms_norm if norm == "rms_norm" else layer_norm
    out = {"normtune autograd fwd+bwd": lambda: torch.autograd.grad(call(xl, *params, EPS), (xl, *params), g)}
    for name, dtype in (("residual", x.dtype), ("fp32-stream residual", torch.float32)):
        r = torch.randn(x.shape, device=x.device, dtype=dtype, requires_grad=True)
        gh = torch.randn_like(r)
        out[f"normtune {name} forward"] = lambda r=r: call(xl, *params, EPS, residual=r)
        out[f"normtune {name} fwd+bwd"] = lambda r=r, gh=gh: torch.autograd.grad(
            call(xl, *params, EPS, residual=r), (xl, r, *params), (g, gh))
    return out


def calls_for(norm: str, M: int, N: int, dev: torch.device, peers: list[str]) -> dict:
    """Zero-argument callables, by name, for one problem (bf16, bf16 weight; LayerNorm with a bias)."""
    torch.manual_seed(0)
    x = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
    g = torch.randn_like(x)
    w = (1 + 0.1 * torch.randn(N, device=dev)).to(torch.bfloat16)
    b = torch.randn(N, device=dev, dtype=torch.bfloat16) if norm == "layer_norm" else None
    problem = Problem(norm, M, N, "bf16", "bf16", True, b is not None)
    out = {}
    if norm == "layer_norm":
        y, mean, rstd = direct.layer_norm_forward(x, w, b, EPS)
        out["normtune direct forward"] = lambda: direct.layer_norm_forward(x, w, b, EPS)
        out["normtune direct backward"] = lambda: direct.layer_norm_backward(g, x, w, b, mean, rstd)
    else:
        y, rstd = direct.rms_norm_forward(x, w, EPS)
        out["normtune direct forward"] = lambda: direct.rms_norm_forward(x, w, EPS)
        out["normtune direct backward"] = lambda: direct.rms_norm_backward(g, x, w, rstd)
    api = NormtuneAPI().prepare(problem, x, w, b, g, None)
    out.update(residual_calls(norm, x, w, b, g))
    out["normtune forward"], out["normtune backward"] = api.forward, api.run
    for name in peers:
        try:
            peer = make_peer(name).prepare(problem, x, w, b, g)
        except (PeerUnavailable, ImportError) as err:
            print(f"  {name} unavailable: {err}", flush=True)
            continue
        out[f"{name} forward"], out[f"{name} backward"] = peer.forward, peer.run
    out["torch.empty (M, N) bf16"] = lambda: torch.empty((M, N), dtype=torch.bfloat16, device=dev)
    out["torch.empty (M,) fp32"] = lambda: torch.empty((M,), dtype=torch.float32, device=dev)
    stats = torch.empty((2, M), dtype=torch.float32, device=dev)
    out["view of a row (stats[1])"] = lambda: stats[1]
    out["torch.empty (2, M) fp32 + unbind"] = lambda: torch.empty((2, M), dtype=torch.float32, device=dev).unbind(0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--tag", default="")
    ap.add_argument("--shapes", default="4096x4096,1024x8192,16384x1024")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--peers", default="", help="comma list of peers timed too (quack, liger)")
    ap.add_argument("--wrapper", action="store_true", help="launch through Triton's Python launcher object")
    args = ap.parse_args()
    if args.wrapper:
        launcher.RAW_LAUNCH = False
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}; normtune from {os.path.dirname(normtune.__file__)}; tag {args.tag!r}",
          flush=True)
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, f"host_calls{args.tag and '-' + args.tag}.jsonl")
    with open(path, "w") as fh:
        for shape in args.shapes.split(","):
            M, N = (int(v) for v in shape.split("x"))
            for norm in ("layer_norm", "rms_norm"):
                calls = calls_for(norm, M, N, dev, [p for p in args.peers.split(",") if p])
                for fn in calls.values():  # compile and warm everything before any timing
                    fn()
                torch.cuda.synchronize()
                for rnd in range(args.rounds):
                    for name, fn in calls.items():
                        us = host_us_per_call(fn, device=dev, calls=20, reps=7)
                        fh.write(json.dumps({"tag": args.tag, "norm": norm, "M": M, "N": N, "call": name,
                                             "round": rnd, "host_us": us}) + "\n")
                        if rnd == args.rounds - 1:
                            print(f"{norm} {M}x{N} {name:34s} {us:7.1f} µs", flush=True)
                del calls
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
