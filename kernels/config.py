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

# Widest normalized dimension supported. Wider rows always run two-pass, so the limit comes from the partial
# buffer (programs x N x 4 bytes), not from registers: 262144 columns on 132 SMs x 2 programs is ~277 MB.
MAX_N = 262144

# Allowed values of the launch knobs (the tuner's space draws from these, and `validate` checks against them).
NUM_WARPS = (1, 2, 4, 8, 16, 32)
EVICTION_POLICIES = ("", "evict_first", "evict_last")
MAX_BLOCK_ROW = 64
MAX_BLOCK_COL = 65536
MAX_TILE = 65536  # elements per register tile (block_row x block_col)
MAX_NUM_STAGES = 6
MAX_PROGRAMS_PER_SM = 32
# An H100/H200 SM has 64K 32-bit registers and at most 255 per thread, so a program of W warps gets at most
# min(255, 65536 / (32 W)). The estimate below overcounts (temporaries die early), and mild spilling still runs:
# on an H200, a single-pass 1x16384 LayerNorm tile on 16 warps (estimate 160 vs 128 available) was the fastest
# config for 2048x16384, while the same tile with prefetch (estimate 192) ran 4-10x slower. So configs are pruned
# only past 1.3x the hardware limit.
REGISTER_FILE = 65536
REGISTER_BUDGET = 255
REGISTER_SLACK = 1.3


def register_budget(num_warps: int) -> int:
    return int(min(REGISTER_BUDGET, REGISTER_SLACK * REGISTER_FILE / (32 * num_warps)))
# Hopper: 227 KB of shared memory per block. Pipelined loads (num_stages > 1) stage tiles there.
SHARED_MEMORY_BUDGET = 227 * 1024


def canonical_dtype(dtype: Any) -> str:
    """`torch.bfloat16`, "bfloat16", "bf16" → "bf16" (and likewise for fp32/fp16)."""
    key = str(dtype).lower()
    if key not in _DTYPE_ALIASES:
        raise TypeError(f"unsupported dtype {dtype!r}: use one of float32, bfloat16, float16 ({', '.join(DTYPES)})")
    return _DTYPE_ALIASES[key]


def is_power_of_two(n: int) -> bool:
    return isinstance(n, int) and n >= 1 and (n & (n - 1)) == 0


