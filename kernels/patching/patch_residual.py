"""`patch(model, fuse_residual=True)`: the residual adds of pre-norm decoder layers fused into their norms.

A pre-norm decoder layer (transformers' Llama, Qwen2, Qwen3, Mistral, Gemma) computes

    a = self_attn(input_layernorm(x))[0];  h = x + a;  y = post_attention_layernorm(h);  out = h + mlp(y)

and Gemma2/Gemma3 wrap both branches in norms of their own ("sandwich"):

    a = post_attention_layernorm(self_attn(input_layernorm(x))[0]);  h = x + a;  y = pre_feedforward_layernorm(h)
    out = h + post_feedforward_layernorm(mlp(y))

The add before the second norm becomes one call of normtune's fused form, `(y, h) = norm(a, residual=x)`, whose
backward writes dh + norm_backward(dy) in the pass that computes dx.

The add at the end of a layer feeds the next layer's `input_layernorm`: where the next layer of the same container
is fused too, the layer returns `out` from `(y_next, out) = next.input_layernorm(m, residual=h)` and hands `y_next`
over on `out` itself (`_Handover`). The next layer takes it only where its own call would compute the same thing in
the same autograd graph: called with that very tensor, unchanged (same `_version`) and still the producer's autograd
output (same `grad_fn`: a reentrant checkpoint re-wraps its outputs), in the producer's grad and inference mode,
with the same norm parameter tensors at the same versions. Any other call runs its own `input_layernorm`; the
producer's unused `y_next` then costs its norm's parameters no gradient (the fused add passes h's gradient
through). No hand-over is made under saved-tensor hooks (non-reentrant activation checkpointing, whose recompute
must save what its first forward saved; offloading), under inference_mode, transformers' gradient checkpointing or
torch.compile, where the producer has forward hooks (they see its output first), where the consumer has forward
pre-hooks (FSDP2 unshards its parameters there) or parameters that are not plain tensors, or to a consumer its
container no longer holds. The last layer of a container hands over, the same way, to a normtune norm registered
right after the container (a decoder's final norm, which then checks for a hand-over before normalizing).

Which layers: any module with `self_attn`, `mlp` and `input_layernorm` submodules whose norms patch() replaced
(normtune's 1-D norms). Whether its forward computes one of the two forms (`patch_forms.py`) is checked by probing
it, not by its class (`patch_probe.py`: its own forward on a copy with stand-in attention, MLP and norms, compared
with the form within `PROBE_TOLERANCE`). A layer that fails is left as it is and reported with the reason. The
fused layer keeps its class (a subclass of it with the fused forward), its submodules and so its Parameter objects.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..api.functional import layer_norm, rms_norm
from ..api.modules import LayerNorm, RMSNorm
from .patch_forms import bind_call, skeleton
from .patch_probe import choose_form

NEEDED = ("self_attn", "mlp", "input_layernorm")
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
        form, reason = choose_form(layer, tolerance)
        if form is None:
            result.unfused[paths[key]] = f"{type(layer).__name__}: {reason}"
            continue
        layer.__class__ = _fused_class(type(layer), form)
        result.fused[type(layer).__name__] = result.fused.get(type(layer).__name__, 0) + 1
        fused.add(key)
    # Consecutive fused layers of one container hand their outputs over; the container's last layer hands its
    # output to a normtune norm registered right after the container (a decoder's final norm).
    # The link is (consumer, its container, its key there): not a submodule (no second path to its parameters),
    # and taken at call time only while the container still holds the consumer under that key.
    for parent in model.modules():
        children = [(k, c) for k, c in parent._modules.items() if c is not None]
        for (_, layer), (key, nxt) in zip(children, children[1:]):
            if id(layer) in fused and id(nxt) in fused and layer is not nxt:
                layer.__dict__[_NEXT] = (nxt, parent, key)
                result.chained += 1
            elif id(layer) not in fused and isinstance(nxt, (LayerNorm, RMSNorm)) and layer._modules:
                last = [c for c in layer._modules.values() if c is not None][-1]
                if id(last) in fused and last.input_layernorm.normalized_shape == nxt.normalized_shape:
                    if not getattr(type(nxt), "_normtune_consumer", False):
                        nxt.__class__ = _consuming_class(type(nxt))
                    last.__dict__[_NEXT] = (nxt, parent, key)
                    result.chained += 1
    return result


# ------------------------------------------------------------------------------------------------ the fused forward
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
    # inference_mode: its tensors keep no version counter, so a change in place could not be seen
    return not checkpointing and not torch.compiler.is_compiling() and not torch.is_inference_mode_enabled() \
        and not _saving_hooked()


def _saving_hooked() -> bool:
    """Saved-tensor hooks are active: non-reentrant activation checkpointing (its first forward and its recompute
    alike), offloading to the host. A hand-over made there could be taken in one of the two forwards and not in the
    other, so it is never made."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return True if top is None else top(False) is not None


