"""`patch(model)`'s gated RMSNorms: the norms of hybrid models that take a gate beside the input (transformers'
`Qwen3NextRMSNormGated`, `Qwen3_5RMSNormGated`, `MambaRMSNormGated`, `BambaRMSNormGated`, `NemotronHRMSNormGated`,
`FalconH1RMSNormGated`, `GraniteMoeHybridRMSNormGated`, and look-alikes) become `GatedRMSNorm`s holding the same
Parameter objects.

Which module: one built like a norm (`patch.py`'s rule) whose forward takes the input and a gate, by the name
`gate` (or `z`). What it computes is probed, never read from its class name: a shallow copy holding random fp32
weights runs on random fp32 inputs and gates at two scales, and its output must match, within the probe's
tolerance, one of the gated forms: the gate before or after the norm, silu or sigmoid, over the whole width or
over the groups its `group_size` or `n_groups` attribute names. A forward whose gate defaults to None must also
match the norm alone without one (what `GatedRMSNorm` computes then). A look-alike with other math is refused with
the closest form's error.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import math

import torch
from torch import Tensor, nn

from ..api.modules import GatedRMSNorm

GATE_NAMES = ("gate", "z")
# Attributes of the original that model code may read and that GatedRMSNorm does not define: kept on the new one.
KEPT_ATTRIBUTES = ("variance_epsilon", "n_groups", "norm_before_gate")


@dataclasses.dataclass(frozen=True)
class GatedPlan:
    """A gated norm's replacement: the gate's position and activation, the group width, eps and its attribute."""

    shape: tuple[int, ...]
    eps: float
    eps_name: str
    position: str
    activation: str
    group: int

    def describe(self) -> str:
        groups = f", groups of {self.group}" if self.group != math.prod(self.shape) else ""
        return f"gated RMSNorm (the norm {self.position} the {self.activation} gate{groups})"


def takes_a_gate(module: nn.Module) -> bool:
    """Whether the module's forward takes the input and then a gate (by name)."""
    try:
        params = list(inspect.signature(type(module).forward).parameters.values())[1:]  # after self
    except (TypeError, ValueError):
        return False
    return len(params) == 2 and params[1].name in GATE_NAMES and all(
        p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD) for p in params)


def classify(module: nn.Module, eps_name: str, tolerance: float) -> GatedPlan | str:
    """The plan whose gated form the module computes, or why none fits (`takes_a_gate` holds)."""
    weight = module._parameters["weight"]
    eps = getattr(module, eps_name)
    if weight.device.type == "meta":
        return "its weights are on the meta device, so its behaviour cannot be checked: patch() after loading them"
    width = weight.numel()
    groups = {width}
    for name, per in (("group_size", True), ("n_groups", False)):
        value = getattr(module, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0 and width % value == 0:
            groups.add(value if per else width // value)
    plans = [GatedPlan(tuple(weight.shape), float(eps), eps_name, position, activation, group)
             for group in sorted(groups) for position in ("before", "after") for activation in ("silu", "sigmoid")]
    gen = torch.Generator().manual_seed(0)
    fake = nn.Parameter(1.0 + 0.5 * torch.randn(weight.shape, generator=gen), requires_grad=False)
    x = torch.randn((2, 3, width), generator=gen) + 0.5
    x[1] *= math.sqrt(eps)  # rows whose mean square is ~eps: a different eps shows there
    z = 2 * torch.randn((2, 3, width), generator=gen)
    probe = copy.copy(module)
    probe.__dict__["_parameters"] = {"weight": fake.to(weight.device)}
    gate_default = list(inspect.signature(type(module).forward).parameters.values())[2].default
    try:
        with torch.no_grad():
            y = type(module).forward(probe, x.to(weight.device), z.to(weight.device))
            alone = type(module).forward(probe, x.to(weight.device), None) if gate_default is None else None
    except Exception as err:  # noqa: BLE001 - any failure means "not a gated norm we can stand in for"
        first_line = (str(err).strip().splitlines() or [""])[0][:160]
        return f"its forward failed on a probe input and gate of shape {tuple(x.shape)} ({type(err).__name__}: " \
               f"{first_line})"
    if not isinstance(y, Tensor) or y.shape != x.shape:
        return f"its forward returned {type(y).__name__}, not a tensor of the input's shape {tuple(x.shape)}"
    errors = {plan: probe_error(y, _formula(plan, x, z, fake)) for plan in plans}
    best = min(errors, key=errors.get)
    if errors[best] > tolerance:
        return (f"its output matches no gated RMSNorm (gate before or after, silu or sigmoid, groups of "
                f"{', '.join(map(str, sorted(groups)))}) with eps={eps} (closest: {best.describe()}, relative error "
                f"{errors[best]:.2g} on a probe input)")
    if alone is not None:
        usable = isinstance(alone, Tensor) and alone.shape == x.shape
        err = probe_error(alone, _formula(best, x, None, fake)) if usable else math.inf
        if err > tolerance:
            return f"without a gate its output is not the norm alone (relative error {err:.2g} on a probe input)"
    return best


def build(module: nn.Module, plan: GatedPlan, config) -> GatedRMSNorm:
    """The GatedRMSNorm holding `module`'s own weight (built on the meta device, then the original assigned)."""
    width = math.prod(plan.shape)
    new = GatedRMSNorm(plan.shape, eps=plan.eps, device="meta", gate_position=plan.position,
                       group_size=None if plan.group == width else plan.group, activation=plan.activation,
                       config=config)
    new.weight = module._parameters["weight"]
    for name in KEPT_ATTRIBUTES:
        if hasattr(module, name) and not hasattr(new, name):
            setattr(new, name, getattr(module, name))
    new.train(module.training)
    return new


def _formula(plan: GatedPlan, x: Tensor, z: Tensor | None, weight: Tensor) -> Tensor:
    """The plan's output in float64 (z None: the norm alone, per group)."""
    x = x.double()
    a = None
    if z is not None:
        a = torch.sigmoid(z.double()) if plan.activation == "sigmoid" else nn.functional.silu(z.double())
    s = x * a if a is not None and plan.position == "after" else x
    sg = s.unflatten(-1, (s.shape[-1] // plan.group, plan.group))
    y = (sg * torch.rsqrt(sg.pow(2).mean(-1, keepdim=True) + plan.eps)).flatten(-2) * weight.double()
    return y * a if a is not None and plan.position == "before" else y


def probe_error(y: Tensor, ref: Tensor) -> float:
    """The worst relative error of a probe's outputs against the float64 formula, over its two scales (inf where
    the output is not finite)."""
    y = y.detach().double().cpu()
    worst = 0.0
    for out, expected in zip(y, ref):
        err = ((out - expected).norm() / max(expected.norm().item(), 1e-30)).item()
        worst = max(worst, err if math.isfinite(err) else math.inf)
    return worst
