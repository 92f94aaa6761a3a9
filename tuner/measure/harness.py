"""One measurement: cold-L2 timing of one (problem, config) with a per-kernel split (`stopwatch.py`), behind the
correctness gate, and `MeasureSession`, the per-device setup (copy bandwidth, L2 flush buffer, spin calibration,
timing preset) built once and shared by sweep, emit, validate and bench.

The forward is run once, untimed. Repetitions continue until `min_reps` are done and either `max_reps` or the time
budget is reached; the median, p10 and p90 are reported. A sweep's trial races the best of its problem so far: once
`race_after` repetitions put its median beyond `race_margin` times that best, it stops there (a clear loser needs
no more precision than that to be ranked below it). This is the "GPU time, host hidden" view; `views.py`
holds the kernel-sum and host-µs views.

Failures are results, not crashes: a config that does not compile is `compile_error`, one that needs more
registers or shared memory than the GPU has is `out_of_resources`, one that computes wrong values is `incorrect`.
"""

from __future__ import annotations

import math
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from normtune.kernels.config import BackwardConfig, ConfigError, Problem

from . import views
from .cases import (GATE_TOLERANCE, Case, CaseCache, Reference, gate, make_case,  # noqa: F401 - public names
                    relative_error)
from .results import (STATUSES, MeasureResult, Stats, bytes_moved, classify_exception,  # noqa: F401
                      error_text, floor_bytes, floor_us, percentile)
from .stopwatch import (CYCLES_PER_US, SPIN_CYCLES, SPIN_US, L2Flusher, calibrate_spin, copy_bandwidth,
                        split_kernel_times, time_kernels)

# The device memory a session may keep problems' inputs and references in (`CaseCache`), and the host memory
# on CPU: the rest is the kernels' outputs, the flush buffer and whatever else the process holds.
CASE_MEMORY_SHARE = 0.25
CPU_CASE_BYTES = 256 * 2**20


@dataclass(frozen=True)
class Timing:
    """How long to time: warm-up calls, repetitions (at least min_reps, at most max_reps, stopping once budget_s
    has passed), profiler repetitions for the kernel-sum view, and calls x repetitions for host µs (in the bench,
    host_reps interleaved rounds over every implementation of a case: `host_rounds.py`)."""

    warmup: int = 3
    min_reps: int = 20
    max_reps: int = 200
    budget_s: float = 1.0
    profile_reps: int = 5
    host_calls: int = 20
    host_reps: int = 5
    race_margin: float | None = None  # stop a config whose median passes this multiple of the best given
    race_after: int = 10  # repetitions before a race may stop it

    def to_dict(self) -> dict:
        return asdict(self)


# Presets of the commands; every interpreter run uses "interpret" (its figures only need to exist).
TIMING = {
    # A sweep's clear losers stop after `race_after` repetitions (docs/perf-notes.md, "Sweep throughput", has the
    # margin's measured grounds).
    "sweep": Timing(warmup=1, max_reps=60, budget_s=0.1, race_margin=1.10),
    # 11 host rounds: with 5, close host-time comparisons still swapped places on the noise of single rounds.
    "bench": Timing(budget_s=0.5, host_reps=11),
    "validate": Timing(max_reps=100, budget_s=0.25),
    "compare": Timing(max_reps=100, budget_s=0.25),
    "remeasure": Timing(max_reps=100, budget_s=0.2),
    "interpret": Timing(warmup=0, min_reps=1, max_reps=2, budget_s=0.0, profile_reps=0, host_calls=1,
                        host_reps=1),
}


# ------------------------------------------------------------------------------------ one measurement


