"""The rows strategy's seeds (`Rows.seeds`, `Rows.expand_seeds`; `tuner/seeds.py` orders every strategy's):
`strategy` is the rows strategy, whose `make` builds its configs."""

from __future__ import annotations

import dataclasses

from ..heuristics import MAX_SINGLE_PASS, ROW_SPLITS, max_warps, next_power_of_two, row_block_col, slice_width
from ..knobs import Kernel2Config
from ..problem import is_power_of_two
from .configs import BackwardConfig

# Largest tile the space and the seeds offer with dw/db per column (block_row times fewer accumulator registers).
MAX_COLUMN_ACC_TILE = 32768
# Rows from which narrow rows (<= 1024 columns) also get the many-programs seeds.
MANY_NARROW_ROWS = 16384
# Rows at least this wide (their power of two) are also seeded split into slices of about LIGHT_SLICE columns on
# light programs (`light_pipelined_splits`).
LIGHT_SPLIT_MIN_N, LIGHT_SLICE = 16384, 4096


def narrow_odd_split(N: int, split: int) -> bool:
    """A split of 3, 5, 6 or 7 whose slices are narrower than 4096 columns: never seeded."""
    return not is_power_of_two(split) and row_block_col(N, split) < 4096


def seeds(strategy, space, default: BackwardConfig) -> list[BackwardConfig]:
    """For wide rows: single pass keeping the raw tile (recompute), pipelining through shared memory, rows
    split over 2-8 programs (dw/db per column on taller tiles), two-pass on multi-row tiles, kernel_2 launched
    early on wider column blocks, and splits of 3, 5, 6, 7 on tall tiles; for many narrow rows, several
    programs per SM on ~4096-element tiles with the reduction fused."""
    p = space.problem
    k1, k2 = default.kernel_1, default.kernel_2
    n_pow2 = next_power_of_two(p.N)
    alts: list[BackwardConfig] = []
    if n_pow2 >= LIGHT_SPLIT_MIN_N:
        alts += light_pipelined_splits(strategy, space, p.N, k2)
    if n_pow2 >= 4096:
        own = default.strategy is strategy  # the default may be another strategy's (few rows too wide for one pass)
        if own and not k1.two_pass:
            alts.append(BackwardConfig(dataclasses.replace(k1, recompute=True, prefetch=False), k2))
        if not (own and k1.two_pass):
            alts.append(BackwardConfig(dataclasses.replace(k1, prefetch=False, num_stages=3), k2))
        for block_row, block_col, warps in ((4, 2048, 8), (2, 4096, 8), (1, 4096, 8)):
            if block_col < n_pow2:
                alts.append(BackwardConfig(strategy.make(
                    block_row=block_row, block_col=block_col, num_warps=warps, programs_per_sm=1, two_pass=True,
                    eviction_policy="evict_first", prefetch=True), k2))
        for split, block_row in ((2, 1), (2, 2), (4, 2)):
            width = row_block_col(p.N, split)
            if width <= MAX_SINGLE_PASS and slice_width(p.N, split) >= 256:
                alts.append(BackwardConfig(strategy.make(
                    block_row=block_row, block_col=width, num_warps=min(16, max_warps(block_row * width)),
                    programs_per_sm=2, eviction_policy="evict_first", prefetch=True, row_split=split), k2))
        alts += tall_split_tiles(strategy, p.N, k2)
    early = Kernel2Config(block_m=128, block_n=32, num_warps=4, pdl=True)
    if n_pow2 >= 8192:  # wide rows: kernel_2 launched early (PDL) on 32-column blocks
        alts.append(BackwardConfig(k1, early))
        alts += tall_split_tiles(strategy, p.N, early)
    if n_pow2 >= 4096:
        # Rows of 3, 5 or 7 times a power of two: split so that each slice fills its tile, dw/db per column, the
        # raw tile kept. Every tile pays one exchange of row sums, so the tile must be tall, and only slices of
        # 4096 columns or wider are seeded (`narrow_odd_split`).
        tail = early if n_pow2 >= 8192 else k2
        for split in (s for s in space.domains(strategy.name)["k1.row_split"] if not is_power_of_two(s)):
            if narrow_odd_split(p.N, split):
                continue
            width = row_block_col(p.N, split)
            for block_row, warps, per_sm in ((16384 // width, 16, 1), (32768 // width, 16, 1),
                                             (8192 // width, 8, 2)):
                if block_row * width <= MAX_COLUMN_ACC_TILE:
                    alts.append(BackwardConfig(strategy.make(
                        block_row=block_row, block_col=width, num_warps=min(warps, max_warps(block_row * width)),
                        programs_per_sm=per_sm, eviction_policy="evict_first", recompute=True, row_split=split,
                        column_accumulators=True), tail))
    if n_pow2 <= 1024 and p.M >= MANY_NARROW_ROWS:
        # Many narrow rows: three programs per SM on ~4096-element tiles with the reduction fused into kernel_1's
        # tail; dw/db per column with loads pipelined through shared memory, or per tile element with prefetch.
        tall = max(1, min(64, 4096 // n_pow2))
        fused = Kernel2Config(block_m=64, block_n=min(16, n_pow2), num_warps=1, fused=True)
        for colacc, stages, warps, prefetch in ((True, 3, 4, False), (False, 1, 8, True)):
            alts.append(BackwardConfig(strategy.make(
                block_row=tall, block_col=n_pow2, num_warps=warps, num_stages=stages, programs_per_sm=3,
                eviction_policy="", prefetch=prefetch, column_accumulators=colacc), fused))
    return alts



def expand_seeds(strategy, space, configs: list[BackwardConfig]) -> list[BackwardConfig]:
    """Each split-row config again with its exchange pipelined (`pipelined_split`), three stages deep where the
    staged tiles fit shared memory, else two: without it a split tile loop compiles to no asynchronous copy
    whatever its num_stages (the exchange's CTA barrier stops Triton's pipeliner)."""
    out = []
    for cfg in configs:
        k1 = cfg.kernel_1
        if cfg.strategy is not strategy or k1.row_split == 1 or k1.pipelined_split:
            continue
        for stages in (3, 2):
            piped = BackwardConfig(dataclasses.replace(k1, pipelined_split=True, prefetch=False,
                                                       num_stages=stages), cfg.kernel_2)
            if space.why_not(piped) is None:
                out.append(piped)
                break
    return out

def light_pipelined_splits(strategy, space, N: int, kernel_2: Kernel2Config) -> list[BackwardConfig]:
    """Very wide rows split into slices of about 4096 columns (at most ROW_SPLITS' largest split) on light
    programs: two-row tiles of 4 warps per 4096 columns, several programs per SM, dw/db per column, the split's
    exchange pipelined three stages deep where the staged tiles fit shared memory (else two), nothing kept
    for the backward's second read. The search reaches this only through many knobs from the default's heavy
    single program per row slice."""
    split = min(max(ROW_SPLITS), max(2, N // LIGHT_SLICE))
    width = row_block_col(N, split)
    if width > MAX_SINGLE_PASS or slice_width(N, split) < 256:
        return []
    out = []
    for block_row, per_sm in ((2, 2), (4, 1)):
        warps = min(16, 4 * block_row * width // (2 * LIGHT_SLICE))
        for stages in (3, 2):
            cfg = BackwardConfig(strategy.make(
                block_row=block_row, block_col=width, num_warps=warps, num_stages=stages, programs_per_sm=per_sm,
                eviction_policy="", prefetch=False, row_split=split, column_accumulators=True,
                pipelined_split=True), kernel_2)
            if space.why_not(cfg) is None:
                out.append(cfg)
                break
    return out

def tall_split_tiles(strategy, N: int, kernel_2: Kernel2Config) -> list[BackwardConfig]:
    """Rows split over 2-8 programs on tiles of 2-4 rows, dw/db per column, the raw tile kept (recompute)."""
    out = []
    for split, block_row in ((2, 2), (4, 2), (4, 4), (8, 4)):
        width = row_block_col(N, split)
        if width <= MAX_SINGLE_PASS and slice_width(N, split) >= 256:
            out.append(BackwardConfig(strategy.make(
                block_row=block_row, block_col=width, num_warps=min(16, max_warps(block_row * width)),
                programs_per_sm=1, eviction_policy="evict_first", recompute=True, row_split=split,
                column_accumulators=True), kernel_2))
    return out

