"""The inputs of one measured backward and the correctness gate every result passes before it is timed.

Inputs are random (never zeros: they hide unwritten outputs) and the forward runs once with normtune's Triton
kernel, so that every implementation differentiates the same saved tensors. A residual problem's forward is the
fused residual form (h = x + residual, y = norm(h)); its backward takes the stream's gradient dh too. A gated
problem's forward is the gated RMSNorm with a random gate z; its backward reads z and writes z's gradient dz,
which the gate checks beside dx and dw. The gate compares (dx, dw, db) with the fp32 PyTorch reference on the same
inputs, in float64: the reference is computed once per `Case` (`Case.gate_reference`, reused by every config
measured on it) and each check is one pass on the device with one read back to the host.

An output that is the small difference of large terms (dx of a row of one column, whose x̂ is ±1 up to eps) is as
exact as fp32 makes it only relative to those terms: two right fp32 computations of it may differ by several
thousandths of its norm, and neither is closer to float64 than that. Its error is therefore measured against the
larger of its own norm and TERM_SHARE of its terms' norm (`Case.term_scales`); where the terms do not cancel the two
are alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from normtune.kernels import backward_launch as kbackward
from normtune.kernels import forward as kforward
from normtune.kernels.api import reference
from normtune.kernels.config import BackwardConfig, Problem

from ..gpu_info import TORCH_DTYPES

# Relative error ‖out − ref‖ / ‖ref‖ allowed against the fp32 reference. Both sides round to the output dtype,
# so a right kernel differs by about one rounding of that dtype (bf16: 2^-8), a wrong one by O(1).
GATE_TOLERANCE = {"fp32": 1e-4, "fp16": 4e-3, "bf16": 3e-2}

# The forward's eps for every implementation (peers run their own forward with it on the same x).
EPS = 1e-5
# The share of an output's terms' norm below which its own norm is not taken as the scale of its error (see above).
TERM_SHARE = 1e-2


@dataclass
class Case:
    """Inputs of one backward: the forward has run, `saved` is x (h, for a residual problem) or y according to
    problem.save; `dh` is the residual stream's gradient (residual problems only); `z` is the gate (gated problems
    only)."""

    problem: Problem
    x: torch.Tensor
    weight: torch.Tensor | None
    bias: torch.Tensor | None
    grad: torch.Tensor
    saved: torch.Tensor
    rstd: torch.Tensor
    mean: torch.Tensor
    dh: torch.Tensor | None = None
    z: torch.Tensor | None = None
    _gate_reference: "Reference | None" = field(default=None, repr=False, compare=False)

    def gate_reference(self) -> "Reference":
        """The gate's float64 reference of these inputs, computed on first use and kept: every config measured on
        this case is checked against the same one (the inputs do not change between trials)."""
        if self._gate_reference is None:
            self._gate_reference = Reference(self.reference(), self.term_scales())
        return self._gate_reference

    def term_scales(self) -> tuple:
        """Per output of `reference` (dx, dw, db[, dz]), the magnitude of the terms it is the difference of (None:
        it is no such difference): dx's first term r·w·g (its gate's share of g, times the gate after the norm,
        plus dh in the residual form), and, with the gate after the norm, dz's as dx's times x·act'(z)."""
        p = self.problem
        g, w = self.grad.float(), reference.effective_weight(self.weight, p.zero_centered)
        wg = (g * w if w is not None else g).abs() * self.rstd[:, None]
        dz = None
        if p.gate is not None:
            act, act_grad = reference.gate_activation(self.z.float(), p.gate_activation == "sigmoid")
            if p.gate == "after":
                dz = wg * (self.saved.float() * act_grad).abs()
            wg = wg * act.abs()
        if self.dh is not None:
            wg = wg + self.dh.float().abs()
        return (wg, None, None, dz) if p.gate is not None else (wg, None, None)

    def launch(self, config: BackwardConfig) -> kbackward.BackwardLaunch:
        return kbackward.BackwardLaunch(self.problem, config, self.grad, self.saved, self.weight, self.bias,
                                        self.rstd, self.mean, dh=self.dh, z=self.z)

    def reference(self):
        p = self.problem
        if p.gate is not None:  # (dx, dw, None, dz)
            return reference.backward_gated(self.grad, self.saved, self.z, self.weight, self.rstd,
                                            gate_after=p.gate == "after", sigmoid=p.gate_activation == "sigmoid",
                                            zero_centered=p.zero_centered)
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
    z = dh = None
    if problem.gate is not None:
        z = randn(M, N).to(dt)
        y, rstd = kforward.forward_gated(x, z, weight, EPS, gate_after=problem.gate == "after",
                                         sigmoid=problem.gate_activation == "sigmoid",
                                         zero_centered=problem.zero_centered)
        mean = None
    elif problem.residual:
        hdt = TORCH_DTYPES[problem.residual_dtype]
        residual = randn(M, N).to(hdt)
        y, x, rstd, mean = kforward.forward_residual(x, residual, weight, bias, EPS, h_dtype=hdt, is_rms=is_rms,
                                                     zero_centered=problem.zero_centered, store_mean=store_mean)
        dh = randn(M, N).to(hdt)
    else:
        y, rstd, mean = kforward.forward(x, weight, bias, EPS, is_rms=is_rms, zero_centered=problem.zero_centered,
                                         store_mean=store_mean)
    saved = y if problem.save == "output" else x
    return Case(problem, x, weight, bias, grad, saved, rstd, mean, dh, z)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return math.inf
    denom = ref.norm().item()
    diff = (out - ref).norm().item()
    return diff / denom if denom > 0 else diff


