"""The checks a public norm call makes of its arguments before anything runs (`functional`, `direct`): the options,
the tensors (dtype, device, shape, strides), each form's own tensors (`check_form`), an explicit config (resolved
to the backward it runs, once per signature), and whether y gives x̂ back."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from . import saving
from ..config import MAX_N, SAVE_MODES, BackwardConfig, ConfigError, mapping_to_json
from .forms import GATED, RESIDUAL, Form
from .backward_calls import BackwardCall, resolved
from .ops import rows_2d
from ..problem import GATE_ACTIVATIONS, GATE_POSITIONS, canonical_dtype
from ..select.select import parsed_config

__all__ = ["check_form", "check_gate", "check_inputs", "gate_options", "gate_problem",
           "check_options", "dtype_eps", "explicit_backward", "output_recovers",
           "residual_dtype_of", "rows_2d", "rows_view", "stream_eps"]

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


_DTYPE_EPS = {d: torch.finfo(d).eps for d in _FLOAT_DTYPES}


def dtype_eps(x, dtype) -> float:
    """RMSNorm's eps=None: torch.finfo(dtype).eps, as torch.nn.RMSNorm takes it (dtype: x's, or with a residual
    h's). A dtype the kernels do not take means x breaks a rule: its check raises, naming it."""
    eps = _DTYPE_EPS.get(dtype)
    if eps is None:
        check_inputs(x, None, None, False)
        raise TypeError(f"eps=None needs a float32, bfloat16 or float16 dtype to take its eps from, got {dtype}")
    return eps


def check_options(eps, save: str, *, eps_may_be_none: bool = False) -> None:
    """The rules for eps and save: at each call of `layer_norm`/`rms_norm`, and when a module is built (where
    RMSNorm's eps=None means the dtype's eps, as in torch)."""
    if type(eps) is float and 0.0 < eps < math.inf and save in SAVE_MODES:  # the usual call, in one test
        return
    if eps is None:
        if not eps_may_be_none:
            raise ValueError("eps must be a positive finite number (e.g. 1e-5), got None")
    elif isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps <= 0:
        raise ValueError(f"eps must be a positive finite number (e.g. 1e-5), got {eps!r}")
    if save not in SAVE_MODES:
        raise ValueError(f"save={save!r} is not allowed: use 'input' (save x) or 'output' (save y, recover x̂)")


def _check_tensor(name: str, t: Any, x: Tensor | None = None) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if x is None:
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}: use float32, bfloat16 or float16 (e.g. {name}.float())")
        return
    N = x.shape[-1]
    if tuple(t.shape) != (N,):
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected ({N},) to match x.shape[-1]")
    if t.dtype not in (x.dtype, torch.float32):
        raise TypeError(f"{name} has dtype {t.dtype}: use x's dtype ({x.dtype}) or torch.float32")
    if t.device != x.device:
        raise ValueError(f"{name} is on {t.device} but x is on {x.device}: move them to one device")


def _explicit_config(config: BackwardConfig | dict | str) -> BackwardConfig:
    """An explicit config as a value (JSON text parsed once per text)."""
    if isinstance(config, BackwardConfig):
        return config
    if isinstance(config, dict):
        return BackwardConfig.from_dict(config)
    if isinstance(config, str):
        return parsed_config(config)
    raise TypeError(f"config must be a BackwardConfig, a dict, JSON text or None, got {type(config).__name__}")


def explicit_backward(config: BackwardConfig | dict | str | None, rows: Tensor, weight, bias, *, is_rms: bool,
                      zero_centered: bool, save: str, residual_dtype: torch.dtype | None = None,
                      gate: tuple[str, str] | None = None, group: int | None = None) -> BackwardCall | str:
    """What the backward takes for the call's `config=`: "" (None: selected per problem); the `BackwardCall` of
    an explicit config, checked against the problem of `rows` (the backward's rows: x, or y when save="output",
    as 2-D rows; with `residual_dtype`, the residual form's) and the weight and bias, once per signature; or,
    while torch.compile traces (symbolic shapes, no json module), the config as JSON text, which the backward op
    resolves outside the graph."""
    if config is None:
        return ""
    if torch.compiler.is_compiling():
        if isinstance(config, BackwardConfig):
            return config.to_json()
        if isinstance(config, (dict, str)):
            return config if isinstance(config, str) else mapping_to_json(config)
    config = _explicit_config(config)
    M, N = rows.shape
    try:  # a gated call's groups are problems of `group` columns each
        return resolved(rows, M, group or N, weight, bias, is_rms, zero_centered, save == "output", config,
                        residual_dtype, gate)
    except ConfigError as err:
        raise ValueError(f"config does not fit this input ({M}x{N}): {err}") from None


