"""Transfers: the best config found on one problem, measured on the problems of its family nearest to it, inside
their studies, so that their local search moves from it where it wins.

Problems of one family often share their winning config over a range of shapes, but each study searches alone:
its local sampler moves one knob at a time from its own best, and a config many knobs away that wins on the
problem next to it is never reached. After each round from the seeds' round on, every fitted problem P gets up
to K transfers: the other problems of P's family, nearest first by `distance` (at most NEAREST of them), each
give their best measured config, adapted to P as the warm start adapts a table's (`warm.for_problem`); a config
P's study already holds, or one already chosen, is passed over. The rounds (`rounds.with_transfers`) put them in
P's next slots, recorded in the journal before they are measured. The choice reads only the measurements, its ties
broken by key and config, so that every run and host makes the same one."""

from __future__ import annotations

import math
from typing import Callable, Iterable

from normtune.kernels.config import BackwardConfig, Problem

K = 3  # transfers per problem and round
NEAREST = 8  # the problems of the family looked at, nearest first


def distance(p: Problem, q: Problem) -> float:
    """How far apart two shapes are, in log space, a width ratio counting twice a row-count ratio (the config that
    wins changes with the width far more than with the rows)."""
    return abs(math.log(max(1, p.M) / max(1, q.M))) + 2.0 * abs(math.log(p.N / q.N))


def best_config(records: Iterable) -> BackwardConfig | None:
    """The config of the fastest correct measurement among `records` (ties: the smaller config JSON); None
    where none ran correctly."""
    ok = [(m.median_us, m.config.to_json(), m.config) for m in records
          if m.status == "ok" and m.median_us is not None]
    return min(ok, key=lambda t: t[:2])[2] if ok else None


def nearest(problem: Problem, problems: list[Problem], count: int = NEAREST) -> list[Problem]:
    """The other problems of `problem`'s family, nearest first (ties by key), at most `count`."""
    family = problem.family.key
    others = [q for q in problems if q.family.key == family and q.key != problem.key]
    return sorted(others, key=lambda q: (distance(problem, q), q.key))[:count]


def choose(problems: list[Problem], best: dict[str, BackwardConfig | None], held: dict[str, set],
           fit: Callable[[BackwardConfig, Problem], BackwardConfig | None], k: int = K,
           count: int = NEAREST) -> dict[str, list[BackwardConfig]]:
    """Problem key → its transfers, in slot order (problems without any are left out). `best`: each problem's
    best measured config (None: none ran); `held`: the configs each study holds, as its space measures them;
    `fit(config, problem)`: the config as `problem`'s space measures it, or None where it does not run there."""
    out = {}
    for p in sorted(problems, key=lambda q: q.key):
        chosen: list[BackwardConfig] = []
        for q in nearest(p, problems, count):
            config = best.get(q.key)
            if config is None:
                continue
            config = fit(config, p)
            if config is None or config in held.get(p.key, set()) or config in chosen:
                continue
            chosen.append(config)
            if len(chosen) == k:
                break
        if chosen:
            out[p.key] = chosen
    return out


def transfers(ctx, problems: list[Problem], measured: dict[str, list]) -> dict[str, list[dict]]:
    """`choose` over the tune's measurements (`measured`: problem key → its study's measurements,
    `emission.study_measurements`): problem key → its transfers' config dicts, for the journal."""
    from ..space import Space
    from .warm import for_problem

    limits, sm_count = ctx.limits(), ctx.info.sm_count
    spaces = {p.key: Space(p, sm_count, limits) for p in problems}
    held = {p.key: {spaces[p.key].canonical(m.config) for m in measured[p.key]} for p in problems}
    best = {p.key: best_config(measured[p.key]) for p in problems}
    chosen = choose(problems, best, held, lambda c, p: for_problem(c, p, spaces[p.key], limits, sm_count))
    return {key: [c.to_dict() for c in configs] for key, configs in chosen.items()}
