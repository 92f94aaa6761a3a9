"""`nn.Module` drop-ins for `torch.nn.LayerNorm` and `torch.nn.RMSNorm` (same constructor arguments and
parameter names, so state dicts load either way), plus normtune's `zero_centered`, `save` and `config`; and
their fused residual forms `FusedAddLayerNorm` / `FusedAddRMSNorm`: forward(x, residual) -> (y, h); and the gated
RMSNorm of hybrid models, `GatedRMSNorm`: forward(x, gate) -> y."""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import Tensor, nn

from .functional import check_options, layer_norm, rms_norm
from .call_checks import gate_options, stream_eps


def _is_int(d) -> bool:
    return isinstance(d, int) and not isinstance(d, bool)


def _shape(normalized_shape: int | Sequence[int]) -> tuple[int, ...]:
    """torch's rule: an int or a sequence of ints (a float such as 64.0 is a TypeError, as in torch)."""
    if _is_int(normalized_shape):
        shape = (normalized_shape,)
    elif isinstance(normalized_shape, (Sequence, torch.Size)) and not isinstance(normalized_shape, str) \
            and all(_is_int(d) for d in normalized_shape):
        shape = tuple(normalized_shape)
    else:
        raise TypeError(f"normalized_shape must be an int or a tuple of ints (e.g. 4096 or (8, 512)), got "
                        f"{normalized_shape!r} ({type(normalized_shape).__name__})")
    if not shape or any(d < 1 for d in shape):
        raise ValueError(f"normalized_shape must be a positive int or a non-empty tuple of them, got {normalized_shape!r}")
    return shape


def widened(t: Tensor | None, x: Tensor) -> Tensor | None:
    """`t` cast to x's dtype where x's is the wider one (an fp32 input with bf16 or fp16 weights or gate, as
    Mamba-2's scan hands its gated norm): the modules compute what torch's type promotion gives the norms they
    replace (weight · x̂ in fp32), and the gradient flows back to `t` in its own dtype. Any other mix is left to the
    call's checks."""
    if t is None or t.dtype == x.dtype or not t.is_floating_point() or torch.promote_types(t.dtype, x.dtype) != x.dtype:
        return t
    return t.to(x.dtype)


def _shaped(y: Tensor, h: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
    """y and h in x's shape (they have it already unless normalized_shape has several dims)."""
    return (y, h) if y.shape == x.shape else (y.view(x.shape), h.view(x.shape))


class _Norm(nn.Module):
    def __init__(self, normalized_shape, eps, elementwise_affine, bias, device, dtype, zero_centered, save, config):
        super().__init__()
        self.normalized_shape = _shape(normalized_shape)
        check_options(eps, save, eps_may_be_none=isinstance(self, RMSNorm))
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        self.zero_centered = zero_centered
        self.save = save
        self.config = config
        if zero_centered and not elementwise_affine:
            raise ValueError("zero_centered=True needs elementwise_affine=True (w = 1 + weight)")
        factory = {"device": device, "dtype": dtype}
        self.register_parameter(
            "weight", nn.Parameter(torch.empty(self.normalized_shape, **factory)) if elementwise_affine else None)
        self.register_parameter(
            "bias", nn.Parameter(torch.empty(self.normalized_shape, **factory)) if elementwise_affine and bias else None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            # zero-centered weights store w' = w - 1: identity is 0
            (nn.init.zeros_ if self.zero_centered else nn.init.ones_)(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def _rows(self, x: Tensor) -> Tensor:
        k = len(self.normalized_shape)
        if tuple(x.shape[x.dim() - k:]) != self.normalized_shape:
            raise ValueError(f"input shape {tuple(x.shape)} does not end with normalized_shape {self.normalized_shape}")
        return x if k == 1 else x.reshape(*x.shape[: x.dim() - k], math.prod(self.normalized_shape))

    @staticmethod
    def _flat(p: Tensor | None, x: Tensor) -> Tensor | None:
        """The parameter as N elements: itself when 1-D (save="output"'s check then tracks the parameter across
        calls, see saving.py), else a view; at x's precision where it is narrower than the input `x` (`widened`)."""
        return widened(p if p is None or p.dim() == 1 else p.reshape(-1), x)

    def extra_repr(self) -> str:
        extra = f", zero_centered={self.zero_centered}" if self.zero_centered else ""
        extra += f", save={self.save!r}" if self.save != "input" else ""
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}{extra}"


class LayerNorm(_Norm):
    """Drop-in for `torch.nn.LayerNorm` backed by normtune's kernels."""

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True,
                 device=None, dtype=None, *, zero_centered: bool = False, save: str = "input", config=None):
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device, dtype, zero_centered, save, config)

    def forward(self, x: Tensor) -> Tensor:
        y = layer_norm(self._rows(x), self._flat(self.weight, x), self._flat(self.bias, x), self.eps,
                       zero_centered=self.zero_centered, save=self.save, config=self.config)
        return y.view(x.shape)


