"""The knob values of the two kernels: `Kernel1Config` (the kernel_1 launch knobs every strategy shares; each
strategy's config type, a frozen subclass in its module, adds its own, each declared with `knob`: its default
and its search domain) and `Kernel2Config` (kernel_2, shared by every strategy), their allowed values and
per-field checks. `strategies/` pairs them in a `BackwardConfig` and writes its canonical JSON.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping

from .heuristics import register_budget
from .limits import REFERENCE, DeviceLimits
from .problem import ConfigError, check_choice, check_int

# Allowed values of the launch knobs (the search space draws its domains from these).
NUM_WARPS = (1, 2, 4, 8, 16, 32)
EVICTION_POLICIES = ("", "evict_first", "evict_last")
MAX_BLOCK_ROW = 64
MAX_BLOCK_COL = 65536
MAX_TILE = 65536  # elements per register tile (block_row x block_col)
MAX_NUM_STAGES = 6
MAX_PROGRAMS_PER_SM = 32
# The strategy of a kernel_1 mapping that names none.
DEFAULT_STRATEGY = "rows"


@dataclass(frozen=True)
class Knob:
    """A knob of one strategy's own: its config type's field, the search domain (ordered: neighbours are one
    step apart when seeding; a config's value must be one of it), the value configs without it hold (and
    measurements older than it ran), and whether the sampler draws it right after the strategy, before the
    shared knobs (`leading`: it decides the form of the tile those size)."""

    name: str
    domain: tuple
    default: Any
    leading: bool = False

    def allows(self, value: Any) -> bool:
        return value in self.domain and isinstance(value, bool) == isinstance(self.default, bool)


def knob(default: Any, domain: tuple, *, leading: bool = False) -> Any:
    """A field of a strategy's config type that is a knob of its own: its default and its search domain (see
    `Knob`). The strategy's module is the one place it is declared."""
    return field(default=default, metadata={"domain": tuple(domain), "leading": leading})


def own_knobs(config_type: type) -> tuple[Knob, ...]:
    """The knobs a strategy's config type adds to the shared ones, in declaration order. A field declared
    without `knob` raises `ConfigError` naming it."""
    hit = _OWN.get(config_type)
    if hit is None:
        shared = {f.name for f in dataclasses.fields(Kernel1Config)}
        out = []
        for f in dataclasses.fields(config_type):
            if f.name in shared:
                continue
            if "domain" not in f.metadata:
                raise ConfigError(f"{config_type.__name__}.{f.name} has no search domain: declare it as "
                                  f"{f.name}: ... = knob(default, domain)")
            out.append(Knob(f.name, f.metadata["domain"], f.default, f.metadata["leading"]))
        hit = _OWN[config_type] = tuple(out)
    return hit


_OWN: dict[type, tuple[Knob, ...]] = {}


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


def check_warps(name: str, num_warps: int, limits: DeviceLimits) -> None:
    if num_warps > limits.max_warps:
        raise ConfigError(f"{name}={num_warps} is more than the {limits.max_warps} warps of {limits.warp_size} "
                          f"threads a program may have on {limits.name}: use num_warps <= {limits.max_warps}")


def json_scalar(v) -> str:
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
            return json_scalar(d)
        return "{" + ",".join(f'"{k}":{obj(d[k])}' for k in sorted(d)) + "}"

    return obj(data)

