"""Whether a decoder layer's own forward computes one of the fused forms (`patch_forms.py`), found by probing it:
a shallow copy of the layer, whose norms are float64-exact formulas with random weights and whose attention and
MLP are recording stand-ins (elementwise nonlinear maps), runs the layer's own forward on random inputs, with a
sentinel for each of its arguments; the form, run on the same copy, must give the same output within the tolerance
and call the attention and the MLP with the same arguments. Everything else the layer owns (its own parameters and
buffers, those of its other submodules) takes random values on copies, and the comparison is made at several
sequence lengths, in float32, the model's dtype and bfloat16, in training and eval mode: a layer that matches the
form only at its patch-time values, or only at one length or dtype, is not fused. The user's weights are never
read or changed.
"""

from __future__ import annotations

import copy
import inspect

import torch
from torch import Tensor, nn

from ..api.modules import LayerNorm, RMSNorm
from .patch_forms import FORMS, bind_call, skeleton


def choose_form(layer: nn.Module, tolerance: float) -> tuple[str | None, str]:
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
        a, b, c = (v.to(x.dtype) for v in (self.a, self.b, self.c))
        out = torch.tanh(x * a + x.roll(1, -1) * b) + c
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
    for key in [k for k in probe.__dict__ if k.startswith("_normtune_")]:  # normtune's hand-over links
        probe.__dict__.pop(key)
    attn, mlp = _Recorder(n, gen, device, True), _Recorder(n, gen, device, False)
    # Everything else the layer owns (its own parameters and buffers, its other submodules') takes random values
    # on copies: a form that holds only at the patch-time values (a scale that is 1 then) is not the form.
    stand_ins = {"self_attn": attn, "mlp": mlp, **{name: _Formula(getattr(layer, name), gen, device)
                                                   for name in FORMS[form]}}
    others = {name: copy.deepcopy(sub) for name, sub in layer._modules.items()
              if sub is not None and name not in stand_ins}
    holder = nn.Module()
    holder.__dict__.update(_parameters=dict(layer._parameters), _buffers=dict(layer._buffers), _modules=others)
    reason = _vary(holder, gen)
    if reason:
        return reason
    probe.__dict__.update(_parameters=holder._parameters, _buffers=holder._buffers,
                          _modules={**layer._modules, **others, **stand_ins})
    probe.__dict__["gradient_checkpointing"] = False
    original = type(layer).forward
    params = list(inspect.signature(original).parameters.values())[2:]
    sentinels = {p.name: _Sentinel(p.name) for p in params
                 if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        sentinels["normtune_probe"] = _Sentinel("normtune_probe")
    if bind_call(original, (torch.empty(0),), sentinels) is None:
        return "its forward does not take the input first and its other arguments by name"
    model_dtype = weight.dtype if weight is not None and weight.is_floating_point() else torch.float32
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        for dtype in dict.fromkeys((torch.float32, model_dtype, torch.bfloat16)):
            tol = tolerance if dtype in (torch.float32, torch.float64) else max(tolerance, 2 * torch.finfo(dtype).eps)
            for batch, tokens in PROBE_SHAPES:
                x = (torch.randn(batch, tokens, n, generator=gen) + 0.5).to(device=device, dtype=dtype)
                call_kwargs = bind_call(original, (x,), sentinels)[1]
                for training in (True, False):
                    for sub in others.values():
                        sub.train(training)
                    probe.__dict__["training"] = training
                    reason = _probe_mode(probe, form, original, x, sentinels, call_kwargs, (attn, mlp), tol)
                    if reason:
                        return reason
    return None


# (batch, tokens) of the probe's inputs: a layer that branches on the sequence length shows it on one of them.
PROBE_SHAPES = ((2, 1), (2, 3), (1, 130))


def _vary(module: nn.Module, gen: torch.Generator) -> str | None:
    """Random values, in place of the originals, for every floating parameter and buffer of `module` and its
    submodules (integer buffers, such as indices, keep theirs); why not where a parameter cannot take them."""
    for sub in module.modules():
        for key, p in sub._parameters.items():
            if p is None:
                continue
            if type(p) not in (nn.Parameter, Tensor) or not p.is_floating_point() or p.is_meta:
                return (f"it owns a parameter the probe cannot vary ({key}: {type(p).__name__} of "
                        f"{p.dtype} on {p.device.type}): patch() before sharding or moving it")
            sub._parameters[key] = nn.Parameter(_random_like(p, gen), requires_grad=False)
        for key, b in sub._buffers.items():
            if b is not None and b.is_floating_point():
                sub._buffers[key] = _random_like(b, gen)
    return None


def _random_like(t: Tensor, gen: torch.Generator) -> Tensor:
    return (0.5 + torch.rand(t.shape, generator=gen)).to(device=t.device, dtype=t.dtype)


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

    got = skeleton(probe, form, x, call_kwargs, probe._modules["input_layernorm"], add_norm, lambda m, h: h + m)
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
