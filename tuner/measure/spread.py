"""Times with their spread, and the one rule for "slower beyond the spread" that emit, validate and compare share.

Every measurement stores its median and its p10/p90 over repetitions. Repeated measurements of one config are
pooled: the median of their medians, and a range that holds both the spread within each measurement (the median
of their p10s and p90s) and the spread between them (the 10th and 90th percentiles of their medians). A is slower than B *beyond the spread* when its median is higher and even
A's fast end (p10) is slower than B's slow end (p90): the two ranges do not overlap. Ratios come with bounds
from the same ranges: A/B lies in [A.p10/B.p90, A.p90/B.p10].
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Iterable


@dataclass(frozen=True)
class Timing:
    """Median, p10 and p90 in µs, pooled over `count` measurements."""

    median: float
    p10: float
    p90: float
    count: int = 1

    @classmethod
    def pool(cls, results: Iterable) -> "Timing | None":
        """Pool correct measurements (anything with status, median_us, p10_us, p90_us); None when none ran."""
        ok = [r for r in results if r.status == "ok" and r.median_us and r.median_us > 0]
        if not ok:
            return None
        medians = [r.median_us for r in ok]
        # A measurement without a stored spread counts as its median (no spread known).
        p10 = [r.p10_us if r.p10_us else r.median_us for r in ok]
        p90 = [r.p90_us if r.p90_us else r.median_us for r in ok]
        between = statistics.quantiles(medians, n=10, method="inclusive") if len(medians) > 1 else medians * 9
        return cls(statistics.median(medians), min(statistics.median(p10), between[0]),
                   max(statistics.median(p90), between[-1]), len(ok))


@dataclass(frozen=True)
class Ratio:
    """A / B as a ratio of medians, with bounds from the spreads."""

    value: float
    low: float
    high: float

    @classmethod
    def of(cls, a: Timing | None, b: Timing | None) -> "Ratio | None":
        if a is None or b is None:
            return None
        return cls(a.median / b.median, a.p10 / b.p90, a.p90 / b.p10)

    @property
    def beyond_spread(self) -> bool:
        """Whether the ratio differs from 1 beyond the measured spread (its bounds exclude 1)."""
        return self.low > 1.0 or self.high < 1.0


def slower_beyond_spread(a: Timing, b: Timing, threshold: float = 0.0) -> bool:
    """A is slower than B by more than `threshold` (a fraction: 0.03 allows three hundredths) and beyond the spread of both."""
    return a.median > b.median * (1.0 + threshold) and a.p10 > b.p90
