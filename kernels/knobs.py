"""The knob values of the two kernels: `Kernel1Config` (the kernel_1 launch knobs every strategy shares; each
strategy's config type adds its own, `strategies/`) and `Kernel2Config` (kernel_2, shared by every strategy),
their allowed values and per-field checks; `BackwardConfig` pairs them.

A config's canonical JSON (what the tables, the store and the `torch.library` boundary hold) is one flat layout
for every strategy: every knob of the registered strategies' config types (`kernel_1_layout`), those that do not
apply to the config's strategy at their default. Parsing dispatches on `strategy` to that strategy's type and
refuses a non-default value for a knob it does not have. The strategies are looked up by name in `STRATEGIES`,
the registry that `strategies/__init__.py` fills as it is imported (`normtune.kernels.config` imports it: use
that module).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping

from .heuristics import register_budget
from .limits import REFERENCE, DeviceLimits
from .problem import ConfigError, Problem, check_choice, check_int, from_mapping

# Allowed values of the launch knobs (the search space draws its domains from these).
NUM_WARPS = (1, 2, 4, 8, 16, 32)
EVICTION_POLICIES = ("", "evict_first", "evict_last")
ROW_SPLITS = (1, 2, 3, 4, 5, 6, 7, 8)
MAX_BLOCK_ROW = 64
MAX_BLOCK_COL = 65536
MAX_TILE = 65536  # elements per register tile (block_row x block_col)
MAX_NUM_STAGES = 6
MAX_PROGRAMS_PER_SM = 32
# The strategy of a kernel_1 mapping that names none.
DEFAULT_STRATEGY = "rows"


@dataclass(frozen=True)
class Kernel1Config:
    """The launch knobs of kernel_1 (grad_input, and dw/db or per-program partials of them) that every strategy
    has; a strategy's config type (a frozen subclass in its module) adds the knobs of its own.

    block_row x block_col is the register tile; num_warps its warps; num_stages > 1 software-pipelines the tile
    loop through shared memory; prefetch loads the next tile into registers before computing the current one;
    eviction_policy is the cache hint of the streaming loads ("" = none); programs_per_sm sizes a persistent grid
    (round(programs_per_sm x SMs) programs) where the strategy has one. `strategy` (a class attribute of each
    type) names the strategy (`strategies/`).
    """

    block_row: int = 1
    block_col: int = 1024
    num_warps: int = 4
    num_stages: int = 1
    programs_per_sm: float = 2
    eviction_policy: str = ""
    prefetch: bool = False

    strategy: ClassVar[str] = ""

    def __post_init__(self) -> None:
        if not self.strategy:
            raise ConfigError("Kernel1Config holds the knobs every strategy shares: build a strategy's config with "
                              "kernel_1_config(strategy=..., ...) or the strategy's make()")
        # 2 and 2.0 are the same grid: keep one spelling so configs hash and serialize identically.
        pps = self.programs_per_sm
        if isinstance(pps, float) and pps.is_integer():
            object.__setattr__(self, "programs_per_sm", int(pps))

    def tile(self) -> int:
        return self.block_row * self.block_col

    def shared_fields(self) -> dict[str, Any]:
        """The knobs every strategy has, by name (to build another strategy's config from this one's)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(Kernel1Config)}

    def check_fields(self, limits: DeviceLimits | None = None) -> None:
        """Each field's type and range (`limits`: the device's, the reference device's without); a strategy's
        type extends it with its own fields, and `Strategy.validate` checks how they combine."""
        check_int("kernel_1.block_row", self.block_row, 1, MAX_BLOCK_ROW, power_of_two=True)
        check_int("kernel_1.block_col", self.block_col, 1, MAX_BLOCK_COL, power_of_two=True)
        check_choice("kernel_1.num_warps", self.num_warps, NUM_WARPS)
        check_warps("kernel_1.num_warps", self.num_warps, limits or REFERENCE)
        check_int("kernel_1.num_stages", self.num_stages, 1, MAX_NUM_STAGES)
        pps = self.programs_per_sm
        if isinstance(pps, bool) or not isinstance(pps, (int, float)) or not 0.125 <= pps <= MAX_PROGRAMS_PER_SM:
            raise ConfigError(f"kernel_1.programs_per_sm={pps!r} is out of range: use a number from 0.125 to "
                              f"{MAX_PROGRAMS_PER_SM} (e.g. 0.5, 1, 2)")
        check_choice("kernel_1.eviction_policy", self.eviction_policy, EVICTION_POLICIES)
        check_booleans(self, ("prefetch",))


def check_booleans(k1: Kernel1Config, names: tuple[str, ...]) -> None:
    for name in names:
        if not isinstance(getattr(k1, name), bool):
            raise ConfigError(f"kernel_1.{name}={getattr(k1, name)!r} must be true or false")


