"""Configuration values: what is normalized (`Problem`) and how the backward is launched (`BackwardConfig`).

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
    SHARED_MEMORY_BUDGET,
    estimate_registers,
    next_power_of_two,
    register_budget,
    row_block_col,
    slice_width,
)

# Norm kinds and saving modes, as spelled in configs, tables and the CLI.
NORMS = ("layer_norm", "rms_norm")
SAVE_MODES = ("input", "output")
# Canonical dtype names; `canonical_dtype` maps torch dtypes and common aliases onto them.
DTYPES = ("fp32", "bf16", "fp16")
_DTYPE_ALIASES = {
    "fp32": "fp32", "float32": "fp32", "float": "fp32", "f32": "fp32", "torch.float32": "fp32",
    "bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "f16": "fp16", "torch.float16": "fp16",
}
ITEMSIZE = {"fp32": 4, "bf16": 2, "fp16": 2}
# 2^(mantissa bits − 1) per activation dtype: a saved output y = x̂·w + b determines x̂ only where
# |w|·limit > |b|; elsewhere save="output" gives NaN gradients for that column (see backward/common.py).
RECOVER_LIMITS = {"fp32": 2.0 ** 23, "bf16": 2.0 ** 7, "fp16": 2.0 ** 10}

# Widest normalized dimension supported. Wider rows always run two-pass, so the limit comes from the partial
# buffer (programs x N x 4 bytes), not from registers: 262144 columns on 132 SMs x 2 programs is ~277 MB.
MAX_N = 262144

# Allowed values of the launch knobs (the tuner's space draws from these, and `validate` checks against them).
NUM_WARPS = (1, 2, 4, 8, 16, 32)
EVICTION_POLICIES = ("", "evict_first", "evict_last")
# kernel_1 strategies: "rows" (persistent programs over row tiles, each writing a partial dw/db row that
# kernel_2 reduces) and "columns" (few rows: one program per column slice sweeps every row and writes the final
# dw/db, after a small kernel has computed each row's two sums; no partials, no kernel_2).
STRATEGIES = ("rows", "columns")
ROW_SPLITS = (1, 2, 4, 8)
MAX_BLOCK_ROW = 64
MAX_BLOCK_COL = 65536
MAX_TILE = 65536  # elements per register tile (block_row x block_col)
MAX_NUM_STAGES = 6
MAX_PROGRAMS_PER_SM = 32
def canonical_dtype(dtype: Any) -> str:
    """`torch.bfloat16`, "bfloat16", "bf16" → "bf16" (and likewise for fp32/fp16)."""
    key = str(dtype).lower()
    if key not in _DTYPE_ALIASES:
        raise TypeError(f"unsupported dtype {dtype!r}: use one of float32, bfloat16, float16 ({', '.join(DTYPES)})")
    return _DTYPE_ALIASES[key]


def is_power_of_two(n: int) -> bool:
    return isinstance(n, int) and n >= 1 and (n & (n - 1)) == 0


class ConfigError(ValueError):
    """A config or problem that cannot run; the message names the field and the allowed values."""


def _check_choice(name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ConfigError(f"{name}={value!r} is not allowed: use one of {', '.join(map(repr, allowed))}")


def _check_int(name: str, value: Any, lo: int, hi: int, power_of_two: bool = False) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"{name}={value!r} must be an integer")
    if not lo <= value <= hi:
        raise ConfigError(f"{name}={value} is out of range: use {lo} <= {name} <= {hi}")
    if power_of_two and not is_power_of_two(value):
        lower = 1 << (value.bit_length() - 1)
        raise ConfigError(f"{name}={value} must be a power of two (e.g. {lower} or {lower * 2})")


def _from_mapping(cls, data: Mapping[str, Any]):
    if not isinstance(data, Mapping):
        raise ConfigError(f"{cls.__name__} expects a JSON object, got {type(data).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"unknown {cls.__name__} field(s) {', '.join(unknown)} (allowed: {', '.join(sorted(names))})")
    return cls(**dict(data))


@dataclass(frozen=True)
class Problem:
    """What is normalized: the norm, the 2-D shape (M rows of N), dtypes and flags.

    `weight_dtype` defaults to `dtype`; fp32 weights with bf16/fp16 activations are supported.
    """

    norm: str
    M: int
    N: int
    dtype: str = "bf16"
    weight_dtype: str | None = None
    has_weight: bool = True
    has_bias: bool | None = None  # None: True for layer_norm, False for rms_norm
    zero_centered: bool = False
    save: str = "input"

    def __post_init__(self) -> None:
        _check_choice("norm", self.norm, NORMS)
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))
        wd = self.dtype if self.weight_dtype is None else canonical_dtype(self.weight_dtype)
        object.__setattr__(self, "weight_dtype", wd)
        if self.has_bias is None:
            object.__setattr__(self, "has_bias", self.norm == "layer_norm")
        _check_choice("save", self.save, SAVE_MODES)
        _check_int("M", self.M, 0, 2**62)
        if not isinstance(self.N, int) or isinstance(self.N, bool) or self.N < 1:
            raise ConfigError(f"N={self.N!r} must be a positive integer (the size of the normalized dimension)")
        if self.N > MAX_N:
            raise ConfigError(f"N={self.N} exceeds the supported maximum {MAX_N}: normalize fewer columns")
        if self.norm == "rms_norm" and self.has_bias:
            raise ConfigError("rms_norm has no bias: use has_bias=False (or norm='layer_norm')")
        if self.zero_centered and not self.has_weight:
            raise ConfigError("zero_centered=True needs a weight (w = 1 + w'): pass has_weight=True")
        if self.weight_dtype != self.dtype and self.weight_dtype != "fp32":
            raise ConfigError(
                f"weight_dtype={self.weight_dtype!r} with dtype={self.dtype!r}: the weight must be fp32 or the "
                "activation dtype"
            )

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    @property
    def family(self) -> "ProblemFamily":
        """The problem without its shape: what a heuristic table's rule set is keyed by."""
        return ProblemFamily(self.norm, self.dtype, self.weight_dtype, self.has_weight, bool(self.has_bias),
                             self.zero_centered, self.save)

    @property
    def key(self) -> str:
        return f"{self.family.key}/{self.M}x{self.N}"

    def with_shape(self, M: int, N: int) -> "Problem":
        return dataclasses.replace(self, M=M, N=N)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Problem":
        return _from_mapping(cls, data)


