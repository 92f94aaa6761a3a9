"""The shapes a tune validates its table on: generated for each problem family of the plan, over and around the
region it fits (widths inside the fitted range or up to twice past its ends, row counts inside the fitted range or
up to twice beyond it, no problem larger than the largest fitted), each draw of a family in its own log-slice of
the widths and of the rows so that the draws span the region, the same for the same plan on every host and every
run. None of them is fitted, and none is a
shape of the held-out preset (kept for measuring the finished table)."""

from __future__ import annotations

import math
import random
from collections import defaultdict

from normtune.kernels.config import MAX_N, Problem

from ..shapes import snap_width
from .plan import HELDOUT_PRESET

ATTEMPTS = 200  # draws per shape before a family gives up on finding another unseen shape
AROUND = 0.25  # the share of widths (and of row counts) drawn past the fitted range rather than inside it


def _log_uniform(rng: random.Random, lo: float, hi: float) -> float:
    return math.exp(rng.uniform(math.log(lo), math.log(hi))) if hi > lo else lo


def _slice(rng: random.Random, lo: float, hi: float, part: tuple[int, int] | None) -> float:
    """Log-uniform in [lo, hi]; in its `part` = (i, of n) log-slice when given."""
    if part is None or hi <= lo:
        return _log_uniform(rng, lo, hi)
    i, n = part
    a, b = math.log(lo), math.log(hi)
    return math.exp(rng.uniform(a + (b - a) * i / n, a + (b - a) * (i + 1) / n))


def _width(rng: random.Random, widths: list[int], part: tuple[int, int] | None = None) -> int:
    """A width inside the fitted range (in its `part` of the range on a log scale, so that the draws of a family
    span it), or (AROUND of the time) up to twice past either end; a multiple of 64 from 1024 columns, of 8
    below."""
    lo, hi = widths[0], widths[-1]
    if rng.random() < AROUND or lo == hi:
        lo, hi = (max(8, lo // 2), lo) if rng.random() < 0.5 else (hi, min(MAX_N, 2 * hi))
        part = None
    return snap_width(_slice(rng, lo, hi, part))


def _rows(rng: random.Random, rows: list[int], part: tuple[int, int] | None = None,
          most: int | None = None) -> int:
    """A row count inside the fitted range (in its `part`, as for widths), or (AROUND of the time) up to twice
    beyond it; at most `most`."""
    lo, hi = rows[0], rows[-1]
    if rng.random() < AROUND or lo == hi:
        lo, hi = max(1, lo // 2), 2 * hi
        part = None
    if most is not None:
        hi = max(1, min(hi, most))
        lo = min(lo, hi)
    return max(1, round(_slice(rng, lo, hi, part)))


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
        most = max(p.M * p.N for p in fitted)  # no larger a problem than the largest fitted
        rng = random.Random(f"{seed}/{key}")
        order = list(range(per_family))
        rng.shuffle(order)  # the k-th draw: the k-th slice of the widths, a shuffled slice of the rows
        drawn: list[tuple[int, int]] = []
        for attempt in range(per_family * ATTEMPTS):
            if len(drawn) == per_family:
                break
            k = len(drawn)
            parts = ((k, per_family), (order[k], per_family)) if attempt < per_family * ATTEMPTS // 2 else (None, None)
            N = _width(rng, widths, parts[0])
            shape = (_rows(rng, rows, parts[1], max(1, most // N)), N)
            if shape not in taken:
                taken.add(shape)
                drawn.append(shape)
        out += [family.problem(M, N) for M, N in drawn]
    return out
