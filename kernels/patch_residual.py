"""`patch(model, fuse_residual=True)`: the residual adds of pre-norm decoder layers fused into their norms.

A pre-norm decoder layer (transformers' Llama, Qwen2, Qwen3, Mistral, Gemma) computes

    a = self_attn(input_layernorm(x))[0];  h = x + a;  y = post_attention_layernorm(h);  out = h + mlp(y)

and Gemma2/Gemma3 wrap both branches in norms of their own ("sandwich"):

    a = post_attention_layernorm(self_attn(input_layernorm(x))[0]);  h = x + a;  y = pre_feedforward_layernorm(h)
    out = h + post_feedforward_layernorm(mlp(y))

The add before the second norm becomes one call of normtune's fused form, `(y, h) = norm(a, residual=x)`, whose
backward writes dh + norm_backward(dy) in the pass that computes dx. The add at the end of a layer feeds the next
layer's `input_layernorm`: where the next layer of the same container is fused too, the layer returns `out` from
`(y_next, out) = next.input_layernorm(m, residual=h)` and hands `y_next` to the next layer on `out` itself, which
uses it only when it is called with that very tensor, unchanged (same `_version`), with the same norm weights;
any other input (a loop that skips or reorders layers, an in-place change) runs its own `input_layernorm` as before.
The last layer of a container hands over, the same way, to a normtune norm registered right after the container
(a decoder's final norm, which then checks for a hand-over before normalizing). The hand-over is off under
gradient checkpointing (the recompute would take another path) and under torch.compile.

Which layers: any module with `self_attn`, `mlp` and `input_layernorm` submodules whose norms patch() replaced
(normtune's 1-D norms). Whether its forward computes one of the two forms is checked by probing it, not by its
class: a shallow copy of the layer, whose norms are float64-exact formulas with random weights and whose attention
and MLP are recording stand-ins (elementwise nonlinear maps), runs the layer's own forward on a random input, with
a sentinel for each of its arguments, in training and eval mode; the fused form, run on the same copy, must give
the same output within `PROBE_TOLERANCE` and call the attention and the MLP with the same arguments. A layer that
fails is left as it is and reported with the reason. The fused layer keeps its class (a subclass of it with the
fused forward), its submodules and so its Parameter objects.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .functional import layer_norm, rms_norm
from .modules import LayerNorm, RMSNorm

NEEDED = ("self_attn", "mlp", "input_layernorm")
# The norms each form reads, in the order they are applied.
FORMS = {"pre-norm": ("input_layernorm", "post_attention_layernorm"),
         "sandwich": ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                      "post_feedforward_layernorm")}
_HANDOVER = "_normtune_normed"  # the attribute on a layer's output holding the next layer's normalized input
_NEXT = "_normtune_next"  # the (unregistered) next fused layer of the same container, or the final norm
_FUSED_CLASSES: dict[tuple[type, str], type] = {}


@dataclass
class FusionResult:
    fused: dict[str, int]  # layer class name -> layers fused
    chained: int  # layer ends fused with the next layer's input_layernorm (or the final norm)
    unfused: dict[str, str]  # path -> why the layer was left as it was


def candidates(model: nn.Module) -> dict[int, nn.Module]:
    """The modules built like a decoder layer (attention, MLP, input norm), by id."""
    return {id(m): m for m in model.modules() if all(isinstance(getattr(m, n, None), nn.Module) for n in NEEDED)}


def fuse(model: nn.Module, tolerance: float) -> FusionResult:
    """Fuse the residual adds of `model`'s decoder layers (their norms already normtune's), in place."""
    paths = {id(m): name for name, m in model.named_modules()}
    result = FusionResult({}, 0, {})
    fused: set[int] = set()
    for key, layer in candidates(model).items():
        if getattr(type(layer), "_normtune_form", None) is not None:  # fused by an earlier patch()
            fused.add(key)
            continue
        form, reason = _choose_form(layer, tolerance)
        if form is None:
            result.unfused[paths[key]] = f"{type(layer).__name__}: {reason}"
            continue
        layer.__class__ = _fused_class(type(layer), form)
        result.fused[type(layer).__name__] = result.fused.get(type(layer).__name__, 0) + 1
        fused.add(key)
    # Consecutive fused layers of one container hand their outputs over; the container's last layer hands its
    # output to a normtune norm registered right after the container (a decoder's final norm).
    for parent in model.modules():
        children = [c for c in parent._modules.values() if c is not None]
        for layer, nxt in zip(children, children[1:]):
            if id(layer) in fused and id(nxt) in fused and layer is not nxt:
                layer.__dict__[_NEXT] = nxt  # not a submodule: no second path to its parameters
                result.chained += 1
            elif id(layer) not in fused and isinstance(nxt, (LayerNorm, RMSNorm)) and layer._modules:
                last = [c for c in layer._modules.values() if c is not None][-1]
                if id(last) in fused and last.input_layernorm.normalized_shape == nxt.normalized_shape:
                    if not getattr(type(nxt), "_normtune_consumer", False):
                        nxt.__class__ = _consuming_class(type(nxt))
                    last.__dict__[_NEXT] = nxt
                    result.chained += 1
    return result


def _choose_form(layer: nn.Module, tolerance: float) -> tuple[str | None, str]:
    """(form, "") where the layer's forward is exactly a form, else (None, why not)."""
    if "forward" in layer.__dict__:
        return None, "its forward is replaced on the instance (e.g. by an offloading hook), which a fused forward " \
                     "would bypass: patch() before adding such hooks"
    form = "sandwich" if isinstance(getattr(layer, "pre_feedforward_layernorm", None), nn.Module) else "pre-norm"
    norms = [getattr(layer, name, None) for name in FORMS[form]]
    missing = [n for n, m in zip(FORMS[form], norms) if not isinstance(m, (LayerNorm, RMSNorm))]
    if missing:
        return None, (f"its {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not one of normtune's norms "
                      "(not replaced: see the report's skipped, or rms_norm/layer_norm=False)")
    shapes = {m.normalized_shape for m in norms}
    if len(shapes) != 1 or len(next(iter(shapes))) != 1:
        return None, f"its norms normalize over {sorted(shapes)}, not one common last dimension"
    reason = _probe(layer, form, next(iter(shapes))[0], tolerance)
    return (None, reason) if reason else (form, "")


