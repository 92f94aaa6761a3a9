"""The two layer forms `patch(model, fuse_residual=True)` fuses (see `patch_residual.py`), written once for both the
fused forward and the probe that checks a layer against them: which norms each form applies, how a layer's call
binds to its forward's parameters, and the form itself with its norm steps left to the caller.
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch import Tensor

# The norms each form reads, in the order they are applied.
FORMS = {"pre-norm": ("input_layernorm", "post_attention_layernorm"),
         "sandwich": ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                      "post_feedforward_layernorm")}


@functools.lru_cache(maxsize=None)
def _signature(forward) -> inspect.Signature:
    return inspect.signature(forward)


def bind_call(forward, args, kwargs) -> tuple[Tensor, dict] | None:
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


def skeleton(layer, form: str, hidden_states: Tensor, call_kwargs: dict, first, add_norm, last) -> Tensor:
    """One layer in the fused form. first(x) → the normalized input; add_norm(name, x, residual) → (y, h) with
    h = residual + x, y = getattr(layer, name)(h); last(m, h) → the layer's output h + m."""
    residual = hidden_states
    attn, _ = layer.self_attn(hidden_states=first(hidden_states), **call_kwargs)
    if form == "sandwich":
        y, h = add_norm("pre_feedforward_layernorm", layer.post_attention_layernorm(attn), residual)
        return last(layer.post_feedforward_layernorm(layer.mlp(y)), h)
    y, h = add_norm("post_attention_layernorm", attn, residual)
    return last(layer.mlp(y), h)
