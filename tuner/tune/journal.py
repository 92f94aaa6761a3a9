"""A tune's decisions, kept in the results database, so that the same command run again (after a kill, or on
another host sharing the database) continues from them rather than from anything held in memory.

The journal is an Optuna study without trials, named after the tune (`Plan.journal_name`), whose user attributes
hold one JSON value per key (below). What was measured is never kept here: the measurements are in the normtune
tables, found again through the tune's studies and the runs the journal names. Only what the tune decided from
them is: the rounds that set each problem's trial target, the problems added where validation pointed, the runs
of its re-measurements, each emitted table, each validation's regret and when it came, and the gate's
verdicts. Every write is one transaction, so a kill loses at most the decision being written.
"""

from __future__ import annotations

import time

PLAN = "plan"  # the plan as first recorded: settings, problems, held-out problems
INCUMBENT = "incumbent"  # {"label", "table"} of the table the tune must not lose to (null: none)
# each round's decision: every problem's target, those raised, stalled, given the freed trials, and its transfers
# (problem key -> {"slot": the first slot they fill, "configs": [config dict]}, `transfer.py`)
ROUNDS = "rounds"
SWEEP_DONE = "sweep_done"  # the rounds ended: no problem's search pays any more (or all reached --trials)
REMEASURE_RUNS = "remeasure_runs"  # ids of the runs holding the neighbour re-measurements
EMISSIONS = "emissions"  # each emitted table: {"index", "inputs", "table", "elapsed_s"}
VALIDATIONS = "validations"  # each validation: {"emission", "elapsed_s", "summary", "rows", ...}
RESWEEPS = "resweeps"  # each sweep where the held-out regret was highest: {"validation", "added", "targets"}
GATES = "gates"  # emission index (text) -> the gate's verdict and the table it let through
CLOCK = "clock"  # [started, last seen] wall-clock times (epoch seconds) of each run of the command


class Journal:
    """The journal study of one tune. Reads come from a copy taken at open (`refresh` takes another); writes go
    to the database at once."""

    def __init__(self, store, name: str):
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.name = name
        self.study = optuna.create_study(study_name=name, storage=store.optuna_storage(), direction="minimize",
                                         load_if_exists=True)
        self._attrs = dict(self.study.user_attrs)
        self._run = None

    def refresh(self) -> None:
        self._attrs = dict(self.study.user_attrs)

    def get(self, key: str, default=None):
        value = self._attrs.get(key)
        return default if value is None else value

    def put(self, key: str, value) -> None:
        self.study.set_user_attr(key, value)
        self._attrs[key] = value

    def append(self, key: str, item) -> int:
        """Add `item` to the list under `key`; returns its index."""
        items = list(self.get(key, []))
        items.append(item)
        self.put(key, items)
        return len(items) - 1

    # ------------------------------------------------------------------------------ elapsed time, over runs

    def start_run(self) -> None:
        """Record that a run of the command starts now (its time counts towards `elapsed_s`)."""
        now = time.time()
        self._run = self.append(CLOCK, [now, now])

    def touch(self) -> None:
        """Record that the current run was alive now (a killed run's time counts up to its last touch)."""
        if self._run is None:
            return
        clock = [list(c) for c in self.get(CLOCK, [])]
        clock[self._run][1] = time.time()
        self.put(CLOCK, clock)

    def elapsed_s(self) -> float:
        """Seconds this tune has run, over every run of the command: earlier runs up to their last touch, the
        current one up to now."""
        now, total = time.time(), 0.0
        for i, (started, last) in enumerate(self.get(CLOCK, [])):
            total += (now if i == self._run else last) - started
        return total