@dataclass(frozen=True)
class ProblemFamily:
    """A problem without M and N: norm, dtypes and flags."""

    norm: str
    dtype: str
    weight_dtype: str
    has_weight: bool
    has_bias: bool
    zero_centered: bool
    save: str

    @property
    def key(self) -> str:
        parts = [self.norm, self.dtype, f"w{self.weight_dtype}" if self.has_weight else "noweight"]
        parts.append("bias" if self.has_bias else "nobias")
        if self.zero_centered:
            parts.append("zc")
        parts.append(f"save-{self.save}")
        return "/".join(parts)

    @classmethod
    def from_key(cls, key: str) -> "ProblemFamily":
        parts = key.split("/")
        try:
            norm, dtype, w, b = parts[:4]
            rest = parts[4:]
            zc = "zc" in rest
            save = next(p for p in rest if p.startswith("save-"))[5:]
        except (ValueError, StopIteration):
            raise ConfigError(f"malformed problem family key {key!r}: expected e.g. 'rms_norm/bf16/wbf16/nobias/save-input'")
        has_weight = w != "noweight"
        fam = cls(norm, canonical_dtype(dtype), canonical_dtype(w[1:]) if has_weight else canonical_dtype(dtype),
                  has_weight, b == "bias", zc, save)
        fam.problem(1, 1)  # validates the combination
        return fam

    def problem(self, M: int, N: int) -> Problem:
        return Problem(self.norm, M, N, self.dtype, self.weight_dtype, self.has_weight, self.has_bias,
                       self.zero_centered, self.save)


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
    order, so every program (and every rerun) gets bitwise the same row terms.

    strategy="columns" (few rows): one program per block_col-wide column slice sweeps all M rows, block_row at a
    time, and writes the final dw/db itself; the rows' two sums come from a small kernel run first. No partial
    buffer and no kernel_2 (kernel_2's fields are ignored). programs_per_sm, two_pass, row_split, recompute do
    not apply.
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

    def __post_init__(self) -> None:
        # 2 and 2.0 are the same grid: keep one spelling so configs hash and serialize identically.
        pps = self.programs_per_sm
        if isinstance(pps, float) and pps.is_integer():
            object.__setattr__(self, "programs_per_sm", int(pps))

    def tile(self) -> int:
        return self.block_row * self.block_col

    def validate(self, problem: Problem) -> None:
        _check_int("kernel_1.block_row", self.block_row, 1, MAX_BLOCK_ROW, power_of_two=True)
        _check_int("kernel_1.block_col", self.block_col, 1, MAX_BLOCK_COL, power_of_two=True)
        _check_choice("kernel_1.num_warps", self.num_warps, NUM_WARPS)
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
        _check_choice("kernel_1.strategy", self.strategy, STRATEGIES)
        _check_choice("kernel_1.row_split", self.row_split, ROW_SPLITS)
        if self.strategy == "columns":
            self._validate_columns(problem)
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
        threads = 32 * self.num_warps
        if self.num_warps > 1 and threads > self.tile():
            raise ConfigError(
                f"kernel_1.num_warps={self.num_warps} leaves threads idle on a {self.block_row}x{self.block_col} "
                f"tile: use num_warps <= {max(1, self.tile() // 32)}"
            )
        regs = estimate_registers(problem, self.block_row, self.block_col, self.num_warps,
                                  self.two_pass and self.strategy == "rows", self.prefetch, self.recompute)
        budget = register_budget(self.num_warps)
        if regs > budget:
            raise ConfigError(
                f"kernel_1 register budget: a {self.block_row}x{self.block_col} tile on {self.num_warps} warps "
                f"keeps ~{regs} fp32 values per thread (budget {budget} at {self.num_warps} warps): use more warps, "
                "a smaller block_row, prefetch=false, or two_pass with a narrower block_col"
            )
        if self.num_stages > 1:
            staged = (self.num_stages - 1) * self.tile() * 2 * problem.itemsize
            if staged > SHARED_MEMORY_BUDGET:
                raise ConfigError(
                    f"kernel_1.num_stages={self.num_stages} stages {staged // 1024} KB of tiles in shared memory "
                    f"(budget {SHARED_MEMORY_BUDGET // 1024} KB): use fewer stages or a smaller tile"
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

    def check_tile(self, num_warps: int, name: str) -> None:
        """The reduction tile on `num_warps` warps: no idle threads, registers within budget."""
        tile = self.block_m * self.block_n
        threads = 32 * num_warps
        if num_warps > 1 and threads > tile:
            raise ConfigError(
                f"{name}={num_warps} leaves threads idle on a {self.block_m}x{self.block_n} kernel_2 tile: "
                f"use num_warps <= {max(1, tile // 32)} or a larger tile"
            )
        if math.ceil(tile / threads) * 2 > register_budget(num_warps) // 2:
            raise ConfigError(
                f"kernel_2 tile {self.block_m}x{self.block_n} on {num_warps} warps needs too many registers: "
                "use a smaller tile or more warps"
            )

    def validate(self, problem: Problem | None = None) -> None:
        _check_int("kernel_2.block_m", self.block_m, 1, 1024, power_of_two=True)
        _check_int("kernel_2.block_n", self.block_n, 1, 4096, power_of_two=True)
        _check_choice("kernel_2.num_warps", self.num_warps, NUM_WARPS)
        _check_int("kernel_2.num_stages", self.num_stages, 1, 4)
        if not isinstance(self.pdl, bool):
            raise ConfigError(f"kernel_2.pdl={self.pdl!r} must be true or false")
        if not isinstance(self.fused, bool):
            raise ConfigError(f"kernel_2.fused={self.fused!r} must be true or false")
        if self.fused and self.pdl:
            raise ConfigError("kernel_2.fused=true has no second launch to overlap: use pdl=false")
        tile = self.block_m * self.block_n
        if not self.fused:  # fused, the reduction runs on kernel_1's warps (checked by BackwardConfig)
            self.check_tile(self.num_warps, "kernel_2.num_warps")
        if (self.num_stages - 1) * tile * 4 * 2 > SHARED_MEMORY_BUDGET:
            raise ConfigError(f"kernel_2.num_stages={self.num_stages} stages too many {self.block_m}x{self.block_n} "
                              "tiles in shared memory: use fewer stages or a smaller tile")


@dataclass(frozen=True)
class BackwardConfig:
    """Both kernels' knobs, tuned jointly."""

    kernel_1: Kernel1Config = field(default_factory=Kernel1Config)
    kernel_2: Kernel2Config = field(default_factory=Kernel2Config)

    def validate(self, problem: Problem) -> "BackwardConfig":
        """Raise `ConfigError` naming the field if this config cannot run `problem`; return self otherwise."""
        if not isinstance(self.kernel_1, Kernel1Config) or not isinstance(self.kernel_2, Kernel2Config):
            raise ConfigError("BackwardConfig needs a Kernel1Config and a Kernel2Config")
        self.kernel_1.validate(problem)
        self.kernel_2.validate(problem)
        if self.kernel_2.fused and self.kernel_1.strategy == "rows":
            self.kernel_2.check_tile(self.kernel_1.num_warps, "kernel_1.num_warps (fused reduction)")
        return self

    def is_valid(self, problem: Problem) -> bool:
        try:
            self.validate(problem)
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
        pf = (" prefetch" if k1.prefetch else "") + (" recompute" if k1.recompute else "")
        if k1.strategy == "columns":
            return (f"k1[columns {k1.block_row}x{k1.block_col} w{k1.num_warps} s{k1.num_stages}{pf}{ev}] "
                    "k2[none]")
        split = f" split{k1.row_split}" if k1.row_split > 1 else ""
        return (f"k1[{mode}{split} {k1.block_row}x{k1.block_col} w{k1.num_warps} s{k1.num_stages} "
                f"pps{k1.programs_per_sm}{pf}{ev}] k2[{k2.block_m}x{k2.block_n} w{k2.num_warps} s{k2.num_stages}"
                f"{' pdl' if k2.pdl else ''}{' fused' if k2.fused else ''}]")


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
