"""Launch arithmetic, free of Triton: register and shared-memory limits, the persistent grid and warp rules. The
strategies (`strategies/`), the runtime, the tuner's search space and the no-GPU report read these from here.

The measurements behind the limits and slack here: docs/kernel-figures.md.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from .limits import REFERENCE, DeviceLimits
from .problem import ITEMSIZE

if TYPE_CHECKING:
    from .problem import Problem

# The reference device's SM has 64K 32-bit registers and at most 255 per thread, so a program of W warps gets at
# most min(255, 65536 / (32 W)). The estimate below overcounts (temporaries die early), and mild spilling still
# runs: a tile estimated above the registers available can be the fastest config of its shape, while the same tile
# with prefetch (estimated further above) is much slower. So configs are pruned only past REGISTER_SLACK times the
# hardware limit, on every warp count (up to 8 warps the 255 cap used to leave no slack). The estimate still
# prunes some configs that run well; the measurements and the compiler's counts next to the estimate:
# docs/kernel-figures.md ("Register estimate").
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
# Grids whose programs wait for each other (row_split, the fused reduction) hold at most this many programs per
# SM, and never more than the compiled kernel's occupancy: every program must be resident at once.
MAX_PROGRAMS_PER_SM_SYNC = 4
# Hopper: 228 KB of shared memory per SM, 1 KB of it reserved per resident block.
SHARED_MEMORY_PER_SM = REFERENCE.shared_per_sm
# Split-row slices start on multiples of this many elements (16-byte aligned for 2-byte data: wide loads).
SLICE_ALIGN = 16
# Widest slice the analytic default gives a program of a split row (rows wider than MAX_SINGLE_PASS).
SPLIT_SLICE = 8192
# Programs a split row (the rows strategy's row_split) may be spread over.
ROW_SPLITS = (1, 2, 3, 4, 5, 6, 7, 8)
# Elements the analytic default fills a whole-row tile up to with rows (N=1024: 8 rows), so that a short row still
# issues wide loads.
ROW_TILE_ELEMENTS = 8192
# fp32 values per tile element the gated form keeps live beside the plain form's: z, its activation and the dz
# term. With them a one-row tile of 16 elements per thread no longer fits prefetch in the registers of 16 warps,
# which the measurements of prefetch on gated rows bear out (docs/kernel-figures.md, "Gated register tile").
GATE_LIVE = 3


# Bytes a staged single-pass kernel_1 asks for beyond its stages' tiles (barriers and a few scalars), and the
# scratch per warp of its cross-warp reductions (which reuse the stages' buffer where those are larger).
STAGED_SLACK = 512
WARP_SCRATCH = 1024


def staged_shared_bytes(problem: "Problem", block_row: int, block_col: int, num_stages: int, two_pass: bool,
                        prefetch: bool, num_warps: int, exchange: bool = False, weight_row: bool = False) -> int:
    """Shared memory kernel_1's pipelined tile loop asks for at num_stages, an upper bound of what Triton compiles.
    Single pass stages every tile stream it does not prefetch into registers (`_single_pass_stage_bytes`; with
    `weight_row`, the rows strategy's loop, also a one-row tile's weight row), and a cross-warp exchange
    (`exchange`: a split row's row sums, or dw/db per column) adds the warps' scratch beside them. Two-pass
    stages its tiles (dy, the saved tensor, dh, z; with prefetch only z) and, per column chunk, the weight (and
    the bias when x̂ is recovered from the output) and the fp32 partial dw/db rows its second pass reads back,
    plus in 16-bit the warps' reduction scratch (docs/kernel-figures.md, "Staged shared memory")."""
    if num_stages <= 1:
        return 0
    if not two_pass:
        staged = (num_stages - 1) * _single_pass_stage_bytes(problem, block_row, block_col, prefetch, weight_row)
        beside = _conversion_scratch(problem, num_warps) + exchange * WARP_SCRATCH * num_warps
        return max(staged + beside, WARP_SCRATCH * num_warps) + STAGED_SLACK
    z = gated(problem) * problem.itemsize  # the gated form stages z, even with prefetch
    per_element = z if prefetch else z + problem.itemsize + _saved_itemsize(problem) + _residual_itemsize(problem)
    weight = problem.has_weight * (ITEMSIZE[problem.weight_dtype] + 4)
    bias = bool(problem.has_bias) * (4 + (problem.save == "output") * ITEMSIZE[problem.weight_dtype])
    per_stage = block_row * block_col * per_element + block_col * (weight + bias)
    scratch = WARP_SCRATCH * num_warps if problem.itemsize < 4 else 0  # fp32 tiles reuse a stage's buffer for it
    return (num_stages - 1) * per_stage + scratch


def _single_pass_stage_bytes(problem: "Problem", block_row: int, block_col: int, prefetch: bool,
                             weight_row: bool) -> int:
    """One stage of the single-pass loop: the tiles of the streams read per row that prefetch does not hold in
    registers (dy and the saved tensor; the gate z and the residual stream's dh are staged even with prefetch),
    and, where `weight_row` and the tile has one row, the weight row, which that loop then reads beside them."""
    per_element = gated(problem) * problem.itemsize + _residual_itemsize(problem)
    if not prefetch:
        per_element += problem.itemsize + _saved_itemsize(problem)
    weight = problem.has_weight * ITEMSIZE[problem.weight_dtype] if weight_row and block_row == 1 else 0
    return block_col * (block_row * per_element + weight)


def _saved_itemsize(problem: "Problem") -> int:
    """Bytes per element of the tensor the forward saved: h, in the residual stream's dtype, in the fused residual
    form saving its input; else the activations'."""
    residual = getattr(problem, "residual", False) and problem.save == "input"
    return problem.residual_itemsize if residual else problem.itemsize


def _residual_itemsize(problem: "Problem") -> int:
    """Bytes per element of the residual stream's gradient dh kernel_1 reads (0 without the residual form)."""
    return problem.residual_itemsize if getattr(problem, "residual", False) else 0


def _conversion_scratch(problem: "Problem", num_warps: int) -> int:
    """The warps' scratch for converting a residual stream wider than the activations, beside the stages."""
    wider = getattr(problem, "residual", False) and problem.residual_itemsize > problem.itemsize
    return WARP_SCRATCH * num_warps if wider else 0


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
    two-pass, the row-term accumulators of pass 1); with a gate, z in fp32, its activation and the dz term
    (GATE_LIVE); the raw next tiles when prefetching (z's too with a gate). Per column: w (held in registers unless
    a single-row tile reloads it per tile), b when recovering x̂ from y, and the dw and db accumulators instead
    when they are kept per column.
    """
    per_thread = math.ceil(block_row * block_col / (warp_size * num_warps))
    # recompute: the tile is held raw (2-byte values pack two per register) rather than converted to fp32
    live = 3.0 if not recompute else 1.0 + 2 * problem.itemsize / 4
    accumulators = problem.has_weight + bool(problem.has_bias)
    if two_pass:
        live += 1 + (problem.norm == "layer_norm")
    elif not column_accumulators:
        live += accumulators
    live += GATE_LIVE * gated(problem)
    if prefetch:
        live += (2 + gated(problem)) * problem.itemsize / 4
    per_column = (problem.save == "output" and bool(problem.has_bias)) + (block_row > 1 and not two_pass)
    if column_accumulators and not two_pass:
        per_column += accumulators
    return math.ceil(per_thread * live + per_thread / block_row * per_column)


def gated(problem: "Problem") -> bool:
    """Whether kernel_1 reads a gate z beside x and dy (the gated form)."""
    return getattr(problem, "gate", None) is not None


def row_tiles(M: int, block_row: int) -> int:
    return cdiv(M, block_row)


def num_groups(M: int, block_row: int, programs_per_sm: float, sms: int, row_split: int = 1) -> int:
    """Persistent row groups of a grid of row programs: round(programs_per_sm x SMs / row_split), never more
    than the row tiles, at least 1. Each group is `row_split` programs sharing its rows (one column slice each);
    a fraction of programs_per_sm (e.g. 0.5) leaves SMs idle but halves the partials kernel_2 must read."""
    return max(1, min(round(programs_per_sm * sms / row_split), row_tiles(M, block_row)))


def wide_fp32_rows(problem: "Problem") -> bool:
    """fp32 rows of 8193-16384 columns, enough of them to measure: the analytic default splits them, and an fp32
    problem takes that default rather than a bf16 rule carried over (`adapt.carried_over`)."""
    return next_power_of_two(problem.N) == MAX_SINGLE_PASS and problem.itemsize == 4 and \
        problem.M >= WIDE_DEFAULT_MIN_ROWS
