"""Peers that `normtune bench` compares against, registered by name with lazy imports: a missing optional
library (Liger, quack) is a message in the report, never an ImportError at start-up.

A peer turns (problem, inputs) into a zero-argument callable that runs *only the backward* on the same inputs
(the forward has run once, untimed), returning (dx, dw, db) so that its values can be checked too, and a
zero-argument forward call (for the host-µs view). `NormtuneAPI` does the same for normtune's public functions,
so that normtune's host µs are those a user's call pays.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from normtune.kernels.config import BackwardConfig, Problem

from .cases import EPS

Backward = Callable[[], tuple]


class PeerUnavailable(RuntimeError):
    """The peer's library is not importable, or it does not support this problem."""


@dataclass
class PreparedPeer:
    run: Backward  # the backward only
    forward: Callable[[], object] | None = None  # one forward call (building the autograd graph)
    note: str = ""
    autograd: bool = True  # False: plain function calls (the host-µs view then compares normtune's direct ones)


def _leaves(x, weight, bias, weight_dtype=None):
    """Fresh autograd leaves (optionally with a different weight dtype) so peers never share graphs."""
    xs = x.detach().clone().requires_grad_(True)
    ws = weight.detach().to(weight_dtype or weight.dtype).clone().requires_grad_(True) if weight is not None else None
    bs = bias.detach().to(weight_dtype or bias.dtype).clone().requires_grad_(True) if bias is not None else None
    return xs, ws, bs


def _autograd_backward(y: torch.Tensor, grad: torch.Tensor, leaves) -> Backward:
    inputs = [t for t in leaves if t is not None]

    def run():
        grads = torch.autograd.grad(y, inputs, grad, retain_graph=True)
        it = iter(grads)
        return tuple(next(it) if t is not None else None for t in leaves)

    return run


class Peer:
    """A backward implementation to compare with. Subclasses set `name` and implement `prepare`."""

    name = "peer"
    description = ""
    # What the peer's backward needs beyond the plain norm saving its input: (test, reason when it fails).
    requirement: tuple[Callable[[Problem], bool], str] | None = None

    def supports(self, problem: Problem) -> str | None:
        """None when the peer can run `problem`, else why not."""
        if problem.save != "input" or problem.zero_centered:
            return "only the plain norm saving its input"
        if self.requirement is not None and not self.requirement[0](problem):
            return self.requirement[1]
        return None

    def prepare(self, problem: Problem, x, weight, bias, grad) -> PreparedPeer:
        raise NotImplementedError


class TorchEager(Peer):
    name = "torch"
    description = "torch eager (F.layer_norm / F.rms_norm autograd)"

    def prepare(self, problem, x, weight, bias, grad):
        xs, ws, bs = _leaves(x, weight, bias)
        N = problem.N
        if problem.norm == "layer_norm":
            def forward():
                return F.layer_norm(xs, (N,), ws, bs, EPS)
        else:
            def forward():
                return F.rms_norm(xs, (N,), ws, EPS)
        return PreparedPeer(_autograd_backward(forward(), grad, (xs, ws, bs)), forward)


class TorchCompile(Peer):
    name = "compile"
    description = "torch.compile of the eager norm (one compile per shape, static shapes)"

    def __init__(self):
        import torch._dynamo

        # One compile per shape: never let a recompile limit silently fall back to eager.
        cfg = torch._dynamo.config
        for knob in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                     "accumulated_cache_size_limit"):
            if hasattr(cfg, knob):
                setattr(cfg, knob, max(getattr(cfg, knob), 4096))

    def prepare(self, problem, x, weight, bias, grad):
        N = problem.N
        if problem.norm == "layer_norm":
            def fn(a, w, b):
                return F.layer_norm(a, (N,), w, b, EPS)
        else:
            def fn(a, w, b):
                return F.rms_norm(a, (N,), w, EPS)
        compiled = torch.compile(fn, dynamic=False)
        xs, ws, bs = _leaves(x, weight, bias)

        def forward():
            return compiled(xs, ws, bs)

        return PreparedPeer(_autograd_backward(forward(), grad, (xs, ws, bs)), forward)


class Liger(Peer):
    name = "liger"
    description = "Liger-Kernel (LigerLayerNormFunction / LigerRMSNormFunction)"
    requirement = (lambda p: p.has_weight and (p.norm != "layer_norm" or bool(p.has_bias)),
                   "Liger needs a weight (and a bias for LayerNorm)")

    def prepare(self, problem, x, weight, bias, grad):
        try:
            if problem.norm == "layer_norm":
                from liger_kernel.ops.layer_norm import LigerLayerNormFunction as Fn
            else:
                from liger_kernel.ops.rms_norm import LigerRMSNormFunction as Fn
        except ImportError as err:
            raise PeerUnavailable(f"liger-kernel is not installed ({err}): pip install liger-kernel") from None
        xs, ws, bs = _leaves(x, weight, bias)
        if problem.norm == "layer_norm":
            def forward():
                return Fn.apply(xs, ws, bs, EPS)
        else:
            def forward():
                # in_place=False: Liger would otherwise write dx into the reused grad_output buffer.
                return Fn.apply(xs, ws, EPS, 0.0, "llama", False)
        return PreparedPeer(_autograd_backward(forward(), grad, (xs, ws, bs)), forward,
                            note="in_place=False" if problem.norm == "rms_norm" else "")


