"""When save="output" may stand in for the input: the rule, and its check cached per weight/bias version.

save="output" keeps y = x̂·w + b and recovers x̂ = (y − b)/w in the backward. y is rounded to the activation dtype
(unit roundoff u), so the recovered x̂ is off by up to u·(|b|/|w| + |x̂|), plus, where |w·x̂| is below the dtype's
smallest normal number (`finfo.tiny`), the spacing of subnormals divided by |w|. Saving x, x̂ is off by about
u·|x̂|. The rule: y may stand in for x only where every column has

    |w| >= finfo(dtype).tiny   and   |b| <= |w|         (w = 1 + w' when zero-centered; w = 1 without a weight)

so that the recovered x̂ holds at most one more rounding of the activation dtype than saving x gives. A weight of
0 (or w' = −1), a denormal-sized weight, or a bias larger than the weight in any column breaks it.

Where it is broken, the autograd API saves x instead for that call (exact, at the memory cost of keeping x);
the backward from y (`direct.*_backward(from_output=True)`, or a backward traced by torch.compile, where the
weights cannot be read while tracing) raises a ValueError/RuntimeError naming the fix instead.

Cost: reading the check's result needs the weight's values on the host — on a GPU, a device-to-host copy that
waits for the queued work. It is therefore cached per (weight, bias) storage, layout and data version
(`Tensor._version`, which every in-place update such as an optimizer step or `load_state_dict` bumps), and a
check also rechecks every other pair seen before whose data changed: a layer whose weights do not change pays
it once; after an optimizer step, the first save="output" layer's read-back serves every layer (one read per
step, where the pairs stay alive between calls: the parameters themselves, as the modules pass them); no call
pays it twice for the same values. Writes through `.data` bypass the version counter and are
not seen (torch's optimizers do not write through `.data`). While a CUDA graph is being captured, no value can be
read: an unchecked version then saves x (always exact).
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor

from ..launcher import data_ptr

# key (storage address, layout, dtypes, flags) → (data versions, weak storages, result) of the last check
_CACHE: dict[tuple, tuple] = {}
# key → weak references to the tensors last checked under it (rechecked with the next read-back)
_TRACKED: dict[tuple, tuple] = {}
MAX_CACHE = 4096


def _rule(weight: Tensor | None, bias: Tensor | None, dtype: torch.dtype, zero_centered: bool) -> Tensor:
    """The rule above as a 0-d bool tensor on the operands' device (nothing is read back)."""
    with torch.no_grad():
        if weight is None:
            return (bias.float().abs() <= 1.0).all()
        w = weight.float() + 1.0 if zero_centered else weight.float()
        aw = w.abs()
        ok = aw >= torch.finfo(dtype).tiny
        if bias is not None:
            ok &= bias.float().abs() <= aw
        return ok.all()


def _read_back(flags: list[Tensor]) -> list[bool]:
    """The one device-to-host read of a check: every flag at once."""
    return torch.stack(flags).tolist()


def output_recovers_input(weight: Tensor | None, bias: Tensor | None, dtype: torch.dtype,
                          zero_centered: bool = False) -> bool:
    """The rule above, read now (on a GPU this waits for the device): whether y of activation dtype `dtype`
    determines x̂ as precisely as x does, in every column."""
    if weight is None and bias is None:
        return True
    return _read_back([_rule(weight, bias, dtype, zero_centered)])[0]


def _part(t: Tensor | None) -> tuple:
    if t is None:
        return (None,)
    return data_ptr(t), t.shape, t.stride(), t.dtype, t.device


def _state(weight: Tensor | None, bias: Tensor | None, dtype: torch.dtype, zero_centered: bool):
    """(cache key, data versions, storages) of an operand pair; raises for tensors without storage."""
    key = (_part(weight), _part(bias), dtype, zero_centered)
    versions = tuple(t._version if t is not None else None for t in (weight, bias))
    return key, versions, tuple(t.untyped_storage() if t is not None else None for t in (weight, bias))


def _cached(key, versions, storages):
    """The cached result for this key if it was computed on these versions of these storages, else None."""
    hit = _CACHE.get(key)
    if hit is not None and hit[0] == versions and all(
            (ref is None and s is None) or (ref is not None and ref() is s) for ref, s in zip(hit[1], storages)):
        return hit[2]
    return None


def _stale_tracked(device: torch.device, skip) -> list:
    """Other operand pairs seen before on `device` (still alive) whose data changed since their check: checked
    along with this call's, so that after an optimizer step the first layer's read-back serves every layer."""
    stale = []
    for key, (wref, bref) in list(_TRACKED.items()):
        if key == skip or (key[0][-1:] != (device,) and key[1][-1:] != (device,)):
            continue
        weight, bias = (ref() if ref is not None else None for ref in (wref, bref))
        if (wref is not None and weight is None) or (bref is not None and bias is None):
            del _TRACKED[key]
            continue
        state = _state(weight, bias, key[2], key[3])
        if state[0] != key:  # re-pointed since (e.g. `.data` assigned): tracked under its new key when next used
            del _TRACKED[key]
        elif _cached(*state) is None:
            stale.append((weight, bias, *state))
    return stale


def recovers(weight: Tensor | None, bias: Tensor | None, dtype: torch.dtype, zero_centered: bool) -> bool:
    """`output_recovers_input`, computed once per storage, layout and data version of weight and bias (see the
    module docstring). A pair whose data changed is checked together with every other pair seen before whose
    data changed too, in one read-back. False, without reading anything, while a CUDA graph is captured."""
    if weight is None and bias is None:
        return True
    try:
        state = _state(weight, bias, dtype, zero_centered)
    except (RuntimeError, NotImplementedError, AttributeError):  # no storage (a tensor subclass): no cache
        return output_recovers_input(weight, bias, dtype, zero_centered)
    result = _cached(*state)
    if result is not None:
        return result
    device = (weight if weight is not None else bias).device
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return False
    pending = [(weight, bias, *state)] + _stale_tracked(device, state[0])
    results = _read_back([_rule(w, b, key[2], key[3]) for w, b, key, _, _ in pending])
    if len(_CACHE) + len(pending) > MAX_CACHE:
        _CACHE.clear()
        _TRACKED.clear()
    for (w, b, key, versions, storages), ok in zip(pending, results):
        _CACHE[key] = (versions, tuple(weakref.ref(s) if s is not None else None for s in storages), ok)
    _TRACKED[state[0]] = tuple(weakref.ref(t) if t is not None else None for t in (weight, bias))
    return results[0]


def clear() -> None:
    _CACHE.clear()
    _TRACKED.clear()


def refusal(what: str) -> str:
    """The message of a backward from y that the rule forbids; `what` names the call."""
    return (f"{what}: y does not determine x̂ precisely for this weight/bias (some column has |w| below the "
            "activation dtype's smallest normal number, or |b| > |w|; w = 1 + w' when zero-centered): save the "
            "input instead (save='input', or pass x with from_output=False)")
