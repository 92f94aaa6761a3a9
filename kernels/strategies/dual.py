"""The dual strategy (few rows, one launch): round(programs_per_sm x SMs) row programs hold whole rows as the rows
strategy's single pass does (block_row x block_col, block_col covering N; num_stages, prefetch, eviction_policy
as there) and write grad_input; beside them, one program per kernel_2.block_n columns sweeps every row,
kernel_2.block_m at a time, and writes the final dw/db. No partial buffer, no kernel_2 launch, no wait between
programs. Its config type holds the shared knobs only; kernel_2's num_warps, num_stages, pdl and fused do not
apply.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

from ..heuristics import MAX_COLUMNS_ROWS, MAX_SINGLE_PASS, cdiv, next_power_of_two, num_groups, row_block_col
from ..knobs import Kernel1Config, Kernel2Config
from ..limits import DeviceLimits
from ..problem import ConfigError, Problem
from .base import Strategy, check_tile, describe_flags
from .columns import FEW_ROWS
from .configs import BackwardConfig
from .fitting import fit_row_tile


@dataclass(frozen=True)
class DualConfig(Kernel1Config):
    """kernel_1 of the dual strategy: the shared knobs only."""

    strategy: ClassVar[str] = "dual"


class Dual(Strategy):
    name = "dual"
    config_type = DualConfig
    sweeps_rows = True
    kernel_2_knobs = ("block_m", "block_n")  # the column programs' tile, on kernel_1's warps

    def validate(self, config: BackwardConfig, problem: Problem, lim: DeviceLimits) -> None:
        k1, k2 = config.kernel_1, config.kernel_2
        if k1.block_col < problem.N:
            raise ConfigError(f"kernel_1.block_col={k1.block_col} < N={problem.N} in single pass: use block_col >= "
                              f"{next_power_of_two(problem.N)} or two_pass=true")
        check_tile(k1, problem, lim)
        if k2.pdl or k2.fused:
            raise ConfigError("kernel_1.strategy='dual' launches no kernel_2: use kernel_2.pdl=false, fused=false")
        k2.check_shape()
        k2.check_tile(k1.num_warps, "kernel_1.num_warps (dual: kernel_2's tile on its warps)", lim)

    def describe(self, config: BackwardConfig) -> str:
        k1, k2 = config.kernel_1, config.kernel_2
        return (f"k1[dual {k1.block_row}x{k1.block_col} w{k1.num_warps} s{k1.num_stages} pps{k1.programs_per_sm}"
                f"{describe_flags(k1)}{self.describe_knobs(k1)}] k2[columns {k2.block_m}x{k2.block_n}]")

    def programs(self, M: int, N: int, config: BackwardConfig, sms: int) -> int:
        return self.row_programs(M, config, sms) + cdiv(N, config.kernel_2.block_n)

    def row_programs(self, M: int, config: BackwardConfig, sms: int) -> int:
        """The programs that write grad_input (the column programs follow them)."""
        k1 = config.kernel_1
        return num_groups(M, k1.block_row, k1.programs_per_sm, sms)

    def whole_rows(self, k1) -> bool:
        return True

    # ---- the search space
    def offered(self, problem: Problem) -> bool:
        return problem.M <= MAX_COLUMNS_ROWS and next_power_of_two(problem.N) <= MAX_SINGLE_PASS

    def sampled(self, key: str, params: Mapping[str, Any]) -> bool:
        return key != "k1.block_col" and super().sampled(key, params)  # its row tile holds whole rows

    def config(self, problem: Problem, params: Mapping[str, Any], space) -> BackwardConfig:
        k1 = self.make(**{**self.knob_values(params), "block_row": params["k1.block_row"],
                          "block_col": row_block_col(problem.N), "num_warps": params["k1.num_warps"],
                          "num_stages": params["k1.num_stages"], "programs_per_sm": params["k1.programs_per_sm"],
                          "eviction_policy": params["k1.eviction_policy"], "prefetch": bool(params["k1.prefetch"])})
        return BackwardConfig(k1, dataclasses.replace(space.unused_kernel_2(), block_m=params["k2.block_m"],
                                                      block_n=params["k2.block_n"]))

    def canonical(self, config: BackwardConfig, space) -> tuple[BackwardConfig, bool]:
        k2 = config.kernel_2
        return dataclasses.replace(config, kernel_2=dataclasses.replace(
            space.unused_kernel_2(), block_m=k2.block_m, block_n=k2.block_n)), True

    # ---- seeds, adapt
    def seeds(self, space, default: BackwardConfig) -> list[BackwardConfig]:
        """Few rows, where the default holds whole rows: its row tile writes grad_input, column programs dw/db, no
        prefetch, 64x64-ish column tiles; up to FEW_ROWS rows also 1- and 2-row tiles on the fewest warps the
        register budget allows, no eviction hint."""
        p, k1 = space.problem, default.kernel_1
        if p.M > MAX_COLUMNS_ROWS or not default.strategy.whole_rows(k1) or default.strategy is self:
            return []
        rows = self.make(**{**k1.shared_fields(), "prefetch": False})
        widths = space.domains()["k2.block_n"]
        out = []
        for block_m, block_n in ((64, 64), (32, 64), (32, 128)):
            block_n = max(b for b in widths if b <= block_n)
            out.append(BackwardConfig(rows, Kernel2Config(block_m=block_m, block_n=block_n, num_warps=1)))
        if p.M <= FEW_ROWS:
            for block_row, stages, per_sm, tail in ((1, 2, 1, (64, 64)), (2, 1, 0.5, (128, 64))):
                for warps in (2, 4, 8, 16):
                    cfg = BackwardConfig(dataclasses.replace(
                        rows, block_row=block_row, num_warps=warps, num_stages=stages, programs_per_sm=per_sm,
                        eviction_policy=""), Kernel2Config(block_m=tail[0], block_n=tail[1], num_warps=1))
                    if space.why_not(cfg) is None:
                        out.append(cfg)
                        break
        return out

    def adapt(self, config: BackwardConfig, problem: Problem, sm_count: int | None,
              limits: DeviceLimits | None = None) -> BackwardConfig | None:
        """Its column programs sweep every row: up to MAX_COLUMNS_ROWS rows, the row tile fitted as the rows
        strategy's whole rows are."""
        if problem.M > MAX_COLUMNS_ROWS:
            return None
        return fit_row_tile(config.kernel_1, config.kernel_2, problem, sm_count, limits=limits)


DUAL = Dual()
