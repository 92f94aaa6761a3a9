"""Where a tune sweeps again after a validation (`decide`): at the held-out shapes where the table's regret is
highest, as far as the spread of the timings shows (ranked by the regret's lower bound; a shape whose table could
be as fast as the best within the spread, as the tiniest shapes' noisy timings often are, is not swept for). A
held-out shape is never fitted; what is added is a fitted shape at its width, on the family's fitted
row count nearest to its own (twice its rows where that is its own), which teaches the table that width, and one
more step of trials for the family's fitted problems nearest to it (on a log scale of rows and columns). With time
left after the tune's first resweeps, those steps may go past `--trials` (`decide`'s ceiling)."""

from __future__ import annotations

import math

from normtune.kernels.config import Problem

from .plan import HELDOUT_PRESET
from .rounds import first_round, round_step

WORST_SHARE = 0.25  # the share of the held-out shapes swept again at most (at least one)
MIN_REGRET = 1.01  # a held-out shape whose regret is no higher is not worth another sweep
NEAREST = 2  # fitted problems per worst shape given one more step


def _distance(a: Problem, b: Problem) -> float:
    return math.hypot(math.log(a.M or 1) - math.log(b.M or 1), math.log(a.N) - math.log(b.N))


def worth_resweeping(regret) -> bool:
    """Whether a held-out shape's regret (a `Ratio`) draws a resweep: above MIN_REGRET, and above 1 by its lower
    bound (the table slower than the best beyond the spread)."""
    return regret is not None and regret.value > MIN_REGRET and regret.low > 1.0


def decide(rows, fitted: list[Problem], heldout: list[Problem], targets: dict[str, int],
           trials: int, ceiling: int | None = None) -> dict | None:
    """The resweep after a validation (its `ValidationRow`s): {"added": [problem dicts], "targets": {key: trials}},
    or None when no held-out shape's regret is high enough to pay. Targets go up to `ceiling` (default `trials`):
    past `trials` only for the problems nearest to the worst held-out shapes, where more search pays."""
    ceiling = trials if ceiling is None else max(trials, ceiling)
    ranked = sorted((r for r in rows if worth_resweeping(r.regret)), key=lambda r: (-r.regret.low, r.problem.key))
    worst = ranked[:max(1, math.ceil(WORST_SHARE * len(rows)))]
    if not worst:
        return None
    step = round_step(trials)
    taken = {(p.family.key, p.M, p.N) for p in fitted + heldout}
    added, raised = [], {}
    for row in worst:
        h = row.problem
        family = [p for p in fitted if p.family == h.family]
        if not family:
            continue
        rows_near = min({p.M for p in family}, key=lambda m: (abs(math.log(m or 1) - math.log(h.M or 1)), m))
        M = rows_near if rows_near != h.M else 2 * h.M
        if (h.family.key, M, h.N) not in taken and (M, h.N) not in HELDOUT_PRESET:
            bridge = h.family.problem(M, h.N)
            taken.add((h.family.key, M, h.N))
            added.append(bridge)
            raised[bridge.key] = min(trials, first_round(trials) + step)
        for p in sorted(family, key=lambda q: (_distance(q, h), q.key))[:NEAREST]:
            raised[p.key] = min(ceiling, max(raised.get(p.key, 0), targets.get(p.key, 0) + step))
    raised = {k: v for k, v in raised.items() if v > targets.get(k, 0)}
    if not raised:
        return None
    return {"added": [p.to_dict() for p in added], "targets": dict(sorted(raised.items())),
            "worst": [{"problem": r.problem.key, "regret": round(r.regret.value, 4)} for r in worst]}
