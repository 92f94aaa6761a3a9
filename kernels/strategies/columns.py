"""The columns strategy (few rows): one program per block_col-wide column slice sweeps all M rows, block_row at a
time, and writes the final dw/db itself; the rows' two sums come from a small kernel run first. No partial buffer
and no kernel_2 (its config is carried, each knob at its domain's first value). Its config type holds the shared
knobs only; programs_per_sm does not apply (held at 1).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

from .capabilities import fits
from ..heuristics import MAX_COLUMNS_ROWS, MAX_SINGLE_PASS, cdiv, next_power_of_two
from ..knobs import Kernel1Config, Kernel2Config
from ..limits import DeviceLimits
from ..problem import ConfigError, Problem
from .base import Strategy, check_tile, describe_flags, fit
from .configs import BackwardConfig

# Widest column slice of one program (its rows' dw/db accumulate in registers while it sweeps every row).
MAX_SLICE = 1024
# Few-row sweeps up to this many rows also get the light seeds: 1-2 warps, no eviction hint.
FEW_ROWS = 512


@dataclass(frozen=True)
class ColumnsConfig(Kernel1Config):
    """kernel_1 of the columns strategy: the shared knobs only."""

    strategy: ClassVar[str] = "columns"


class Columns(Strategy):
    name = "columns"
    config_type = ColumnsConfig
    sweeps_rows = True
    kernel_2_knobs = ()

    def validate(self, config: BackwardConfig, problem: Problem, lim: DeviceLimits) -> None:
        k1 = config.kernel_1
        if k1.block_col > MAX_SLICE:
            raise ConfigError(f"kernel_1.block_col={k1.block_col} is the column slice of strategy='columns': "
                              f"use block_col <= {MAX_SLICE}")
        if k1.num_stages > 1 and k1.prefetch:
            raise ConfigError("kernel_1.prefetch and num_stages > 1 both pipeline the row loop: use one")
        check_tile(k1, problem, lim)
        config.kernel_2.validate(lim)

    def describe(self, config: BackwardConfig) -> str:
        k1 = config.kernel_1
        return (f"k1[columns {k1.block_row}x{k1.block_col} w{k1.num_warps} s{k1.num_stages}{describe_flags(k1)}"
                f"{self.describe_knobs(k1)}] k2[none]")

    def programs(self, M: int, N: int, config: BackwardConfig, sms: int) -> int:
        return cdiv(N, config.kernel_1.block_col)

    # ---- the search space
    def offered(self, problem: Problem) -> bool:
        return problem.M <= MAX_COLUMNS_ROWS

    def sampled(self, key: str, params: Mapping[str, Any]) -> bool:
        if key.startswith("k2."):  # sampled, and ignored by `config`
            return True
        return super().sampled(key, params)

    def enumerated(self, key: str, variant: Mapping[str, Any]) -> bool:
        return not key.startswith("k2.") and key != "k1.programs_per_sm" and self.sampled(key, variant)

    def config(self, problem: Problem, params: Mapping[str, Any], space) -> BackwardConfig:
        k1 = self.make(**{**self.knob_values(params), "block_row": params["k1.block_row"],
                          "block_col": params["k1.block_col"], "num_warps": params["k1.num_warps"],
                          "num_stages": params["k1.num_stages"], "programs_per_sm": 1,
                          "eviction_policy": params["k1.eviction_policy"], "prefetch": bool(params["k1.prefetch"])})
        return BackwardConfig(k1, space.unused_kernel_2())

    def params(self, config: BackwardConfig, params: dict[str, Any], domains: Mapping[str, tuple]) -> None:
        params["k1.programs_per_sm"] = domains["k1.programs_per_sm"][0]
        params.update({k: v[0] for k, v in domains.items() if k.startswith("k2.")})

    def canonical(self, config: BackwardConfig, space) -> tuple[BackwardConfig, bool]:
        # no grid knob, no kernel_2: one spelling of each
        return BackwardConfig(dataclasses.replace(config.kernel_1, programs_per_sm=1), space.unused_kernel_2()), False

    # ---- default, seeds, adapt
    def default(self, problem: Problem, lim: DeviceLimits) -> BackwardConfig | None:
        """Rows too wide for one pass, few enough to sweep (up to MAX_COLUMNS_ROWS): column slices of 128 (from
        256 rows, 16x128 tiles on 16 warps) or 32 columns (32x32 on one warp), prefetch."""
        if not (next_power_of_two(problem.N) > MAX_SINGLE_PASS and 0 < problem.M <= MAX_COLUMNS_ROWS):
            return None
        many = problem.M >= 256
        config = BackwardConfig(
            self.make(block_row=16 if many else 32, block_col=128 if many else 32, num_warps=16 if many else 1,
                      num_stages=1, programs_per_sm=1, eviction_policy="", prefetch=True),
            Kernel2Config(block_m=128, block_n=16, num_warps=4))
        return fit(config, problem, lim)

    def seeds(self, space, default: BackwardConfig) -> list[BackwardConfig]:
        """Column slices of 64-128 on 16-32-row tiles; for up to FEW_ROWS rows also 32-column slices on 1-2
        warps without an eviction hint."""
        p = space.problem
        if p.M > MAX_COLUMNS_ROWS:
            return []
        light = ((64, 32, 2, ""), (16, 32, 1, "")) if p.M <= FEW_ROWS else ()
        out = []
        for block_row, block_col, warps, hint in ((32, 64, 4, "evict_first"), (16, 128, 4, "evict_first"),
                                                  (32, 128, 4, "evict_first")) + light:
            if block_col in space.domains()["k1.block_col"]:
                out.append(BackwardConfig(self.make(block_row=block_row, block_col=block_col, num_warps=warps,
                                                    programs_per_sm=1, eviction_policy=hint, prefetch=True),
                                          Kernel2Config()))
        return out

    def adapt(self, config: BackwardConfig, problem: Problem, sm_count: int | None,
              limits: DeviceLimits | None = None) -> BackwardConfig | None:
        """A column slice sweeps every row: any N, up to MAX_COLUMNS_ROWS rows."""
        k1 = config.kernel_1
        cand = BackwardConfig(dataclasses.replace(k1, block_col=min(k1.block_col, next_power_of_two(problem.N))),
                              config.kernel_2)
        return cand if problem.M <= MAX_COLUMNS_ROWS and fits(problem, cand, limits) else None


COLUMNS = Columns()
