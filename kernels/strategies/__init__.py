"""The kernel_1 strategies, one module each, and the registry that lists them: `STRATEGIES` maps a config's
`kernel_1.strategy` to its `Strategy` object (`base.py` is the contract, `registry.py` the registry, `configs.py`
the `BackwardConfig` that pairs a strategy's kernel_1 config with kernel_2's). Nothing outside this package
branches on a strategy's name: it asks the config's strategy (`BackwardConfig.strategy`) or walks the registry,
when it needs it (`register` adds a strategy at any time).
"""

from __future__ import annotations

from ..knobs import Knob, knob
from ..limits import REFERENCE, DeviceLimits
from ..problem import Problem
from .base import KERNEL_1_DOMAINS, KERNEL_2_DOMAINS, Strategy
from .columns import COLUMNS, ColumnsConfig
from .configs import BackwardConfig, kernel_1_config, kernel_1_layout
from .dual import DUAL, DualConfig
from .registry import STRATEGIES, lookup, register
from .rows import ROWS, RowsConfig

for _strategy in (ROWS, COLUMNS, DUAL):
    register(_strategy)
# Which strategy's analytic default runs a problem: the first that gives one (rows always does).
DEFAULT_ORDER = ("columns", "rows")
# The order in which the strategies' seeds are timed (strategies not listed follow, in registry order).
SEED_ORDER = ("rows", "dual", "columns")

__all__ = ["DEFAULT_ORDER", "KERNEL_1_DOMAINS", "KERNEL_2_DOMAINS", "SEED_ORDER", "STRATEGIES", "BackwardConfig",
           "ColumnsConfig", "DualConfig", "Knob", "RowsConfig", "Strategy", "default_config", "in_order",
           "kernel_1_config", "kernel_1_layout", "knob", "lookup", "num_programs", "partial_rows", "register"]


def in_order(names: tuple[str, ...]) -> list[Strategy]:
    """The registered strategies, those named first in the order given."""
    return [STRATEGIES[n] for n in names if n in STRATEGIES] + [s for n, s in STRATEGIES.items() if n not in names]


def default_config(problem: Problem, limits: DeviceLimits | None = None) -> BackwardConfig:
    """The analytic default: used when no tuned table covers the problem (`Strategy.default` of each strategy in
    DEFAULT_ORDER, the first that applies), sized for the device of `limits` (the reference device without)."""
    for strategy in in_order(DEFAULT_ORDER):
        config = strategy.default(problem, limits or REFERENCE)
        if config is not None:
            return config
    raise AssertionError("the rows strategy gives every problem a default")


def num_programs(M: int, N: int, config: BackwardConfig, sms: int) -> int:
    """Programs kernel_1 launches (0 rows: none)."""
    return 0 if M <= 0 else config.strategy.programs(M, N, config, sms)


def partial_rows(M: int, config: BackwardConfig, sms: int) -> int:
    """Rows of the fp32 partial dw/db buffers kernel_1 writes (none without partials)."""
    return 0 if M <= 0 else config.strategy.partial_rows(M, config, sms)