def _fits(t: Any, x: Tensor, N: int) -> bool:
    """weight/bias `t` follows the rules for x (the fast path's test; `_check_tensor` says which rule broke)."""
    return isinstance(t, Tensor) and t.shape == (N,) and t.dtype in (x.dtype, torch.float32) and t.device == x.device


def check_inputs(x, weight, bias, zero_centered: bool, *, name: str = "x") -> None:
    """The tensor rules of the module docstring, each broken one raising TypeError/ValueError naming the argument
    (eps and save: `check_options`). Inputs that follow every rule return after one pass over their attributes
    (this runs on every call); the rules are then checked one by one, for the message."""
    if isinstance(x, Tensor) and x.dtype in _FLOAT_DTYPES and x.dim():
        N = x.shape[-1]
        if (0 < N <= MAX_N and (weight is None or _fits(weight, x, N)) and (bias is None or _fits(bias, x, N))
                and (weight is not None or not zero_centered)):
            return
    _check_tensor(name, x)
    if x.dim() == 0:
        raise ValueError(f"{name} is a scalar: normalization needs at least one dimension")
    N = x.shape[-1]
    if N < 1:
        raise ValueError(f"{name} has an empty last dimension (shape {tuple(x.shape)}): nothing to normalize")
    if N > MAX_N:
        raise ValueError(f"{name}.shape[-1]={N} exceeds the supported maximum {MAX_N}: normalize fewer columns")
    if weight is not None:
        _check_tensor("weight", weight, x)
    if bias is not None:
        _check_tensor("bias", bias, x)
    if zero_centered and weight is None:
        raise ValueError("zero_centered=True needs a weight (w = 1 + weight): pass weight or zero_centered=False")


def rows_view(t: Tensor, rows: Tensor) -> bool:
    """Whether `rows` (`rows_2d(t)`) is a view of t's own elements, not a copy."""
    if rows is t:
        return True
    return t.stride(-1) == 1 and rows._base is not None and rows._base is (t if t._base is None else t._base)


def output_recovers(x, weight, bias, zero_centered: bool) -> bool:
    """`saving.recovers` for this call's weight and bias; True for inputs that break a rule of `check_inputs`
    (which then names the rule)."""
    if not (isinstance(x, Tensor) and x.dtype in _FLOAT_DTYPES and x.dim()):
        return True
    N = x.shape[-1]
    if (weight is not None and not _fits(weight, x, N)) or (bias is not None and not _fits(bias, x, N)) or (
            zero_centered and weight is None):
        return True
    return saving.recovers(weight, bias, x.dtype, zero_centered)


# The residual form (`forms.RESIDUAL`): residual has x's shape and device and x's dtype or float32; the stream h is
# in residual_dtype (default: the residual's), x's dtype or float32.
_TORCH = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_ALLOWED = "use x's dtype or torch.float32 (an fp32 residual stream)"


def residual_dtype_of(x: Tensor, residual, residual_dtype) -> torch.dtype:
    """The dtype of h for inputs x and residual (checked: each broken rule raises naming the argument)."""
    if not isinstance(residual, Tensor):
        raise TypeError(f"residual must be a torch.Tensor (the residual stream, shaped like x), got "
                        f"{type(residual).__name__}")
    if residual.shape != x.shape:
        raise ValueError(f"residual has shape {tuple(residual.shape)} but x has {tuple(x.shape)}: pass a residual "
                         "shaped like x")
    if residual.device != x.device:
        raise ValueError(f"residual is on {residual.device} but x is on {x.device}: move them to one device")
    if residual.dtype not in (x.dtype, torch.float32):
        raise TypeError(f"residual has dtype {residual.dtype}: {_ALLOWED}")
    if residual_dtype is None:
        return residual.dtype
    if isinstance(residual_dtype, str) and residual_dtype.lower() in ("fp32", "float32", "bf16", "bfloat16", "fp16",
                                                                      "float16"):
        residual_dtype = _TORCH[canonical_dtype(residual_dtype)]
    if residual_dtype not in (x.dtype, torch.float32):
        raise TypeError(f"residual_dtype={residual_dtype!r} is not allowed: {_ALLOWED}")
    return residual_dtype


