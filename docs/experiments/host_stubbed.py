"""Host µs per call of normtune's own Python path, on any machine: CPU tensors through the Triton interpreter's
entry points with every kernel launch replaced by a no-op (`Launcher.__call__`), so a call's time is the checks,
planning, allocation and autograd bookkeeping around the launches, not the interpreter's execution.

    TRITON_INTERPRET=1 python3 docs/experiments/host_stubbed.py [--shape 3x5x64] [--rounds 7] [--calls 300]

Times the process's CPU time, interleaved round by round (the best round is kept per call: other processes on
the machine only add time), the forward alone and forward + backward (`torch.autograd.grad`, no gradient accumulation) of plain and
residual calls of `rms_norm` and `layer_norm` in bf16, the residual with a bf16 and an fp32 stream, and gated calls
(the norm after the gate) over the whole width and in 8 groups.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from normtune.kernels import FusedAddRMSNorm, launcher, layer_norm, rms_norm  # noqa: E402


def calls_for(shape: tuple[int, ...]) -> dict:
    """Zero-argument callables, by name: each one forward, or forward + backward, through the autograd API."""
    N = shape[-1]
    bf16 = torch.bfloat16
    x = torch.randn(shape, dtype=bf16, requires_grad=True)
    r16 = torch.randn(shape, dtype=bf16, requires_grad=True)
    r32 = torch.randn(shape, dtype=torch.float32, requires_grad=True)
    w = (1 + 0.1 * torch.randn(N)).to(bf16).requires_grad_()
    b = (0.1 * torch.randn(N)).to(bf16).requires_grad_()
    gy, gh16, gh32 = torch.randn(shape, dtype=bf16), torch.randn(shape, dtype=bf16), torch.randn(shape)
    module = FusedAddRMSNorm(N, eps=1e-6, dtype=bf16)
    z = torch.randn(shape, dtype=bf16, requires_grad=True)
    group = N // 8 if N % 8 == 0 else N

    def gated(group_size):
        return lambda: torch.autograd.grad(rms_norm(x, w, 1e-6, gate=z, gate_position="after",
                                                    group_size=group_size), (x, z, w), gy)

    out = {
        "rms_norm forward": lambda: rms_norm(x, w),
        "rms_norm fwd+bwd": lambda: torch.autograd.grad(rms_norm(x, w), (x, w), gy),
        "layer_norm fwd+bwd": lambda: torch.autograd.grad(layer_norm(x, w, b), (x, w, b), gy),
        "rms_norm residual forward": lambda: rms_norm(x, w, residual=r16),
        "rms_norm residual fwd+bwd": lambda: torch.autograd.grad(rms_norm(x, w, residual=r16), (x, r16, w),
                                                                 (gy, gh16)),
        "layer_norm residual fwd+bwd": lambda: torch.autograd.grad(layer_norm(x, w, b, residual=r16),
                                                                   (x, r16, w, b), (gy, gh16)),
        "rms_norm fp32-stream fwd+bwd": lambda: torch.autograd.grad(rms_norm(x, w, residual=r32), (x, r32, w),
                                                                    (gy, gh32)),
        "FusedAddRMSNorm fwd+bwd": lambda: torch.autograd.grad(module(x, r16), (x, r16, module.weight), (gy, gh16)),
        "rms_norm gated fwd+bwd": gated(None),
        "rms_norm gated 8 groups fwd+bwd": gated(group),
    }
    return out


def best_us(fn, calls: int) -> float:
    """CPU µs per call of this process (on a shared machine, wall time also counts others' turns)."""
    t = time.process_time()
    for _ in range(calls):
        fn()
    return (time.process_time() - t) * 1e6 / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="3x5x64")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=300)
    args = ap.parse_args()
    launcher.Launcher.__call__ = lambda self, grid, launch_args, key=None: None
    torch.manual_seed(0)
    calls = calls_for(tuple(int(v) for v in args.shape.split("x")))
    for fn in calls.values():
        fn()
        fn()
    best = {name: float("inf") for name in calls}
    for _ in range(args.rounds):
        for name, fn in calls.items():
            best[name] = min(best[name], best_us(fn, args.calls))
    for name, us in best.items():
        print(f"{name:32s} {us:7.1f} µs")


if __name__ == "__main__":
    main()
