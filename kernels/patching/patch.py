"""`patch(model)`: replace a model's LayerNorms and RMSNorms, in place, by normtune's modules.

What is replaced: `torch.nn.LayerNorm`, `torch.nn.RMSNorm`, and any other module that is built like a norm and
behaves like one. Built like a norm: a leaf module (no submodules, no buffers, no torch layer among its classes)
whose parameters are a 1-D `weight` (and perhaps a `bias` of the same shape), with an `eps` or `variance_epsilon` —
the RMSNorms of `transformers` models (Llama, Qwen2, Qwen3 with its q_norm/k_norm over the head dim, T5, Gemma's
zero-centered (1 + w) …) and hand-written LayerNorms. Behaves like one: a copy of the module, holding random fp32
weights instead of the user's (which are never touched), is run on a random fp32 input at two scales (~1 and
~sqrt(eps), where eps matters), and its output must match RMSNorm, LayerNorm or their zero-centered forms over the
last dimension within `PROBE_TOLERANCE`. The same probe checks a torch LayerNorm/RMSNorm subclass that overrides
`forward` (Nemotron's weight + 1 LayerNorm is a zero-centered one). Norms without a weight (weightless RMSNorms,
L2 norms) are left alone. The gated RMSNorms of hybrid models (a forward taking the input and a gate) become
`GatedRMSNorm`s where a probe of the same kind says which gated form they compute (`patch_gated.py`).

What is kept: the Parameter objects themselves (optimizer state, tied weights and checkpoints keep working), the
names the state dict stores them under, their device and dtype, and train/eval mode. A module reachable under
several names is replaced by one module everywhere.

What is refused, naming the module, the reason and the fix (a ValueError; with strict=False the module is left as
it is and listed in the report's `skipped` instead): a norm-like module whose output matches no formula (an offset,
a different eps, another reduction such as channels-first), a forward that fails on the probe input or takes more
than the input and is not a gated RMSNorm, weights on the meta device (the probe needs values),
weights outside float32/bfloat16/float16, more than normtune's maximum of values per row, forward/backward hooks
or an instance-level forward (they would not carry over).
"""

from __future__ import annotations

import copy
import inspect
import math
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from ..config import MAX_N, SAVE_MODES, BackwardConfig
from ..api.modules import LayerNorm, RMSNorm
from .patch_gated import GatedPlan, build, classify, probe_error, takes_a_gate

# Relative error allowed between a probed module and a formula. The probe runs in fp32 against a float64
# reference, so a true match is ~1e-7 off; an offset, a wrong eps or a low-precision cast inside is ~1e-3 or more.
PROBE_TOLERANCE = 1e-4
EPS_NAMES = ("eps", "variance_epsilon")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


@dataclass
class PatchReport:
    """What `patch` did: replaced modules counted by their original class name, and (strict=False) the modules it
    left as they were, by path, with the reason. With fuse_residual=True also: the decoder layers whose residual
    adds were fused into their norms, by class name; how many layer ends were fused with the norm after them, the
    next layer's input norm or the final norm (`chained`); and the decoder layers left as they were (`unfused`),
    by path, with the reason."""

    replaced: dict[str, int] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    fused: dict[str, int] = field(default_factory=dict)
    chained: int = 0
    unfused: dict[str, str] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.replaced.values())

    def __str__(self) -> str:
        done = ", ".join(f"{count} {name}" for name, count in self.replaced.items()) or "nothing"
        lines = [f"replaced {done}"] + [f"skipped {path}: {why}" for path, why in self.skipped.items()]
        if self.fused or self.unfused:
            layers = ", ".join(f"{count} {name}" for name, count in self.fused.items()) or "no layer"
            lines.append(f"fused the residual adds of {layers} ({self.chained} layer ends with the norm after "
                         "them: the next layer's input norm or the final norm)")
            lines += [f"unfused {path}: {why}" for path, why in self.unfused.items()]
        return "\n".join(lines)


@dataclass(frozen=True)
class _Plan:
    """How to build the replacement: which norm, over which shape, with which eps and weight convention."""

    kind: str  # "layer_norm" or "rms_norm"
    shape: tuple[int, ...]
    eps: float | None  # None: the input dtype's eps (torch.nn.RMSNorm's eps=None)
    zero_centered: bool = False
    eps_name: str = "eps"

    def describe(self) -> str:
        name = "RMSNorm" if self.kind == "rms_norm" else "LayerNorm"
        return f"zero-centered {name}" if self.zero_centered else name


