"""When save="output" may stand in for the input: the rule, and its check cached per weight/bias version.

save="output" keeps y = x̂·w + b and recovers x̂ = (y − b)/w in the backward. y is rounded to the activation dtype
(unit roundoff u), so the recovered x̂ is off by up to u·(|b|/|w| + |x̂|), plus, where |w·x̂| is below the dtype's
smallest normal number (`finfo.tiny`), the spacing of subnormals divided by |w|. Saving x, x̂ is off by about
u·|x̂|. The rule: y may stand in for x only where every column has

    |w| >= finfo(dtype).tiny   and   |b| <= |w|         (w = 1 + w' when zero-centered; w = 1 without a weight)

so that the recovered x̂ carries at most one more rounding of the activation dtype than saving x gives. A weight of
0 (or w' = −1), a denormal-sized weight, or a bias larger than the weight in any column breaks it.

Where it is broken, the autograd API saves x instead for that call (exact, at the memory cost of keeping x);
the backward from y (`direct.*_backward(from_output=True)`, or a backward traced by torch.compile, where the
weights cannot be read while tracing) raises a ValueError/RuntimeError naming the fix instead.

Cost: reading the check's result needs the weight's values on the host — on a GPU, a device-to-host copy that
waits for the queued work. It is therefore cached per (weight, bias) storage, layout and data version
(`Tensor._version`, which every in-place update such as an optimizer step or `load_state_dict` bumps): a layer
whose weights do not change pays it once, a training step once per layer after the optimizer updated the
weights, and no call pays it twice for the same values. Writes through `.data` bypass the version counter and are
not seen (torch's optimizers do not write through `.data`). While a CUDA graph is being captured, no value can be
read: an unchecked version then saves x (always exact).
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor

from .launcher import data_ptr

_CACHE: dict[tuple, tuple] = {}
MAX_CACHE = 4096


def output_recovers_input(weight: Tensor | None, bias: Tensor | None, dtype: torch.dtype,
                          zero_centered: bool = False) -> bool:
    """The rule above, read now (on a GPU this waits for the device): whether y of activation dtype `dtype`
    determines x̂ as precisely as x does, in every column."""
    with torch.no_grad():
        if weight is None:
            return bias is None or bool((bias.float().abs() <= 1.0).all())
        w = weight.float() + 1.0 if zero_centered else weight.float()
        aw = w.abs()
        ok = aw >= torch.finfo(dtype).tiny
        if bias is not None:
            ok &= bias.float().abs() <= aw
        return bool(ok.all())


def _part(t: Tensor | None) -> tuple:
    if t is None:
        return (None,)
    return data_ptr(t), t.shape, t.stride(), t.dtype, t.device


def _storage(t: Tensor | None):
    return None if t is None else t.untyped_storage()


def recovers(weight: Tensor | None, bias: Tensor | None, dtype: torch.dtype, zero_centered: bool) -> bool:
    """`output_recovers_input`, computed once per storage, layout and data version of weight and bias (see the
    module docstring). False, without reading anything, while a CUDA graph is captured and the versions are new."""
    if weight is None and bias is None:
        return True
    try:
        key = (_part(weight), _part(bias), dtype, zero_centered)
        versions = tuple(t._version if t is not None else None for t in (weight, bias))
        storages = (_storage(weight), _storage(bias))
    except (RuntimeError, NotImplementedError, AttributeError):  # no storage (a tensor subclass): no cache
        return output_recovers_input(weight, bias, dtype, zero_centered)
    hit = _CACHE.get(key)
    if hit is not None and hit[0] == versions and all(
            (ref is None and s is None) or (ref is not None and ref() is s) for ref, s in zip(hit[1], storages)):
        return hit[2]
    device = (weight if weight is not None else bias).device
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return False
    result = output_recovers_input(weight, bias, dtype, zero_centered)
    if len(_CACHE) >= MAX_CACHE:
        _CACHE.clear()
    _CACHE[key] = (versions, tuple(weakref.ref(s) if s is not None else None for s in storages), result)
    return result


def clear() -> None:
    _CACHE.clear()


def refusal(what: str) -> str:
    """The message of a backward from y that the rule forbids; `what` names the call."""
    return (f"{what}: y does not determine x̂ precisely for this weight/bias (some column has |w| below the "
            "activation dtype's smallest normal number, or |b| > |w|; w = 1 + w' when zero-centered): save the "
            "input instead (save='input', or pass x with from_output=False)")