def measure_config(case: Case, config: BackwardConfig, *, flusher: L2Flusher | None, bandwidth_gbps: float,
                   reference_grads=None, warmup: int = 3, min_reps: int = 20, max_reps: int = 200,
                   budget_s: float = 1.0, check: bool = True, spin_cycles: int = SPIN_CYCLES,
                   phases: dict[str, float] | None = None, stop_above_us: float | None = None,
                   stop_after: int = 10) -> MeasureResult:
    """Gate then time `config` on `case`. Never raises for a bad config: the status says what went wrong.
    `stop_above_us` races it (`time_kernels`): a config that loses stops after `stop_after` repetitions, and its
    per-kernel split gets half as many.
    `phases`, when given, receives the seconds of the first launch (which loads or compiles the kernels) as
    "load", of the rest of the gate (outputs, poisoning, the check) as "gate" and of the timed repetitions as
    "timing"."""
    phases = {} if phases is None else phases
    t_gate, timed_before, loaded_before = time.perf_counter(), phases.get("timing", 0.0), phases.get("load", 0.0)
    try:
        return _gate_then_time(case, config, flusher=flusher, bandwidth_gbps=bandwidth_gbps,
                               reference_grads=reference_grads, warmup=warmup, min_reps=min_reps,
                               max_reps=max_reps, budget_s=budget_s, check=check, spin_cycles=spin_cycles,
                               phases=phases, stop_above_us=stop_above_us, stop_after=stop_after)
    finally:
        timed = phases.get("timing", 0.0) - timed_before
        loaded = phases.get("load", 0.0) - loaded_before
        phases["gate"] = phases.get("gate", 0.0) + (time.perf_counter() - t_gate) - timed - loaded


