"""The knob values of the two kernels: `Kernel1Config` (kernel_1's launch knobs, in the layout the tables and the
store write) and `Kernel2Config` (kernel_2, shared by every strategy), their allowed values and per-field checks.

Which kernel_1 knobs apply, and how they combine, is the strategy's business (`strategies/`): a strategy reads
the fields it uses, leaves the others at their defaults, and validates the combination. A strategy that needs a
knob of its own declares it in its module (`Strategy.extra`) on a subclass of `Kernel1Config`.

`BackwardConfig` pairs them. Its strategy is looked up by name in `STRATEGIES`, the registry that
`strategies/__init__.py` fills as it is imported (`normtune.kernels.config` imports it: use that module).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

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
BOOLEAN_KNOBS = ("two_pass", "prefetch", "recompute", "column_accumulators", "pipelined_split")


@dataclass(frozen=True)
class Kernel1Config:
    """Launch knobs of kernel_1 (grad_input, and dw/db or per-program partials of them).

    block_row x block_col is the register tile; num_warps its warps; num_stages > 1 software-pipelines the tile
    loop through shared memory; prefetch loads the next tile into registers before computing the current one;
    eviction_policy is the cache hint of the streaming loads ("" = none); programs_per_sm sizes a persistent grid
    (round(programs_per_sm x SMs) programs). `strategy` names the kernel_1 strategy (`strategies/`), whose module
    documents what the other knobs (two_pass, recompute, row_split, column_accumulators, pipelined_split) mean.
    """

    block_row: int = 1
    block_col: int = 1024
    num_warps: int = 4
    num_stages: int = 1
    programs_per_sm: float = 2
    two_pass: bool = False
    eviction_policy: str = ""
    prefetch: bool = False
    recompute: bool = False
    row_split: int = 1
    strategy: str = "rows"
    column_accumulators: bool = False
    pipelined_split: bool = False

    def __post_init__(self) -> None:
        # 2 and 2.0 are the same grid: keep one spelling so configs hash and serialize identically.
        pps = self.programs_per_sm
        if isinstance(pps, float) and pps.is_integer():
            object.__setattr__(self, "programs_per_sm", int(pps))

    def tile(self) -> int:
        return self.block_row * self.block_col

    def check_fields(self, limits: DeviceLimits | None = None) -> None:
        """Each field's type and range, whatever the strategy (`Strategy.validate` checks how they combine);
        `limits`: the device's (the reference device's without)."""
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
        for name in BOOLEAN_KNOBS:
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"kernel_1.{name}={getattr(self, name)!r} must be true or false")
        check_choice("kernel_1.row_split", self.row_split, ROW_SPLITS)


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


@dataclass(frozen=True)
class BackwardConfig:
    """Both kernels' knobs, tuned jointly. Hashable, printable, and round-trips through canonical JSON (the
    form the tables and the store hold: kernel_1's fields flat, the strategy one of them)."""

    kernel_1: Kernel1Config = field(default_factory=Kernel1Config)
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
            raise ConfigError("BackwardConfig needs a Kernel1Config and a Kernel2Config")
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
        return {"kernel_1": dataclasses.asdict(self.kernel_1), "kernel_2": dataclasses.asdict(self.kernel_2)}

    def to_json(self) -> str:
        """Canonical compact JSON (sorted keys), the same bytes as json.dumps(sort_keys=True, separators=(",",
        ":")). Written out by hand because torch.compile traces this (explicit `config=` in a compiled model)
        and cannot trace the json module."""
        def obj(value, names) -> str:
            return "{" + ",".join(f'"{n}":{_json_scalar(getattr(value, n))}' for n in names) + "}"

        names = _K1_NAMES if type(self.kernel_1) is Kernel1Config else json_names(type(self.kernel_1))
        return f'{{"kernel_1":{obj(self.kernel_1, names)},"kernel_2":{obj(self.kernel_2, _K2_NAMES)}}}'

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "BackwardConfig":
        if not isinstance(data, Mapping) or set(data) - {"kernel_1", "kernel_2"}:
            raise ConfigError(f"a backward config is an object with keys kernel_1 and kernel_2, got {data!r}")
        k1 = data.get("kernel_1", {})
        strategy = STRATEGIES.get(k1.get("strategy", "rows")) if isinstance(k1, Mapping) else None
        k1_type = strategy.config_type if strategy is not None else Kernel1Config  # validate names a bad one
        return cls(from_mapping(k1_type, k1), from_mapping(Kernel2Config, data.get("kernel_2", {})))

    @classmethod
    def from_json(cls, text: str) -> "BackwardConfig":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ConfigError(f"config is not valid JSON ({err}): expected e.g. {cls().to_json()}") from None
        return cls.from_dict(data)

    def __str__(self) -> str:
        strategy = STRATEGIES.get(self.kernel_1.strategy)
        return strategy.describe(self) if strategy is not None else repr(self)


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


def json_names(cls: type) -> tuple[str, ...]:
    """A config dataclass's field names in canonical JSON order (sorted)."""
    return tuple(sorted(f.name for f in dataclasses.fields(cls)))


_K1_NAMES = json_names(Kernel1Config)
_K2_NAMES = json_names(Kernel2Config)
