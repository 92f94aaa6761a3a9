"""What is normalized: `Problem` (norm, shape, dtypes, flags) and `ProblemFamily` (the same without the shape),
with the names they are spelled in (norms, save modes, dtypes) and the checks that name a bad field and the values
it could take. The launch knobs that run a problem are in `config.py`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

# Norm kinds and saving modes, as spelled in configs, tables and the CLI.
NORMS = ("layer_norm", "rms_norm")
SAVE_MODES = ("input", "output")
# The gated form's gate positions (the gate multiplies the norm's output, or its input) and activations.
GATE_POSITIONS = ("before", "after")
GATE_ACTIVATIONS = ("silu", "sigmoid")
# Canonical dtype names; `canonical_dtype` maps torch dtypes and common aliases onto them.
DTYPES = ("fp32", "bf16", "fp16")
_DTYPE_ALIASES = {
    "fp32": "fp32", "float32": "fp32", "float": "fp32", "f32": "fp32", "torch.float32": "fp32",
    "bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "f16": "fp16", "torch.float16": "fp16",
}
ITEMSIZE = {"fp32": 4, "bf16": 2, "fp16": 2}
# 2^(mantissa bits − 1) per activation dtype: a saved output y = x̂·w + b determines x̂ only where
# |w|·limit > |b|; elsewhere save="output" gives NaN gradients for that column (see backward/common.py).
RECOVER_LIMITS = {"fp32": 2.0 ** 23, "bf16": 2.0 ** 7, "fp16": 2.0 ** 10}

# Widest normalized dimension supported. Wider rows always run two-pass, so the limit comes from the partial
# buffer (programs x N x 4 bytes), not from registers: 262144 columns on 132 SMs x 2 programs is ~277 MB.
MAX_N = 262144
MAX_M = 2**62  # rows: any count whose element offsets fit int64


def canonical_dtype(dtype: Any) -> str:
    """`torch.bfloat16`, "bfloat16", "bf16" → "bf16" (and likewise for fp32/fp16)."""
    key = str(dtype).lower()
    if key not in _DTYPE_ALIASES:
        raise TypeError(f"unsupported dtype {dtype!r}: use one of float32, bfloat16, float16 ({', '.join(DTYPES)})")
    return _DTYPE_ALIASES[key]


def is_power_of_two(n: int) -> bool:
    return isinstance(n, int) and n >= 1 and (n & (n - 1)) == 0


class ConfigError(ValueError):
    """A config or problem that cannot run; the message names the field and the allowed values."""


def check_choice(name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ConfigError(f"{name}={value!r} is not allowed: use one of {', '.join(map(repr, allowed))}")


def check_int(name: str, value: Any, lo: int, hi: int, power_of_two: bool = False) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"{name}={value!r} must be an integer")
    if not lo <= value <= hi:
        raise ConfigError(f"{name}={value} is out of range: use {lo} <= {name} <= {hi}")
    if power_of_two and not is_power_of_two(value):
        lower = 1 << (value.bit_length() - 1)
        raise ConfigError(f"{name}={value} must be a power of two (e.g. {lower} or {lower * 2})")


def from_mapping(cls, data: Mapping[str, Any]):
    if not isinstance(data, Mapping):
        raise ConfigError(f"{cls.__name__} expects a JSON object, got {type(data).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"unknown {cls.__name__} field(s) {', '.join(unknown)} (allowed: {', '.join(sorted(names))})")
    return cls(**dict(data))


@dataclass(frozen=True)
class Problem:
    """What is normalized: the norm, the 2-D shape (M rows of N), dtypes and flags.

    `weight_dtype` defaults to `dtype`; fp32 weights with bf16/fp16 activations are supported.
    `residual`: the fused residual form, h = x + residual, y = norm(h); the forward writes h (the residual stream)
    and the backward adds the stream's gradient dh into grad_input. `residual_dtype` is h's dtype (and so dh's and
    grad_input's): `dtype` (the default) or fp32 (an fp32 residual stream with 16-bit activations); None when
    `residual` is False. A problem without a residual keeps the fields out of its dict, key and family key, so
    that stored problems and tables from before the residual form read and write unchanged.
    `gate`: the gated RMSNorm, "before" (y = w·x̂·act(z)) or "after" (y = w·norm(x·act(z))), with z shaped like
    x and in its dtype; `gate_activation` "silu" (the default with a gate) or "sigmoid"; both None without a gate
    (kept out of the dict and keys, as the residual's fields). RMSNorm only, saving its input, without a residual.
    """

    norm: str
    M: int
    N: int
    dtype: str = "bf16"
    weight_dtype: str | None = None
    has_weight: bool = True
    has_bias: bool | None = None  # None: True for layer_norm, False for rms_norm
    zero_centered: bool = False
    save: str = "input"
    residual: bool = False
    residual_dtype: str | None = None
    gate: str | None = None
    gate_activation: str | None = None

    def __post_init__(self) -> None:
        check_choice("norm", self.norm, NORMS)
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))
        object.__setattr__(self, "residual_dtype", _residual_dtype(self.residual, self.residual_dtype, self.dtype))
        object.__setattr__(self, "gate_activation", _gate_activation(self.gate, self.gate_activation))
        wd = self.dtype if self.weight_dtype is None else canonical_dtype(self.weight_dtype)
        object.__setattr__(self, "weight_dtype", wd)
        if self.has_bias is None:
            object.__setattr__(self, "has_bias", self.norm == "layer_norm")
        check_choice("save", self.save, SAVE_MODES)
        check_int("M", self.M, 0, MAX_M)
        if not isinstance(self.N, int) or isinstance(self.N, bool) or self.N < 1:
            raise ConfigError(f"N={self.N!r} must be a positive integer (the size of the normalized dimension)")
        if self.N > MAX_N:
            raise ConfigError(f"N={self.N} exceeds the supported maximum {MAX_N}: normalize fewer columns")
        if self.norm == "rms_norm" and self.has_bias:
            raise ConfigError("rms_norm has no bias: use has_bias=False (or norm='layer_norm')")
        if self.zero_centered and not self.has_weight:
            raise ConfigError("zero_centered=True needs a weight (w = 1 + w'): pass has_weight=True")
        if self.weight_dtype != self.dtype and self.weight_dtype != "fp32":
            raise ConfigError(
                f"weight_dtype={self.weight_dtype!r} with dtype={self.dtype!r}: the weight must be fp32 or the "
                "activation dtype"
            )
        if self.gate is not None:
            _check_gated(self.norm, self.save, self.residual)

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    @property
    def family(self) -> "ProblemFamily":
        """The problem without its shape: what a heuristic table's rule set is keyed by."""
        return ProblemFamily(self.norm, self.dtype, self.weight_dtype, self.has_weight, bool(self.has_bias),
                             self.zero_centered, self.save, self.residual, self.residual_dtype, self.gate,
                             self.gate_activation)

    @property
    def key(self) -> str:
        return f"{self.family.key}/{self.M}x{self.N}"

    def with_shape(self, M: int, N: int) -> "Problem":
        return dataclasses.replace(self, M=M, N=N)

    @property
    def residual_itemsize(self) -> int:
        """Bytes per element of h, dh and grad_input in the residual form (the activation's without one)."""
        return ITEMSIZE[self.residual_dtype or self.dtype]

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        if not self.residual:  # as before the residual form: stored problems keep their JSON
            del data["residual"], data["residual_dtype"]
        if self.gate is None:  # likewise before the gated form
            del data["gate"], data["gate_activation"]
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Problem":
        return from_mapping(cls, data)


@dataclass(frozen=True)
class ProblemFamily:
    """A problem without M and N: norm, dtypes and flags."""

    norm: str
    dtype: str
    weight_dtype: str
    has_weight: bool
    has_bias: bool
    zero_centered: bool
    save: str
    residual: bool = False
    residual_dtype: str | None = None
    gate: str | None = None
    gate_activation: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "residual_dtype", _residual_dtype(self.residual, self.residual_dtype, self.dtype))
        object.__setattr__(self, "gate_activation", _gate_activation(self.gate, self.gate_activation))

    @property
    def key(self) -> str:
        parts = [self.norm, self.dtype, f"w{self.weight_dtype}" if self.has_weight else "noweight"]
        parts.append("bias" if self.has_bias else "nobias")
        if self.zero_centered:
            parts.append("zc")
        parts.append(f"save-{self.save}")
        if self.residual:
            parts.append(f"res-{self.residual_dtype}")
        if self.gate is not None:
            parts.append(f"gate-{self.gate}-{self.gate_activation}")
        return "/".join(parts)

    @classmethod
    def from_key(cls, key: str) -> "ProblemFamily":
        parts = key.split("/")
        try:
            norm, dtype, w, b = parts[:4]
            rest = parts[4:]
            zc = "zc" in rest
            save = next(p for p in rest if p.startswith("save-"))[5:]
            res = [p[4:] for p in rest if p.startswith("res-")]
            gates = [p for p in rest if p.startswith("gate-")]
            if len(res) > 1 or len(gates) > 1 or set(rest) - {"zc", f"save-{save}", *gates} - {f"res-{r}" for r in res}:
                raise ValueError
            residual_dtype = canonical_dtype(res[0]) if res else None
            gate, activation = gates[0].split("-")[1:] if gates else (None, None)
        except (ValueError, StopIteration, TypeError):
            raise ConfigError(f"malformed problem family key {key!r}: expected e.g. "
                              "'rms_norm/bf16/wbf16/nobias/save-input' (a residual family ends in '/res-bf16' or "
                              "'/res-fp32', a gated one in e.g. '/gate-before-silu')") from None
        has_weight = w != "noweight"
        fam = cls(norm, canonical_dtype(dtype), canonical_dtype(w[1:]) if has_weight else canonical_dtype(dtype),
                  has_weight, b == "bias", zc, save, residual_dtype is not None, residual_dtype, gate, activation)
        fam.problem(1, 1)  # validates the combination
        return fam

    def problem(self, M: int, N: int) -> Problem:
        return Problem(self.norm, M, N, self.dtype, self.weight_dtype, self.has_weight, self.has_bias,
                       self.zero_centered, self.save, self.residual, self.residual_dtype, self.gate,
                       self.gate_activation)


def _residual_dtype(residual: Any, residual_dtype: Any, dtype: str) -> str | None:
    """The canonical residual_dtype of a problem or family: None without a residual, else `dtype` or fp32."""
    if not isinstance(residual, bool):
        raise ConfigError(f"residual={residual!r} must be True or False")
    if not residual:
        if residual_dtype is not None:
            raise ConfigError(f"residual_dtype={residual_dtype!r} needs residual=True (or residual_dtype=None)")
        return None
    rd = dtype if residual_dtype is None else canonical_dtype(residual_dtype)
    if rd not in (dtype, "fp32"):
        raise ConfigError(f"residual_dtype={rd!r} with dtype={dtype!r}: the residual stream must be fp32 or the "
                          "activation dtype")
    return rd


def _gate_activation(gate: Any, activation: Any) -> str | None:
    """The canonical gate_activation of a problem or family: None without a gate, else "silu" (the default) or
    "sigmoid"."""
    if gate is None:
        if activation is not None:
            raise ConfigError(f"gate_activation={activation!r} needs a gate: pass gate='before' or 'after'")
        return None
    check_choice("gate", gate, GATE_POSITIONS)
    activation = "silu" if activation is None else activation
    check_choice("gate_activation", activation, GATE_ACTIVATIONS)
    return activation


def _check_gated(norm: str, save: str, residual: bool) -> None:
    """The gated form's rules: RMSNorm, saving its input (y does not give x̂ back where the gate is 0), no
    residual."""
    if norm != "rms_norm":
        raise ConfigError(f"gate with norm={norm!r}: the gated form is an RMSNorm; use norm='rms_norm'")
    if save != "input":
        raise ConfigError(f"gate with save={save!r}: the gated form saves its input; use save='input'")
    if residual:
        raise ConfigError("gate with residual=True: the gated form has no residual stream; use residual=False")
