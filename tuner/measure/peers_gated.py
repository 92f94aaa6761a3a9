"""Gated RMSNorm implementations to compare with, registered by name with lazy imports: a library that is not
installed (flash-linear-attention, mamba_ssm, transformers) is a `PeerUnavailable` message, never an ImportError.

The problem (`tuner.gated_shapes.GatedProblem`) is y = w · rmsnorm(x) · act(z) (gate position "before") or
y = w · rmsnorm(x · act(z)) ("after"), normalized in groups of `group_size` columns. Each peer turns the inputs
into a `PreparedGated`: the forward and backward through autograd (a fresh graph per call), the backward alone
(on one retained graph) and the forward alone, the first two returning (dx, dz, dw) so that values are checked
against the float64 `reference` before anything is timed (`check`).

The memory floor: the forward reads x and z and writes y (3 passes of M×N elements), the backward reads x, z and
dy and writes dx and dz (5 passes), at the activation's element size; plus the weight (read by both, dw written).
"""

from __future__ import annotations

import importlib
import inspect
import math
from dataclasses import dataclass
from typing import Callable

import torch

from ..gated_shapes import GatedProblem
from ..gpu_info import TORCH_DTYPES
from .cases import GATE_TOLERANCE, relative_error
from .peers import PeerUnavailable

FORWARD_PASSES, BACKWARD_PASSES = 3, 5


@dataclass
class GatedInputs:
    x: torch.Tensor
    z: torch.Tensor
    weight: torch.Tensor
    dy: torch.Tensor


@dataclass
class PreparedGated:
    block: Callable[[], tuple]  # forward + backward: (dx, dz, dw)
    backward: Callable[[], tuple]  # the backward alone, on one retained graph: (dx, dz, dw)
    forward: Callable[[], torch.Tensor]  # the forward alone: y
    note: str = ""


def make_inputs(problem: GatedProblem, device, seed: int = 0) -> GatedInputs:
    """Random inputs (never zeros: they hide unwritten outputs); the weight in the activation dtype."""
    gen = torch.Generator(device=device).manual_seed(seed)
    dt = TORCH_DTYPES[problem.dtype]
    M, N = problem.M, problem.N

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32)

    weight = 0.1 * randn(N) + (0.0 if problem.zero_centered else 1.0)
    return GatedInputs((randn(M, N) + 0.5).to(dt), randn(M, N).to(dt), weight.to(dt), randn(M, N).to(dt))