def next_power_of_two(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


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


def estimate_registers(problem: Problem, block_row: int, block_col: int, num_warps: int, two_pass: bool,
                       prefetch: bool, recompute: bool = False) -> int:
    """fp32 registers per thread that kernel_1 keeps live (an estimate for pruning, not the compiler's count).

    Per tile element: the grad and saved activation in fp32 and one temporary; the dw and db accumulators (or,
    two-pass, the row-term accumulators of pass 1); the raw next tile when prefetching. Per column: w (held in
    registers unless a single-row tile reloads it per tile) and b when recovering x̂ from y.
    """
    per_thread = math.ceil(block_row * block_col / (32 * num_warps))
    # recompute: the tile is held raw (2-byte values pack two per register) rather than converted to fp32
    live = 3.0 if not recompute else 1.0 + 2 * problem.itemsize / 4
    if two_pass:
        live += 1 + (problem.norm == "layer_norm")
    else:
        live += problem.has_weight + bool(problem.has_bias)
    if prefetch:
        live += 2 * problem.itemsize / 4
    per_column = (problem.save == "output" and bool(problem.has_bias)) + (block_row > 1 and not two_pass)
    return math.ceil(per_thread * live + per_thread / block_row * per_column)


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
    """

    block_row: int = 1
    block_col: int = 1024
    num_warps: int = 4
    num_stages: int = 1
    programs_per_sm: int = 2
    two_pass: bool = False
    eviction_policy: str = ""
    prefetch: bool = False
    recompute: bool = False

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
        if not self.two_pass and self.block_col < problem.N:
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
        regs = estimate_registers(problem, self.block_row, self.block_col, self.num_warps, self.two_pass,
                                  self.prefetch, self.recompute)
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


@dataclass(frozen=True)
class Kernel2Config:
    """Launch knobs of kernel_2: a block_m x block_n tile sweeps the (programs x N) fp32 partials, cdiv(N,
    block_n) programs; num_stages > 1 pipelines the sweep's loads. pdl launches kernel_2 with Programmatic
    Dependent Launch (Hopper and newer; ignored elsewhere), hiding the launch gap after kernel_1."""

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 1
    pdl: bool = False

    def validate(self, problem: Problem | None = None) -> None:
        _check_int("kernel_2.block_m", self.block_m, 1, 1024, power_of_two=True)
        _check_int("kernel_2.block_n", self.block_n, 1, 4096, power_of_two=True)
        _check_choice("kernel_2.num_warps", self.num_warps, NUM_WARPS)
        _check_int("kernel_2.num_stages", self.num_stages, 1, 4)
        if not isinstance(self.pdl, bool):
            raise ConfigError(f"kernel_2.pdl={self.pdl!r} must be true or false")
        tile = self.block_m * self.block_n
        threads = 32 * self.num_warps
        if self.num_warps > 1 and threads > tile:
            raise ConfigError(
                f"kernel_2.num_warps={self.num_warps} leaves threads idle on a {self.block_m}x{self.block_n} tile: "
                f"use num_warps <= {max(1, tile // 32)}"
            )
        if math.ceil(tile / threads) * 2 > register_budget(self.num_warps) // 2:
            raise ConfigError(
                f"kernel_2 tile {self.block_m}x{self.block_n} on {self.num_warps} warps needs too many registers: "
                "use a smaller tile or more warps"
            )
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
        return (f"k1[{mode} {k1.block_row}x{k1.block_col} w{k1.num_warps} s{k1.num_stages} "
                f"pps{k1.programs_per_sm}{pf}{ev}] k2[{k2.block_m}x{k2.block_n} w{k2.num_warps} s{k2.num_stages}"
                f"{' pdl' if k2.pdl else ''}]")


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


def default_config(problem: Problem) -> BackwardConfig:
    """Analytic launch rules, used when no tuned table covers the problem. Every rule is about keeping a
    streaming kernel's loads in flight without spilling registers (figures: H200, bf16, docs/perf-notes.md):

    - Single pass while a whole row fits the register tile: next_pow2(N) <= 16384. At 2048x16384 a one-row
      single-pass tile on 16 warps beat every two-pass config (LayerNorm 102 vs 108-120 µs kernel_1), since it
      reads each element once. Wider rows run two-pass on 4096-column chunks, 8 warps.
    - block_row fills the tile up to ~8192 elements (N=1024 → 8 rows), so a short row still issues wide loads.
    - num_warps: 8 for rows up to 2048 columns (with prefetch, halving the warps of a 16-warp 8x1024 tile was
      0-30% faster), 16 from 4096 columns.
    - prefetch (load tile i+1 before computing tile i) whenever its registers fit the hardware budget: the
      largest single win measured, kernel_1 0.78x median over the 30 seed cases. Where it does not fit (one-row
      tiles of 16384 columns), bf16 keeps the raw tile across the reductions instead (recompute).
    - evict_first on the streaming loads (0-3% better), programs_per_sm=1: a second program per SM doubled
      kernel_2's partials for no kernel_1 gain once prefetch keeps loads in flight.
    - kernel_2: many programs of narrow columns and tall tiles (it is latency-bound: a 32x128 tile took
      7-42 µs because N=1024 gave 8 programs that each looped over the partials): 128x16. PDL off: on an H100 it changed
      nothing measurable (total x1.002 median over the 30 seed cases).
    """
    n_pow2 = next_power_of_two(problem.N)
    two_pass = n_pow2 > 16384
    block_col = 4096 if two_pass else n_pow2
    block_row = 1 if two_pass else max(1, min(16, 8192 // block_col))
    tile = block_row * block_col
    # 16 warps once a row is >= 4096 columns (H100 and H200 sweeps: every tuned seed config at N >= 4096 ran 16
    # warps or smem pipelining; 8 warps cost LayerNorm 4096x8192 96.6 vs 82.0 µs on the H100).
    num_warps = 8 if two_pass else (16 if block_col >= 4096 else max(4, min(8, tile // 1024)))
    while num_warps > 1 and 4 * 32 * num_warps > tile:  # tiny rows: keep >= 4 elements per thread
        num_warps //= 2
    hardware = min(REGISTER_BUDGET, REGISTER_FILE // (32 * num_warps))
    prefetch = estimate_registers(problem, block_row, block_col, num_warps, two_pass, True) <= hardware
    # Where prefetch does not fit (one-row tiles of 16384), bf16 LayerNorm rows with a bias (two accumulators)
    # keep their raw tile across the reductions instead of fp32 copies (recompute: 2048x16384 167 -> 126 µs on
    # the H100). RMSNorm fits without it and runs slower with it (2048x16384: 87.2 vs 84.5 µs H100, 74.3 vs
    # 68.1 µs H200).
    recompute = (not two_pass and not prefetch and problem.dtype == "bf16" and block_row == 1
                 and bool(problem.has_bias))
    k1 = Kernel1Config(block_row=block_row, block_col=block_col, num_warps=num_warps, num_stages=1,
                       programs_per_sm=1, two_pass=two_pass, eviction_policy="evict_first", prefetch=prefetch,
                       recompute=recompute)
    block_n = min(16, n_pow2)  # 128x16 tiles: kernel_2 x0.83 vs wider tiles, median over the 30 seed cases (H100)
    block_m = 128
    k2_warps = max(1, min(4, (block_m * block_n) // 32))
    k2 = Kernel2Config(block_m=block_m, block_n=block_n, num_warps=k2_warps)
    # Where the register estimate rejects the plain tile (e.g. LayerNorm recovering x̂ from y with a bias at
    # N=16384 also holds the bias row), keep the raw tile instead (recompute), then more warps, then two-pass.
    candidates = [k1, dataclasses.replace(k1, recompute=problem.dtype == "bf16"),
                  dataclasses.replace(k1, recompute=problem.dtype == "bf16", num_warps=min(32, 2 * num_warps)),
                  Kernel1Config(block_row=1, block_col=min(4096, block_col), num_warps=8, programs_per_sm=1,
                                two_pass=True, eviction_policy="evict_first", prefetch=True)]
    for cand in candidates:
        cfg = BackwardConfig(cand, k2)
        if cfg.is_valid(problem):
            return cfg
    return BackwardConfig(candidates[-1], k2).validate(problem)
