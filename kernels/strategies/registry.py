"""The kernel_1 strategies by name: `STRATEGIES` maps a config's `kernel_1.strategy` to its `Strategy` object.

`strategies/__init__.py` registers the built-in strategies; `register` adds another (a plug-in, a test) at any
time. Every reader looks a strategy up when it needs it (`lookup`, or a walk of `STRATEGIES`) and keeps no copy,
so a strategy registered after the tuner was imported is seen from then on.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..knobs import Kernel1Config, own_knobs
from ..problem import ConfigError, check_choice

STRATEGIES: dict[str, Any] = {}


def register(strategy: Any) -> Any:
    """Add `strategy` under its name (replacing the strategy of that name, if any) and return it. Refused with
    `ConfigError`, naming what to change: a config type that is not a frozen subclass of `Kernel1Config` whose
    `strategy` is the strategy's name, a knob of its own declared without `knob(default, domain)` or whose
    default is outside its domain, and a knob of the same name as another registered strategy's (a sampler's
    parameter is one knob)."""
    name, cls = getattr(strategy, "name", ""), getattr(strategy, "config_type", None)
    if not isinstance(name, str) or not name.isidentifier():
        raise ConfigError(f"a strategy's name must be an identifier (its launch module is <name>_launch), got {name!r}")
    if not (isinstance(cls, type) and issubclass(cls, Kernel1Config) and cls is not Kernel1Config
            and cls.__dataclass_params__.frozen and cls.strategy == name):
        raise ConfigError(f"strategy {name!r}: config_type must be a frozen dataclass subclass of Kernel1Config with "
                          f"strategy: ClassVar[str] = {name!r}")
    for knob in own_knobs(cls):
        if not knob.allows(knob.default):
            raise ConfigError(f"strategy {name!r}: knob {knob.name}'s default {knob.default!r} is not in its domain "
                              f"{knob.domain!r}")
        owner = knob_owner(knob.name, besides=name)
        if owner is not None:
            raise ConfigError(f"strategy {name!r}: knob {knob.name} is already a knob of strategy {owner!r}: give it "
                              "another name")
    STRATEGIES[name] = strategy
    return strategy


def lookup(name: str) -> Any:
    """The strategy registered as `name`; `ConfigError` naming the registered ones otherwise."""
    strategy = STRATEGIES.get(name) if isinstance(name, str) else None
    if strategy is None:
        check_choice("kernel_1.strategy", name, tuple(STRATEGIES))
    return strategy


def knob_owner(name: str, besides: str = "") -> str | None:
    """The registered strategy (other than `besides`) whose config type has a knob of its own called `name`."""
    for other, strategy in STRATEGIES.items():
        if other != besides and any(f.name == name for f in dataclasses.fields(strategy.config_type)) \
                and not any(f.name == name for f in dataclasses.fields(Kernel1Config)):
            return other
    return None
