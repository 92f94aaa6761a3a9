"""The stopwatch: device time of a sequence of launches per repetition, with a cold L2, and what it needs (the L2
flush, the spin and its clock, the copy bandwidth the memory floor is computed from).

Protocol for every timed repetition (ours and peers alike):
    flush L2 (write a buffer of at least twice the device's L2) → spin the GPU for a while (so the host has queued every
    launch of the repetition before the timed region starts: host launch overhead never shows up as device time)
    → event → kernel_1 → event → kernel_2 → event.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from . import views
from .results import Stats, percentile

# GPU cycles to spin before each timed repetition when the clock is not calibrated, and the spin in µs once it
# is: longer than the host needs to queue a repetition's flush, events and launches. Peers' whole calls get a
# spin stretched to twice their measured host time (`MeasureSession.time_callable`).
SPIN_CYCLES = 500_000
SPIN_US = 100.0
CYCLES_PER_US = 2000  # cycles per µs of spin until `calibrate_spin` measures the clock


# ---------------------------------------------------------------------------------------- L2 and bandwidth


def flush_size(l2_bytes: int) -> int:
    return max(2 * int(l2_bytes), 64 * 2**20)


class L2Flusher:
    """Evicts L2 by writing a buffer of at least twice its size (and at least 64 MiB)."""

    def __init__(self, device: torch.device, l2_bytes: int):
        self.nbytes = flush_size(l2_bytes)
        self.buffer = torch.empty(self.nbytes // 4, dtype=torch.int32, device=device)

    def __call__(self) -> None:
        self.buffer.zero_()


def _event_times_us(fn: Callable[[], object], reps: int) -> list[float]:
    """Device time (µs) of `fn` between two events, `reps` times, each waited for."""
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return times


def copy_bandwidth(device: torch.device, nbytes: int = 2**30, reps: int = 20) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written; median of `reps`."""
    n = nbytes // 4
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize(device)
    median_us = percentile(_event_times_us(lambda: dst.copy_(src), reps), 50)
    del src, dst
    return 2 * n * 4 / (median_us * 1e3)


def calibrate_spin(device: torch.device, cycles: int = 2_000_000, reps: int = 3) -> float:
    """Clock cycles per µs of the spin kernel on this device (median of `reps`): spins are sized in µs."""
    views.spin(cycles // 10)
    torch.cuda.synchronize(device)
    return cycles / percentile(_event_times_us(lambda: views.spin(cycles), reps), 50)


# ---------------------------------------------------------------------------------------- timing


def time_kernels(steps: list[Callable[[], None]], *, flusher: L2Flusher | None, split: bool = True,
                 warmup: int = 3, min_reps: int = 20, max_reps: int = 200, budget_s: float = 1.0,
                 device: torch.device | None = None, spin_cycles: int = SPIN_CYCLES,
                 stop_above_us: float | None = None, stop_after: int = 10) -> list[Stats]:
    """Time a sequence of launches (e.g. [kernel_1, kernel_2]) per repetition.

    split=True records an event between consecutive steps and returns one `Stats` per step and, last, their
    total; split=False records events only around the whole sequence (an event between kernels would break a
    programmatic dependent launch's overlap) and returns [total]. On CPU (interpreter) host wall-clock is used
    and nothing is flushed. `stop_above_us` ends the repetitions early, before `min_reps`, once `stop_after` are
    done and the median of the whole sequence's times so far is above it (a race the config has lost)."""
    on_gpu = device is not None and device.type == "cuda"
    for _ in range(warmup):
        for step in steps:
            step()
    n_marks = len(steps) + 1 if split else 2
    per_step: list[list[float]] = [[] for _ in range(n_marks - 1)]
    if not on_gpu:
        for done in range(1, max(1, min_reps) + 1):
            marks = [time.perf_counter()]
            for step in steps:
                step()
                if split:
                    marks.append(time.perf_counter())
            if not split:
                marks.append(time.perf_counter())
            for i in range(n_marks - 1):
                per_step[i].append((marks[i + 1] - marks[i]) * 1e6)
            if stop_above_us is not None and done >= stop_after and _median_total(per_step) > stop_above_us:
                break
    else:
        torch.cuda.synchronize(device)
        stream = torch.cuda.current_stream(device)  # looked up once: Event.record() would on every call
        start = time.perf_counter()
        done = 0
        while done < max_reps:
            batch = min(10, max_reps - done)
            events = [[torch.cuda.Event(enable_timing=True) for _ in range(n_marks)] for _ in range(batch)]
            for evs in events:
                if flusher is not None:
                    flusher()
                views.spin(spin_cycles)
                evs[0].record(stream)
                for i, step in enumerate(steps):
                    step()
                    if split:
                        evs[i + 1].record(stream)
                if not split:
                    evs[1].record(stream)
            events[-1][-1].synchronize()
            for evs in events:
                for i in range(n_marks - 1):
                    per_step[i].append(evs[i].elapsed_time(evs[i + 1]) * 1e3)
            done += batch
            if done >= min_reps and time.perf_counter() - start >= budget_s:
                break
            if stop_above_us is not None and done >= stop_after and _median_total(per_step) > stop_above_us:
                break
    stats = [Stats.of(v) for v in per_step]
    if split:
        stats.append(Stats.of([sum(t) for t in zip(*per_step)]))
    return stats


def _median_total(per_step: list[list[float]]) -> float:
    """Median over the repetitions so far of the whole sequence's time (the sum of its steps)."""
    return percentile([sum(t) for t in zip(*per_step)], 50)


def split_kernel_times(total_us: float, kernel_1_us: float, kernel_2_us: float, *, pdl: bool) -> tuple[float, float]:
    """(kernel_1, kernel_2) µs for the per-kernel split. With PDL the split run's event between the kernels
    serializes them, so kernel_2 is reported as what the overlapped backward costs after kernel_1: the total
    (host hidden, no event between) minus kernel_1, never below zero."""
    if pdl:
        return kernel_1_us, max(0.0, total_us - kernel_1_us)
    return kernel_1_us, kernel_2_us
