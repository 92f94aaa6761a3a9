"""Where a sweep starts: the configs each study times first, before the sampler proposes its own.

`seeds` is the analytic default, then `strategies` (structurally different configs that a local search around
the default would not reach: each strategy's `Strategy.seeds`, in `SEED_ORDER`, then a fused reduction with wide
column blocks under the default's kernel_1, then what the strategies derive from those, `Strategy.expand_seeds`),
then the default's one-step neighbours. Only configs the space allows are returned, in their canonical form
(`Space.worth_measuring`). A change to what this module or a strategy's seeds return is a new SEED_VERSION
(`sweep/options.py`).
"""

from __future__ import annotations

from normtune.kernels.config import BackwardConfig, Kernel2Config, default_config
from normtune.kernels.heuristics import MAX_COLUMNS_ROWS, next_power_of_two
from normtune.kernels.strategies import SEED_ORDER, in_order
from normtune.kernels.strategies.columns import FEW_ROWS  # noqa: F401 - where the light few-row seeds stop

# `space` below is the `space.Space` that calls this module with itself (this module does not import it).


def strategies(space) -> list[BackwardConfig]:
    """Structurally different configs a local search around the default would not reach."""
    p, base = space.problem, default_config(space.problem, space.limits)
    alts: list[BackwardConfig] = []
    ordered = in_order(SEED_ORDER)
    for strategy in ordered:
        alts += strategy.seeds(space, base)
    wide = min(128, next_power_of_two(p.N))
    alts.append(BackwardConfig(base.kernel_1, Kernel2Config(block_m=32, block_n=wide, num_warps=4, fused=True)))
    for strategy in ordered:
        alts += strategy.expand_seeds(space, [base] + alts)
    return space.worth_measuring(alts)


def seeds(space) -> list[BackwardConfig]:
    """The analytic default, structural alternatives (`strategies`) and the default's one-step neighbours
    (each knob moved to the adjacent domain value, where the default's strategy takes it: `Strategy.neighbour`;
    moved to another strategy, the default's shared knobs with that strategy's own at their first values)."""
    base = space.canonical(default_config(space.problem, space.limits))
    few = space.problem.M <= MAX_COLUMNS_ROWS  # few rows: the row-sweeping strategies first (a budgeted sweep
    out = [base] + sorted(space.strategies(), key=lambda c: few and not c.strategy.sweeps_rows)  # reaches them)
    return list(dict.fromkeys(out + neighbours(space, base)))


def neighbours(space, config: BackwardConfig) -> list[BackwardConfig]:
    """`config`'s one-step neighbours the space allows, canonical, in knob order: each of its strategy's knobs
    moved to the adjacent domain value, where the strategy takes it (`Strategy.neighbour`); moved to another
    strategy, the shared knobs kept and that strategy's own at their first values."""
    d = space.domains(config.kernel_1.strategy)
    params = space.params(config)
    out: list[BackwardConfig] = []
    for key, dom in d.items():
        cur = params.get(key)
        if cur not in dom:
            continue
        i = dom.index(cur)
        for j in (i - 1, i + 1):
            if 0 <= j < len(dom) and config.strategy.neighbour(key, dom[j], config.kernel_1, space.problem):
                moved = {**params, key: dom[j]}
                if key == "k1.strategy":
                    moved = {**{k: v[0] for k, v in space.domains(dom[j]).items()}, **params, key: dom[j]}
                out += space.worth_measuring([space.config(moved)])
    return list(dict.fromkeys(out))
