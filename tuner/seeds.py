"""Where a sweep starts: the configs each study times first, before the sampler proposes its own.

`seeds` is the analytic default, then `strategies` (structurally different configs — other strategies, row
splits, pipelining, fused reductions — that a local search around the default would not reach, each with the
measurement that put it here), then the default's one-step neighbours. Only configs the space allows are
returned, in their canonical form (`Space.worth_measuring`). A change to what this module returns is a new
SEED_VERSION (`sweep/options.py`).
"""

from __future__ import annotations

import dataclasses

from normtune.kernels.config import BackwardConfig, Kernel1Config, Kernel2Config
from normtune.kernels.heuristics import (
    MAX_COLUMNS_ROWS,
    MAX_SINGLE_PASS,
    ROW_SWEEPING,
    default_config,
    max_warps,
    next_power_of_two,
    row_block_col,
    slice_width,
)
from normtune.kernels.problem import is_power_of_two

from .space import MAX_COLUMN_ACC_TILE, Space

# Rows from which narrow rows (<= 1024 columns) also get the many-programs seeds (`strategies`).
MANY_NARROW_ROWS = 16384
FEW_ROWS = 512  # light dual and columns seeds (`_light_few_row_seeds`) up to this many rows


def strategies(space: Space) -> list[BackwardConfig]:
    """Structurally different configs a local search around the default would not reach: for wide rows,
    single pass keeping the raw tile (recompute), pipelining through shared memory, rows split over 2-8
    programs (dw/db per column on taller tiles), two-pass on multi-row tiles (H100: 4x2048 two-pass ran
    LayerNorm 512x16384 in 33 µs, the default 52); for few rows, the columns and dual strategies (H100:
    columns LayerNorm 512x16384 39.2 vs 44.1 µs default); the fused reduction with wide column blocks."""
    p, base = space.problem, default_config(space.problem, space.limits)
    k1, k2 = base.kernel_1, base.kernel_2
    alts: list[BackwardConfig] = []
    if next_power_of_two(p.N) >= 4096:
        if not k1.two_pass:
            alts += [BackwardConfig(dataclasses.replace(k1, recompute=True, prefetch=False), k2),
                     BackwardConfig(dataclasses.replace(k1, prefetch=False, num_stages=3), k2)]
        for block_row, block_col, warps in ((4, 2048, 8), (2, 4096, 8), (1, 4096, 8)):
            if block_col < next_power_of_two(p.N):
                alts.append(BackwardConfig(Kernel1Config(
                    block_row=block_row, block_col=block_col, num_warps=warps, programs_per_sm=1, two_pass=True,
                    eviction_policy="evict_first", prefetch=True), k2))
        for split, block_row in ((2, 1), (2, 2), (4, 2)):
            width = row_block_col(p.N, split)
            if width <= MAX_SINGLE_PASS and slice_width(p.N, split) >= 256:
                alts.append(BackwardConfig(Kernel1Config(
                    block_row=block_row, block_col=width, num_warps=min(16, max_warps(block_row * width)),
                    programs_per_sm=2, eviction_policy="evict_first", prefetch=True, row_split=split), k2))
        # Taller split tiles with dw/db per column, keeping the raw tile (H100, 4096x32768: LayerNorm 2x8192
        # 365 µs, RMSNorm 4x8192 361 µs; the best split tiles without them, 2x4096, ran 422 and 408 µs).
        alts += _tall_split_tiles(p.N, k2)
    early = Kernel2Config(block_m=128, block_n=32, num_warps=4, pdl=True)
    if next_power_of_two(p.N) >= 8192:
        # Wide rows: kernel_2 launched early (PDL) on 32-column blocks, under the default and the taller split
        # tiles (H100, LayerNorm 512/1024/2048x16384: 38.1 / 59.6 / 102.7 µs vs 40.5 / 61.6 / 103.8 with the
        # table's 16-column kernel_2; the best fused tails were 2.5-4.7 µs slower there).
        alts.append(BackwardConfig(k1, early))
        alts += _tall_split_tiles(p.N, early)
    if next_power_of_two(p.N) >= 4096:
        # Rows of 3, 5 or 7 times a power of two (5120, 12288, 14336, …): split so that each slice fills its
        # tile (a split of 2, 4 or 8 masks a quarter or more of its lanes), dw/db per column, raw tile kept.
        # Every tile pays one exchange of row sums, so the tile must be tall: H100, LayerNorm 16384x12288 split
        # 3 on 4x4096 tiles 554 µs vs 600 for the table (2x4096: 712); slices of 1024-2048 columns (splits
        # 5, 6, 7) lost to the table everywhere they were timed (docs/perf-notes.md), so only wide slices are
        # seeded.
        tail = early if next_power_of_two(p.N) >= 8192 else k2
        for split in (s for s in space.domains()["k1.row_split"] if not is_power_of_two(s)):
            if _narrow_odd_split(p.N, split):
                continue
            width = row_block_col(p.N, split)
            for block_row, warps, per_sm in ((16384 // width, 16, 1), (32768 // width, 16, 1),
                                             (8192 // width, 8, 2)):
                if block_row * width <= MAX_COLUMN_ACC_TILE:
                    alts.append(BackwardConfig(Kernel1Config(
                        block_row=block_row, block_col=width, num_warps=min(warps, max_warps(block_row * width)),
                        programs_per_sm=per_sm, eviction_policy="evict_first", recompute=True, row_split=split,
                        column_accumulators=True), tail))
    if next_power_of_two(p.N) <= 1024 and p.M >= MANY_NARROW_ROWS:
        # Many narrow rows: three programs per SM on ~4096-element tiles with the reduction fused into
        # kernel_1's tail; dw/db per column with loads pipelined through shared memory, or per tile element
        # with prefetch. The held-out references (unseeded sweeps) settled there: 65536x768 H200 LayerNorm
        # 84.0 µs vs 101.9 for the default, RMSNorm 82.5 vs 94.8; 262144x256 and 524288x128 likewise.
        block_col = next_power_of_two(p.N)
        tall = max(1, min(64, 4096 // block_col))
        fused = Kernel2Config(block_m=64, block_n=min(16, block_col), num_warps=1, fused=True)
        for colacc, stages, warps, prefetch in ((True, 3, 4, False), (False, 1, 8, True)):
            alts.append(BackwardConfig(Kernel1Config(
                block_row=tall, block_col=block_col, num_warps=warps, num_stages=stages, programs_per_sm=3,
                eviction_policy="", prefetch=prefetch, column_accumulators=colacc), fused))
    if p.M <= MAX_COLUMNS_ROWS and k1.strategy == "rows" and not k1.two_pass and k1.row_split == 1:
        # Few rows, one launch: the default's row tile writes grad_input, column programs dw/db; no prefetch
        # (H100, RMSNorm 128x8192: 7.9 µs vs 10.2 with prefetch; 64x64 column tiles fastest at 64-1024 rows).
        rows = dataclasses.replace(k1, strategy="dual", recompute=False, column_accumulators=False, prefetch=False)
        widths = space.domains()["k2.block_n"]
        for block_m, block_n in ((64, 64), (32, 64), (32, 128)):
            block_n = max(b for b in widths if b <= block_n)
            alts.append(BackwardConfig(rows, Kernel2Config(block_m=block_m, block_n=block_n, num_warps=1)))
    alts += _light_few_row_seeds(space, k1) if p.M <= FEW_ROWS else []
    if p.M <= MAX_COLUMNS_ROWS:
        light = ((64, 32, 2, ""), (16, 32, 1, "")) if p.M <= FEW_ROWS else ()  # see _light_few_row_seeds
        for block_row, block_col, warps, hint in ((32, 64, 4, "evict_first"), (16, 128, 4, "evict_first"),
                                                  (32, 128, 4, "evict_first")) + light:
            if block_col in space.domains()["k1.block_col"]:
                alts.append(BackwardConfig(Kernel1Config(
                    strategy="columns", block_row=block_row, block_col=block_col, num_warps=warps,
                    programs_per_sm=1, eviction_policy=hint, prefetch=True), Kernel2Config()))
    wide = min(128, next_power_of_two(p.N))
    alts.append(BackwardConfig(k1, Kernel2Config(block_m=32, block_n=wide, num_warps=4, fused=True)))
    alts += _pipelined_splits(space, [base] + alts)
    return space.worth_measuring(alts)


def _pipelined_splits(space: Space, configs: list[BackwardConfig]) -> list[BackwardConfig]:
    """Each split-row config (the default's, the seeds') again with its exchange pipelined (`pipelined_split`),
    three stages deep where the staged tiles fit shared memory, else two. Without it a split tile loop compiles to
    no asynchronous copy whatever its num_stages (the exchange's CTA barrier stops Triton's pipeliner; sm_90
    compile: LayerNorm 2048x16384 split 2 on 1x8192 tiles, 8 warps, recompute, 3 stages, has 0 cp.async,
    pipelined 42)."""
    out = []
    for cfg in configs:
        k1 = cfg.kernel_1
        if k1.row_split == 1 or k1.pipelined_split:
            continue
        for stages in (3, 2):
            piped = BackwardConfig(dataclasses.replace(k1, pipelined_split=True, prefetch=False, num_stages=stages),
                                   cfg.kernel_2)
            if space.why_not(piped) is None:
                out.append(piped)
                break
    return out


def _tall_split_tiles(N: int, kernel_2: Kernel2Config) -> list[BackwardConfig]:
    """Rows split over 2-8 programs on tiles of 2-4 rows, dw/db per column, the raw tile kept (recompute)."""
    out = []
    for split, block_row in ((2, 2), (4, 2), (4, 4), (8, 4)):
        width = row_block_col(N, split)
        if width <= MAX_SINGLE_PASS and slice_width(N, split) >= 256:
            out.append(BackwardConfig(Kernel1Config(
                block_row=block_row, block_col=width, num_warps=min(16, max_warps(block_row * width)),
                programs_per_sm=1, eviction_policy="evict_first", recompute=True, row_split=split,
                column_accumulators=True), kernel_2))
    return out


def _light_few_row_seeds(space: Space, k1: Kernel1Config) -> list[BackwardConfig]:
    """Few rows: dual on 1- and 2-row tiles (fewest warps the register budget allows) and columns on 1-2
    warps, no eviction hint: where the H200 held-out references (unseeded) ran few rows and 40-72 trials from
    the 16-warp seeds did not reach (LayerNorm 96x4096: dual 1x4096 on 2 warps 6.6 µs, table 8.0)."""
    out = []
    if k1.strategy == "rows" and not k1.two_pass and k1.row_split == 1:
        for block_row, stages, per_sm, tail in ((1, 2, 1, (64, 64)), (2, 1, 0.5, (128, 64))):
            for warps in (2, 4, 8, 16):
                cfg = BackwardConfig(dataclasses.replace(
                    k1, strategy="dual", block_row=block_row, num_warps=warps, num_stages=stages,
                    programs_per_sm=per_sm, eviction_policy="", recompute=False, column_accumulators=False,
                    prefetch=False), Kernel2Config(block_m=tail[0], block_n=tail[1], num_warps=1))
                if space.why_not(cfg) is None:
                    out.append(cfg)
                    break
    return out


def _narrow_odd_split(N: int, split: int) -> bool:
    """A split of 3, 5, 6 or 7 whose slices are narrower than 4096 columns: never seeded (see `strategies`)."""
    return not is_power_of_two(split) and row_block_col(N, split) < 4096


def seeds(space: Space) -> list[BackwardConfig]:
    """The analytic default, structural alternatives (`strategies`) and the default's one-step neighbours
    (each knob moved to the adjacent domain value)."""
    base = space.canonical(default_config(space.problem, space.limits))
    few = space.problem.M <= MAX_COLUMNS_ROWS  # few rows: dual/columns first (a time-budgeted sweep reaches them)
    out = [base] + sorted(space.strategies(), key=lambda c: few and c.kernel_1.strategy not in ROW_SWEEPING)
    d = space.domains()
    params = space.params(base)
    for key, dom in d.items():
        if key == "k1.block_col" and not base.kernel_1.two_pass:
            continue
        cur = params.get(key)
        if cur not in dom:
            continue
        i = dom.index(cur)
        for j in (i - 1, i + 1):
            if 0 <= j < len(dom):
                if key == "k1.row_split" and _narrow_odd_split(space.problem.N, dom[j]):
                    continue  # as in `strategies`: odd splits only where each slice is 4096 columns or wider
                out += space.worth_measuring([space.config({**params, key: dom[j]})])
    return list(dict.fromkeys(out))
