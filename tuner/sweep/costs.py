"""Where a sweep worker's wall clock goes: seconds per phase, kept while it runs and stored with its run.

The measuring process reports its own busy time per trial (the problem's inputs and reference, the correctness
first launch of each config, which loads or compiles its kernels, the rest of the correctness gate, and the
timed repetitions); the worker times its own
work: claiming slots and creating trials (database), the sampler's proposals, waiting on compile-ahead
processes, storing measurements and telling trials (database), and the heartbeats (their own thread). The
worker proposes and stores while the GPU measures, so these overlap the measuring; the GPU is idle for the
start-up (until the first trial is sent) and for `gpu_idle_s` = wall - start-up - measuring afterwards.
`compiles` counts the trials whose compile job was a seed's submitted before the trial's claim (`compile_ahead`)
and those compiled only once claimed, and `compile_jobs` sums their jobs' seconds in the compile processes (set
against the processes' number and the wall, how busy the pool was); `proposals`, the sampler's proposals that
became trials (and how many of them the proposer process made ahead, `proposer` its busy seconds) and those the
space rejected.

`timeline` holds when the start-up steps happened, in seconds since the command started (`timeline.mark`):
options parsed, measuring process spawned, its torch imported, its CUDA context made, ready (copy bandwidth
measured), the device detected, the compile processes ready, database open, first study open, first trial sent, its
result back, stored.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

from . import timeline

# The measuring process's phases, then the worker's own (in the order the closing line shows them).
MEASURING = ("inputs", "load", "gate", "timing")
WORKER = ("sampler", "database", "compile_wait", "heartbeat")
# The start-up steps of `timeline`, as the closing line names them.
# A `--devices` worker's timeline also holds its own spawn and start, and its launcher's steps (launcher_…).
STEPS = {"options": "options", "launcher_options": "options", "worker_spawned": "worker spawned",
         "launcher_workers_spawned": "workers spawned", "worker_started": "worker started",
         "measurer_spawned": "measuring process spawned", "launcher_store_open": "launcher's database open",
         "measurer_torch": "measuring process imported torch", "measurer_cuda": "its CUDA context",
         "measurer_ready": "measuring process ready", "device_detected": "device detected",
         "launcher_device_detected": "launcher's device detected", "compilers_ready": "compile processes ready",
         "launcher_compilers_ready": "compile processes ready", "store_open": "database open", "first_study": "first study",
         "first_sent": "first trial sent", "first_result": "first result", "first_stored": "first stored"}
LABELS = {"inputs": "inputs", "load": "load", "gate": "gate", "timing": "timing", "sampler": "sampler",
          "database": "database", "compile_wait": "compile wait", "heartbeat": "heartbeat"}


class Costs:
    """Seconds per phase of one worker, safe to add to from the heartbeat thread."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.startup_s: float | None = None  # until the first trial went to the measuring process, once started
        self.first_result_s: float | None = None  # until its result came back
        self.trials = 0
        self.phases: dict[str, float] = {name: 0.0 for name in MEASURING + WORKER}
        self.compiles = {"ahead": 0, "at_claim": 0}  # trials' compile jobs: a seed's submitted before its claim, or not
        # The sampler's proposals: made trials (`ahead` of them made by the proposer process), or refused by the space.
        self.proposals = {"kept": 0, "rejected": 0, "ahead": 0}
        self._lock = threading.Lock()

    def add(self, phase: str, seconds: float) -> None:
        with self._lock:
            self.phases[phase] = self.phases.get(phase, 0.0) + seconds

    @contextmanager
    def timed(self, phase: str):
        t = time.perf_counter()
        try:
            yield
        finally:
            self.add(phase, time.perf_counter() - t)

    def sent(self) -> None:
        """A trial went to the measuring process."""
        if self.startup_s is None:
            self.startup_s = time.perf_counter() - self.t0
            timeline.mark("first_sent")

    def measured(self, phases: dict[str, float]) -> None:
        """A result came back, with the measuring process's seconds per phase."""
        if self.first_result_s is None:
            self.first_result_s = time.perf_counter() - self.t0
            timeline.mark("first_result")
        self.trials += 1
        for name in MEASURING:
            self.add(name, float(phases.get(name, 0.0)))

    def to_dict(self) -> dict:
        with self._lock:
            wall = time.perf_counter() - self.t0
            measuring = sum(self.phases[name] for name in MEASURING)
            startup = self.startup_s if self.startup_s is not None else wall
            return {"wall_s": wall, "startup_s": startup, "first_result_s": self.first_result_s,
                    "trials": self.trials, "measuring_s": measuring,
                    "gpu_idle_s": max(0.0, wall - startup - measuring), **{f"{k}_s": v for k, v in self.phases.items()},
                    "compiles": dict(self.compiles), "proposals": dict(self.proposals),
                    "timeline": timeline.marks()}


def _step_order(item: tuple[str, float]) -> tuple:
    """Steps by when they happened; steps at the same moment in their usual order."""
    name, at = item
    order = list(STEPS)
    return at, order.index(name) if name in order else len(order), name


def line(costs: dict) -> str:
    """One line: the wall, the start-up, the measuring (and its share of the wall after start-up), what the worker
    did meanwhile, and the time the measuring process sat idle after start-up."""
    wall, startup = costs.get("wall_s") or 0.0, costs.get("startup_s") or 0.0
    after = wall - startup
    measuring = costs.get("measuring_s") or 0.0
    share = f" ({100 * measuring / after:.0f}% of the wall after start-up)" if after > 0 else ""
    first = costs.get("first_result_s")
    parts = [f"{wall:.1f} s wall, {costs.get('trials', 0)} trials",
             f"start-up {startup:.1f} s" + (f" (first result at {first:.1f} s)" if first is not None else ""),
             f"measuring {measuring:.1f} s{share}: "
             + ", ".join(f"{LABELS[k]} {costs.get(k + '_s', 0.0):.1f}" for k in MEASURING),
             "worker: " + ", ".join(f"{LABELS[k]} {costs.get(k + '_s', 0.0):.1f}" for k in WORKER),
             f"measuring process idle {costs.get('gpu_idle_s', 0.0):.1f} s after start-up"]
    compiles = costs.get("compiles") or {}
    if any(compiles.values()):
        pool = costs.get("compile_jobs_s")  # runs stored before it was kept have none
        parts.append(f"compiles: {compiles.get('ahead', 0)} ahead of their trial's claim, "
                     f"{compiles.get('at_claim', 0)} at it" + (f", {pool:.1f} s in the compile processes"
                                                               if pool is not None else ""))
    proposals = costs.get("proposals") or {}
    if any(proposals.values()):
        ahead = (f" ({proposals['ahead']} made ahead by the proposer process, busy "
                 f"{costs.get('proposer_s', 0.0):.1f} s)" if proposals.get("ahead") else "")
        parts.append(f"sampler proposals: {proposals.get('kept', 0)} kept{ahead}, {proposals.get('rejected', 0)} "
                     "rejected by the space")
    steps = costs.get("timeline") or {}
    if steps:
        parts.append("since the command started: " + ", ".join(
            f"{STEPS.get(k, k)} {v:.1f}" for k, v in sorted(steps.items(), key=_step_order)))
    return "; ".join(parts)
