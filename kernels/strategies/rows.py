"""The rows strategy: persistent programs over row tiles, each writing a partial dw/db row that kernel_2 reduces
(or that the same programs reduce after a grid-wide barrier: kernel_2.fused).

Its forms, chosen by knobs:
- single pass (two_pass=False): a program holds whole rows (block_col >= N) and grid-strides over row tiles;
  recompute keeps only the raw 16-bit tile live across the row reductions and widens it again after them, halving
  the registers the tile holds there (no effect for fp32 data);
- two-pass: each row tile is walked in column chunks of block_col twice: pass 1 reduces the row terms, pass 2
  re-reads them (from L2 when the tile fits) and writes grad_input and the partials;
- split rows (row_split > 1, single pass): each row is spread over row_split programs, each holding one column
  slice, so that a wide row's tile and accumulators fit the registers. A row group's programs exchange their
  slices' row sums through global memory and add them in slice order: every program, and every rerun, gets
  bitwise the same row terms. Splits of 3, 5, 6 and 7 fill the power-of-two tiles of rows of 3, 5 or 7 times a
  power of two, where a split of 2, 4 or 8 leaves a quarter or more of their lanes masked;
- column accumulators (single pass): dw/db accumulate one fp32 value per column, each tile's rows summed into it
  as the tile is done, so a multi-row tile holds block_row times fewer accumulator registers;
- pipelined split (row_split > 1): the exchange inside the tile loop waits through inline assembly instead of a
  CTA barrier, which Triton's software pipeliner refuses, so num_stages > 1 pipelines a split row's loads too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

from ..heuristics import (MAX_SINGLE_PASS, ROW_SPLITS, next_power_of_two, num_groups, row_block_col,
                          slice_width)
from .capabilities import fits
from ..knobs import Kernel1Config, Kernel2Config, check_booleans, knob
from ..limits import DeviceLimits
from ..problem import ConfigError, Problem, check_choice, is_power_of_two
from . import rows_default, rows_seeds
from .rows_seeds import MAX_COLUMN_ACC_TILE, narrow_odd_split
from .base import MAX_SPACE_TILE, Strategy, check_tile, describe_flags
from .configs import BackwardConfig
from .fitting import fit_row_tile

# Narrowest two-pass chunk worth measuring (narrower chunks are the columns strategy's slices).
MIN_TWO_PASS_CHUNK = 512


def exchanges_across_warps(k1) -> bool:
    """Whether a rows config's staged loop also exchanges values across its warps through shared memory: a split
    row's pipelined row sums, or dw/db kept per column (`staged_shared_bytes`'s `exchange`)."""
    return (k1.row_split > 1 and k1.pipelined_split) or k1.column_accumulators


def fitting_split(N: int, row_split: int) -> bool:
    """The row's slices are exactly one power of two wide: no lane of their tiles is masked. A split of 2, 4 or 8
    does that only for power-of-two rows; 3, 5, 6 and 7 for rows such as 3072, 5120, 12288 and 14336."""
    return N % row_split == 0 and is_power_of_two(N // row_split)


@dataclass(frozen=True)
class RowsConfig(Kernel1Config):
    """kernel_1 of the rows strategy: the shared knobs and its forms' (the module says what each does). two_pass and
    row_split are drawn before the shared knobs (they decide the tile's form); pipelined_split is offered where
    rows split."""

    two_pass: bool = knob(False, (False, True), leading=True)
    recompute: bool = knob(False, (False, True))
    row_split: int = knob(1, ROW_SPLITS, leading=True)
    column_accumulators: bool = knob(False, (False, True))
    pipelined_split: bool = knob(False, (False, True))

    strategy: ClassVar[str] = "rows"

    def check_fields(self, limits: DeviceLimits | None = None) -> None:
        super().check_fields(limits)
        check_booleans(self, ("two_pass", "recompute", "column_accumulators", "pipelined_split"))
        check_choice("kernel_1.row_split", self.row_split, ROW_SPLITS)


# Its knobs' refusals where a form of its own lacks them.
COLUMN_ACCUMULATORS_SINGLE_PASS = ("kernel_1.column_accumulators=true applies to the rows strategy's single pass: "
                                   "use two_pass=false and strategy='rows', or column_accumulators=false")
PIPELINED_SPLIT_ONLY = ("kernel_1.pipelined_split=true pipelines the exchange of a split row: use row_split > 1 with "
                        "strategy='rows', or pipelined_split=false")
# The knobs of its own that `describe` shows in its terms.
SHOWN = ("two_pass", "recompute", "row_split", "column_accumulators", "pipelined_split")


class Rows(Strategy):
    name = "rows"
    config_type = RowsConfig
    decided_first = ("k1.two_pass",)

    def validate(self, config: BackwardConfig, problem: Problem, lim: DeviceLimits) -> None:
        k1, k2 = config.kernel_1, config.kernel_2
        if k1.recompute and k1.two_pass:
            raise ConfigError("kernel_1.recompute=true applies to single pass: two_pass=true re-reads its chunks "
                              "(use recompute=false)")
        if k1.column_accumulators and k1.two_pass:
            raise ConfigError(COLUMN_ACCUMULATORS_SINGLE_PASS)
        if k1.pipelined_split and k1.row_split == 1:
            raise ConfigError(PIPELINED_SPLIT_ONLY)
        if k1.row_split > 1:
            if k1.two_pass:
                raise ConfigError("kernel_1.row_split > 1 splits a single-pass row: use two_pass=false or "
                                  "row_split=1")
            if slice_width(problem.N, k1.row_split) < 256:
                raise ConfigError(f"kernel_1.row_split={k1.row_split} leaves slices under 256 of N={problem.N} "
                                  "columns: use a smaller row_split")
            if k1.block_col < slice_width(problem.N, k1.row_split):
                raise ConfigError(
                    f"kernel_1.block_col={k1.block_col} does not cover a 1/{k1.row_split} slice of N={problem.N}: "
                    f"use block_col >= {row_block_col(problem.N, k1.row_split)}")
        elif not k1.two_pass and k1.block_col < problem.N:
            raise ConfigError(f"kernel_1.block_col={k1.block_col} < N={problem.N} in single pass: use block_col >= "
                              f"{next_power_of_two(problem.N)} or two_pass=true")
        check_tile(k1, problem, lim, two_pass=k1.two_pass, recompute=k1.recompute,
                   column_accumulators=k1.column_accumulators,
                   exchange=exchanges_across_warps(k1), weight_row=True)
        k2.validate(lim)
        if k2.fused:
            k2.check_tile(k1.num_warps, "kernel_1.num_warps (fused reduction)", lim)

    def describe(self, config: BackwardConfig) -> str:
        k1, k2 = config.kernel_1, config.kernel_2
        mode = "2pass" if k1.two_pass else "1pass"
        split = f" split{k1.row_split}" if k1.row_split > 1 else ""
        return (f"k1[{mode}{split} {k1.block_row}x{k1.block_col} w{k1.num_warps} s{k1.num_stages} "
                f"pps{k1.programs_per_sm}{describe_flags(k1, own_flags(k1))}{self.describe_knobs(k1, SHOWN)}] "
                f"k2[{k2.block_m}x{k2.block_n} w{k2.num_warps} s{k2.num_stages}{' pdl' if k2.pdl else ''}"
                f"{' fused' if k2.fused else ''}]")

    def programs(self, M: int, N: int, config: BackwardConfig, sms: int) -> int:
        return self.partial_rows(M, config, sms) * config.kernel_1.row_split

    def partial_rows(self, M: int, config: BackwardConfig, sms: int) -> int:
        k1 = config.kernel_1
        return num_groups(M, k1.block_row, k1.programs_per_sm, sms, k1.row_split)

    # ---- the device's features
    def fallbacks(self, k1: RowsConfig, limits: DeviceLimits) -> list[str]:
        if k1.pipelined_split and not limits.inline_ptx:
            return [f"kernel_1.pipelined_split: its waits are inline PTX, which {limits.name} does not run: the "
                    "split row's exchange waits through Triton's barrier (not software-pipelined)"]
        return []

    def portable(self, k1: RowsConfig, limits: DeviceLimits) -> RowsConfig:
        return k1 if limits.inline_ptx or not k1.pipelined_split else dataclasses.replace(k1, pipelined_split=False)

    def holds_rows(self, k1: Kernel1Config) -> bool:
        """Split rows (each slice fills the registers) or recompute (the packed 16-bit tile kept live)."""
        return not k1.two_pass and (k1.row_split > 1 or k1.recompute)

    def whole_rows(self, k1: Kernel1Config) -> bool:
        return not k1.two_pass and k1.row_split == 1

    def walks_twice(self, k1: RowsConfig) -> bool:
        return k1.two_pass

    def carry_over(self, config: BackwardConfig, problem: Problem, stand_in: str,
                   factor: int) -> tuple[BackwardConfig | None, str]:
        """A split row in `factor` times the slices, each of the same bytes, without recompute (`adapt` then fits
        it to the row); where that would pass ROW_SPLITS' largest, the largest split takes what it can and the
        tile holds fewer rows for the rest. A whole row held in registers does not carry over."""
        k1 = config.kernel_1
        split = k1.row_split * factor
        if k1.row_split == 1:
            return None, f"its config holds whole {stand_in} rows in registers"
        block_row, block_col = k1.block_row, max(1, k1.block_col // factor)
        if split > ROW_SPLITS[-1]:
            rest = -(-split // ROW_SPLITS[-1])  # the factor the slices cannot take: fewer rows per tile instead
            if k1.block_row < rest:
                return None, (f"its config holds {stand_in} rows in registers in {k1.row_split} slices of one row, "
                              f"and {problem.dtype} would need more than {ROW_SPLITS[-1]}")
            split, block_row, block_col = ROW_SPLITS[-1], k1.block_row // rest, k1.block_col
        return BackwardConfig(dataclasses.replace(k1, row_split=split, block_row=block_row, block_col=block_col,
                                                  recompute=False), config.kernel_2), ""

    # ---- the search space
    def offered(self, problem: Problem) -> bool:
        return True

    def narrow_domains(self, domains: dict[str, tuple], problem: Problem, lim: DeviceLimits) -> None:
        """Splits whose slices fit one pass (>= 256 columns; 3, 5, 6, 7 only where they fit the row exactly), the
        pipelined exchange only where rows split and the device runs its inline PTX, two-pass only for rows
        wider than 1024 columns (and the only form where no split fits)."""
        splits = tuple(s for s in domains["k1.row_split"]
                       if slice_width(problem.N, s) <= MAX_SINGLE_PASS and (s == 1 or slice_width(problem.N, s) >= 256)
                       and (is_power_of_two(s) or fitting_split(problem.N, s)))
        domains["k1.row_split"] = splits or (1,)
        if len(domains["k1.row_split"]) == 1 or not lim.inline_ptx:
            domains["k1.pipelined_split"] = (False,)
        n_pow2 = next_power_of_two(problem.N)
        domains["k1.two_pass"] = tuple(m for m in domains["k1.two_pass"] if (m or splits) and (not m or n_pow2 > 1024))

    def largest_tile(self, k1: RowsConfig) -> int:
        return MAX_COLUMN_ACC_TILE if k1.column_accumulators else MAX_SPACE_TILE

    def why_not(self, config: BackwardConfig, space) -> str | None:
        k1 = config.kernel_1
        if k1.pipelined_split and k1.num_stages == 1:
            return ("pipelined_split with num_stages = 1 issues the same loads as the plain exchange: use "
                    "num_stages > 1")
        if k1.two_pass and k1.block_col < MIN_TWO_PASS_CHUNK:
            return f"two-pass chunks narrower than {MIN_TWO_PASS_CHUNK} columns are the columns strategy's job"
        return None

    def variants(self, domains: Mapping[str, tuple]) -> tuple[dict, ...]:
        return tuple({"k1.two_pass": v} for v in domains["k1.two_pass"])

    def sampled(self, key: str, params: Mapping[str, Any]) -> bool:
        two_pass = bool(params.get("k1.two_pass", False))
        if key == "k1.block_col":  # single pass derives it from N and row_split
            return two_pass
        if key in ("k1.recompute", "k1.column_accumulators"):
            return not two_pass
        if key == "k1.pipelined_split":  # decided after row_split and num_stages
            return not two_pass and params.get("k1.row_split", 1) != 1 and params.get("k1.num_stages", 1) != 1
        return super().sampled(key, params)

    def enumerated(self, key: str, variant: Mapping[str, Any]) -> bool:
        if variant["k1.two_pass"]:
            return key not in ("k1.row_split", "k1.recompute", "k1.column_accumulators", "k1.pipelined_split")
        return key != "k1.block_col"

    def config(self, problem: Problem, params: Mapping[str, Any], space) -> BackwardConfig:
        two_pass = bool(params["k1.two_pass"])
        row_split = 1 if two_pass else params.get("k1.row_split", 1)
        k1 = self.make(**{
            **self.knob_values(params), "block_row": params["k1.block_row"],
            "block_col": params["k1.block_col"] if two_pass else row_block_col(problem.N, row_split),
            "num_warps": params["k1.num_warps"], "num_stages": params["k1.num_stages"],
            "programs_per_sm": params["k1.programs_per_sm"], "two_pass": two_pass,
            "eviction_policy": params["k1.eviction_policy"], "prefetch": bool(params["k1.prefetch"]),
            "recompute": bool(params.get("k1.recompute", False)) and not two_pass,
            "column_accumulators": bool(params.get("k1.column_accumulators", False)) and not two_pass,
            "row_split": row_split,
            "pipelined_split": bool(params.get("k1.pipelined_split", False)) and row_split > 1})
        fused = bool(params.get("k2.fused", False))
        k2 = Kernel2Config(block_m=params["k2.block_m"], block_n=params["k2.block_n"],
                           num_warps=space.kernel_2_domains()["num_warps"][0] if fused else params["k2.num_warps"],
                           num_stages=params["k2.num_stages"], pdl=bool(params["k2.pdl"]) and not fused,
                           fused=fused)
        return BackwardConfig(k1, k2)

    def params(self, config: BackwardConfig, params: dict[str, Any], domains: Mapping[str, tuple]) -> None:
        if config.kernel_1.two_pass:
            params["k1.row_split"] = domains["k1.row_split"][0]
        else:
            params["k1.block_col"] = domains["k1.block_col"][0]

    def canonical(self, config: BackwardConfig, space) -> tuple[BackwardConfig, bool]:
        if config.kernel_2.fused:  # kernel_1's warps run the fused reduction; nothing to overlap
            config = dataclasses.replace(config, kernel_2=dataclasses.replace(
                config.kernel_2, num_warps=space.kernel_2_domains()["num_warps"][0], pdl=False))
        return config, True

    # ---- the analytic default (after the columns strategy's, for rows too wide for one pass)
    def default(self, problem: Problem, lim: DeviceLimits) -> BackwardConfig:
        """The analytic default where the columns strategy gives none (`rows_default.default`)."""
        return rows_default.default(self, problem, lim)

    # ---- seeds (`tuner/seeds.py`; `rows_seeds.py`)
    def seeds(self, space, default: BackwardConfig) -> list[BackwardConfig]:
        """The rows strategy's structural seeds (`rows_seeds.seeds`)."""
        return rows_seeds.seeds(self, space, default)

    def neighbour(self, key: str, value: Any, k1: RowsConfig, problem: Problem) -> bool:
        """Single pass derives its column tile from N; odd splits only where each slice is 4096 columns or wider
        (as in `seeds`)."""
        if key == "k1.block_col":
            return k1.two_pass
        return not (key == "k1.row_split" and narrow_odd_split(problem.N, value))

    def expand_seeds(self, space, configs: list[BackwardConfig]) -> list[BackwardConfig]:
        """Each split-row config again with its exchange pipelined (`rows_seeds.expand_seeds`)."""
        return rows_seeds.expand_seeds(self, space, configs)

    # ---- a table rule's config on another problem (`kernels/select/adapt.py`)
    def adapt(self, config: BackwardConfig, problem: Problem, sm_count: int | None,
              limits: DeviceLimits | None = None) -> BackwardConfig | None:
        """A split row keeps the rule's split if its slices still fit the rule's tile, else the next split that
        keeps that tile, else the rule's split on wider tiles, else no split; then `fit_rows`."""
        k1 = config.kernel_1
        if k1.row_split > 1:  # the row's slices must stay >= 256 columns and fit one pass
            kept = [s for s in ROW_SPLITS if s >= k1.row_split and row_block_col(problem.N, s) <= k1.block_col]
            for split in kept[:1] + [k1.row_split]:
                width = row_block_col(problem.N, split)
                if slice_width(problem.N, split) >= 256 and width <= MAX_SINGLE_PASS:
                    cand = BackwardConfig(dataclasses.replace(k1, block_col=width, row_split=split), config.kernel_2)
                    if fits(problem, cand, limits):
                        return cand
            k1 = dataclasses.replace(k1, row_split=1, pipelined_split=False)  # nothing to exchange: the plain loop
        return fit_rows(k1, config.kernel_2, problem, sm_count, limits)


def fit_rows(k1: RowsConfig, k2: Kernel2Config, problem: Problem, sm_count: int | None,
             limits: DeviceLimits | None = None) -> BackwardConfig | None:
    """A rows-strategy kernel_1 (whole rows or two-pass) fitted to `problem`: single pass takes block_col =
    next_pow2(N) (two-pass past MAX_SINGLE_PASS, back to single pass where the chunk covers the row), then
    `fit_row_tile`."""
    n_pow2 = next_power_of_two(problem.N)
    if not k1.two_pass and n_pow2 > MAX_SINGLE_PASS:
        k1 = dataclasses.replace(k1, two_pass=True, block_col=min(4096, k1.block_col), block_row=1,
                                 recompute=False, column_accumulators=False)
    elif k1.two_pass and k1.block_col >= n_pow2 and n_pow2 <= MAX_SINGLE_PASS:
        k1 = dataclasses.replace(k1, two_pass=False, block_col=n_pow2)
    return fit_row_tile(k1, k2, problem, sm_count, whole_rows=not k1.two_pass, limits=limits)


def own_flags(k1: RowsConfig) -> str:
    """The rows strategy's boolean knobs that are on, as `describe` shows them."""
    return ((" recompute" if k1.recompute else "") + (" colacc" if k1.column_accumulators else "")
            + (" pipelined" if k1.pipelined_split else ""))


ROWS = Rows()