def patch(model: nn.Module, *, layer_norm: bool = True, rms_norm: bool = True, save: str = "input",
          config: BackwardConfig | dict | str | None = None, strict: bool = True,
          fuse_residual: bool = False) -> PatchReport:
    """Replace, in place, the LayerNorms (layer_norm=True) and RMSNorms (rms_norm=True) of `model` by normtune's
    modules holding the same Parameter objects; returns a `PatchReport`.

    save: "input" or "output" (see `normtune.kernels.layer_norm`); config: a `BackwardConfig`, its dict or JSON,
    forcing the backward launch of every replaced norm (None: chosen per shape). strict=True (the default) raises
    a ValueError, before replacing anything, for a norm it cannot replace exactly; strict=False leaves such
    modules as they are and lists them in the report's `skipped`.

    fuse_residual=True also fuses the residual adds of pre-norm decoder layers (transformers' Llama, Qwen, Mistral,
    Gemma families) into their replaced norms, each layer checked by probing its own forward (see
    `patch_residual.py`); a layer that is not exactly such a layer is left as it is and listed in `unfused`.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    for name, value in (("layer_norm", layer_norm), ("rms_norm", rms_norm), ("strict", strict),
                        ("fuse_residual", fuse_residual)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")
    if save not in SAVE_MODES:
        raise ValueError(f"save={save!r} is not allowed: use 'input' (save x) or 'output' (save y, recover x̂)")
    config = _parse_config(config)
    wanted = {"layer_norm": layer_norm, "rms_norm": rms_norm}
    if _classify(model, wanted) is not None:
        raise ValueError(f"model is itself a norm ({type(model).__name__}): patch() replaces modules inside a model; "
                         "use normtune.kernels.LayerNorm/RMSNorm directly or patch a container holding it")

    paths = {id(m): name for name, m in model.named_modules()}
    decisions: dict[int, _Plan | str | None] = {}
    edges = []  # (parent, attribute, module) of each module to replace, one per place it is reachable from
    for parent in model.modules():
        for attr, child in parent._modules.items():
            if child is None:
                continue
            if id(child) not in decisions:
                decisions[id(child)] = _classify(child, wanted)
            decision = decisions[id(child)]
            if isinstance(decision, (_Plan, GatedPlan)):
                edges.append((parent, attr, child))

    report = PatchReport()
    modules = {id(m): m for m in model.modules()}
    refused = [(paths[key], type(modules[key]).__name__, reason) for key, reason in decisions.items()
               if isinstance(reason, str)]
    if refused and strict:
        path, name, reason = refused[0]
        more = f" ({len(refused) - 1} more modules refused)" if len(refused) > 1 else ""
        raise ValueError(f"cannot replace {path} ({name}): {reason}{more}; pass strict=False to leave such modules "
                         "as they are (listed in the report's skipped)")
    report.skipped.update({path: f"{name}: {reason}" for path, name, reason in refused})

    built: dict[int, nn.Module] = {}
    counts: Counter = Counter()
    for parent, attr, child in edges:
        if id(child) not in built:
            built[id(child)] = _build(child, decisions[id(child)], save, config)
            counts[type(child).__name__] += 1
        setattr(parent, attr, built[id(child)])
    report.replaced.update(counts)
    if fuse_residual:
        from .patch_residual import fuse

        fusion = fuse(model, PROBE_TOLERANCE)
        report.fused, report.chained, report.unfused = fusion.fused, fusion.chained, fusion.unfused
    return report


def _parse_config(config) -> BackwardConfig | None:
    """Parsed once here, so that malformed JSON or keys fail at patch(); whether the config fits each norm's
    shape is checked at each call, as for a module built with it."""
    if config is None or isinstance(config, BackwardConfig):
        return config
    if isinstance(config, dict):
        return BackwardConfig.from_dict(config)
    if isinstance(config, str):
        return BackwardConfig.from_json(config)
    raise TypeError(f"config must be a BackwardConfig, a dict, JSON text or None, got {type(config).__name__}")


def _classify(module: nn.Module, wanted: dict[str, bool]) -> _Plan | str | None:
    """A plan to replace the module, the reason it cannot be replaced exactly, or None for a module that is not a
    norm of a wanted kind (left alone, not reported)."""
    if isinstance(module, (LayerNorm, RMSNorm)):  # normtune's own: already patched
        return None
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
        is_rms = isinstance(module, nn.RMSNorm)
        if not wanted["rms_norm" if is_rms else "layer_norm"]:
            return None
        plans = [_Plan("rms_norm" if is_rms else "layer_norm", tuple(module.normalized_shape), module.eps, zc)
                 for zc in (False, True)]
        if type(module).forward is (nn.RMSNorm if is_rms else nn.LayerNorm).forward:
            return _unsupported(module, plans[0]) or plans[0]
        # A subclass with its own forward must still compute the norm (zero-centered ones, e.g. weight + 1, too).
        return _unsupported(module, plans[0]) or _takes_more_than_the_input(module) or _probe(module, plans)
    if not _built_like_a_norm(module):
        return None
    eps_name = next(name for name in EPS_NAMES if hasattr(module, name))
    eps = getattr(module, eps_name)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps <= 0:
        return f"its {eps_name} ({eps!r}) is not a positive finite number"
    weight, bias = module._parameters["weight"], module._parameters.get("bias")
    if bias is None and takes_a_gate(module):  # a gated RMSNorm (`patch_gated.py`)
        if not wanted["rms_norm"]:
            return None
        gated = classify(module, eps_name, PROBE_TOLERANCE)
        return gated if isinstance(gated, str) else (_unsupported(module, gated) or gated)
    if bias is not None and bias.shape != weight.shape:
        return f"its bias has shape {tuple(bias.shape)}, not its weight's {tuple(weight.shape)}"
    shape = tuple(weight.shape)
    kinds = ["layer_norm"] if bias is not None else ["rms_norm", "layer_norm"]  # normtune's RMSNorm has no bias
    if not any(wanted[kind] for kind in kinds):
        return None
    plans = [_Plan(kind, shape, float(eps), zc, eps_name) for kind in kinds for zc in (False, True)]
    decision = _probe(module, plans)
    if isinstance(decision, _Plan) and not wanted[decision.kind]:
        return None
    reason = _takes_more_than_the_input(module) or (
        decision if isinstance(decision, str) else _unsupported(module, decision))
    return reason or decision


def _built_like_a_norm(module: nn.Module) -> bool:
    if module._modules or any(b is not None for b in module._buffers.values()):
        return False
    # torch's own layers and their subclasses (BatchNorm, GroupNorm, InstanceNorm …) reduce over other dims
    if any(cls.__module__.split(".")[0] == "torch" for cls in type(module).__mro__ if cls not in (nn.Module, object)):
        return False
    params = {name for name, p in module._parameters.items() if p is not None}
    weight = module._parameters.get("weight")
    return (isinstance(weight, nn.Parameter) and weight.dim() == 1 and params <= {"weight", "bias"}
            and any(hasattr(module, name) for name in EPS_NAMES))


def _takes_more_than_the_input(module: nn.Module) -> str | None:
    """A forward with more parameters than the input (e.g. a gate, a residual) is called with them somewhere: the
    replacement, which takes only the input, would fail there or drop them."""
    try:
        params = list(inspect.signature(type(module).forward).parameters.values())[1:]  # after self
    except (TypeError, ValueError):
        return None
    takes_input = params and params[0].kind is not inspect.Parameter.VAR_POSITIONAL
    extra = [p.name for p in (params[1:] if takes_input else params)]
    if extra:
        return f"its forward takes more than the input ({', '.join(extra)}), which the replacement would not accept"
    return None


def _unsupported(module: nn.Module, plan: _Plan) -> str | None:
    """Why normtune cannot stand in for the module, whatever it computes (None: it can)."""
    n = math.prod(plan.shape)
    if n > MAX_N:
        return f"it normalizes {n} values per row, more than normtune's maximum {MAX_N}"
    for name in ("weight", "bias"):
        p = module._parameters.get(name)
        if p is not None and p.dtype not in _DTYPES:
            return (f"its {name} is {p.dtype}, which normtune does not take: convert the model to float32, "
                    "bfloat16 or float16 before patch()")
    hooks = [name.strip("_") for name in _HOOKS if getattr(module, name, None)]
    if hooks:
        return f"it has {', '.join(hooks)}, which the replacement would not carry: register them after patch()"
    if "forward" in module.__dict__:
        return "its forward is replaced on the instance (e.g. by an offloading hook), which the replacement " \
               "would drop: patch() before adding such hooks"
    return None


def _probe(module: nn.Module, plans: list[_Plan]) -> _Plan | str:
    """The plan whose formula the module computes, or why none fits. Runs a shallow copy of the module whose
    parameters are random fp32 tensors (the user's parameters are never read or written, nor the global RNG)."""
    params = module._parameters
    present = [p for p in params.values() if p is not None]
    device = present[0].device if present else torch.device("cpu")
    if device.type == "meta":
        return "its weights are on the meta device, so its behaviour cannot be checked: patch() after loading them"
    gen = torch.Generator().manual_seed(0)
    fake = {name: None if p is None else nn.Parameter(
        (1.0 if name == "weight" else 0.0) + 0.5 * torch.randn(p.shape, generator=gen), requires_grad=False)
        for name, p in params.items()}
    shape = plans[0].shape
    eps = plans[0].eps if plans[0].eps is not None else torch.finfo(torch.float32).eps
    x = torch.randn((2, 3, *shape), generator=gen) + 0.5
    x[1] *= math.sqrt(eps)  # rows whose mean square is ~eps: a different eps shows there
    probe = copy.copy(module)
    probe.__dict__["_parameters"] = {name: t if t is None else t.to(device) for name, t in fake.items()}
    try:
        with torch.no_grad():
            y = type(module).forward(probe, x.to(device))  # the class's forward, not one set on the instance
    except Exception as err:  # noqa: BLE001 - any failure means "not a norm we can stand in for"
        first_line = (str(err).strip().splitlines() or [""])[0][:160]
        return f"its forward failed on a probe input of shape {tuple(x.shape)} ({type(err).__name__}: {first_line})"
    if not isinstance(y, Tensor) or y.shape != x.shape:
        return f"its forward returned {type(y).__name__} {tuple(getattr(y, 'shape', ()))}, not a tensor of the " \
               f"input's shape {tuple(x.shape)}"
    errors = {plan: probe_error(y, _formula(plan, x, fake.get("weight"), fake.get("bias"))) for plan in plans}
    best = min(errors, key=errors.get)
    if errors[best] <= PROBE_TOLERANCE:
        return best
    return (f"its output matches none of {', '.join(p.describe() for p in plans)} over the last dimension with "
            f"eps={plans[0].eps} (closest: {best.describe()}, relative error {errors[best]:.2g} on a probe input)")


def _formula(plan: _Plan, x: Tensor, weight: Tensor | None, bias: Tensor | None) -> Tensor:
    """The plan's output for the probe input, in float64."""
    k = len(plan.shape)
    rows = x.double().flatten(-k)
    if plan.kind == "layer_norm":
        rows = rows - rows.mean(-1, keepdim=True)
    eps = plan.eps if plan.eps is not None else torch.finfo(torch.float32).eps
    y = rows * torch.rsqrt(rows.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        w = weight.detach().double().flatten()
        y = y * (1.0 + w if plan.zero_centered else w)
    if bias is not None:
        y = y + bias.detach().double().flatten()
    return y.view(x.shape)


def _build(module: nn.Module, plan: _Plan, save: str, config: BackwardConfig | None) -> nn.Module:
    """The normtune module holding `module`'s own Parameter objects (built on the meta device: nothing is
    allocated, then the originals are assigned)."""
    if isinstance(plan, GatedPlan):
        return build(module, plan, config)
    weight, bias = module._parameters.get("weight"), module._parameters.get("bias")
    options = {"eps": plan.eps, "elementwise_affine": weight is not None, "device": "meta",
               "zero_centered": plan.zero_centered, "save": save, "config": config}
    if plan.kind == "layer_norm":
        new = LayerNorm(plan.shape, bias=bias is not None, **options)
    else:
        new = RMSNorm(plan.shape, **options)
    if weight is not None:
        new.weight = weight
    if bias is not None:
        new.bias = bias
    if plan.eps_name != "eps":  # code that reads e.g. norm.variance_epsilon keeps working
        setattr(new, plan.eps_name, plan.eps)
    new.train(module.training)
    return new