OUTPUTS = ("dx", "dw", "db", "dz")  # dz: the gate's gradient (gated problems only)


class Reference:
    """(dx, dw, db) of the reference (and dz, for a gated problem), prepared once for the gate: each present output
    in float64 with its norm, on the reference's device. `errors` computes a trial's relative errors (as
    `relative_error` does) on the device and reads them back at once."""

    def __init__(self, grads, scales=None):
        self.names = tuple(name for name, r in zip(OUTPUTS, grads) if r is not None)
        self.exact = tuple(None if r is None else r.double() for r in grads)
        norms = []
        for r, terms in zip(self.exact, scales or (None,) * len(self.exact)):
            if r is not None:  # at least TERM_SHARE of its terms' norm, where `Case.term_scales` gives them
                norm = torch.linalg.vector_norm(r)
                norms.append(norm if terms is None else torch.maximum(
                    norm, TERM_SHARE * torch.linalg.vector_norm(terms.double())))
        self.norms = torch.stack(norms) if norms else None

    def errors(self, got) -> dict[str, float]:
        """‖out − ref‖ / ‖ref‖ in float64 per present output (‖ref‖ at least TERM_SHARE of its terms' norm where
        the reference was given them; ‖out − ref‖ where that is 0); inf where the output holds a NaN or an
        infinity. One host read for all of them."""
        if self.norms is None:
            return {}
        diffs = torch.stack([torch.linalg.vector_norm(torch.sub(out, ref))
                             for out, ref in zip(got, self.exact) if ref is not None])
        # A NaN or an infinity in an output makes its difference's norm NaN or inf.
        values = torch.where(self.norms > 0, diffs / self.norms, diffs).tolist()
        return {name: v if math.isfinite(v) else math.inf for name, v in zip(self.names, values)}


def gate(problem: Problem, got, ref) -> tuple[bool, dict[str, float], str]:
    """Compare (dx, dw, db) with the reference (a `Reference`, or the reference's (dx, dw, db)); returns (passed,
    errors, message)."""
    tol = GATE_TOLERANCE[problem.dtype]
    if problem.save == "output":
        tol *= 2  # x̂ is recovered from the rounded y
    if not isinstance(ref, Reference):
        ref = Reference(ref)
    errors = ref.errors(got)
    bad = [f"{name} relative error {err:.3g} > {tol:g}" for name, err in errors.items() if not err <= tol]
    return not bad, errors, "; ".join(bad)


def tensor_bytes(*holders) -> int:
    """Bytes of the distinct tensor storages held in the attributes (and tuples of them) of `holders`."""
    seen: dict[int, int] = {}

    def visit(value) -> None:
        if isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        elif isinstance(value, (tuple, list)):
            for v in value:
                visit(v)

    for holder in holders:
        for value in vars(holder).values():
            visit(value)
    return sum(seen.values())


class CaseCache:
    """The inputs and float64 reference of several problems, kept while they fit in `budget_bytes`: a sweep's
    problems take turns trial by trial, so a single kept problem would be made anew for nearly every trial.

    A problem that does not fit evicts the problems unused for `stale_s` (a sweep that has moved on); where that
    is not enough it is made for its trials only and replaced by the next problem that does not fit, the kept ones
    staying (a round over more problems than fit then reuses what it can instead of evicting each in turn)."""

    def __init__(self, budget_bytes: int, stale_s: float = 30.0):
        self.budget_bytes, self.stale_s = budget_bytes, stale_s
        self._kept: dict[Problem, list] = {}  # problem -> [case, reference, bytes, last used]
        self._passing: tuple[Problem, Case, Reference] | None = None  # the one too large to keep

    @property
    def kept_bytes(self) -> int:
        return sum(entry[2] for entry in self._kept.values())

    def __len__(self) -> int:
        return len(self._kept)

    def get(self, problem: Problem, make, now: float) -> tuple[Case, Reference, bool]:
        """(case, reference, made now) of `problem`; `make(problem)` returns a new (case, reference)."""
        entry = self._kept.get(problem)
        if entry is not None:
            entry[3] = now
            return entry[0], entry[1], False
        if self._passing is not None and self._passing[0] == problem:
            return self._passing[1], self._passing[2], False
        self._passing = None  # freed before the next one is made
        for key in [k for k, e in self._kept.items() if now - e[3] > self.stale_s]:
            del self._kept[key]
        case, ref = make(problem)
        size = tensor_bytes(case, ref)
        if self.kept_bytes + size <= self.budget_bytes:
            self._kept[problem] = [case, ref, size, now]
        else:
            self._passing = (problem, case, ref)
        return case, ref, True