class _Handover:
    """The next norm's output, computed by the producing layer in the pass that wrote its output `x`, and the
    state it was computed in. The consumer takes it only where its own call would compute the same thing in the
    same autograd graph: it is the consumer named, x is unchanged (version) and still the producer's autograd
    output (the same grad_fn: a checkpoint's Function re-wraps its outputs), the grad mode and inference mode are
    the producer's, and the norm's parameters are the same tensors at the same versions."""

    __slots__ = ("consumer", "version", "grad_fn", "grad_enabled", "inference", "params", "versions", "y")

    def __init__(self, consumer: nn.Module, x: Tensor, norm: nn.Module, y: Tensor):
        self.consumer, self.version, self.grad_fn, self.y = consumer, x._version, x.grad_fn, y
        self.grad_enabled, self.inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
        self.params = _norm_params(norm)
        self.versions = tuple(p._version for p in self.params)

    def taken_by(self, consumer: nn.Module, x: Tensor, norm: nn.Module) -> Tensor | None:
        params = _norm_params(norm)
        valid = (consumer is self.consumer and x._version == self.version and x.grad_fn is self.grad_fn
                 and torch.is_grad_enabled() == self.grad_enabled
                 and torch.is_inference_mode_enabled() == self.inference
                 and len(params) == len(self.params) and all(p is q for p, q in zip(params, self.params))
                 and tuple(p._version for p in params) == self.versions and not _saving_hooked())
        return self.y if valid else None


def _norm_params(norm: nn.Module) -> tuple[Tensor, ...]:
    return tuple(p for p in (norm.weight, getattr(norm, "bias", None)) if p is not None)


def _plain_params(norm: nn.Module) -> bool:
    """The norm's parameters are ordinary tensors with storage (not sharded DTensors, not on the meta device)."""
    return all(type(p) in (nn.Parameter, Tensor) and not p.is_meta for p in _norm_params(norm))


def _consumer_of(layer: nn.Module) -> nn.Module | None:
    """Where `layer`'s output may be handed over: the next fused layer (or final norm) linked at patch time, while
    it is still the next entry of the container it was linked in and nothing runs before its forward (forward
    pre-hooks, e.g. FSDP's unsharding of its parameters), and while `layer` has no forward hooks (which would see,
    and could change in place, the output before the consumer does)."""
    link = layer.__dict__.get(_NEXT)
    if link is None or layer._forward_hooks or layer._forward_hooks_with_kwargs:
        return None
    consumer, container, key = link
    if container._modules.get(key) is not consumer or consumer._forward_pre_hooks:
        return None
    from torch.nn.modules import module as torch_module

    if torch_module._global_forward_pre_hooks:
        return None
    return consumer


def _taken(consumer: nn.Module, x: Tensor, norm: nn.Module) -> Tensor | None:
    """The handed-over output of `norm` for this input of `consumer`, or None: compute it."""
    handover = x.__dict__.pop(_HANDOVER, None)
    return handover.taken_by(consumer, x, norm) if handover is not None else None


def _fused_forward(self, *args, **kwargs):
    original = self._normtune_base.forward
    bound = bind_call(original, args, kwargs)
    if bound is None:
        return original(self, *args, **kwargs)
    hidden_states, call_kwargs = bound
    handover = _handover_on(self)

    def first(x):
        if handover and _bare(self.input_layernorm):
            y = _taken(self, x, self.input_layernorm)
            if y is not None:
                return y
        return self.input_layernorm(x)

    def add_norm(name, x, residual):
        return fused_add_norm(getattr(self, name), x, residual)

    nxt = _consumer_of(self) if handover else None
    norm = _input_norm(nxt)

    def last(m, h):
        if not isinstance(norm, (LayerNorm, RMSNorm)) or not _bare(norm) or not _plain_params(norm):
            return h + m
        y_next, out = fused_add_norm(norm, m, h)
        out.__dict__[_HANDOVER] = _Handover(nxt, out, norm, y_next)
        return out

    return skeleton(self, self._normtune_form, hidden_states, call_kwargs, first, add_norm, last)


def _input_norm(consumer: nn.Module | None) -> nn.Module | None:
    """The norm a hand-over to `consumer` runs: a fused layer's input_layernorm, or the consuming norm itself."""
    if consumer is None:
        return None
    return consumer if getattr(type(consumer), "_normtune_consumer", False) else consumer.input_layernorm


def _consuming_forward(self, x):
    """A final norm's forward: the normalized input handed over with this very tensor, else its own."""
    if isinstance(x, Tensor) and not torch.compiler.is_compiling():
        y = _taken(self, x, self)
        if y is not None:
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


def _fused_class(cls: type, form: str) -> type:
    """The subclass of `cls` running the fused forward (one per class and form; same name and module)."""
    key = (cls, form)
    if key not in _FUSED_CLASSES:
        _FUSED_CLASSES[key] = type(cls.__name__, (cls,), {
            "forward": _fused_forward, "_normtune_form": form, "_normtune_base": cls, "__module__": cls.__module__,
            "__qualname__": cls.__qualname__, "__doc__": f"{cls.__name__} with its residual adds fused into its "
                                                         f"norms by normtune.patch ({form} form)."})
    return _FUSED_CLASSES[key]
