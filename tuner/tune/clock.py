"""The time budget of one run of `normtune tune` (`--time-budget`): a hard wall-clock limit counted from the
command's start. The final steps (fitting the table, gating it, writing it and the report) keep a reserve; each
phase before them gets its share of what is left, by weight against the phases still to come, so that time a phase
does not need goes to the later ones. Every phase checks its own deadline, and the sweep gets its share as its own
time budget."""

from __future__ import annotations

import time

# The final steps' reserve: a share of the budget, at least and at most so many seconds.
RESERVE_SHARE, RESERVE_MIN_S, RESERVE_MAX_S = 0.05, 5.0, 30.0


class Clock:
    def __init__(self, budget_s: float | None, started: float | None = None):
        self.budget_s = budget_s
        self.started = time.monotonic() if started is None else started
        self.reserve_s = 0.0 if budget_s is None else min(max(RESERVE_MIN_S, RESERVE_SHARE * budget_s),
                                                          RESERVE_MAX_S, budget_s / 2)

    def elapsed_s(self) -> float:
        return time.monotonic() - self.started

    def left_s(self) -> float | None:
        """Seconds to the hard limit (None: no budget)."""
        return None if self.budget_s is None else self.budget_s - self.elapsed_s()

    def free_s(self) -> float | None:
        """Seconds the phases before the final steps may still use (None: no budget)."""
        left = self.left_s()
        return None if left is None else left - self.reserve_s

    def out(self) -> bool:
        """The phases' time is spent: only the final steps may run."""
        free = self.free_s()
        return free is not None and free <= 0

    def share_s(self, weight: float, *later: float) -> float | None:
        """The seconds a phase of `weight` may use, with phases of weights `later` still to come (None: no
        budget)."""
        free = self.free_s()
        if free is None:
            return None
        return max(0.0, free * weight / (weight + sum(later)))

    def deadline(self, seconds: float | None) -> float | None:
        """The monotonic time `seconds` from now (None: none)."""
        return None if seconds is None else time.monotonic() + seconds