@dataclass(frozen=True)
class Kernel2Config:
    """Launch knobs of kernel_2: a block_m x block_n tile sweeps the (programs x N) fp32 partials, cdiv(N,
    block_n) programs; num_stages > 1 pipelines the sweep's loads. pdl launches kernel_2 with Programmatic
    Dependent Launch (Hopper and newer; ignored elsewhere), hiding the launch gap after kernel_1.

    fused: no second launch: once every kernel_1 program has written its partial row (a grid-wide barrier on
    a counter), the same programs reduce the partials, block_n columns each in turn, in the same fixed order
    as kernel_2 (bitwise the same result). kernel_1's grid is then capped at what the GPU holds at once, so that
    the barrier cannot wait on a program that is not running. num_warps and pdl do not apply when fused."""

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 1
    pdl: bool = False
    fused: bool = False

    def check_tile(self, num_warps: int, name: str, limits: DeviceLimits | None = None) -> None:
        """The reduction tile on `num_warps` warps: no idle threads, registers within budget."""
        lim = limits or REFERENCE
        tile = self.block_m * self.block_n
        threads = lim.warp_size * num_warps
        if num_warps > 1 and threads > tile:
            raise ConfigError(
                f"{name}={num_warps} leaves threads idle on a {self.block_m}x{self.block_n} kernel_2 tile: "
                f"use num_warps <= {max(1, tile // lim.warp_size)} or a larger tile"
            )
        if math.ceil(tile / threads) * 2 > register_budget(num_warps, lim) // 2:
            raise ConfigError(
                f"kernel_2 tile {self.block_m}x{self.block_n} on {num_warps} warps needs too many registers: "
                "use a smaller tile or more warps"
            )

    def check_shape(self) -> None:
        """The tile's sides (what a strategy that only uses kernel_2's tile checks)."""
        check_int("kernel_2.block_m", self.block_m, 1, 1024, power_of_two=True)
        check_int("kernel_2.block_n", self.block_n, 1, 4096, power_of_two=True)

    def validate(self, limits: DeviceLimits | None = None) -> None:
        lim = limits or REFERENCE
        self.check_shape()
        check_choice("kernel_2.num_warps", self.num_warps, NUM_WARPS)
        check_warps("kernel_2.num_warps", self.num_warps, lim)
        check_int("kernel_2.num_stages", self.num_stages, 1, 4)
        if not isinstance(self.pdl, bool):
            raise ConfigError(f"kernel_2.pdl={self.pdl!r} must be true or false")
        if not isinstance(self.fused, bool):
            raise ConfigError(f"kernel_2.fused={self.fused!r} must be true or false")
        if self.fused and self.pdl:
            raise ConfigError("kernel_2.fused=true has no second launch to overlap: use pdl=false")
        tile = self.block_m * self.block_n
        if not self.fused:  # fused, the reduction runs on kernel_1's warps (checked by the strategy)
            self.check_tile(self.num_warps, "kernel_2.num_warps", lim)
        if (self.num_stages - 1) * tile * 4 * 2 > lim.shared_per_block:
            raise ConfigError(f"kernel_2.num_stages={self.num_stages} stages too many {self.block_m}x{self.block_n} "
                              "tiles in shared memory: use fewer stages or a smaller tile")


# The kernel_1 strategies by name (`strategies/`): filled by `strategies/__init__.py`, read by `BackwardConfig`.
STRATEGIES: dict[str, Any] = {}


def _default_kernel_1() -> Kernel1Config:
    return STRATEGIES[DEFAULT_STRATEGY].make()


