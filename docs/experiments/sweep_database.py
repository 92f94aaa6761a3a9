"""A sweep worker's database time per trial (claims, trial rows, stored measurements with their tell, the studies'
upkeep) on SQLite, with one worker and with two workers on one file, on CPU: the measuring process is a stand-in
that answers after MEASURE_MS (as a GPU would be busy), no kernel runs.

    python docs/experiments/sweep_database.py [TRIALS] [MEASURE_MS] [REPEATS]

Sweeps 3 RMSNorm problems for TRIALS trials each (default 40; random sampler, no compile processes) on a fresh
SQLite file, REPEATS times (default 3) per setting, and prints, per setting, the database time per trial: the
workers' database seconds as their costs record them (the "database" phase of the closing line "where the time
went") over all the trials they measured; then how the trials fell to the workers and what the file ends with.
Two workers sweep the same problems from different places in the list, as `--devices` workers do. Compare two
checkouts by running this script with PYTHONPATH pointing at the other one (DEVELOPERS.md).
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import platform
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

PROBLEMS = [(4096, 1024), (2048, 2048), (1024, 4096)]


class StandIn:
    """The measuring process: a plausible time `seconds` after each `submit`."""

    seconds = 0.005

    def __init__(self, *args, **kwargs):
        self.phases, self._due = {}, 0.0

    def start(self):
        pass

    def submit(self, problem, config, best_us=None):
        self._due = time.perf_counter() + self.seconds

    def ready(self):
        return time.perf_counter() >= self._due

    def collect(self, timeout_s):
        from normtune.tuner.measure.harness import MeasureResult

        time.sleep(max(0.0, self._due - time.perf_counter()))
        self.phases = {"timing": self.seconds}
        return MeasureResult(status="ok", median_us=10.0 + hash(self._due) % 100 / 10, reps=20)

    def measure(self, problem, config, timeout_s):
        self.submit(problem, config)
        return self.collect(timeout_s)

    def interrupt(self):
        pass

    def close(self, wait_s: float = 0.0):
        pass


def worker(path: str, trials: int, index: int, workers: int, measure_s: float, start, out) -> None:
    """One sweep worker on `path`: waits for `start`, sweeps, sends its costs to `out`."""
    from normtune.kernels.config import Problem
    from normtune.tuner.gpu_info import detect
    from normtune.tuner.store.database import Store
    from normtune.tuner.sweep import driver
    from normtune.tuner.sweep.options import SweepOptions

    StandIn.seconds = measure_s
    driver.MeasuringProcess = StandIn
    info = dataclasses.replace(detect(interpret=True), sm_count=132)
    opts = SweepOptions(gpu_key="interpret", problems=[Problem("rms_norm", M, N, "bf16") for M, N in PROBLEMS],
                        trials=trials, sampler="random", interpret=True, compile_workers=0, worker_index=index,
                        workers=workers)
    with Store(f"sqlite:///{path}") as store:
        start.wait()
        costs = driver.Sweep(opts, store, info).run().costs
    out.put(costs)


def setting(workers: int, trials: int, measure_s: float) -> tuple[float, list[int], int]:
    """The sweep's database ms per trial (all its workers' database seconds over all their trials), each worker's
    trials, and the measurements the file holds."""
    ctx = mp.get_context("spawn")
    path = str(Path(tempfile.mkdtemp()) / "sweep.db")
    from normtune.tuner.store.database import Store

    Store(f"sqlite:///{path}").close()  # the schema, before the workers race to create it
    start, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=worker, args=(path, trials, i, workers, measure_s, start, out))
             for i in range(workers)]
    for p in procs:
        p.start()
    time.sleep(5.0)  # every worker imported and opened the store
    start.set()
    costs = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    stored = sqlite3.connect(path).execute("SELECT COUNT(*) FROM normtune_measurements").fetchone()[0]
    trials_each = [c["trials"] for c in costs]
    return 1000 * sum(c["database_s"] for c in costs) / max(1, sum(trials_each)), trials_each, stored


def main() -> None:
    trials = int(sys.argv[1]) if len(sys.argv) > 1 else 40
    measure_s = (float(sys.argv[2]) if len(sys.argv) > 2 else 5.0) / 1000
    repeats = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    import normtune

    print(f"normtune from {Path(normtune.__file__).resolve().parent}; {platform.processor() or platform.machine()}, "
          f"Python {platform.python_version()}, SQLite {sqlite3.sqlite_version}")
    for workers in (1, 2):
        per_trial, split, stored = [], [], set()
        for _ in range(repeats):
            ms, each, n = setting(workers, trials, measure_s)
            per_trial.append(ms)
            split.append(each)
            stored.add(n)
        print(f"{workers} worker(s), {len(PROBLEMS)} problems x {trials} trials, measuring {1000 * measure_s:.0f} ms: "
              f"database {statistics.median(per_trial):.2f} ms per trial (median of {repeats} sweeps, range "
              f"{min(per_trial):.2f}-{max(per_trial):.2f}); trials per worker {split}; measurements stored "
              f"{sorted(stored)}")


if __name__ == "__main__":
    main()
