"""Making a table rule's config run a problem it was not fitted on: `adapt` (another shape) and `carried_over`
(another dtype: the table's rules of a stand-in dtype, `STAND_IN_DTYPES`). Both return configs that validate for
the problem, or say why none carries over; `tables.Table.match` applies them.
"""

from __future__ import annotations

from ..config import ITEMSIZE, BackwardConfig, Problem
from ..heuristics import wide_fp32_rows
from ..limits import DeviceLimits
from ..strategies import default_config

# A dtype the table has no family of borrows the rules of this one (same norm, closest flags), adapted and validated
# for the problem like any rule's config: fp16 has bf16's element size, so the same tiles, registers and bytes per
# row; fp32 rows hold twice the bytes. A config sized to a bf16 row carries over only where `carried_over` says.
# Why a stand-in's rules beat the analytic default there: docs/kernel-figures.md ("Stand-in dtypes").
STAND_IN_DTYPES = {"fp16": "bf16", "fp32": "bf16"}


def holds_rows(config: BackwardConfig) -> bool:
    """Whether a config sizes its register tile for the element size it was fitted on (`Strategy.holds_rows`:
    split rows, whose slices fill the registers, or recompute, which keeps the packed 16-bit tile live)."""
    return config.strategy.holds_rows(config.kernel_1)


def carried_over(config: BackwardConfig, stand_in: str, problem: Problem) -> tuple[BackwardConfig | None, str]:
    """A stand-in's `holds_rows` config for `problem`'s dtype, or None and why it does not carry over.

    - the same element size (fp16 on a bf16 rule): the config as it is. recompute widens the packed 16-bit tile
      again after the row reductions for either dtype (`widen_again`; sm_90 compile, RMSNorm 2048x16384 on a
      1x16384 recompute tile: 128 registers and no stack in bf16 and in fp16);
    - twice the element size (fp32): a split row in twice the slices, each of the same bytes, without recompute,
      that `adapt` then fits to the row (the config as it was runs slower than the analytic default; a whole row
      held in registers does not split well). Where twice the slices would pass ROW_SPLITS' largest, the largest
      split takes what it can and the tile holds fewer rows for the rest (a rule in 8 slices of 4x4096 runs fp32
      in 8 slices of 2x4096), the form the best configs of unseeded fp32 sweeps of 2048x32768 have.
    - fp32 rows of 8193-16384 columns from 512 rows (`heuristics.wide_fp32_rows`): none; the analytic default
      splits them in slices of 4096 columns on 2-row tiles, level with or faster than the bf16 LayerNorm rules
      carried in 8 slices of 4 x 2048 on every shape timed (docs/experiments/fp32_wide_rows.py).

    The measurements behind each case: docs/kernel-figures.md ("Stand-in dtypes").
    """
    dtype = problem.dtype
    factor = ITEMSIZE[dtype] // ITEMSIZE[stand_in]
    if factor == 1:
        return config, ""
    if wide_fp32_rows(problem):
        return None, f"{dtype} rows of 8193-16384 columns from 512 rows split in the analytic default's slices"
    return config.strategy.carry_over(config, problem, stand_in, factor)


def adapt(config: BackwardConfig, problem: Problem, sm_count: int | None = None,
          limits: DeviceLimits | None = None) -> BackwardConfig:
    """Make a rule's config valid for `problem` (its strategy's `adapt`: single pass takes block_col =
    next_pow2(N), two-pass past MAX_SINGLE_PASS; knobs that cannot apply are dropped); if it still cannot run,
    the analytic default. With `sm_count`, a problem too short to fill a quarter of the rule's grid with row tiles
    gets smaller row tiles; above a quarter the fitted tile is kept. `limits`: the device's (None: the reference
    device's), which the adapted config is validated for (once: the selection finds it validated). A rule that
    fits no form on that device is adapted for the reference device, so that the selection (`select.on_device`)
    says what the device lacks and why the analytic default runs instead."""
    fitted = config.strategy.adapt(config, problem, sm_count, limits)
    if fitted is None and limits is not None:
        fitted = config.strategy.adapt(config, problem, sm_count)
    return fitted or default_config(problem)