def gated_rms_norm_reference(x, z, weight, problem: GatedProblem) -> torch.Tensor:
    """The gated RMSNorm in the tensors' own dtype (autograd-able): float64 tensors give the reference."""
    act = torch.sigmoid(z) if problem.activation == "sigmoid" else torch.nn.functional.silu(z)
    w = 1.0 + weight if problem.zero_centered else weight
    h = x * act if problem.gate_position == "after" else x
    M, N, g = x.shape[0], x.shape[1], problem.group
    hg = h.reshape(M, N // g, g)
    normed = (hg * torch.rsqrt(hg.pow(2).mean(-1, keepdim=True) + problem.eps)).reshape(M, N)
    y = normed * w
    return y * act if problem.gate_position == "before" else y


def reference(problem: GatedProblem, inputs: GatedInputs) -> dict:
    """y and the gradients (dx, dz, dw) in float64."""
    x, z, w = (t.detach().double().requires_grad_(True) for t in (inputs.x, inputs.z, inputs.weight))
    y = gated_rms_norm_reference(x, z, w, problem)
    dx, dz, dw = torch.autograd.grad(y, (x, z, w), inputs.dy.double())
    return {"y": y.detach(), "dx": dx, "dz": dz, "dw": dw}


def floor_bytes(problem: GatedProblem) -> tuple[int, int]:
    """(forward, backward) bytes at the memory floor."""
    e = torch.empty((), dtype=TORCH_DTYPES[problem.dtype]).element_size()
    mn, n = problem.M * problem.N, problem.N
    return FORWARD_PASSES * mn * e + n * e, BACKWARD_PASSES * mn * e + 2 * n * e


def floor_us(nbytes: int, bandwidth_gbps: float) -> float:
    """µs to move `nbytes` at the copy bandwidth (GB/s); NaN where the bandwidth is unknown."""
    return nbytes / (bandwidth_gbps * 1e3) if bandwidth_gbps and math.isfinite(bandwidth_gbps) else math.nan


def check(problem: GatedProblem, prepared: PreparedGated, ref: dict) -> dict[str, float]:
    """Relative errors of y, dx, dz and dw against the float64 reference."""
    y = prepared.forward()
    dx, dz, dw = prepared.block()
    return {"y": relative_error(y, ref["y"]), "dx": relative_error(dx, ref["dx"]),
            "dz": relative_error(dz, ref["dz"]), "dw": relative_error(dw, ref["dw"])}


def within_tolerance(problem: GatedProblem, errors: dict[str, float]) -> bool:
    return all(e <= GATE_TOLERANCE[problem.dtype] for e in errors.values())


def _leaves(inputs: GatedInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fresh autograd leaves so implementations never share graphs."""
    return tuple(t.detach().clone().requires_grad_(True) for t in (inputs.x, inputs.z, inputs.weight))


def autograd_gated(forward: Callable[[], torch.Tensor], leaves, dy: torch.Tensor, note: str = "") -> PreparedGated:
    """The three calls of an implementation whose `forward()` returns y with autograd."""
    leaves = tuple(leaves)

    def block():
        return torch.autograd.grad(forward(), leaves, dy)

    kept = forward()

    def backward():
        return torch.autograd.grad(kept, leaves, dy, retain_graph=True)

    return PreparedGated(block, backward, forward, note)


def first_config_autotune() -> None:
    """Make every `triton.autotune` take its first config without timing: Triton's interpreter has no
    benchmarker, and flash-linear-attention's kernels are autotuned. For CPU checks only."""
    from triton.runtime import autotuner

    autotuner.Autotuner.prune_configs = lambda self, kwargs: self.configs[:1]


def _import(module: str, package: str):
    try:
        return importlib.import_module(module)
    except Exception as err:  # noqa: BLE001 - a compiled extension can fail with other errors than ImportError
        raise PeerUnavailable(f"{package} is not installed or does not import ({type(err).__name__}: {err}); "
                              f"pip install {package}") from None


class GatedPeer:
    """A gated RMSNorm implementation. Subclasses set `name` and implement `prepare`."""

    name = "peer"
    description = ""
    positions = ("before", "after")
    activations = ("silu",)
    grouped_before = False  # whether groups narrower than the width work with the norm before the gate

    def supports(self, problem: GatedProblem) -> str | None:
        """None when the peer can run `problem`, else why not."""
        if problem.gate_position not in self.positions:
            return f"{self.name} has no norm {'after' if problem.gate_position == 'after' else 'before'} the gate"
        if problem.activation not in self.activations:
            return f"{self.name} gates with {', '.join(self.activations)} only"
        if problem.zero_centered:
            return f"{self.name} has no zero-centred weight"
        if problem.gate_position == "before" and problem.group != problem.N and not self.grouped_before:
            return f"{self.name} normalizes the whole width before the gate"
        return None

    def prepare(self, problem: GatedProblem, inputs: GatedInputs) -> PreparedGated:
        raise NotImplementedError


def transformers_module(problem: GatedProblem):
    """transformers' own gated norm for the problem's gate position, in the activation dtype, weight set."""
    if problem.gate_position == "before" and problem.activation == "sigmoid":
        candidates = (("transformers.models.kimi_linear.modeling_kimi_linear", "KimiLinearRMSNormGated"),
                      ("transformers.models.bailing_hybrid.modeling_bailing_hybrid", "BailingHybridRMSNormGated"))
    elif problem.gate_position == "before":
        candidates = (("transformers.models.qwen3_next.modeling_qwen3_next", "Qwen3NextRMSNormGated"),
                      ("transformers.models.qwen3_5.modeling_qwen3_5", "Qwen3_5RMSNormGated"))
    else:
        candidates = (("transformers.models.mamba2.modeling_mamba2", "MambaRMSNormGated"),)
    for module_name, cls_name in candidates:
        try:
            cls = getattr(importlib.import_module(module_name), cls_name)
        except (ImportError, AttributeError):
            continue
        return cls(problem.N, eps=problem.eps, **_group_argument(cls, problem)), cls_name
    raise PeerUnavailable(f"this transformers has none of {', '.join(c for _, c in candidates)}: "
                          "pip install 'transformers>=4.57'")


def _group_argument(cls, problem: GatedProblem) -> dict:
    """How `cls` (a transformers gated norm) takes the problem's groups: `group_size` or `n_groups` where its
    constructor has one (versions differ), nothing for the whole width; PeerUnavailable for groups it cannot take."""
    if problem.gate_position == "before":
        return {}
    params = inspect.signature(cls.__init__).parameters
    if "group_size" in params:
        return {"group_size": problem.group}
    if "n_groups" in params:
        return {"n_groups": problem.N // problem.group}
    if problem.group == problem.N:
        return {}
    raise PeerUnavailable(f"this transformers' {cls.__name__} normalizes the whole width only (no group_size or "
                          f"n_groups): groups of {problem.group} need a newer transformers")


class TransformersEager(GatedPeer):
    name = "hf-eager"
    description = ("transformers' module, eager: Qwen3NextRMSNormGated (before), KimiLinearRMSNormGated (before, "
                   "sigmoid gate), MambaRMSNormGated (after)")
    activations = ("silu", "sigmoid")

    def supports(self, problem):
        if problem.gate_position == "after" and problem.activation == "sigmoid":
            return f"{self.name}: transformers' norm after the gate gates with silu only"
        return super().supports(problem)

    def _module(self, problem, inputs):
        module, cls_name = transformers_module(problem)
        module = module.to(device=inputs.x.device, dtype=inputs.x.dtype)
        with torch.no_grad():
            module.weight.copy_(inputs.weight)
        return module, cls_name

    def prepare(self, problem, inputs):
        module, cls_name = self._module(problem, inputs)
        x, z, _ = _leaves(inputs)
        return autograd_gated(lambda: module(x, z), (x, z, module.weight), inputs.dy, cls_name)


class TransformersCompile(TransformersEager):
    name = "hf-compile"
    description = "torch.compile of transformers' module (static shapes: one compile per shape)"

    def __init__(self, dynamic_rows: bool = False):
        from .peers_residual import TorchCompile

        TorchCompile()  # recompile limits and no donated buffers (the backward runs twice on one graph)
        # dynamic_rows: one compile per (width, group, position, dtype), the row count a symbolic size.
        self.dynamic_rows = dynamic_rows
        self._compiled: dict[tuple, tuple] = {}

    def prepare(self, problem, inputs):
        if not self.dynamic_rows:
            module, cls_name = self._module(problem, inputs)
            compiled = torch.compile(module, dynamic=False)
        else:
            key = (problem.N, problem.group, problem.gate_position, problem.dtype, str(inputs.x.device))
            if key not in self._compiled:
                module, cls_name = self._module(problem, inputs)
                self._compiled[key] = (module, cls_name, torch.compile(module))
            module, cls_name, compiled = self._compiled[key]
            with torch.no_grad():
                module.weight.copy_(inputs.weight)
        x, z, _ = _leaves(inputs)
        if self.dynamic_rows:
            torch._dynamo.mark_dynamic(x, 0)
            torch._dynamo.mark_dynamic(z, 0)
        note = f"compiled {cls_name}" + (", rows dynamic" if self.dynamic_rows else "")
        return autograd_gated(lambda: compiled(x, z), (x, z, module.weight), inputs.dy, note)


class FlaGated(GatedPeer):
    name = "fla-gated"
    description = "flash-linear-attention fla.modules.norm.fused_norm_gate.rms_norm_gated (FusedRMSNormGated)"
    positions = ("before",)
    activations = ("silu", "sigmoid")

    def prepare(self, problem, inputs):
        fn = _import("fla.modules.norm.fused_norm_gate", "flash-linear-attention").rms_norm_gated
        act = "swish" if problem.activation == "silu" else "sigmoid"
        x, z, w = _leaves(inputs)
        return autograd_gated(lambda: fn(x, z, w, None, activation=act, eps=problem.eps), (x, z, w), inputs.dy)


class FlaFn(GatedPeer):
    name = "fla-fn"
    description = "flash-linear-attention fla.modules.norm.layernorm_gated.rmsnorm_fn (groups, both positions)"
    grouped_before = True
    module, package = "fla.modules.norm.layernorm_gated", "flash-linear-attention"

    def prepare(self, problem, inputs):
        fn = _import(self.module, self.package).rmsnorm_fn
        x, z, w = _leaves(inputs)
        before = problem.gate_position == "before"
        return autograd_gated(lambda: fn(x, w, None, z=z, eps=problem.eps, group_size=problem.group,
                                         norm_before_gate=before), (x, z, w), inputs.dy)


class MambaSsm(FlaFn):
    name = "mamba"
    description = "mamba_ssm mamba_ssm.ops.triton.layernorm_gated.rmsnorm_fn (groups, both positions)"
    module, package = "mamba_ssm.ops.triton.layernorm_gated", "mamba-ssm"


class Normtune(GatedPeer):
    """normtune through its public function, as a user calls it (config None: the runtime's choice)."""

    name = "normtune"
    description = "normtune rms_norm(x, w, eps, gate=z, gate_position=..., group_size=..., gate_activation=...)"
    activations = ("silu", "sigmoid")
    grouped_before = True

    def __init__(self, config=None):
        self.config = config

    def supports(self, problem):
        return None

    def prepare(self, problem, inputs):
        from normtune.kernels.api.functional import rms_norm

        x, z, w = _leaves(inputs)
        group = None if problem.group == problem.N else problem.group
        return autograd_gated(lambda: rms_norm(x, w, problem.eps, gate=z, gate_position=problem.gate_position,
                                               group_size=group, gate_activation=problem.activation,
                                               zero_centered=problem.zero_centered, config=self.config),
                              (x, z, w), inputs.dy)


GATED_PEERS: dict[str, type[GatedPeer]] = {
    cls.name: cls for cls in (TransformersEager, TransformersCompile, FlaGated, FlaFn, MambaSsm)}


def prepare_peer(name: str, x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, dy: torch.Tensor, *,
                 gate_position: str, group_size: int | None = None, eps: float = 1e-6,
                 activation: str = "silu") -> PreparedGated:
    """The named peer's calls on given tensors (x, z, dy: rows × width; weight: width), the problem read from
    their shapes and dtype; raises PeerUnavailable when the peer cannot run it."""
    if name not in GATED_PEERS:
        raise ValueError(f"unknown gated peer {name!r} (allowed: {', '.join(GATED_PEERS)})")
    if x.dim() != 2 or z.shape != x.shape or dy.shape != x.shape or weight.shape != (x.shape[1],):
        raise ValueError(f"x, z and dy must be rows × width and weight width; got {tuple(x.shape)}, "
                         f"{tuple(z.shape)}, {tuple(dy.shape)} and {tuple(weight.shape)}")
    dtype = {v: k for k, v in TORCH_DTYPES.items()}.get(x.dtype)
    if dtype is None:
        raise ValueError(f"x has dtype {x.dtype}: use float32, bfloat16 or float16")
    problem = GatedProblem(x.shape[0], x.shape[1], gate_position, group_size, dtype, eps, activation)
    peer = GATED_PEERS[name]()
    why = peer.supports(problem)
    if why is not None:
        raise PeerUnavailable(why)
    return peer.prepare(problem, GatedInputs(x, z, weight, dy))


def parse_gated_peers(spec: str) -> list[str]:
    """'all' | comma list of names → names, rejecting unknown ones with the allowed list."""
    spec = spec.strip().lower()
    if spec == "all":
        return list(GATED_PEERS)
    names = [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [n for n in names if n not in GATED_PEERS]
    if unknown or not names:
        raise ValueError(f"unknown gated peer(s) {', '.join(unknown) or repr(spec)} (allowed: all, "
                         f"{', '.join(GATED_PEERS)})")
    return names
