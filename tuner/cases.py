"""The inputs of one measured backward and the correctness gate every result passes before it is timed.

Inputs are random (never zeros: they hide unwritten outputs) and the forward runs once with normtune's Triton
kernel, so that every implementation differentiates the same saved tensors. A residual problem's forward is the
fused residual form (h = x + residual, y = norm(h)); its backward takes the stream's gradient dh too. The gate
compares (dx, dw, db) with the fp32 PyTorch reference on the same inputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from normtune.kernels import backward as kbackward
from normtune.kernels import forward as kforward
from normtune.kernels import reference
from normtune.kernels.config import BackwardConfig, Problem

from .device import TORCH_DTYPES

# Relative error ‖out − ref‖ / ‖ref‖ allowed against the fp32 reference. Both sides round to the output dtype,
# so a right kernel differs by about one rounding of that dtype (bf16: 2^-8), a wrong one by O(1).
GATE_TOLERANCE = {"fp32": 1e-4, "fp16": 4e-3, "bf16": 3e-2}

# The forward's eps for every implementation (peers run their own forward with it on the same x).
EPS = 1e-5


@dataclass
class Case:
    """Inputs of one backward: the forward has run, `saved` is x (h, for a residual problem) or y according to
    problem.save; `dh` is the residual stream's gradient (residual problems only)."""

    problem: Problem
    x: torch.Tensor
    weight: torch.Tensor | None
    bias: torch.Tensor | None
    grad: torch.Tensor
    saved: torch.Tensor
    rstd: torch.Tensor
    mean: torch.Tensor
    dh: torch.Tensor | None = None

    def launch(self, config: BackwardConfig) -> kbackward.BackwardLaunch:
        return kbackward.BackwardLaunch(self.problem, config, self.grad, self.saved, self.weight, self.bias,
                                        self.rstd, self.mean, dh=self.dh)

    def reference(self):
        p = self.problem
        return reference.backward(self.grad, self.saved, self.weight, self.bias, self.rstd, self.mean,
                                  is_rms=p.norm == "rms_norm", zero_centered=p.zero_centered,
                                  from_output=p.save == "output", dh=self.dh)


def make_case(problem: Problem, device: torch.device | str, seed: int = 0) -> Case:
    """Random inputs, forward run once with the Triton kernel."""
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    dt, wdt = TORCH_DTYPES[problem.dtype], TORCH_DTYPES[problem.weight_dtype]
    M, N = problem.M, problem.N

    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)

    x = (randn(M, N) + 0.5).to(dt)
    weight = None
    if problem.has_weight:
        weight = (0.1 * randn(N)).to(wdt) if problem.zero_centered else (1.0 + 0.1 * randn(N)).to(wdt)
    bias = (0.1 * randn(N)).to(wdt) if problem.has_bias else None
    grad = randn(M, N).to(dt)
    is_rms = problem.norm == "rms_norm"
    store_mean = not is_rms and problem.save == "input"
    if problem.residual:
        hdt = TORCH_DTYPES[problem.residual_dtype]
        residual = randn(M, N).to(hdt)
        y, x, rstd, mean = kforward.forward_residual(x, residual, weight, bias, EPS, h_dtype=hdt, is_rms=is_rms,
                                                     zero_centered=problem.zero_centered, store_mean=store_mean)
        dh = randn(M, N).to(hdt)
    else:
        y, rstd, mean = kforward.forward(x, weight, bias, EPS, is_rms=is_rms, zero_centered=problem.zero_centered,
                                         store_mean=store_mean)
        dh = None
    saved = y if problem.save == "output" else x
    return Case(problem, x, weight, bias, grad, saved, rstd, mean, dh)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return math.inf
    denom = ref.norm().item()
    diff = (out - ref).norm().item()
    return diff / denom if denom > 0 else diff


def gate(problem: Problem, got, ref) -> tuple[bool, dict[str, float], str]:
    """Compare (dx, dw, db) with the reference; returns (passed, errors, message)."""
    tol = GATE_TOLERANCE[problem.dtype]
    if problem.save == "output":
        tol *= 2  # x̂ is recovered from the rounded y
    errors, bad = {}, []
    for name, a, b in zip(("dx", "dw", "db"), got, ref):
        if b is None:
            continue
        err = relative_error(a, b)
        errors[name] = err
        if not err <= tol:
            bad.append(f"{name} relative error {err:.3g} > {tol:g}")
    return not bad, errors, "; ".join(bad)
