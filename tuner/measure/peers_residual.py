"""Implementations of the residual block that `normtune bench --residual` times, registered by name with lazy
imports: a missing optional library (Liger, quack) is a message in the report, never an ImportError at start-up.

The block is what a pre-norm transformer layer runs:

    h = x + residual   (in the residual dtype)
    y = norm(h)

with gradients flowing into both outputs (dy into y, dh into h, the residual stream's gradient), so that x's and
residual's gradient is dh + norm_backward(dy). Each implementation turns the inputs into a `PreparedBlock`: the
block (forward and backward through autograd, a fresh graph per call), the backward alone (on one retained
graph), and the forward alone; each returns (dx, dresidual, dw, db) or (y, h), so that values are checked too.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from normtune.kernels.config import Problem

from .cases import EPS
from ..gpu_info import TORCH_DTYPES
from .peers import PeerUnavailable, liger_backend_call, liger_functional


@dataclass
class BlockInputs:
    """The block's inputs and the two upstream gradients (dy for y, dh for h)."""

    x: torch.Tensor
    residual: torch.Tensor
    weight: torch.Tensor | None
    bias: torch.Tensor | None
    dy: torch.Tensor
    dh: torch.Tensor


@dataclass
class PreparedBlock:
    block: Callable[[], tuple]  # forward + backward: (dx, dresidual, dw, db)
    backward: Callable[[], tuple]  # the backward alone, on one retained graph: (dx, dresidual, dw, db)
    forward: Callable[[], tuple]  # the forward alone: (y, h)
    note: str = ""


def make_inputs(problem: Problem, device, seed: int = 0) -> BlockInputs:
    """Random inputs (never zeros: they hide unwritten outputs) for a residual problem."""
    gen = torch.Generator(device=device).manual_seed(seed)
    dt, wdt = TORCH_DTYPES[problem.dtype], TORCH_DTYPES[problem.weight_dtype]
    rdt = TORCH_DTYPES[problem.residual_dtype or problem.dtype]
    M, N = problem.M, problem.N

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32)

    weight = None
    if problem.has_weight:
        weight = (0.1 * randn(N) + (0.0 if problem.zero_centered else 1.0)).to(wdt)
    bias = (0.1 * randn(N)).to(wdt) if problem.has_bias else None
    return BlockInputs((randn(M, N) + 0.5).to(dt), randn(M, N).to(rdt), weight, bias, randn(M, N).to(dt),
                       randn(M, N).to(rdt))


def reference(problem: Problem, inputs: BlockInputs) -> dict:
    """y, h and the gradients in float64 (torch autograd on float64 copies)."""
    leaves = [t.detach().double().requires_grad_(True) if t is not None else None
              for t in (inputs.x, inputs.residual, inputs.weight, inputs.bias)]
    x, r, w, b = leaves
    h = x + r
    w_eff = (1.0 + w if problem.zero_centered else w) if w is not None else None
    N = problem.N
    y = F.rms_norm(h, (N,), w_eff, EPS) if problem.norm == "rms_norm" else F.layer_norm(h, (N,), w_eff, b, EPS)
    present = [t for t in leaves if t is not None]
    grads = iter(torch.autograd.grad((y, h), present, (inputs.dy.double(), inputs.dh.double())))
    dx, dr, dw, db = (next(grads) if t is not None else None for t in leaves)
    return {"y": y.detach(), "h": h.detach(), "dx": dx, "dresidual": dr, "dw": dw, "db": db}


def _leaves(inputs: BlockInputs, weight_dtype: torch.dtype | None = None) -> list:
    """Fresh autograd leaves (weights optionally in another dtype) so implementations never share graphs."""
    out = []
    for i, t in enumerate((inputs.x, inputs.residual, inputs.weight, inputs.bias)):
        if t is None:
            out.append(None)
            continue
        t = t.detach().to(weight_dtype) if (i >= 2 and weight_dtype is not None) else t.detach()
        out.append(t.clone().requires_grad_(True))
    return out


def autograd_block(forward: Callable[[], tuple], leaves: list, inputs: BlockInputs) -> PreparedBlock:
    """The three calls of an implementation whose `forward()` returns (y, h) with autograd."""
    present = [t for t in leaves if t is not None]
    grads_out = (inputs.dy, inputs.dh)

    def expand(grads):
        it = iter(grads)
        return tuple(next(it) if t is not None else None for t in leaves)

    def block():
        return expand(torch.autograd.grad(forward(), present, grads_out))

    kept = forward()

    def backward():
        return expand(torch.autograd.grad(kept, present, grads_out, retain_graph=True))

    return PreparedBlock(block, backward, forward)


class ResidualPeer:
    """A residual-block implementation to compare with. Subclasses set `name` and implement `prepare`."""

    name = "peer"
    description = ""
    rms_only = False

    def supports(self, problem: Problem) -> str | None:
        """None when the peer can run `problem`, else why not."""
        if problem.save != "input" or problem.zero_centered:
            return "only the plain norm saving its input"
        if self.rms_only and problem.norm != "rms_norm":
            return f"{self.name} has no fused residual LayerNorm with a backward"
        if self.rms_only and not problem.has_weight:
            return f"{self.name} needs a weight"
        return None

    def prepare(self, problem: Problem, inputs: BlockInputs) -> PreparedBlock:
        raise NotImplementedError


