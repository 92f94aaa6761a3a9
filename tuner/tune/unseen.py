"""The shapes a tune validates its table on: generated for each problem family of the plan, between and around the
shapes it fits (widths between two fitted widths or past the ends, row counts inside the fitted range or up to
twice beyond it), the same for the same plan on every host and every run. None of them is fitted, and none is a
shape of the held-out preset (kept for measuring the finished table)."""

from __future__ import annotations

import math
import random
from collections import defaultdict

from normtune.kernels.config import MAX_N, Problem

from .plan import HELDOUT_PRESET

ATTEMPTS = 200  # draws per shape before a family gives up on finding another unseen shape
AROUND = 0.25  # the share of widths (and of row counts) drawn past the fitted range rather than inside it


def _log_uniform(rng: random.Random, lo: float, hi: float) -> float:
    return math.exp(rng.uniform(math.log(lo), math.log(hi))) if hi > lo else lo


def _width(rng: random.Random, widths: list[int]) -> int:
    """A width between two fitted ones, or (AROUND of the time, or with one width) up to twice past either end;
    a multiple of 64 from 1024 columns (as model widths are), of 8 below."""
    if len(widths) > 1 and rng.random() >= AROUND:
        i = rng.randrange(len(widths) - 1)
        lo, hi = widths[i], widths[i + 1]
    elif rng.random() < 0.5:
        lo, hi = max(8, widths[0] // 2), widths[0]
    else:
        lo, hi = widths[-1], min(MAX_N, 2 * widths[-1])
    n = _log_uniform(rng, lo, hi)
    step = 64 if n >= 1024 else 8
    return int(min(MAX_N, max(step, round(n / step) * step)))


def _rows(rng: random.Random, rows: list[int]) -> int:
    lo, hi = rows[0], rows[-1]
    if rng.random() < AROUND or lo == hi:
        lo, hi = max(1, lo // 2), 2 * hi
    return max(1, round(_log_uniform(rng, lo, hi)))


def unseen_problems(problems: list[Problem], per_family: int, seed: str) -> list[Problem]:
    """`per_family` generated held-out problems for each family of `problems` (fewer where no more unseen shapes
    can be drawn), deterministic for `seed`; by family, then as drawn."""
    by_family: dict[str, list[Problem]] = defaultdict(list)
    for p in problems:
        by_family[p.family.key].append(p)
    out = []
    for key in sorted(by_family):
        fitted = by_family[key]
        family = fitted[0].family
        widths, rows = sorted({p.N for p in fitted}), sorted({p.M for p in fitted})
        taken = {(p.M, p.N) for p in fitted} | HELDOUT_PRESET
        rng = random.Random(f"{seed}/{key}")
        drawn: list[tuple[int, int]] = []
        for _ in range(per_family * ATTEMPTS):
            if len(drawn) == per_family:
                break
            shape = (_rows(rng, rows), _width(rng, widths))
            if shape not in taken:
                taken.add(shape)
                drawn.append(shape)
        out += [family.problem(M, N) for M, N in drawn]
    return out
