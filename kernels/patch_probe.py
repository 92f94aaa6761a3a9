"""Whether a decoder layer's own forward computes one of the fused forms (`patch_forms.py`), found by probing it:
a shallow copy of the layer, whose norms are float64-exact formulas with random weights and whose attention and
MLP are recording stand-ins (elementwise nonlinear maps), runs the layer's own forward on a random input, with a
sentinel for each of its arguments, in training and eval mode; the form, run on the same copy, must give the same
output within the tolerance and call the attention and the MLP with the same arguments. The user's weights are
never read, and the layer's other submodules get their training mode back.
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor, nn

from .modules import LayerNorm, RMSNorm
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
    for key in [k for k in probe.__dict__ if k.startswith("_normtune_")]:  # normtune's hand-over links
        probe.__dict__.pop(key)
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
    bound = bind_call(original, (x,), sentinels)
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