def stream_eps(x: Tensor, residual, residual_dtype) -> float:
    """RMSNorm's eps=None in the residual form: the eps of h's dtype, the residual stream's (`residual_dtype`, else
    the residual's), which torch.nn.RMSNorm(eps=None) applied on h would take; not x's (bf16's eps on an fp32
    stream is 2^16 times fp32's). Arguments that break a rule raise as the call's checks would."""
    if residual_dtype is None and type(residual) is Tensor:
        return dtype_eps(x, residual.dtype)
    if type(residual_dtype) is torch.dtype:
        return dtype_eps(x, residual_dtype)
    return dtype_eps(x, residual_dtype_of(x, residual, residual_dtype))


def check_form(form: Form, x: Tensor, extras: tuple, stream_dtype) -> torch.dtype | None:
    """The checks of the form's own tensors (`extras`, after x's checks passed): the dtype of its stream outputs
    (None for a form without any), each broken rule raising naming the argument."""
    if form is RESIDUAL:
        return residual_dtype_of(x, extras[0], stream_dtype)
    if form is GATED:
        check_gate(x, extras[0])
    return None


# The gated form (`forms.GATED`): gate has x's shape, dtype and device; its options are checked before anything runs.
def check_gate(x: Tensor, gate, name: str = "gate") -> None:
    if not isinstance(gate, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor (the gate z, shaped like x), got {type(gate).__name__}")
    if gate.shape != x.shape:
        raise ValueError(f"{name} has shape {tuple(gate.shape)} but x has {tuple(x.shape)}: pass a gate shaped like x")
    if gate.device != x.device:
        raise ValueError(f"{name} is on {gate.device} but x is on {x.device}: move them to one device")
    if gate.dtype != x.dtype:
        raise TypeError(f"{name} has dtype {gate.dtype} but x has {x.dtype}: pass the gate in x's dtype")


def gate_options(x, gate_position, gate_activation, group_size, *, save: str = "input", residual=None) -> tuple:
    """The gated form's `opts` (`forms.GATED`: gate after, sigmoid, group size) from a call's arguments; each broken
    rule raises naming the argument. Rules of x itself are `check_inputs`' (x's width is 0 here if x breaks one)."""
    if residual is not None:
        raise ValueError("gate with residual: the gated form has no residual stream; pass residual=None")
    if gate_position not in GATE_POSITIONS:
        raise ValueError(f"gate_position={gate_position!r} is not allowed: use 'before' (y = w·norm(x)·act(gate)) "
                         "or 'after' (y = w·norm(x·act(gate)))")
    if gate_activation not in GATE_ACTIVATIONS:
        raise ValueError(f"gate_activation={gate_activation!r} is not allowed: use 'silu' or 'sigmoid'")
    if save != "input":
        raise ValueError(f"save={save!r} with a gate: the gated form saves its input; use save='input'")
    N = x.shape[-1] if isinstance(x, Tensor) and x.dim() else 0
    if group_size is not None:
        if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1:
            raise ValueError(f"group_size={group_size!r} must be a positive integer dividing x's width (or None: "
                             "the whole width)")
        if N and N % group_size:
            raise ValueError(f"group_size={group_size} does not divide x's width {N}: pass a divisor of "
                             "x.shape[-1] (or None: the whole width)")
    return gate_position == "after", gate_activation == "sigmoid", N if group_size is None else group_size


def gate_problem(opts: tuple) -> tuple[str, str] | None:
    """(gate, gate_activation) as a `Problem` names them, from the gated form's `opts` (None: no gate)."""
    if not opts:
        return None
    return ("after" if opts[0] else "before"), ("sigmoid" if opts[1] else "silu")