def _eager(problem: Problem):
    """The eager block: the add in the residual dtype, the norm in torch (weights cast to h's dtype if needed)."""
    N, is_rms = problem.N, problem.norm == "rms_norm"

    def block(x, r, w, b):
        h = x.to(r.dtype) + r
        w2 = w.to(h.dtype) if w is not None and w.dtype != h.dtype else w
        b2 = b.to(h.dtype) if b is not None and b.dtype != h.dtype else b
        y = F.rms_norm(h, (N,), w2, EPS) if is_rms else F.layer_norm(h, (N,), w2, b2, EPS)
        return y.to(x.dtype), h

    return block


class TorchEager(ResidualPeer):
    name = "torch"
    description = "torch eager: h = x + r, then F.rms_norm / F.layer_norm (autograd)"

    def prepare(self, problem, inputs):
        fn, leaves = _eager(problem), _leaves(inputs)
        return autograd_block(lambda: fn(*leaves), leaves, inputs)


class TorchCompile(ResidualPeer):
    name = "compile"
    description = "torch.compile of the eager block (one compile per shape, static shapes)"

    def __init__(self):
        from .peers import TorchCompile as PlainCompile

        PlainCompile()  # its recompile limits: one compile per shape, never a silent fall back to eager
        import torch._functorch.config as functorch_config

        # A backward compiled with donated buffers (saved tensors reused as its outputs' memory) refuses to run
        # twice on one graph, which the backward-alone view does: compiled without them.
        functorch_config.donated_buffer = False

    def prepare(self, problem, inputs):
        compiled, leaves = torch.compile(_eager(problem), dynamic=False), _leaves(inputs)
        prepared = autograd_block(lambda: compiled(*leaves), leaves, inputs)
        prepared.note = "compiled without donated buffers (the backward runs more than once per graph)"
        return prepared


class Quack(ResidualPeer):
    name = "quack"
    description = "quack rmsnorm(x, w, residual=r, prenorm=True), fp32 weights"
    rms_only = True
    weight_dtype: torch.dtype | None = torch.float32

    def prepare(self, problem, inputs):
        try:
            qr = importlib.import_module("quack.rmsnorm")  # `from quack import rmsnorm` is the function
        except Exception as err:  # noqa: BLE001 - quack's import can fail in its DSL runtime too
            raise PeerUnavailable(f"quack is not importable ({type(err).__name__}: {err})") from None
        leaves = _leaves(inputs, self.weight_dtype)
        x, r, w, _ = leaves
        rdt = TORCH_DTYPES[problem.residual_dtype or problem.dtype]

        def forward():
            return qr.rmsnorm(x, w, residual=r, residual_dtype=rdt, eps=EPS, prenorm=True)

        prepared = autograd_block(forward, leaves, inputs)
        prepared.note = f"weights in {w.dtype}".replace("torch.", "")
        return prepared


class QuackWeights16(Quack):
    name = "quack-w16"
    description = "quack rmsnorm(x, w, residual=r, prenorm=True), weights in the activation dtype"
    weight_dtype = None


class Liger(ResidualPeer):
    name = "liger"
    description = "Liger liger_kernel.functional.fused_add_rms_norm, impl='nvidia-triton'"
    rms_only = True
    impl = "nvidia-triton"

    def supports(self, problem):
        why = super().supports(problem)
        if why is None and (problem.residual_dtype or problem.dtype) != problem.dtype:
            return "Liger's fused_add_rms_norm keeps the residual stream in x's dtype"
        return why

    def prepare(self, problem, inputs):
        fn = getattr(liger_functional(), "fused_add_rms_norm", None)
        if fn is None:
            raise PeerUnavailable("this liger-kernel has no functional.fused_add_rms_norm (0.8.5 or later)")
        call = liger_backend_call(fn, self.impl)
        leaves = _leaves(inputs)
        x, r, w, _ = leaves
        return autograd_block(lambda: tuple(call(x, r, w, EPS, in_place=False)), leaves, inputs)


class LigerCuteDSL(Liger):
    name = "liger-cutedsl"
    description = "Liger liger_kernel.functional.fused_add_rms_norm, impl='nvidia-cutedsl'"
    impl = "nvidia-cutedsl"


class Normtune(ResidualPeer):
    """normtune through its public functions, as a user calls them (config None: the runtime's choice)."""

    name = "normtune"
    description = "normtune rms_norm / layer_norm(x, ..., residual=r)"

    def __init__(self, config=None):
        self.config = config

    def supports(self, problem):
        return None

    def prepare(self, problem, inputs):
        from normtune.kernels.api.functional import layer_norm, rms_norm

        leaves = _leaves(inputs)
        x, r, w, b = leaves
        kw = dict(residual=r, residual_dtype=TORCH_DTYPES[problem.residual_dtype or problem.dtype],
                  zero_centered=problem.zero_centered, save=problem.save, config=self.config)
        if problem.norm == "rms_norm":
            def forward():
                return rms_norm(x, w, EPS, **kw)
        else:
            def forward():
                return layer_norm(x, w, b, EPS, **kw)
        return autograd_block(forward, leaves, inputs)


RESIDUAL_PEERS: dict[str, type[ResidualPeer]] = {
    cls.name: cls for cls in (TorchEager, TorchCompile, Quack, QuackWeights16, Liger, LigerCuteDSL)}


def parse_residual_peers(spec: str) -> list[str]:
    """'all' | 'none' | comma list of names → names, rejecting unknown ones with the allowed list."""
    spec = spec.strip().lower()
    if spec in ("", "none"):
        return []
    if spec == "all":
        return list(RESIDUAL_PEERS)
    names = [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [n for n in names if n not in RESIDUAL_PEERS]
    if unknown:
        raise ValueError(f"unknown residual peer(s) {', '.join(unknown)} (allowed: all, none, "
                         f"{', '.join(RESIDUAL_PEERS)})")
    return names