# ------------------------------------------------------------------------------------------------ the fused forward
@functools.lru_cache(maxsize=None)
def _signature(forward) -> inspect.Signature:
    return inspect.signature(forward)


def _call_kwargs(forward, args, kwargs) -> tuple[Tensor, dict] | None:
    """(the input, the layer's other arguments by name as its forward hands them to `self_attn`), or None where
    they do not bind by name or the input is not a tensor (the original forward then runs)."""
    # torch.compile traces inspect.signature itself (a cached call would only draw its warning)
    signature = inspect.signature(forward) if torch.compiler.is_compiling() else _signature(forward)
    try:
        bound = signature.bind(None, *args, **kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    params = list(signature.parameters.values())
    if len(params) < 2 or params[1].kind not in (inspect.Parameter.POSITIONAL_ONLY,
                                                 inspect.Parameter.POSITIONAL_OR_KEYWORD):
        return None
    hidden_states = bound.arguments[params[1].name]
    out: dict = {}
    for p in params[2:]:
        value = bound.arguments[p.name]
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            out.update(value)
        elif p.kind is inspect.Parameter.VAR_POSITIONAL:
            if value:
                return None
        else:
            out[p.name] = value
    return (hidden_states, out) if isinstance(hidden_states, Tensor) else None


def _skeleton(layer, form: str, hidden_states: Tensor, call_kwargs: dict, first, add_norm, last) -> Tensor:
    """One layer in the fused form. first(x) → the normalized input; add_norm(name, x, residual) → (y, h) with
    h = residual + x, y = getattr(layer, name)(h); last(m, h) → the layer's output h + m."""
    residual = hidden_states
    attn, _ = layer.self_attn(hidden_states=first(hidden_states), **call_kwargs)
    if form == "sandwich":
        y, h = add_norm("pre_feedforward_layernorm", layer.post_attention_layernorm(attn), residual)
        return last(layer.post_feedforward_layernorm(layer.mlp(y)), h)
    y, h = add_norm("post_attention_layernorm", attn, residual)
    return last(layer.mlp(y), h)


def fused_add_norm(norm: nn.Module, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
    """(norm(residual + x), residual + x) through normtune's fused form; the two steps where the operands differ in
    shape, dtype or device (the add would broadcast or promote, which the fused form does not)."""
    if x.shape != residual.shape or x.dtype != residual.dtype or x.device != residual.device or not _bare(norm) \
            or not isinstance(norm, (LayerNorm, RMSNorm)):
        h = residual + x
        return norm(h), h
    eps = norm.eps if norm.eps is not None else torch.finfo(x.dtype).eps
    options = dict(residual=residual, zero_centered=norm.zero_centered, save=norm.save, config=norm.config)
    if isinstance(norm, RMSNorm):
        return rms_norm(x, norm.weight, eps, **options)
    return layer_norm(x, norm.weight, norm.bias, eps, **options)


def _bare(norm: nn.Module) -> bool:
    """No hooks (the module's or global ones) nor an instance forward: calling the fused form instead of the module
    skips nothing."""
    from torch.nn.modules import module as torch_module

    return not (norm._forward_hooks or norm._forward_pre_hooks or "forward" in norm.__dict__
                or torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks)


def _handover_on(layer: nn.Module) -> bool:
    checkpointing = getattr(layer, "gradient_checkpointing", False) and layer.training
    return not checkpointing and not torch.compiler.is_compiling()


def _fused_forward(self, *args, **kwargs):
    original = self._normtune_base.forward
    bound = _call_kwargs(original, args, kwargs)
    if bound is None:
        return original(self, *args, **kwargs)
    hidden_states, call_kwargs = bound
    handover = _handover_on(self)

    def first(x):
        normed = x.__dict__.pop(_HANDOVER, None) if handover else None
        if normed is not None and _bare(self.input_layernorm):
            layer, version, weight_version, y = normed
            if layer is self and version == x._version and weight_version == _weight_version(self.input_layernorm):
                return y
        return self.input_layernorm(x)

    def add_norm(name, x, residual):
        return fused_add_norm(getattr(self, name), x, residual)

    nxt = self.__dict__.get(_NEXT) if handover else None
    norm = _input_norm(nxt)

    def last(m, h):
        if not isinstance(norm, (LayerNorm, RMSNorm)) or not _bare(norm):
            return h + m
        y_next, out = fused_add_norm(norm, m, h)
        out.__dict__[_HANDOVER] = (nxt, out._version, _weight_version(norm), y_next)
        return out

    return _skeleton(self, self._normtune_form, hidden_states, call_kwargs, first, add_norm, last)


def _input_norm(consumer: nn.Module | None) -> nn.Module | None:
    """The norm a hand-over to `consumer` runs: a fused layer's input_layernorm, or the consuming norm itself."""
    if consumer is None:
        return None
    return consumer if getattr(type(consumer), "_normtune_consumer", False) else consumer.input_layernorm


def _consuming_forward(self, x):
    """A final norm's forward: the normalized input handed over with this very tensor, else its own."""
    normed = None
    if isinstance(x, Tensor) and not torch.compiler.is_compiling():
        normed = x.__dict__.pop(_HANDOVER, None)
    if normed is not None:
        consumer, version, weight_version, y = normed
        if consumer is self and version == x._version and weight_version == _weight_version(self):
            return y
    return self._normtune_base.forward(self, x)


def _consuming_class(cls: type) -> type:
    key = (cls, "consumer")
    if key not in _FUSED_CLASSES:
        _FUSED_CLASSES[key] = type(cls.__name__, (cls,), {
            "forward": _consuming_forward, "_normtune_consumer": True, "_normtune_base": cls,
            "__module__": cls.__module__, "__qualname__": cls.__qualname__,
            "__doc__": f"{cls.__name__} that takes its normalized input from the fused layer before it."})
    return _FUSED_CLASSES[key]


def _weight_version(norm: nn.Module) -> tuple:
    return tuple(p._version for p in (norm.weight, getattr(norm, "bias", None)) if p is not None)


def _fused_class(cls: type, form: str) -> type:
    """The subclass of `cls` running the fused forward (one per class and form; same name and module)."""
    key = (cls, form)
    if key not in _FUSED_CLASSES:
        _FUSED_CLASSES[key] = type(cls.__name__, (cls,), {
            "forward": _fused_forward, "_normtune_form": form, "_normtune_base": cls, "__module__": cls.__module__,
            "__qualname__": cls.__qualname__, "__doc__": f"{cls.__name__} with its residual adds fused into its "
                                                         f"norms by normtune.patch ({form} form)."})
    return _FUSED_CLASSES[key]


# ------------------------------------------------------------------------------------------------------ the probe
class _Recorder(nn.Module):
    """A stand-in for the attention or the MLP: an elementwise nonlinear map mixing neighbouring features, which
    records the arguments it is called with. As attention it returns (out, None), as transformers' do."""

    def __init__(self, n: int, gen: torch.Generator, device, attention: bool):
        super().__init__()
        self.a, self.b, self.c = (0.5 + torch.rand(n, generator=gen).to(device) for _ in range(3))
        self.attention = attention
        self.calls: list = []

    def forward(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        x = kwargs.get("hidden_states", args[0] if args else None)
        out = torch.tanh(x * self.a + x.roll(1, -1) * self.b) + self.c
        return (out, None) if self.attention else out


class _Formula(nn.Module):
    """A norm as its formula, in float64, on random weights (for the probe: never the user's)."""

    def __init__(self, norm: nn.Module, gen: torch.Generator, device):
        super().__init__()
        self.is_rms = isinstance(norm, RMSNorm)
        self.zero_centered, self.eps = norm.zero_centered, norm.eps
        n = norm.normalized_shape[0]
        self.w = (0.5 * torch.randn(n, generator=gen, dtype=torch.float64) + 1.0).to(device) \
            if norm.weight is not None else None
        self.bias = 0.5 * torch.randn(n, generator=gen, dtype=torch.float64).to(device) \
            if getattr(norm, "bias", None) is not None else None

    def forward(self, x: Tensor) -> Tensor:
        rows = x.double()
        if not self.is_rms:
            rows = rows - rows.mean(-1, keepdim=True)
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        y = rows * torch.rsqrt(rows.pow(2).mean(-1, keepdim=True) + eps)
        if self.w is not None:
            y = y * (1.0 + self.w if self.zero_centered else self.w)
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype)


class _Sentinel:
    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"<probe {self.name}>"


def _probe(layer: nn.Module, form: str, n: int, tolerance: float) -> str | None:
    """None where the layer's own forward computes `form` on the probe, else why not."""
    weight = layer.input_layernorm.weight
    device = weight.device if weight is not None else torch.device("cpu")
    if device.type == "meta":
        return "its weights are on the meta device, so its forward cannot be probed: patch() after loading them"
    gen = torch.Generator().manual_seed(0)
    probe = nn.Module.__new__(type(layer))
    probe.__dict__.update(layer.__dict__)
    probe.__dict__.pop(_NEXT, None)
    attn, mlp = _Recorder(n, gen, device, True), _Recorder(n, gen, device, False)
    probe.__dict__["_modules"] = {**layer._modules, **{name: _Formula(getattr(layer, name), gen, device)
                                                       for name in FORMS[form]}, "self_attn": attn, "mlp": mlp}
    probe.__dict__["gradient_checkpointing"] = False
    original = type(layer).forward
    params = list(inspect.signature(original).parameters.values())[2:]
    sentinels = {p.name: _Sentinel(p.name) for p in params
                 if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        sentinels["normtune_probe"] = _Sentinel("normtune_probe")
    x = torch.randn(2, 3, n, generator=gen).to(device) + 0.5
    bound = _call_kwargs(original, (x,), sentinels)
    if bound is None:
        return "its forward does not take the input first and its other arguments by name"
    # The layer's other submodules (a dropout, say) run as they are, in the probed mode; the global RNG is kept.
    others = [m for name, sub in layer._modules.items() if sub is not None and probe._modules[name] is sub
              for m in sub.modules()]
    modes = {m: m.training for m in others}
    devices = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            for training in (True, False):
                for m in others:
                    m.training = training
                probe.__dict__["training"] = training
                reason = _probe_mode(probe, form, original, x, sentinels, bound[1], (attn, mlp), tolerance)
                if reason:
                    return reason
    finally:
        for m, mode in modes.items():
            m.training = mode
    return None


def _probe_mode(probe, form, original, x, sentinels, call_kwargs, recorders, tolerance) -> str | None:
    """One mode's comparison of the layer's forward with the fused form (None: they agree)."""
    attn, mlp = recorders
    attn.calls.clear(), mlp.calls.clear()
    try:
        expected = original(probe, x, **sentinels)
    except Exception as err:  # noqa: BLE001 - any failure means "not a form we can stand in for"
        first_line = (str(err).strip().splitlines() or [""])[0][:160]
        return f"its forward failed on the probe ({type(err).__name__}: {first_line})"
    calls = (attn.calls[:], mlp.calls[:])
    attn.calls.clear(), mlp.calls.clear()

    def add_norm(name, a, residual):
        h = residual + a
        return probe._modules[name](h), h

    got = _skeleton(probe, form, x, call_kwargs, probe._modules["input_layernorm"], add_norm, lambda m, h: h + m)
    if not isinstance(expected, Tensor) or expected.shape != x.shape:
        return f"its forward returns {type(expected).__name__}, not a tensor of its input's shape"
    if not _same_calls(calls[0], attn.calls) or not _same_calls(calls[1], mlp.calls):
        return f"its forward calls self_attn or mlp otherwise than the {form} form does"
    err = ((expected.double() - got.double()).norm() / max(got.double().norm().item(), 1e-30)).item()
    if not err <= tolerance:
        mode = "training" if probe.training else "eval"
        return f"its output is not the {form} form's ({mode} mode, relative error {err:.2g} on the probe input)"
    return None


def _same_calls(a: list, b: list) -> bool:
    """The same number of calls, with the same non-tensor arguments (by identity: the probe's sentinels) under the
    same names; tensor arguments are compared through the outputs."""
    if len(a) != len(b):
        return False
    for (args_a, kw_a), (args_b, kw_b) in zip(a, b):
        if len(args_a) != len(args_b) or set(kw_a) != set(kw_b):
            return False
        pairs = list(zip(args_a, args_b)) + [(kw_a[k], kw_b[k]) for k in kw_a]
        if any(not (isinstance(u, Tensor) and isinstance(v, Tensor)) and u is not v for u, v in pairs):
            return False
    return True
