"""The sweep process's own cost per trial (Optuna's sampler and its database work, the claims, the store), with the
GPU measurement replaced by a stand-in that answers at once: what a sweep spends beside measuring and compiling.

    python docs/experiments/sweep_overhead.py [TRIALS] [DB_PATH] [MEASURE_MS]

Sweeps the 15 RMSNorm seed shapes (bf16) for TRIALS trials each (default 40) on a fresh SQLite database
(default: a temporary file) and prints the wall time, the sweep's trials and the Optuna trials it created.
Runs on CPU; no GPU and no kernel is involved. With MEASURE_MS, the stand-in is busy that long per trial, as a
GPU would be (and reports it as timing): the wall then shows how much of the sweep's own work hides behind it.
TPE's proposals are made ahead in the proposer process, as on a GPU; PROPOSE_AHEAD=0 makes them in the sweep's
own thread.
"""

from __future__ import annotations

import dataclasses
import os
import random
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

from normtune.kernels.config import Problem
from normtune.tuner.gpu_info import detect
from normtune.tuner.measure.harness import MeasureResult
from normtune.tuner.shapes import SEED
from normtune.tuner.store.database import Store
from normtune.tuner.sweep import costs_line, driver
from normtune.tuner.sweep.options import SweepOptions


class BusyMeasurer:
    """Stands in for the measuring process: busy MEASURE_MS after each `submit`, while the sweep goes on."""

    seconds = 0.0

    def __init__(self, *args, **kwargs):
        self.phases, self._due = {}, 0.0

    def start(self):
        pass

    def submit(self, problem, config, best_us=None):
        self._due = time.perf_counter() + self.seconds

    def ready(self):
        return time.perf_counter() >= self._due

    def collect(self, timeout_s):
        time.sleep(max(0.0, self._due - time.perf_counter()))
        self.phases = {"timing": self.seconds}
        us = random.uniform(10.0, 20.0)
        return MeasureResult(status="ok", median_us=us, p10_us=us * 0.99, p90_us=us * 1.01, reps=20)

    def measure(self, problem, config, timeout_s):  # what a sweep without submit/collect calls
        self.submit(problem, config)
        return self.collect(timeout_s)

    def interrupt(self):
        pass

    def close(self):
        pass


class InstantMeasurer:
    """Stands in for the measuring process: a plausible time at once."""

    def __init__(self, *args, **kwargs):
        pass

    def start(self):
        pass

    def measure(self, problem, config, timeout_s):
        us = random.uniform(10.0, 20.0)
        return MeasureResult(status="ok", median_us=us, p10_us=us * 0.99, p90_us=us * 1.01, reps=20)

    def interrupt(self):
        pass

    def close(self):
        pass


def main() -> None:
    trials = int(sys.argv[1]) if len(sys.argv) > 1 else 40
    path = Path(sys.argv[2]) if len(sys.argv) > 2 else Path(tempfile.mkdtemp()) / "overhead.db"
    driver.MeasuringProcess = InstantMeasurer
    if len(sys.argv) > 3:
        BusyMeasurer.seconds = float(sys.argv[3]) / 1000
        driver.MeasuringProcess = BusyMeasurer
    info = dataclasses.replace(detect(interpret=True), sm_count=132)  # an H100's grid sizes for the search space
    problems = [Problem("rms_norm", M, N, "bf16", "bf16", True, False, False, "input") for M, N in SEED]
    opts = SweepOptions(gpu_key="interpret", problems=problems, trials=trials, interpret=True, compile_workers=0,
                        propose_ahead=os.environ.get("PROPOSE_AHEAD", "1") != "0")
    with Store(f"sqlite:///{path}") as store:
        t = time.perf_counter()
        summary = driver.Sweep(opts, store, info).run()
        wall = time.perf_counter() - t
    measured = sum(p.trials for p in summary.problems)
    states = dict(sqlite3.connect(path).execute("SELECT state, COUNT(*) FROM trials GROUP BY state").fetchall())
    print(f"{len(problems)} problems x {trials} trials: {wall:.1f} s, {measured} measured, "
          f"{1000 * wall / max(1, measured):.0f} ms per measured trial; Optuna trials by state: {states}")
    print(f"where the time went: {costs_line(summary.costs)}")


if __name__ == "__main__":
    main()