@dataclass(frozen=True)
class BackwardConfig:
    """Both kernels' knobs, tuned jointly. Hashable, printable, and round-trips through canonical JSON (the
    form the tables and the store hold: kernel_1's knobs in the flat layout of `kernel_1_layout`)."""

    kernel_1: Kernel1Config = field(default_factory=_default_kernel_1)
    kernel_2: Kernel2Config = field(default_factory=Kernel2Config)

    @property
    def strategy(self):
        """The kernel_1 strategy object (`strategies/`) of this config."""
        return STRATEGIES[self.kernel_1.strategy]

    def validate(self, problem: Problem, limits: DeviceLimits | None = None) -> "BackwardConfig":
        """Raise `ConfigError` naming the field if this config cannot run `problem` (on the device of `limits`;
        without, the reference device); return self otherwise."""
        k1 = self.kernel_1
        if not isinstance(k1, Kernel1Config) or not isinstance(self.kernel_2, Kernel2Config):
            raise ConfigError("BackwardConfig needs a strategy's kernel_1 config and a Kernel2Config")
        k1.check_fields(limits)
        check_choice("kernel_1.strategy", k1.strategy, tuple(STRATEGIES))
        strategy = STRATEGIES[k1.strategy]
        if type(k1) is not strategy.config_type:
            raise ConfigError(f"kernel_1 of strategy={k1.strategy!r} is a {strategy.config_type.__name__}, got a "
                              f"{type(k1).__name__}: build it with the strategy's make()")
        strategy.validate_extra(k1)
        strategy.validate(self, problem, limits or REFERENCE)
        return self

    def is_valid(self, problem: Problem, limits: DeviceLimits | None = None) -> bool:
        try:
            self.validate(problem, limits)
        except ConfigError:
            return False
        return True

    def to_dict(self) -> dict[str, Any]:
        """The canonical layout as a mapping: kernel_1's every knob of `kernel_1_layout` (and its strategy's own
        `extra` knobs), those its strategy lacks at their default."""
        k1 = self.kernel_1
        return {"kernel_1": {name: getattr(k1, name) if own else default for name, own, default, _ in _wire(type(k1))},
                "kernel_2": dataclasses.asdict(self.kernel_2)}

    def to_json(self) -> str:
        """Canonical compact JSON (sorted keys), the same bytes as json.dumps(sort_keys=True, separators=(",",
        ":")) of `to_dict`. Written out by hand because torch.compile traces this (explicit `config=` in a
        compiled model) and cannot trace the json module."""
        k1, k2 = self.kernel_1, self.kernel_2
        one = ",".join(f'"{name}":{_json_scalar(getattr(k1, name)) if own else text}'
                       for name, own, _, text in _wire(type(k1)))
        two = ",".join(f'"{name}":{_json_scalar(getattr(k2, name))}' for name in _K2_NAMES)
        return f'{{"kernel_1":{{{one}}},"kernel_2":{{{two}}}}}'

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "BackwardConfig":
        if not isinstance(data, Mapping) or set(data) - {"kernel_1", "kernel_2"}:
            raise ConfigError(f"a backward config is an object with keys kernel_1 and kernel_2, got {data!r}")
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
    they name (`strategy`, default rows), every knob it lacks at its layout default. A non-default value for a
    knob the strategy lacks, or a name no strategy has, raises `ConfigError` naming it."""
    if fields is not None and not isinstance(fields, Mapping):
        raise ConfigError(f"Kernel1Config expects a JSON object, got {type(fields).__name__}")
    data = {**(fields or {}), **kwargs}
    name = data.get("strategy", DEFAULT_STRATEGY)
    check_choice("kernel_1.strategy", name, tuple(STRATEGIES))
    strategy = STRATEGIES[name]
    layout = kernel_1_layout()
    own = {f.name for f in dataclasses.fields(strategy.config_type)}
    unknown = sorted(set(data) - own - set(layout))
    if unknown:
        allowed = sorted(set(layout) | own)
        raise ConfigError(f"unknown Kernel1Config field(s) {', '.join(unknown)} (allowed: {', '.join(allowed)})")
    for key, value in data.items():
        if key != "strategy" and key not in own and not _same(value, layout[key]):
            raise ConfigError(strategy.inapplicable(key, value))
    return strategy.make(**{k: v for k, v in data.items() if k in own})


def kernel_1_layout() -> dict[str, Any]:
    """The kernel_1 knobs of the canonical layout and their defaults, in declaration order: the shared fields,
    each registered strategy's own (its `extra` knobs aside: those appear in its own configs' JSON only), and
    the strategy. The store's knob columns are generated from it."""
    out: dict[str, Any] = {}
    for strategy in STRATEGIES.values():
        extra = {knob.name for knob in strategy.extra}
        for f in dataclasses.fields(strategy.config_type):
            if f.name not in extra:
                if out.setdefault(f.name, f.default) != f.default:
                    raise AssertionError(f"kernel_1.{f.name} has two defaults: {out[f.name]!r} and {f.default!r}")
    out["strategy"] = DEFAULT_STRATEGY
    return out


# Config type -> ((name, held by the type, default, default as JSON), ...) in canonical (sorted) order.
_WIRE: dict[type, tuple] = {}


def _wire(cls: type) -> tuple:
    hit = _WIRE.get(cls)
    if hit is None:
        own = {f.name: f.default for f in dataclasses.fields(cls)}
        names = {**kernel_1_layout(), **own}
        hit = tuple((name, name in own or name == "strategy", names[name], _json_scalar(names[name]))
                    for name in sorted(names))
        _WIRE[cls] = hit
    return hit


def _same(value: Any, default: Any) -> bool:
    return type(value) is type(default) and value == default


def check_warps(name: str, num_warps: int, limits: DeviceLimits) -> None:
    if num_warps > limits.max_warps:
        raise ConfigError(f"{name}={num_warps} is more than the {limits.max_warps} warps of {limits.warp_size} "
                          f"threads a program may have on {limits.name}: use num_warps <= {limits.max_warps}")


def _json_scalar(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(v)


def mapping_to_json(data: Mapping[str, Any]) -> str:
    """JSON text of a {"kernel_1": {...}, "kernel_2": {...}} mapping of scalars, without the json module (see
    `BackwardConfig.to_json`); keys it does not know are kept, for from_json to reject with its message."""
    def obj(d) -> str:
        if not isinstance(d, Mapping):
            return _json_scalar(d)
        return "{" + ",".join(f'"{k}":{obj(d[k])}' for k in sorted(d)) + "}"

    return obj(data)


_K2_NAMES = tuple(sorted(f.name for f in dataclasses.fields(Kernel2Config)))