def _gate_then_time(case: Case, config: BackwardConfig, *, flusher, bandwidth_gbps, reference_grads, warmup,
                    min_reps, max_reps, budget_s, check, spin_cycles, phases, stop_above_us,
                    stop_after) -> MeasureResult:
    problem = case.problem
    device = case.grad.device
    interpret = device.type != "cuda"
    try:
        config.validate(problem)
    except ConfigError as err:
        return MeasureResult(status="invalid", error=str(err), interpret=interpret)
    try:
        launch = case.launch(config)
        # Poison the outputs: an element the kernels fail to write stays NaN and fails the gate.
        launch.dx.fill_(math.nan)
        for out in (launch.dw, launch.db, launch.dz):
            if out is not None:
                out.fill_(math.nan)
        t0 = time.perf_counter()
        got = launch.run() + ((launch.dz,) if launch.dz is not None else ())  # a gated problem's dz is checked too
        if not interpret:
            torch.cuda.synchronize(device)
        compile_s = time.perf_counter() - t0
        phases["load"] = phases.get("load", 0.0) + compile_s
    except Exception as err:  # noqa: BLE001 - every failure becomes a status
        return MeasureResult(status=classify_exception(err), error=error_text(err), interpret=interpret)
    result = MeasureResult(status="ok", compile_s=compile_s, programs=launch.programs, interpret=interpret)
    if check:
        ref = reference_grads if reference_grads is not None else case.gate_reference()
        passed, errors, message = gate(problem, got, ref)
        result.errors = errors
        if not passed:
            result.status, result.error = "incorrect", message
            return result
    t_timing = time.perf_counter()
    try:
        steps = [launch.kernel_1, launch.kernel_2]
        # The whole backward, no event between the kernels: a PDL kernel_2 keeps its overlap with kernel_1.
        (total,) = time_kernels(steps, flusher=flusher, split=False, warmup=warmup, min_reps=min_reps,
                                max_reps=max_reps, budget_s=budget_s, device=device, spin_cycles=spin_cycles,
                                stop_above_us=stop_above_us, stop_after=stop_after)
        # The per-kernel split, from fewer repetitions with an event between the kernels (a lost race's: half).
        lost = total.count < min_reps
        split_min, split_max = (max(1, stop_after // 2),) * 2 if lost else (max(1, min_reps // 2), max(1, max_reps // 4))
        k1, k2, _ = time_kernels(steps, flusher=flusher, split=True, warmup=0, min_reps=split_min,
                                 max_reps=split_max, budget_s=budget_s / 4, device=device, spin_cycles=spin_cycles)
    except Exception as err:  # noqa: BLE001
        return MeasureResult(status="error", error=error_text(err) + "\n" + traceback.format_exc(limit=3),
                             interpret=interpret)
    finally:
        phases["timing"] = phases.get("timing", 0.0) + time.perf_counter() - t_timing
    result.median_us, result.p10_us, result.p90_us, result.reps = total.median, total.p10, total.p90, total.count
    result.kernel_1_us, result.kernel_2_us = split_kernel_times(total.median, k1.median, k2.median,
                                                                pdl=bool(getattr(launch, "pdl", False)))
    if not getattr(launch, "has_kernel_2", True):  # the split run timed an empty step: only its events' cost
        result.kernel_2_us = 0.0
    result.bytes_moved = bytes_moved(problem, launch.partial_rows)
    result.gbps = result.bytes_moved / (total.median * 1e3) if total.median > 0 else None
    result.floor_us = floor_us(problem, bandwidth_gbps)
    if result.floor_us == result.floor_us and total.median > 0:  # not NaN
        result.floor_fraction = result.floor_us / total.median
    return result


# ------------------------------------------------------------------------------------------ the session


class MeasureSession:
    """Everything measuring on one device needs, set up once: the copy bandwidth (for the memory floor), the L2
    flush buffer (cold L2), the spin's clock rate, and a timing preset. On CPU (the Triton interpreter) nothing
    is flushed or spun, the bandwidth is unknown (NaN) and timings are host wall-clock.

        session = MeasureSession.for_device(info, timing=TIMING["bench"])
        case = session.case(problem)
        result = session.measure(case, config)            # GPU time (host hidden) + kernel_1/kernel_2 split
        result = session.measure_problem(problem, config) # the same, inputs and reference kept per problem
        kernels = session.kernel_times(launch.run)        # kernel-sum view (profiler), {} on CPU
        host = session.host_us(fn)                        # host µs per call
    """

    def __init__(self, device: torch.device | str, *, l2_bytes: int = 0, cold: bool = True,
                 timing: Timing | None = None, bandwidth_gbps: float | None = None,
                 bandwidth_bytes: int = 2**30):
        self.device = torch.device(device)
        self.on_gpu = self.device.type == "cuda"
        self.timing = TIMING["interpret"] if not self.on_gpu else (timing or TIMING["sweep"])
        if not self.on_gpu:
            self.bandwidth_gbps, self.flusher, self.cycles_per_us = math.nan, None, math.nan
            self.cases = CaseCache(CPU_CASE_BYTES)
            return
        self.bandwidth_gbps = bandwidth_gbps if bandwidth_gbps is not None else \
            copy_bandwidth(self.device, nbytes=bandwidth_bytes)
        self.flusher = L2Flusher(self.device, l2_bytes) if cold else None
        self.cycles_per_us = calibrate_spin(self.device)
        total = torch.cuda.get_device_properties(self.device).total_memory
        self.cases = CaseCache(int(total * CASE_MEMORY_SHARE))

    @classmethod
    def for_device(cls, info, device_index: int | None = None, **kwargs) -> "MeasureSession":
        """The session for a `tuner.gpu_info.DeviceInfo` (its L2 size; the CPU for the interpreter)."""
        if info.interpret:
            return cls("cpu", **kwargs)
        device = torch.device("cuda", device_index) if device_index is not None else torch.device("cuda")
        return cls(device, l2_bytes=info.l2_bytes, **kwargs)

    @property
    def spin_cycles(self) -> int:
        """The spin before each timed repetition: SPIN_US at the calibrated clock."""
        return int(SPIN_US * self.cycles_per_us) if self.on_gpu else 0

    def _prologue(self) -> None:
        if self.flusher is not None:
            self.flusher()
        views.spin(self.spin_cycles)

    def case(self, problem: Problem, seed: int = 0) -> Case:
        return make_case(problem, self.device, seed)

    def floor_us(self, problem: Problem) -> float:
        return floor_us(problem, self.bandwidth_gbps)

    def measure(self, case: Case, config: BackwardConfig, *, reference_grads=None, check: bool = True,
                timing: Timing | None = None, phases: dict[str, float] | None = None,
                best_us: float | None = None) -> MeasureResult:
        """Gate, then time `config` on `case` (see `measure_config`). `best_us`, the best time of the problem so
        far, races the config against it where the timing preset has a `race_margin`."""
        t = timing or self.timing
        stop_above = best_us * t.race_margin if best_us is not None and t.race_margin is not None else None
        return measure_config(case, config, flusher=self.flusher, bandwidth_gbps=self.bandwidth_gbps,
                              reference_grads=reference_grads, warmup=t.warmup, min_reps=t.min_reps,
                              max_reps=t.max_reps, budget_s=t.budget_s, check=check,
                              spin_cycles=self.spin_cycles or SPIN_CYCLES, phases=phases,
                              stop_above_us=stop_above, stop_after=t.race_after)

    def measure_problem(self, problem: Problem, config: BackwardConfig, phases: dict[str, float] | None = None,
                        best_us: float | None = None) -> MeasureResult:
        """`measure` on `problem`'s inputs and float64 reference, made once and reused by every measurement of the
        problem while they are kept (`self.cases`: a sweep's trials, a head-to-head's rounds). `phases` also
        receives the seconds spent making the inputs and reference, as "inputs"; `best_us` races the config
        (`measure`)."""
        phases = {} if phases is None else phases
        t = time.perf_counter()
        case, reference, made = self.cases.get(problem, self._new_case, now=t)
        if made:
            phases["inputs"] = phases.get("inputs", 0.0) + time.perf_counter() - t
        return self.measure(case, config, reference_grads=reference, phases=phases, best_us=best_us)

    def _new_case(self, problem: Problem) -> tuple[Case, Reference]:
        case = self.case(problem)
        reference = case.gate_reference()
        if self.on_gpu:
            torch.cuda.synchronize(self.device)
        return case, reference

    @property
    def recorded_bandwidth_gbps(self) -> float | None:
        """The copy bandwidth as a run records it: None where there is none (the interpreter)."""
        return self.bandwidth_gbps if math.isfinite(self.bandwidth_gbps) else None

    def host_us(self, fn: Callable[[], object], *, calls: int | None = None, reps: int | None = None) -> float:
        """Host µs per call of `fn` (see `views.host_us_per_call`)."""
        t = self.timing
        return views.host_us_per_call(fn, device=self.device, calls=calls or t.host_calls, reps=reps or t.host_reps,
                                      cycles_per_us=self.cycles_per_us if self.on_gpu else CYCLES_PER_US)

    def time_callable(self, fn: Callable[[], object]) -> Stats:
        """GPU time (host hidden) of a whole callable, e.g. a peer's backward: the spin is stretched to twice
        the callable's host time, so that a slow Python call is never billed as device time."""
        t = self.timing
        for _ in range(t.warmup):
            fn()
        spin = self.spin_cycles
        if self.on_gpu:
            spin = max(spin, int(2 * self.host_us(fn, calls=1) * self.cycles_per_us))
        (total,) = time_kernels([fn], flusher=self.flusher, split=False, warmup=0, min_reps=t.min_reps,
                                max_reps=t.max_reps, budget_s=t.budget_s, device=self.device, spin_cycles=spin)
        return total

    def kernel_times(self, fn: Callable[[], object]) -> dict[str, float]:
        """Per-kernel device time (µs per call) of `fn` from the profiler; {} on CPU or with profile_reps=0."""
        if not self.on_gpu or self.timing.profile_reps <= 0:
            return {}
        return views.profile_kernels(fn, prologue=self._prologue, device=self.device, reps=self.timing.profile_reps)

    def provenance(self) -> dict:
        """How this session measures, for a report's provenance."""
        return {"copy_bandwidth_gbps": self.recorded_bandwidth_gbps,
                "cold_l2": self.flusher is not None, "flush_bytes": self.flusher.nbytes if self.flusher else 0,
                "spin_cycles": self.spin_cycles,
                "cycles_per_us": self.cycles_per_us if math.isfinite(self.cycles_per_us) else None,
                "timing": self.timing.to_dict()}