class RMSNorm(_Norm):
    """Drop-in for `torch.nn.RMSNorm`; eps=None means torch.finfo(x.dtype).eps, as in torch."""

    def __init__(self, normalized_shape, eps: float | None = None, elementwise_affine: bool = True, device=None,
                 dtype=None, *, zero_centered: bool = False, save: str = "input", config=None):
        super().__init__(normalized_shape, eps, elementwise_affine, False, device, dtype, zero_centered, save, config)

    def forward(self, x: Tensor) -> Tensor:
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        y = rms_norm(self._rows(x), self._flat(self.weight, x), eps, zero_centered=self.zero_centered,
                     save=self.save, config=self.config)
        return y.view(x.shape)


class FusedAddLayerNorm(LayerNorm):
    """`LayerNorm` of h = x + residual: forward(x, residual) returns (y, h), h in `residual_dtype` (None: the
    residual's dtype). The backward adds h's gradient into the gradient of x and residual in the same kernel."""

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True,
                 device=None, dtype=None, *, zero_centered: bool = False, save: str = "input", config=None,
                 residual_dtype: torch.dtype | None = None):
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device, dtype, zero_centered=zero_centered,
                         save=save, config=config)
        self.residual_dtype = residual_dtype

    def forward(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        y, h = layer_norm(self._rows(x), self._flat(self.weight, x), self._flat(self.bias, x), self.eps,
                          residual=self._rows(residual), residual_dtype=self.residual_dtype,
                          zero_centered=self.zero_centered, save=self.save, config=self.config)
        return _shaped(y, h, x)


class FusedAddRMSNorm(RMSNorm):
    """`RMSNorm` of h = x + residual: forward(x, residual) returns (y, h), as `FusedAddLayerNorm`. eps=None means
    torch.finfo of h's dtype (the residual stream's), as `RMSNorm` applied on h would take it."""

    def __init__(self, normalized_shape, eps: float | None = None, elementwise_affine: bool = True, device=None,
                 dtype=None, *, zero_centered: bool = False, save: str = "input", config=None,
                 residual_dtype: torch.dtype | None = None):
        super().__init__(normalized_shape, eps, elementwise_affine, device, dtype, zero_centered=zero_centered,
                         save=save, config=config)
        self.residual_dtype = residual_dtype

    def forward(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        eps = self.eps if self.eps is not None else stream_eps(x, residual, self.residual_dtype)
        y, h = rms_norm(self._rows(x), self._flat(self.weight, x), eps, residual=self._rows(residual),
                        residual_dtype=self.residual_dtype, zero_centered=self.zero_centered, save=self.save,
                        config=self.config)
        return _shaped(y, h, x)


class GatedRMSNorm(RMSNorm):
    """The gated RMSNorm (`rms_norm(..., gate=...)`): forward(x, gate) = w·norm(x)·act(gate) with
    gate_position="before" (Qwen3-Next's, Qwen3.5's), or w·norm(x·act(gate)) with "after" (Mamba-2's and its
    descendants'); activation "silu" or "sigmoid". group_size: the columns one set of statistics covers (a divisor
    of the width; None: the whole width). eps=None means torch.finfo(x.dtype).eps, as `RMSNorm`. gate=None: the
    norm alone (per group), as transformers' gated norms take it."""

    def __init__(self, normalized_shape, eps: float | None = 1e-6, elementwise_affine: bool = True, device=None,
                 dtype=None, *, gate_position: str = "before", group_size: int | None = None,
                 activation: str = "silu", zero_centered: bool = False, config=None):
        super().__init__(normalized_shape, eps, elementwise_affine, device, dtype, zero_centered=zero_centered,
                         config=config)
        # the call's checks, now (a meta tensor of the layer's width stands for x)
        gate_options(torch.empty(0, math.prod(self.normalized_shape), device="meta"), gate_position, activation,
                     group_size)
        self.gate_position, self.group_size, self.activation = gate_position, group_size, activation

    def forward(self, x: Tensor, gate: Tensor | None = None) -> Tensor:
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        if gate is None:
            rows, width = self._rows(x), math.prod(self.normalized_shape)
            group = self.group_size or width
            if group == width:
                return super().forward(x)
            y = rms_norm(rows.unflatten(-1, (width // group, group)), None, eps).flatten(-2)
            w = self._flat(self.weight, x)
            return (y if w is None else y * (w + 1 if self.zero_centered else w).to(y.dtype)).view(x.shape)
        y = rms_norm(self._rows(x), self._flat(self.weight, x), eps, gate=self._rows(widened(gate, x)),
                     gate_position=self.gate_position, group_size=self.group_size, gate_activation=self.activation,
                     zero_centered=self.zero_centered, config=self.config)
        return y.view(x.shape)

    def extra_repr(self) -> str:
        extra = f", group_size={self.group_size}" if self.group_size is not None else ""
        return f"{super().extra_repr()}, gate_position={self.gate_position!r}, activation={self.activation!r}{extra}"
