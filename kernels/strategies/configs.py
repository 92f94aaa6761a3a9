"""`BackwardConfig` (a strategy's kernel_1 config and a `Kernel2Config`, tuned jointly) and its canonical JSON,
the form the tables, the store and the `torch.library` boundary hold.

Each strategy's configs have a layout of their own (`kernel_1_layout(name)`): the knobs every strategy shares,
`strategy`, and the strategy's own knobs. Another strategy's knob is refused when a config is parsed, so a knob
declared on one strategy changes no other strategy's configs. A knob of a strategy's own is written only where
it is not at its default, so that configs (and stored measurements, and their hashes) written before it existed
keep their bytes.

The one exception is frozen: the rows, columns and dual configs were written in a flat layout before each
strategy's knobs were closed to the others, and the shipped tables and results databases hold those bytes. Their
configs state the rows strategy's knobs of that layout (`FLAT_LAYOUT`), at their defaults where the strategy lacks
them, and accept them there at those defaults. A strategy or knob declared since is in no other strategy's layout.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..knobs import DEFAULT_STRATEGY, Kernel1Config, Kernel2Config, json_scalar, own_knobs
from ..limits import REFERENCE, DeviceLimits
from ..problem import ConfigError, Problem, from_mapping
from .registry import STRATEGIES, knob_owner, lookup

# The flat layout's knobs beyond the shared ones (the rows strategy's, in its declaration order) and the
# strategies whose configs state them: frozen, see the module's docstring.
FLAT_LAYOUT: dict[str, Any] = {"two_pass": False, "recompute": False, "row_split": 1, "column_accumulators": False,
                               "pipelined_split": False}
FLAT_STRATEGIES = ("rows", "columns", "dual")


def _default_kernel_1() -> Kernel1Config:
    return lookup(DEFAULT_STRATEGY).make()


@dataclass(frozen=True)
class BackwardConfig:
    """Both kernels' knobs, tuned jointly. Hashable, printable, and round-trips through canonical JSON (kernel_1's
    knobs in the layout of its strategy, `kernel_1_layout`)."""

    kernel_1: Kernel1Config = field(default_factory=_default_kernel_1)
    kernel_2: Kernel2Config = field(default_factory=Kernel2Config)

    @property
    def strategy(self):
        """The kernel_1 strategy object (`strategies/`) of this config."""
        return lookup(self.kernel_1.strategy)

    def validate(self, problem: Problem, limits: DeviceLimits | None = None) -> "BackwardConfig":
        """Raise `ConfigError` naming the field if this config cannot run `problem` (on the device of `limits`;
        without, the reference device); return self otherwise."""
        k1 = self.kernel_1
        if not isinstance(k1, Kernel1Config) or not isinstance(self.kernel_2, Kernel2Config):
            raise ConfigError("BackwardConfig needs a strategy's kernel_1 config and a Kernel2Config")
        k1.check_fields(limits)
        strategy = lookup(k1.strategy)
        if type(k1) is not strategy.config_type:
            raise ConfigError(f"kernel_1 of strategy={k1.strategy!r} is a {strategy.config_type.__name__}, got a "
                              f"{type(k1).__name__}: build it with the strategy's make()")
        for knob in own_knobs(type(k1)):
            value = getattr(k1, knob.name)
            if not knob.allows(value):
                raise ConfigError(f"kernel_1.{knob.name}={value!r} is not allowed for strategy={k1.strategy!r}: use "
                                  f"one of {', '.join(map(repr, knob.domain))}")
        strategy.validate(self, problem, limits or REFERENCE)
        return self

    def is_valid(self, problem: Problem, limits: DeviceLimits | None = None) -> bool:
        try:
            self.validate(problem, limits)
        except ConfigError:
            return False
        return True

    def to_dict(self) -> dict[str, Any]:
        """The canonical layout as a mapping (`kernel_1_layout` of the config's strategy; see the module)."""
        k1 = self.kernel_1
        kernel_1 = {}
        for name, held, always, default, _ in _wire(type(k1)):
            value = getattr(k1, name) if held else default
            if always or not _same(value, default):
                kernel_1[name] = value
        return {"kernel_1": kernel_1, "kernel_2": dataclasses.asdict(self.kernel_2)}

    def to_json(self) -> str:
        """Canonical compact JSON (sorted keys), the same bytes as json.dumps(sort_keys=True, separators=(",",
        ":")) of `to_dict`. Written out by hand because torch.compile traces this (explicit `config=` in a
        compiled model) and cannot trace the json module."""
        k1, k2 = self.kernel_1, self.kernel_2
        one = []
        for name, held, always, default, text in _wire(type(k1)):
            if not held:
                one.append(f'"{name}":{text}')
                continue
            value = getattr(k1, name)
            if always or not _same(value, default):
                one.append(f'"{name}":{json_scalar(value)}')
        two = ",".join(f'"{name}":{json_scalar(getattr(k2, name))}' for name in _K2_NAMES)
        return f'{{"kernel_1":{{{",".join(one)}}},"kernel_2":{{{two}}}}}'

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "BackwardConfig":
        if not isinstance(data, Mapping) or set(data) - {"kernel_1", "kernel_2"}:
            if isinstance(data, Mapping) and "families" in data:
                raise ConfigError("this is a table, not one backward config: give it as $NORMTUNE_CONFIG (or a "
                                  "user table) and use the table's choice")
            got = sorted(data) if isinstance(data, Mapping) else type(data).__name__
            raise ConfigError(f"a backward config is an object with keys kernel_1 and kernel_2, got {got}")
        return cls(kernel_1_config(data.get("kernel_1", {})), from_mapping(Kernel2Config, data.get("kernel_2", {})))

    @classmethod
    def from_json(cls, text: str) -> "BackwardConfig":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ConfigError(f"config is not valid JSON ({err}): expected e.g. {cls().to_json()}") from None
        except RecursionError:
            raise ConfigError(f"config JSON nests too deeply to be a config: expected e.g. {cls().to_json()}") from None
        return cls.from_dict(data)

    def __str__(self) -> str:
        strategy = STRATEGIES.get(self.kernel_1.strategy)
        return strategy.describe(self) if strategy is not None else repr(self)


def kernel_1_config(fields: Mapping[str, Any] | None = None, /, **kwargs) -> Kernel1Config:
    """A kernel_1 config from knobs in the canonical layout (a mapping, or keywords): the type of the strategy
    they name (`strategy`, default rows), every knob left out at its default. A knob of another strategy, or a
    name no strategy has, raises `ConfigError` naming it (the flat layout's knobs at their defaults aside)."""
    if fields is not None and not isinstance(fields, Mapping):
        raise ConfigError(f"Kernel1Config expects a JSON object, got {type(fields).__name__}")
    data = {**(fields or {}), **kwargs}
    name = data.get("strategy", DEFAULT_STRATEGY)
    strategy = lookup(name)
    own = {f.name for f in dataclasses.fields(strategy.config_type)}
    flat = FLAT_LAYOUT if name in FLAT_STRATEGIES else {}
    unknown = []
    for key, value in data.items():
        if key == "strategy" or key in own or (key in flat and _same(value, flat[key])):
            continue
        owner = knob_owner(key, besides=name)
        if owner is not None:
            raise ConfigError(f"kernel_1.{key}={value!r} is a knob of strategy={owner!r}, which strategy={name!r} "
                              f"does not have: leave it out, or use strategy={owner!r}")
        unknown.append(key)
    if unknown:
        allowed = sorted(own | {"strategy"})
        raise ConfigError(f"unknown Kernel1Config field(s) {', '.join(sorted(map(str, unknown)))} of "
                          f"strategy={name!r} (allowed: {', '.join(allowed)})")
    return strategy.make(**{k: v for k, v in data.items() if k in own})


def kernel_1_layout(strategy: str | None = None) -> dict[str, Any]:
    """The kernel_1 knobs of the configs of `strategy` and their defaults, in declaration order: the shared knobs,
    its own (and the flat layout's, `FLAT_LAYOUT`, where it has that layout), then `strategy`. Without a name:
    every registered strategy's knobs together."""
    names = (strategy,) if strategy is not None else tuple(STRATEGIES)
    out: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(Kernel1Config)}
    for name in names:
        if name in FLAT_STRATEGIES:
            out.update(FLAT_LAYOUT)
        out.update({knob.name: knob.default for knob in own_knobs(lookup(name).config_type)})
    out["strategy"] = DEFAULT_STRATEGY if strategy is None else strategy
    return out


# Config type -> ((name, held by the type, always written, default, default as JSON), ...) in canonical (sorted)
# order. A type's layout is its own fields' and the frozen flat layout's: it never changes once computed.
_WIRE: dict[type, tuple] = {}


def _wire(cls: type) -> tuple:
    hit = _WIRE.get(cls)
    if hit is None:
        shared = {f.name: f.default for f in dataclasses.fields(Kernel1Config)}
        always = {**shared, **(FLAT_LAYOUT if cls.strategy in FLAT_STRATEGIES else {}), "strategy": cls.strategy}
        names = {**always, **{f.name: f.default for f in dataclasses.fields(cls)}}
        own = {f.name for f in dataclasses.fields(cls)} | {"strategy"}
        hit = tuple((name, name in own, name in always, names[name], json_scalar(names[name]))
                    for name in sorted(names))
        _WIRE[cls] = hit
    return hit


def _same(value: Any, default: Any) -> bool:
    return type(value) is type(default) and value == default


_K2_NAMES = tuple(sorted(f.name for f in dataclasses.fields(Kernel2Config)))
