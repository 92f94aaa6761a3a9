"""Launch configuration values: how the backward is launched (`BackwardConfig` of a `Kernel1Config` and a
`Kernel2Config`) for a `Problem` (defined in `problem.py`, re-exported here with its names and checks).

These frozen dataclasses are the single definition shared by the runtime (`kernels/`), the tuner (`tuner/`) and
the emitted heuristic tables (`configs/*.json`): a config is hashable, printable, and round-trips through JSON.

`validate(problem)` rejects combinations the kernels cannot run (or cannot run sensibly) *before* anything is
compiled, with a message naming the field and the values it could take.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from .heuristics import (
    estimate_registers,
    next_power_of_two,
    register_budget,
    row_block_col,
    slice_width,
    staged_shared_bytes,
)
from .limits import REFERENCE, DeviceLimits
from .problem import (  # noqa: F401 - the problem's names are re-exported: `from .config import Problem` works
    DTYPES,
    ITEMSIZE,
    MAX_N,
    NORMS,
    RECOVER_LIMITS,
    SAVE_MODES,
    ConfigError,
    Problem,
    ProblemFamily,
    _check_choice,
    _check_int,
    _from_mapping,
    canonical_dtype,
    is_power_of_two,
)

# Allowed values of the launch knobs (the tuner's space draws from these, and `validate` checks against them).
NUM_WARPS = (1, 2, 4, 8, 16, 32)
EVICTION_POLICIES = ("", "evict_first", "evict_last")
# kernel_1 strategies: "rows" (persistent programs over row tiles, each writing a partial dw/db row that
# kernel_2 reduces) and "columns" (few rows: one program per column slice sweeps every row and writes the final
# dw/db, after a small kernel has computed each row's two sums; no partials, no kernel_2), and "dual" (few rows,
# one launch: row programs write grad_input, column programs the final dw/db; no partials, no kernel_2).
STRATEGIES = ("rows", "columns", "dual")
ROW_SPLITS = (1, 2, 3, 4, 5, 6, 7, 8)
MAX_BLOCK_ROW = 64
MAX_BLOCK_COL = 65536
MAX_TILE = 65536  # elements per register tile (block_row x block_col)
MAX_NUM_STAGES = 6
MAX_PROGRAMS_PER_SM = 32


@dataclass(frozen=True)
class Kernel1Config:
    """Launch knobs of kernel_1 (grad_input and per-program partial grad_weight/grad_bias).

    block_row x block_col is the register tile. Single pass (two_pass=False) holds whole rows (block_col >= N)
    and grid-strides over row tiles; two-pass walks each row tile in column chunks of block_col twice: pass 1
    reduces the row terms, pass 2 re-reads (from L2 when the tile fits) and writes grad_input and partials.
    num_stages > 1 software-pipelines the tile loop (loads issued num_stages - 1 iterations ahead).
    prefetch loads the next tile (two-pass: chunk) into registers before computing the current one. recompute
    (single pass) keeps only the raw bf16 tile live across the row reductions and widens it again after them,
    halving the registers the tile holds there, so that wide LayerNorm rows fit (no effect for fp16/fp32 data).
    round(programs_per_sm x SMs) persistent programs (a fraction such as 0.5 leaves SMs idle but halves the
    partials), never more than the row tiles. eviction_policy is the cache
    hint of the streaming loads ("" = none).

    row_split (single pass, rows strategy): each row is spread over this many programs, each holding one
    column slice (block_col covers the slice), so a wide row's tile and dw/db accumulators fit the registers.
    The programs of a row group exchange their slices' row sums through global memory and add them in slice
    order, so every program (and every rerun) gets bitwise the same row terms. Splits of 3, 5, 6 and 7 give
    rows of 3, 5 or 7 times a power of two (hidden sizes such as 5120, 12288, 14336) slices that fill their
    power-of-two tile, where a split of 2, 4 or 8 leaves a quarter or more of its lanes masked.

    column_accumulators (single pass): dw/db accumulate one fp32 value per column, each tile's rows summed into
    it as the tile is done, instead of one per tile element summed once at the end. A multi-row tile then holds
    block_row times fewer accumulator registers, so taller tiles fit: fewer row-sum exchanges per row under
    row_split, and more rows in flight per load.

    pipelined_split (row_split > 1): the exchange of row sums inside the tile loop waits through inline assembly
    instead of Triton's CTA barrier, which Triton's software pipeliner refuses: with num_stages > 1 the split
    tile loop then issues its loads num_stages - 1 tiles ahead as it does for unsplit rows (without it, a split
    row's num_stages has no effect). The same slice sums, added in the same order by every program of a group.

    strategy="columns" (few rows): one program per block_col-wide column slice sweeps all M rows, block_row at a
    time, and writes the final dw/db itself; the rows' two sums come from a small kernel run first. No partial
    buffer and no kernel_2 (kernel_2's fields are ignored). programs_per_sm, two_pass, row_split, recompute do
    not apply.

    strategy="dual" (few rows, one launch): round(programs_per_sm x SMs) programs hold whole rows as single pass
    does (block_row x block_col, block_col covering N; num_stages, prefetch, eviction_policy as there) and write
    grad_input; beside them, one program per kernel_2.block_n columns sweeps every row, kernel_2.block_m at a
    time, and writes the final dw/db. No partial buffer, no kernel_2 launch, no wait between programs. two_pass,
    row_split, recompute and column_accumulators do not apply, nor kernel_2's num_warps, num_stages, pdl, fused.
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

    def validate(self, problem: Problem, limits: DeviceLimits | None = None) -> None:
        """`limits`: the device's (registers, shared memory, warp size); the reference device's without."""
        lim = limits or REFERENCE
        _check_int("kernel_1.block_row", self.block_row, 1, MAX_BLOCK_ROW, power_of_two=True)
        _check_int("kernel_1.block_col", self.block_col, 1, MAX_BLOCK_COL, power_of_two=True)
        _check_choice("kernel_1.num_warps", self.num_warps, NUM_WARPS)
        _check_warps("kernel_1.num_warps", self.num_warps, lim)
        _check_int("kernel_1.num_stages", self.num_stages, 1, MAX_NUM_STAGES)
        pps = self.programs_per_sm
        if isinstance(pps, bool) or not isinstance(pps, (int, float)) or not 0.125 <= pps <= MAX_PROGRAMS_PER_SM:
            raise ConfigError(f"kernel_1.programs_per_sm={pps!r} is out of range: use a number from 0.125 to "
                              f"{MAX_PROGRAMS_PER_SM} (e.g. 0.5, 1, 2)")
        if not isinstance(self.two_pass, bool):
            raise ConfigError(f"kernel_1.two_pass={self.two_pass!r} must be true or false")
        _check_choice("kernel_1.eviction_policy", self.eviction_policy, EVICTION_POLICIES)
        if not isinstance(self.prefetch, bool):
            raise ConfigError(f"kernel_1.prefetch={self.prefetch!r} must be true or false")
        if not isinstance(self.recompute, bool):
            raise ConfigError(f"kernel_1.recompute={self.recompute!r} must be true or false")
        if self.recompute and self.two_pass:
            raise ConfigError("kernel_1.recompute=true applies to single pass: two_pass=true re-reads its chunks "
                              "(use recompute=false)")
        if not isinstance(self.column_accumulators, bool):
            raise ConfigError(f"kernel_1.column_accumulators={self.column_accumulators!r} must be true or false")
        if self.column_accumulators and (self.two_pass or self.strategy != "rows"):
            raise ConfigError("kernel_1.column_accumulators=true applies to the rows strategy's single pass: use "
                              "two_pass=false and strategy='rows', or column_accumulators=false")
        _check_choice("kernel_1.strategy", self.strategy, STRATEGIES)
        _check_choice("kernel_1.row_split", self.row_split, ROW_SPLITS)
        if not isinstance(self.pipelined_split, bool):
            raise ConfigError(f"kernel_1.pipelined_split={self.pipelined_split!r} must be true or false")
        if self.pipelined_split and (self.row_split == 1 or self.strategy != "rows"):
            raise ConfigError("kernel_1.pipelined_split=true pipelines the exchange of a split row: use row_split "
                              "> 1 with strategy='rows', or pipelined_split=false")
        if self.strategy == "columns":
            self._validate_columns(problem)
        elif self.strategy == "dual" and (self.two_pass or self.row_split != 1 or self.recompute):
            raise ConfigError("kernel_1.strategy='dual' holds whole rows in one pass: use two_pass=false, "
                              "row_split=1, recompute=false")
        elif self.row_split > 1:
            if self.two_pass:
                raise ConfigError("kernel_1.row_split > 1 splits a single-pass row: use two_pass=false or "
                                  "row_split=1")
            if slice_width(problem.N, self.row_split) < 256:
                raise ConfigError(f"kernel_1.row_split={self.row_split} leaves slices under 256 of N={problem.N} "
                                  "columns: use a smaller row_split")
            if self.block_col < slice_width(problem.N, self.row_split):
                raise ConfigError(
                    f"kernel_1.block_col={self.block_col} does not cover a 1/{self.row_split} slice of N="
                    f"{problem.N}: use block_col >= {row_block_col(problem.N, self.row_split)}")
        elif not self.two_pass and self.block_col < problem.N:
            raise ConfigError(
                f"kernel_1.block_col={self.block_col} < N={problem.N} in single pass: use block_col >= "
                f"{next_power_of_two(problem.N)} or two_pass=true"
            )
        if self.tile() > MAX_TILE:
            raise ConfigError(
                f"kernel_1 tile block_row x block_col = {self.tile()} exceeds {MAX_TILE} elements: shrink "
                "block_row or block_col"
            )
        threads = lim.warp_size * self.num_warps
        if self.num_warps > 1 and threads > self.tile():
            raise ConfigError(
                f"kernel_1.num_warps={self.num_warps} leaves threads idle on a {self.block_row}x{self.block_col} "
                f"tile: use num_warps <= {max(1, self.tile() // lim.warp_size)}"
            )
        regs = estimate_registers(problem, self.block_row, self.block_col, self.num_warps,
                                  self.two_pass and self.strategy == "rows", self.prefetch, self.recompute,
                                  self.column_accumulators, lim.warp_size)
        budget = register_budget(self.num_warps, lim)
        if regs > budget:
            raise ConfigError(
                f"kernel_1 register budget: a {self.block_row}x{self.block_col} tile on {self.num_warps} warps "
                f"keeps ~{regs} fp32 values per thread (budget {budget} at {self.num_warps} warps): use more warps, "
                "a smaller block_row, prefetch=false, or two_pass with a narrower block_col"
            )
        staged = staged_shared_bytes(problem, self.block_row, self.block_col, self.num_stages, self.two_pass,
                                     self.prefetch, self.num_warps)
        if staged > lim.shared_per_block:
            raise ConfigError(
                f"kernel_1.num_stages={self.num_stages} stages {staged // 1024} KB in shared memory (budget "
                f"{lim.shared_per_block // 1024} KB on {lim.name}): use fewer stages or a smaller tile"
            )


    def _validate_columns(self, problem: Problem) -> None:
        if self.two_pass or self.row_split != 1 or self.recompute:
            raise ConfigError("kernel_1.strategy='columns' sweeps rows of a column slice: use two_pass=false, "
                              "row_split=1, recompute=false")
        if self.block_col > 1024:
            raise ConfigError(f"kernel_1.block_col={self.block_col} is the column slice of strategy='columns': "
                              "use block_col <= 1024")
        if self.num_stages > 1 and self.prefetch:
            raise ConfigError("kernel_1.prefetch and num_stages > 1 both pipeline the row loop: use one")


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

    def validate(self, problem: Problem | None = None, limits: DeviceLimits | None = None) -> None:
        lim = limits or REFERENCE
        _check_int("kernel_2.block_m", self.block_m, 1, 1024, power_of_two=True)
        _check_int("kernel_2.block_n", self.block_n, 1, 4096, power_of_two=True)
        _check_choice("kernel_2.num_warps", self.num_warps, NUM_WARPS)
        _check_warps("kernel_2.num_warps", self.num_warps, lim)
        _check_int("kernel_2.num_stages", self.num_stages, 1, 4)
        if not isinstance(self.pdl, bool):
            raise ConfigError(f"kernel_2.pdl={self.pdl!r} must be true or false")
        if not isinstance(self.fused, bool):
            raise ConfigError(f"kernel_2.fused={self.fused!r} must be true or false")
        if self.fused and self.pdl:
            raise ConfigError("kernel_2.fused=true has no second launch to overlap: use pdl=false")
        tile = self.block_m * self.block_n
        if not self.fused:  # fused, the reduction runs on kernel_1's warps (checked by BackwardConfig)
            self.check_tile(self.num_warps, "kernel_2.num_warps", lim)
        if (self.num_stages - 1) * tile * 4 * 2 > lim.shared_per_block:
            raise ConfigError(f"kernel_2.num_stages={self.num_stages} stages too many {self.block_m}x{self.block_n} "
                              "tiles in shared memory: use fewer stages or a smaller tile")


@dataclass(frozen=True)
class BackwardConfig:
    """Both kernels' knobs, tuned jointly."""

    kernel_1: Kernel1Config = field(default_factory=Kernel1Config)
    kernel_2: Kernel2Config = field(default_factory=Kernel2Config)

    def validate(self, problem: Problem, limits: DeviceLimits | None = None) -> "BackwardConfig":
        """Raise `ConfigError` naming the field if this config cannot run `problem` (on the device of `limits`;
        without, the reference device); return self otherwise."""
        if not isinstance(self.kernel_1, Kernel1Config) or not isinstance(self.kernel_2, Kernel2Config):
            raise ConfigError("BackwardConfig needs a Kernel1Config and a Kernel2Config")
        self.kernel_1.validate(problem, limits)
        if self.kernel_1.strategy == "dual":  # kernel_2's tile is the column programs', on kernel_1's warps
            k2 = self.kernel_2
            if k2.pdl or k2.fused:
                raise ConfigError("kernel_1.strategy='dual' launches no kernel_2: use kernel_2.pdl=false, "
                                  "fused=false")
            _check_int("kernel_2.block_m", k2.block_m, 1, 1024, power_of_two=True)
            _check_int("kernel_2.block_n", k2.block_n, 1, 4096, power_of_two=True)
            k2.check_tile(self.kernel_1.num_warps, "kernel_1.num_warps (dual: kernel_2's tile on its warps)", limits)
            return self
        self.kernel_2.validate(problem, limits)
        if self.kernel_2.fused and self.kernel_1.strategy == "rows":
            self.kernel_2.check_tile(self.kernel_1.num_warps, "kernel_1.num_warps (fused reduction)", limits)
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

        return (f'{{"kernel_1":{obj(self.kernel_1, _K1_NAMES)},'
                f'"kernel_2":{obj(self.kernel_2, _K2_NAMES)}}}')

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "BackwardConfig":
        if not isinstance(data, Mapping) or set(data) - {"kernel_1", "kernel_2"}:
            raise ConfigError(f"a backward config is an object with keys kernel_1 and kernel_2, got {data!r}")
        return cls(_from_mapping(Kernel1Config, data.get("kernel_1", {})),
                   _from_mapping(Kernel2Config, data.get("kernel_2", {})))

    @classmethod
    def from_json(cls, text: str) -> "BackwardConfig":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ConfigError(f"config is not valid JSON ({err}): expected e.g. {cls().to_json()}") from None
        return cls.from_dict(data)

    def __str__(self) -> str:
        k1, k2 = self.kernel_1, self.kernel_2
        mode = "2pass" if k1.two_pass else "1pass"
        ev = f" {k1.eviction_policy}" if k1.eviction_policy else ""
        pf = ((" prefetch" if k1.prefetch else "") + (" recompute" if k1.recompute else "")
              + (" colacc" if k1.column_accumulators else "") + (" pipelined" if k1.pipelined_split else ""))
        if k1.strategy == "columns":
            return (f"k1[columns {k1.block_row}x{k1.block_col} w{k1.num_warps} s{k1.num_stages}{pf}{ev}] "
                    "k2[none]")
        if k1.strategy == "dual":
            return (f"k1[dual {k1.block_row}x{k1.block_col} w{k1.num_warps} s{k1.num_stages} pps{k1.programs_per_sm}"
                    f"{pf}{ev}] k2[columns {k2.block_m}x{k2.block_n}]")
        split = f" split{k1.row_split}" if k1.row_split > 1 else ""
        return (f"k1[{mode}{split} {k1.block_row}x{k1.block_col} w{k1.num_warps} s{k1.num_stages} "
                f"pps{k1.programs_per_sm}{pf}{ev}] k2[{k2.block_m}x{k2.block_n} w{k2.num_warps} s{k2.num_stages}"
                f"{' pdl' if k2.pdl else ''}{' fused' if k2.fused else ''}]")


def _check_warps(name: str, num_warps: int, limits: DeviceLimits) -> None:
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


_K1_NAMES = tuple(sorted(f.name for f in dataclasses.fields(Kernel1Config)))
_K2_NAMES = tuple(sorted(f.name for f in dataclasses.fields(Kernel2Config)))




# The analytic default lives with the rest of the launch arithmetic; re-exported here for `config` users.
from .heuristics import default_config  # noqa: E402
