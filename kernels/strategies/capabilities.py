"""Launch features a config may ask for that not every GPU has, and the portable form a device runs instead.

A config (from a table tuned on another GPU, an explicit `config=`, or the analytic default) may name a feature
the device lacks (`limits.DeviceLimits` says which it has):

- kernel_2.pdl: programmatic dependent launch (NVIDIA, compute capability 9.0 on) → an ordinary second launch;
- kernel_1.eviction_policy: PTX eviction priorities (NVIDIA) → plain loads, which is what Triton's AMD backend
  compiles them to anyway;
- a strategy's own knobs (`Strategy.fallbacks`, `Strategy.portable`): the rows strategy's pipelined_split waits
  through inline PTX (NVIDIA) → the exchange through Triton's own barrier and atomics (the same sums in the same
  order; the loop is not software-pipelined).

`portable` drops what the device lacks (the results are the same: each of these changes only when or how loads
are issued); `fallbacks` says what it dropped, for `normtune where`. The search space offers none of these on
such a device. Cluster launches and TMA descriptors are not used by any kernel here.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from ..limits import REFERENCE, DeviceLimits
from ..problem import ConfigError, Problem

if TYPE_CHECKING:  # the strategies validate through `checked`: the config's type is theirs
    from .configs import BackwardConfig


def fallbacks(config: BackwardConfig, limits: DeviceLimits) -> list[str]:
    """One line per feature `config` asks for that the device lacks, saying what runs instead."""
    k1, k2 = config.kernel_1, config.kernel_2
    out = []
    if k2.pdl and not limits.pdl:
        out.append(f"kernel_2.pdl: {limits.name} has no programmatic dependent launch (NVIDIA, compute capability "
                   "9.0 on): kernel_2 is an ordinary second launch")
    if k1.eviction_policy and not limits.eviction_hints:
        out.append(f"kernel_1.eviction_policy={k1.eviction_policy}: {limits.name} has no eviction hints: plain loads")
    return out + config.strategy.fallbacks(k1, limits)


def portable(config: BackwardConfig, limits: DeviceLimits) -> BackwardConfig:
    """`config` without the features the device lacks (itself when it lacks none)."""
    k1, k2 = config.kernel_1, config.kernel_2
    new_k1 = config.strategy.portable(
        k1 if limits.eviction_hints or not k1.eviction_policy else dataclasses.replace(k1, eviction_policy=""),
        limits)
    new_k2 = k2 if limits.pdl or not k2.pdl else dataclasses.replace(k2, pdl=False)
    if new_k1 == k1 and new_k2 == k2:
        return config
    return dataclasses.replace(config, kernel_1=new_k1, kernel_2=new_k2)


# (problem, config, limits) → the config's portable form, validated for the problem on that device: what
# `checked` has answered. Validation is a pure function of the three, so each triple is validated once.
_CHECKED: dict[tuple, BackwardConfig] = {}
MAX_CHECKED = 8192


def checked(problem: Problem, config: BackwardConfig, limits: DeviceLimits | None = None) -> BackwardConfig:
    """`config` in the portable form of the device of `limits` (the reference device without), validated for
    `problem` there (`BackwardConfig.validate`, which raises `ConfigError` naming the field). The runtime's one
    validation of a config: the selection, an explicit `config=` and the launch plan all ask here, and a triple
    already answered is not validated again (a config that fails is, each time it is asked about)."""
    lim = limits or REFERENCE
    key = (problem, config, lim)
    hit = _CHECKED.get(key)
    if hit is None:
        hit = portable(config, lim).validate(problem, lim)
        if len(_CHECKED) >= MAX_CHECKED:  # e.g. a new row count every step: start over rather than grow
            _CHECKED.clear()
        _CHECKED[key] = _CHECKED[(problem, hit, lim)] = hit  # the portable form is its own portable form
    return hit


def fits(problem: Problem, config: BackwardConfig, limits: DeviceLimits | None = None) -> bool:
    """Whether `config` validates for `problem` on the device of `limits` (`checked`: a config the caller then
    runs is not validated again when the selection or the launch plan asks about it)."""
    try:
        checked(problem, config, limits)
    except ConfigError:
        return False
    return True


def clear_checked() -> None:
    """Forget validated configs (`select.clear_caches`)."""
    _CHECKED.clear()