class Quack(Peer):
    name = "quack"
    description = "quack (CuTe DSL), fp32 weights"
    requirement = (lambda p: p.has_weight, "quack's backward needs a weight")

    def prepare(self, problem, x, weight, bias, grad):
        try:
            import importlib

            qr = importlib.import_module("quack.rmsnorm")  # `from quack import rmsnorm` is the function
        except Exception as err:  # noqa: BLE001 - quack's import can fail in its DSL runtime too
            raise PeerUnavailable(f"quack is not importable ({type(err).__name__}: {err})") from None
        note = "quack needs fp32 weights: weights (and bias) upcast to fp32" if weight.dtype != torch.float32 else ""
        if problem.norm == "rms_norm":
            xs, ws, bs = _leaves(x, weight, bias, torch.float32)

            def forward():
                return qr.rmsnorm(xs, ws, eps=EPS)

            return PreparedPeer(_autograd_backward(forward(), grad, (xs, ws, bs)), forward, note=note)
        # quack 0.6.x has LayerNorm forward/backward functions but no autograd wrapper: call them directly.
        w32 = weight.detach().float()
        b32 = bias.detach().float() if bias is not None else None
        def forward():
            return qr.layernorm_fwd(x, w32, b32, eps=EPS, return_rstd=True, return_mean=True)

        _, rstd, mean = forward()

        def run():
            dx, dw, db = qr.layernorm_bwd(x, w32, grad, rstd, mean, has_bias=b32 is not None)
            return dx, dw, db

        return PreparedPeer(run, forward, autograd=False,
                            note=(note + "; " if note else "") + "LayerNorm via quack.rmsnorm.layernorm_bwd")


def liger_functional():
    """`liger_kernel.functional` (Liger 0.8.5 and later: every op with a choice of backend)."""
    import importlib

    try:
        return importlib.import_module("liger_kernel.functional")
    except Exception as err:  # noqa: BLE001 - its CuTe DSL backend can fail at import too
        raise PeerUnavailable(f"liger_kernel.functional is not importable ({type(err).__name__}: {err}): pip "
                              "install liger-kernel (0.8.5 or later)") from None


def liger_backend_call(fn, impl: str):
    """`fn` with its backend chosen: Liger's functional entry points take `impl=` (earlier releases `backend=`)."""
    import inspect

    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        params = {}
    key = "backend" if "backend" in params and "impl" not in params else "impl"
    return lambda *args, **kwargs: fn(*args, **{key: impl}, **kwargs)


class LigerCuteDSL(Peer):
    name = "liger-cutedsl"
    description = "Liger liger_kernel.functional.rms_norm / layer_norm, impl='nvidia-cutedsl'"
    requirement = Liger.requirement

    def prepare(self, problem, x, weight, bias, grad):
        fn = getattr(liger_functional(), problem.norm, None)
        if fn is None:
            raise PeerUnavailable(f"this liger-kernel has no functional.{problem.norm} (0.8.5 or later)")
        call = liger_backend_call(fn, "nvidia-cutedsl")
        xs, ws, bs = _leaves(x, weight, bias)
        if problem.norm == "layer_norm":
            def forward():
                return call(xs, ws, bs, EPS)
        else:
            def forward():
                return call(xs, ws, EPS, in_place=False)  # in_place would write dx into the reused grad buffer
        return PreparedPeer(_autograd_backward(forward(), grad, (xs, ws, bs)), forward,
                            note="in_place=False" if problem.norm == "rms_norm" else "")


class NormtuneAPI:
    """normtune through its public functions (`layer_norm`, `rms_norm`, autograd), as a user calls it: the
    host-µs view of normtune times these calls, config resolution and dispatch included. `config=None` lets the
    runtime choose (the shipped table), as a user's call does."""

    name = "normtune"

    def prepare(self, problem: Problem, x, weight, bias, grad, config: BackwardConfig | None) -> PreparedPeer:
        from normtune.kernels.api.functional import layer_norm, rms_norm

        xs, ws, bs = _leaves(x, weight, bias)
        kw = dict(zero_centered=problem.zero_centered, save=problem.save, config=config)
        if problem.norm == "layer_norm":
            def forward():
                return layer_norm(xs, ws, bs, EPS, **kw)
        else:
            def forward():
                return rms_norm(xs, ws, EPS, **kw)
        return PreparedPeer(_autograd_backward(forward(), grad, (xs, ws, bs)), forward)

    def prepare_direct(self, problem: Problem, x, weight, bias, grad, config: BackwardConfig | None) -> PreparedPeer:
        """normtune's functions without autograd (`normtune.kernels.direct`), for the host-µs comparison with a
        peer that is called that way (quack's LayerNorm)."""
        from normtune.kernels.api import direct

        zc, out = problem.zero_centered, problem.save == "output"
        if problem.norm == "layer_norm":
            def forward():
                return direct.layer_norm_forward(x, weight, bias, EPS, zero_centered=zc)

            y, mean, rstd = forward()

            def run():
                return direct.layer_norm_backward(grad, y if out else x, weight, bias, mean, rstd, zero_centered=zc,
                                                  from_output=out, config=config)
        else:
            def forward():
                return direct.rms_norm_forward(x, weight, EPS, zero_centered=zc)

            y, rstd = forward()

            def run():
                return direct.rms_norm_backward(grad, y if out else x, weight, rstd, zero_centered=zc,
                                                from_output=out, config=config)
        return PreparedPeer(run, forward, autograd=False)


PEERS: dict[str, type[Peer]] = {cls.name: cls for cls in (TorchEager, TorchCompile, Liger, LigerCuteDSL, Quack)}


def parse_peers(spec: str) -> list[str]:
    """'all' | 'none' | comma list of names → names, rejecting unknown ones with the allowed list."""
    spec = spec.strip().lower()
    if spec in ("", "none"):
        return []
    if spec == "all":
        return list(PEERS)
    names = [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [n for n in names if n not in PEERS]
    if unknown:
        raise ValueError(f"unknown peer(s) {', '.join(unknown)} (allowed: all, none, {', '.join(PEERS)})")
    return names


def make_peer(name: str) -> Peer:
    return PEERS[name]()
