"""Launch arithmetic, free of Triton: register and shared-memory limits, the persistent grid, warp rules and the
analytic default config. The runtime, the tuner's search space and the no-GPU report all read these from here.

Figures in comments are from the H100/H200 sweeps (bf16, cold L2; docs/perf-notes.md).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from .limits import REFERENCE, DeviceLimits
from .problem import ITEMSIZE

if TYPE_CHECKING:  # the value types import this module for their limits; defaults import them lazily
    from .config import BackwardConfig, Problem

# An H100/H200 SM has 64K 32-bit registers and at most 255 per thread, so a program of W warps gets at most
# min(255, 65536 / (32 W)). The estimate below overcounts (temporaries die early), and mild spilling still runs:
# on an H200, a single-pass 1x16384 LayerNorm tile on 16 warps (estimate 160 vs 128 available) was the fastest
# config for 2048x16384, while the same tile with prefetch (estimate 192) ran 4-10x slower. So configs are pruned
# only past 1.3x the hardware limit, on every warp count (up to 8 warps the 255 cap used to leave no slack; the one
# shipped config this admits is the H100 LayerNorm N = 32768 kernel_2, a 128x16 tile on one warp, within 1 % of
# the best 4-warp kernel_2 there). docs/experiments/data/register_spills_h100.jsonl has the
# compiler's counts next to the estimate for wide tiles: the estimate still prunes some configs that run well
# (H100 RMSNorm 4096x32768, split 4, 4x8192 on 16 warps with prefetch: estimate 224, 138 values spilled, 329 µs
# against 349 without prefetch).
# These figures are the reference device's (`limits.REFERENCE`); every function below that depends on the GPU takes
# a `limits` (`limits.DeviceLimits`, read from the device) and uses the reference's only without one.
REGISTER_FILE = REFERENCE.registers_per_sm
REGISTER_BUDGET = REFERENCE.max_registers_per_thread
REGISTER_SLACK = 1.3
# Hopper: 227 KB of shared memory per block. Pipelined loads (num_stages > 1) stage tiles there.
SHARED_MEMORY_BUDGET = REFERENCE.shared_per_block
# Widest row one program holds in single pass: a 1x16384 tile on 16 warps fills an SM's registers. Wider rows
# run two-pass, or split over several programs (row_split).
MAX_SINGLE_PASS = 16384
# Fewer elements than this per thread leave warps idle on short tiles (and buy nothing on a streaming kernel).
MIN_ELEMENTS_PER_THREAD = 4
# The few-rows (columns) strategy sweeps all rows of a column slice in one program: worth it only while rows are
# few (M of the order of the SM count); the search space offers it up to this many rows.
MAX_COLUMNS_ROWS = 2048
# From this many rows the default gives 16-bit rows of 8193-16384 columns the shipped tables' form there (RMSNorm:
# prefetch with recompute; LayerNorm: the row split in 4): measured from 512 rows up (`default_config`).
WIDE_DEFAULT_MIN_ROWS = 512
# fp32 rows of 8193-16384 columns, from WIDE_DEFAULT_MIN_ROWS rows, split in slices of at most this many columns:
# a 2 x 4096 fp32 tile holds the bytes of the 16-bit rule's 4 x 4096 (`default_config`).
WIDE_FP32_SLICE = 4096
# Strategies whose column programs sweep every row of their slice: offered up to MAX_COLUMNS_ROWS, time grows with M.
ROW_SWEEPING = ("columns", "dual")
# Grids whose programs wait for each other (row_split, the fused reduction) hold at most this many programs per
# SM, and never more than the compiled kernel's occupancy: every program must be resident at once.
MAX_PROGRAMS_PER_SM_SYNC = 4
# Hopper: 228 KB of shared memory per SM, 1 KB of it reserved per resident block.
SHARED_MEMORY_PER_SM = REFERENCE.shared_per_sm
# Split-row slices start on multiples of this many elements (16-byte aligned for 2-byte data: wide loads).
SLICE_ALIGN = 16
# Widest slice the analytic default gives a program of a split row (rows wider than MAX_SINGLE_PASS).
SPLIT_SLICE = 8192


def staged_shared_bytes(problem: "Problem", block_row: int, block_col: int, num_stages: int, two_pass: bool,
                        prefetch: bool, num_warps: int) -> int:
    """Shared memory kernel_1's pipelined tile loop asks for at num_stages. Single pass stages the grad and saved
    tiles. Two-pass also stages, per column chunk, the weight (and the bias when x̂ is recovered from the output)
    and the fp32 partial dw/db rows its second pass reads back (with prefetch, only those), plus in 16-bit the
    warps' reduction scratch. For two-pass this is what Triton 3.6 compiles for sm_90: exact on 246 of 254 compiled
    configs, never under, up to 16 KB over (docs/perf-notes.md)."""
    if num_stages <= 1:
        return 0
    tiles = 2 * block_row * block_col * problem.itemsize
    if not two_pass:
        return (num_stages - 1) * tiles
    weight = problem.has_weight * (ITEMSIZE[problem.weight_dtype] + 4)
    bias = bool(problem.has_bias) * (4 + (problem.save == "output") * ITEMSIZE[problem.weight_dtype])
    per_stage = (0 if prefetch else tiles) + block_col * (weight + bias)
    scratch = 1024 * num_warps if problem.itemsize < 4 else 0  # fp32 tiles reuse a stage's buffer for it
    return (num_stages - 1) * per_stage + scratch


def register_budget(num_warps: int, limits: DeviceLimits | None = None) -> int:
    """Registers per thread a config may keep live on `num_warps` warps (with the slack above)."""
    return int(REGISTER_SLACK * hardware_registers(num_warps, limits))


def hardware_registers(num_warps: int, limits: DeviceLimits | None = None) -> int:
    """Registers per thread the hardware gives a program of `num_warps` warps (no slack)."""
    lim = limits or REFERENCE
    return min(lim.max_registers_per_thread, lim.registers_per_sm // (lim.warp_size * num_warps))


def occupancy(regs_per_thread: int, shared_bytes: int, num_warps: int, shared_per_sm: int | None = None,
              limits: DeviceLimits | None = None) -> int:
    """Programs of a compiled kernel one SM holds at once: registers (allocated 256 per warp at a time),
    threads, shared memory, and the blocks-per-SM limit."""
    lim = limits or REFERENCE
    regs_per_warp = cdiv(regs_per_thread * lim.warp_size, 256) * 256
    by_regs = lim.registers_per_sm // max(1, regs_per_warp * num_warps)
    by_threads = lim.max_threads_per_sm // (lim.warp_size * num_warps)
    shared_sm = shared_per_sm or lim.shared_per_sm
    by_shared = shared_sm // (shared_bytes + 1024) if shared_bytes else lim.max_blocks_per_sm
    return max(0, min(lim.max_blocks_per_sm, by_regs, by_threads, by_shared))


def max_warps(tile: int, limits: DeviceLimits | None = None) -> int:
    """Most warps (at most the device's per program) that still give every thread MIN_ELEMENTS_PER_THREAD
    elements of a `tile`-element tile."""
    lim = limits or REFERENCE
    warps = lim.max_warps
    while warps > 1 and MIN_ELEMENTS_PER_THREAD * lim.warp_size * warps > tile:
        warps //= 2
    return warps


def next_power_of_two(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def needs_int64(M: int, N: int, *strides: int) -> bool:
    """Whether offsets into M rows of N columns (at these row strides, if given) can pass 32 bits."""
    return M * max((*strides, N)) >= 2**31


def alignment_hint(*values: int) -> int:
    """The multiple that the kernels may assume of a row width and row strides (`assume_multiple`): the largest
    power of two up to 8 dividing them all, or 1 where they are all multiples of 16 (Triton specializes those
    itself) or share no factor of 2. bf16 rows of 3000 columns: 8, so their loads are 16-byte vectors."""
    bits = 0
    for v in values:  # the lowest set bit of their OR is the largest power of two dividing them all
        bits |= v
    low = bits & -bits
    return 1 if low == 0 or low >= 16 else low


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def slice_width(N: int, row_split: int) -> int:
    """Columns each of the `row_split` programs of a row owns (the last slice may be shorter)."""
    if row_split <= 1:
        return N
    return cdiv(cdiv(N, row_split), SLICE_ALIGN) * SLICE_ALIGN


def row_block_col(N: int, row_split: int = 1) -> int:
    """The single-pass tile width: the power of two covering a row (or a row's slice)."""
    return next_power_of_two(slice_width(N, row_split))


def estimate_registers(problem: "Problem", block_row: int, block_col: int, num_warps: int, two_pass: bool,
                       prefetch: bool, recompute: bool = False, column_accumulators: bool = False,
                       warp_size: int = 32) -> int:
    """fp32 registers per thread that kernel_1 keeps live (an estimate for pruning, not the compiler's count).

    Per tile element: the grad and saved activation in fp32 and one temporary; the dw and db accumulators (or,
    two-pass, the row-term accumulators of pass 1); the raw next tile when prefetching. Per column: w (held in
    registers unless a single-row tile reloads it per tile), b when recovering x̂ from y, and the dw and db
    accumulators instead when they are kept per column.
    """
    per_thread = math.ceil(block_row * block_col / (warp_size * num_warps))
    # recompute: the tile is held raw (2-byte values pack two per register) rather than converted to fp32
    live = 3.0 if not recompute else 1.0 + 2 * problem.itemsize / 4
    accumulators = problem.has_weight + bool(problem.has_bias)
    if two_pass:
        live += 1 + (problem.norm == "layer_norm")
    elif not column_accumulators:
        live += accumulators
    if prefetch:
        live += 2 * problem.itemsize / 4
    per_column = (problem.save == "output" and bool(problem.has_bias)) + (block_row > 1 and not two_pass)
    if column_accumulators and not two_pass:
        per_column += accumulators
    return math.ceil(per_thread * live + per_thread / block_row * per_column)


def row_tiles(M: int, block_row: int) -> int:
    return cdiv(M, block_row)


def num_groups(M: int, config: "BackwardConfig", sms: int) -> int:
    """Persistent row groups of kernel_1's row strategy: round(programs_per_sm x SMs / row_split), never more
    than the row tiles, at least 1. Each group is `row_split` programs sharing its rows (one column slice each);
    a fraction of programs_per_sm (e.g. 0.5) leaves SMs idle but halves the partials kernel_2 must read."""
    k1 = config.kernel_1
    return max(1, min(round(k1.programs_per_sm * sms / k1.row_split), row_tiles(M, k1.block_row)))


def num_programs(M: int, N: int, config: "BackwardConfig", sms: int) -> int:
    """Programs kernel_1 launches (0 rows: none). Row strategy: groups x row_split; columns strategy: one
    program per block_col-wide column slice, each sweeping every row; dual: the row programs (one group each)
    and, for a problem with a weight or bias, one program per kernel_2.block_n columns."""
    if M <= 0:
        return 0
    k1 = config.kernel_1
    if k1.strategy == "columns":
        return cdiv(N, k1.block_col)
    if k1.strategy == "dual":
        return num_groups(M, config, sms) + cdiv(N, config.kernel_2.block_n)
    return num_groups(M, config, sms) * k1.row_split


def partial_rows(M: int, config: "BackwardConfig", sms: int) -> int:
    """Rows of the fp32 partial dw/db buffers kernel_1 writes (one per row group; none for columns or dual)."""
    if M <= 0 or config.kernel_1.strategy in ROW_SWEEPING:
        return 0
    return num_groups(M, config, sms)


def wide_fp32_rows(problem: "Problem") -> bool:
    """fp32 rows of 8193-16384 columns, enough of them to measure: the analytic default splits them, and an fp32
    problem takes that default rather than a bf16 rule carried over (`adapt.carried_over`)."""
    return next_power_of_two(problem.N) == MAX_SINGLE_PASS and problem.itemsize == 4 and \
        problem.M >= WIDE_DEFAULT_MIN_ROWS


def default_config(problem: "Problem", limits: DeviceLimits | None = None) -> "BackwardConfig":
    """Analytic launch rules, used when no tuned table covers the problem. Every rule is about keeping a
    streaming kernel's loads in flight without spilling registers (figures: H200, bf16, docs/perf-notes.md):

    - Single pass while a whole row fits the register tile: next_pow2(N) <= 16384. At 2048x16384 a one-row
      single-pass tile on 16 warps beat every two-pass config (LayerNorm 102 vs 108-120 µs kernel_1), since it
      reads each element once. Wider rows: the columns strategy up to MAX_COLUMNS_ROWS rows, then rows split
      over programs in 8192-column slices; where neither fits, two-pass on 4096-column chunks, 8 warps.
    - 16-bit rows of 8193-16384 columns, from WIDE_DEFAULT_MIN_ROWS rows, take the shipped tables' form there
      (docs/experiments/wide_default.py, H100 and H200): RMSNorm prefetch with recompute (1.05-1.26x faster than
      the plain whole-row tile), LayerNorm the row split in 4 slices of 4-row tiles, one program per SM, the
      pipelined exchange (1.17-1.50x faster: its two fp32 accumulators per column no longer fill the registers).
    - fp32 rows of 8193-16384 columns, from WIDE_DEFAULT_MIN_ROWS rows, split in the fewest slices whose tile is at
      most WIDE_FP32_SLICE columns (3 up to 12288, else 4), on 2-row tiles with prefetch and dw/db per column: the
      best config of 7 of the 8 unseeded fp32 validation sweeps at 1024 and 2048 x 16384 (both norms, H100 and
      H200, runs 250-254: 1.08-1.15x faster than what the runtime then ran); on 12 shapes of 512-8192 rows (H200,
      docs/experiments/fp32_wide_rows.py) 1.04-1.09x faster than the whole-row tile RMSNorm ran and 1.01-1.24x
      than the bf16 rules LayerNorm carried (within the spread at 512 and 1024 x 16384). Under 512 rows it won on
      some shapes and lost on others (0.95-1.13x).
    - block_row fills the tile up to ~8192 elements (N=1024 → 8 rows), so a short row still issues wide loads.
    - num_warps: 8 for rows up to 2048 columns (with prefetch, halving the warps of a 16-warp 8x1024 tile was
      0-30% faster), 16 from 4096 columns.
    - prefetch (load tile i+1 before computing tile i) whenever its registers fit the hardware budget: the
      largest single win measured, kernel_1 0.78x median over the 30 seed cases. Where it does not fit (one-row
      tiles of 16384 columns), 16-bit rows keep the raw tile across the reductions instead (recompute).
    - evict_first on the streaming loads (0-3% better), programs_per_sm=1: a second program per SM doubled
      kernel_2's partials for no kernel_1 gain once prefetch keeps loads in flight.
    - kernel_2: many programs of narrow columns and tall tiles (it is latency-bound: a 32x128 tile took
      7-42 µs because N=1024 gave 8 programs that each looped over the partials): 128x16. PDL off: on an H100
      it changed nothing measurable (total x1.002 median over the 30 seed cases).

    `limits` (the device's, `limits.DeviceLimits`; the reference H100's without) bound the registers, shared
    memory and warps of every candidate, and the config returned asks for no feature the device lacks
    (`capabilities.portable`): each rule's candidate is taken in its portable form if that is valid there.
    """
    from .capabilities import portable
    from .config import ROW_SPLITS, BackwardConfig, Kernel1Config, Kernel2Config

    lim = limits or REFERENCE

    def fit(cfg: "BackwardConfig") -> "BackwardConfig | None":
        cfg = portable(cfg, lim)
        return cfg if cfg.is_valid(problem, lim) else None

    n_pow2 = next_power_of_two(problem.N)
    two_pass = n_pow2 > MAX_SINGLE_PASS
    if two_pass and 0 < problem.M <= MAX_COLUMNS_ROWS:
        # Rows too wide for one pass, few enough to sweep: the columns strategy (no partials, no kernel_2).
        # H100, RMSNorm bf16, against the two-pass default: 2048x32768 250 vs 368 µs, 512x32768 72.6 vs 97.6,
        # 128x65536 45.1 vs 67.6, 64x65536 32.4 vs 39.6 (held-out validation, docs/validate/h100).
        many = problem.M >= 256
        columns = BackwardConfig(
            Kernel1Config(block_row=16 if many else 32, block_col=128 if many else 32, num_warps=16 if many else 1,
                          num_stages=1, programs_per_sm=1, two_pass=False, eviction_policy="", prefetch=True,
                          strategy="columns"),
            Kernel2Config(block_m=128, block_n=16, num_warps=4))
        if fit(columns):
            return fit(columns)
    split = next((s for s in (2, 4, 8) if slice_width(problem.N, s) <= SPLIT_SLICE), 0) if two_pass else 0
    if split and problem.M > MAX_COLUMNS_ROWS and problem.itemsize == 2:
        # Many 16-bit rows too wide for one pass: single pass over 8192-column slices keeping the raw tile, with
        # dw/db per column so that 2-4-row tiles fit. H100, 4096x32768 (docs/experiments/data/wide_rows_h100.jsonl):
        # LayerNorm 2x8192 tiles 365 µs, RMSNorm 4x8192 361 µs, against 1130 and 724 µs two-pass.
        split_k1 = Kernel1Config(block_row=2 if problem.has_bias else 4, block_col=row_block_col(problem.N, split),
                                 num_warps=16, programs_per_sm=1, eviction_policy="evict_first", recompute=True,
                                 row_split=split, column_accumulators=True)
        for k1 in (split_k1, dataclasses.replace(split_k1, block_row=1)):
            split_cfg = BackwardConfig(k1, Kernel2Config(block_m=128, block_n=16, num_warps=4))
            if fit(split_cfg):
                return fit(split_cfg)
    if wide_fp32_rows(problem):
        # The references' form (docstring). H200, against the whole-row tile: RMSNorm 1024x16384 71.7 vs 77.0 µs,
        # 4096x12288 188.8 vs 206.4; LayerNorm, against the bf16 rule in 8 slices: 8192x9216 323.4 vs 400.3.
        split = next(s for s in ROW_SPLITS[1:] if row_block_col(problem.N, s) <= WIDE_FP32_SLICE)
        wide = BackwardConfig(
            Kernel1Config(block_row=2, block_col=row_block_col(problem.N, split), num_warps=16, num_stages=1,
                          programs_per_sm=1, eviction_policy="", prefetch=True, row_split=split,
                          column_accumulators=True),
            Kernel2Config(block_m=64, block_n=16, num_warps=4, pdl=True))
        if fit(wide):
            return fit(wide)
    # 16-bit rows of 8193-16384 columns, enough of them to measure: the shipped tables' forms (docstring).
    wide_16_bit = n_pow2 == MAX_SINGLE_PASS and problem.itemsize == 2 and problem.M >= WIDE_DEFAULT_MIN_ROWS
    if wide_16_bit and problem.norm == "layer_norm":
        # 4 slices of 4-row tiles, dw/db per column, 3 stages through the pipelined exchange (the tables' rule from
        # 2048 rows). H100, 2048x12296: 83.7 against the whole-row tile's 106.0 µs.
        wide = BackwardConfig(
            Kernel1Config(block_row=4, block_col=row_block_col(problem.N, 4), num_warps=8, num_stages=3,
                          programs_per_sm=1, eviction_policy="", row_split=4, column_accumulators=True,
                          pipelined_split=True),
            Kernel2Config(block_m=64, block_n=16, num_warps=1, pdl=True))
        if fit(wide):
            return fit(wide)
    block_col = 4096 if two_pass else n_pow2
    # Up to 64 rows (the space's largest block_row): a cap of 16 left rows of <= 256 columns with 2048-4096
    # element tiles, under the ~8192 the tuned N=1024/2048 seed rules settled on.
    block_row = 1 if two_pass else max(1, min(64, 8192 // block_col))
    tile = block_row * block_col
    # 16 warps once a row is >= 4096 columns (H100 and H200 sweeps: every tuned seed config at N >= 4096 ran 16
    # warps or smem pipelining; 8 warps cost LayerNorm 4096x8192 96.6 vs 82.0 µs on the H100).
    num_warps = 8 if two_pass else (16 if block_col >= 4096 else max(4, min(8, tile // 1024)))
    num_warps = min(num_warps, max_warps(tile, lim))
    prefetch = estimate_registers(problem, block_row, block_col, num_warps, two_pass, True,
                                  warp_size=lim.warp_size) <= hardware_registers(num_warps, lim)
    # Where prefetch does not fit (one-row tiles of 16384), bf16 LayerNorm rows with a bias (two accumulators)
    # keep their raw tile across the reductions instead of fp32 copies (recompute: 2048x16384 167 -> 126 µs on
    # the H100). RMSNorm fits without it and runs slower with it (2048x16384: 87.2 vs 84.5 µs H100, 74.3 vs
    # 68.1 µs H200).
    recompute = (not two_pass and not prefetch and problem.itemsize == 2 and block_row == 1
                 and bool(problem.has_bias))
    if wide_16_bit and not prefetch and problem.norm == "rms_norm":
        # Prefetch fits once the raw tile is kept across the reductions (the tables' rule at 16384 columns).
        # H100, 4096x10000: 101.3 against the plain whole-row tile's 116.5 µs.
        prefetch = recompute = True
    k1 = Kernel1Config(block_row=block_row, block_col=block_col, num_warps=num_warps, num_stages=1,
                       programs_per_sm=1, two_pass=two_pass, eviction_policy="evict_first", prefetch=prefetch,
                       recompute=recompute)
    block_n = min(16, n_pow2)  # 128x16 tiles: kernel_2 x0.83 vs wider tiles, median over the 30 seed cases (H100)
    block_m = 128
    k2_warps = max(1, min(4, (block_m * block_n) // lim.warp_size))
    k2 = Kernel2Config(block_m=block_m, block_n=block_n, num_warps=k2_warps)
    # Where the register estimate rejects the plain tile (e.g. LayerNorm recovering x̂ from y with a bias at
    # N=16384 also holds the bias row), keep the raw tile instead (recompute), then more warps, then two-pass.
    candidates = [k1, dataclasses.replace(k1, recompute=problem.itemsize == 2),
                  dataclasses.replace(k1, recompute=problem.itemsize == 2,
                                      num_warps=min(lim.max_warps, 2 * num_warps)),
                  Kernel1Config(block_row=1, block_col=min(4096, block_col), num_warps=8, programs_per_sm=1,
                                two_pass=True, eviction_policy="evict_first", prefetch=True)]
    for cand in candidates:
        cfg = fit(BackwardConfig(cand, k2))
        if cfg:
            return cfg
    return portable(BackwardConfig(candidates[-1], k2), lim).validate(problem, lim)
