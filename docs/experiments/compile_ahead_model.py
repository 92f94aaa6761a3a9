"""The sweep's scheduling of compiles against measurements, in a model: the real sweep worker (claims, Optuna,
the store, the seeds compiled ahead) with a stand-in GPU and a stand-in compile pool, on CPU.

    python docs/experiments/compile_ahead_model.py [TRIALS] [MEASURE_MS] [COMPILE_MS] [PROCESSES]

Sweeps the 30 seed problems (both norms, bf16) for TRIALS trials each (default 30) on a fresh SQLite database,
three times: as before the compile-ahead changes (6 trials held ahead of the measurement, the only ones
compiling), with the seeds also compiled ahead of their claims (`tuner/sweep/compile_ahead.py`), and with both
that and the worker holding as many trials ahead as the pool has processes (`SweepOptions.held_ahead`). The stand-in measuring process is busy MEASURE_MS
per trial (default 28); the stand-in pool has PROCESSES threads (default 14), each compile taking COMPILE_MS
(default 600) for every trial. Every trial compiling from scratch is the worst case of an empty Triton cache: a
real sweep's configs that share a binary find it in the cache. Prints, per variant, the wall, the stand-in GPU's
busy share after the first result, the worker's compile wait and the most compiles that ran at once.
"""

from __future__ import annotations

import dataclasses
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from normtune.kernels.config import Problem
from normtune.tuner.gpu_info import detect
from normtune.tuner.shapes import SEED
from normtune.tuner.store.database import Store
from normtune.tuner.sweep import compile_ahead, driver
from normtune.tuner.sweep.options import SweepOptions
from sweep_overhead import BusyMeasurer as StandInGPU  # busy `seconds` after each submit, beside this script


class StandInPool:
    """`processes` threads, each compile taking `seconds`; counts the most compiles running at once."""

    def __init__(self, processes: int, seconds: float):
        self._threads, self._seconds = ThreadPoolExecutor(processes), seconds
        self._lock, self.running, self.peak, self.jobs = threading.Lock(), 0, 0, 0

    def submit(self, fn, problem: dict, config_json: str, sms: int):
        self.jobs += 1
        return self._threads.submit(self._compile)

    def _compile(self):
        with self._lock:
            self.running += 1
            self.peak = max(self.peak, self.running)
        time.sleep(self._seconds)
        with self._lock:
            self.running -= 1
        return "ok", self._seconds, None

    def shutdown(self, wait: bool = False, cancel_futures: bool = True) -> None:
        self._threads.shutdown(wait=False, cancel_futures=cancel_futures)


VARIANTS = {"before (6 held, no seeds ahead)": (False, 6), "seeds ahead, 6 held": (True, 6),
            "seeds ahead, one held per process": (True, None)}


def run(name: str, trials: int, processes: int, compile_s: float) -> str:
    ahead, held = VARIANTS[name]
    info = dataclasses.replace(detect(interpret=True), sm_count=132)  # an H100's grid sizes for the search space
    problems = [Problem(norm, M, N, "bf16") for norm in ("rms_norm", "layer_norm") for M, N in SEED]
    opts = SweepOptions(gpu_key="interpret", problems=problems, trials=trials, interpret=True,
                        compile_workers=processes, lookahead=held)
    pool = StandInPool(processes, compile_s)
    warm = compile_ahead.CompileAhead.warm
    if not ahead:
        compile_ahead.CompileAhead.warm = lambda self, seeds: None
    try:
        with Store(f"sqlite:///{Path(tempfile.mkdtemp()) / 'model.db'}") as store:
            t = time.perf_counter()
            summary = driver.Sweep(opts, store, info, helpers=(StandInGPU(), pool)).run()
            wall = time.perf_counter() - t
    finally:
        compile_ahead.CompileAhead.warm = warm
    costs = summary.costs
    after = wall - costs["first_result_s"]
    busy = costs["measuring_s"] / after if after > 0 else float("nan")
    return (f"{name}: {costs['trials']} trials in {wall:.1f} s, GPU busy "
            f"{100 * busy:.0f} % after the first result (at {costs['first_result_s']:.1f} s), compile wait "
            f"{costs['compile_wait_s']:.1f} s, {pool.jobs} compiles, at most {pool.peak} at once")


def main() -> None:
    args = sys.argv[1:]
    trials = int(args[0]) if args else 30
    StandInGPU.seconds = (float(args[1]) if len(args) > 1 else 28.0) / 1000
    compile_s = (float(args[2]) if len(args) > 2 else 600.0) / 1000
    processes = int(args[3]) if len(args) > 3 else 14
    print(f"30 problems x {trials} trials; measurement {StandInGPU.seconds * 1000:.0f} ms, compile "
          f"{compile_s * 1000:.0f} ms, {processes} compile processes")
    for name in VARIANTS:
        print(run(name, trials, processes, compile_s))


if __name__ == "__main__":
    main()
