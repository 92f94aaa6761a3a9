"""Two more views of what a backward costs, beside the GPU time with the host hidden (`measure.time_kernels`):

- **kernel sum**: the device time of each kernel the call launches, from torch.profiler, summed. This is how
  peers usually report. Launch gaps between kernels are not in it. Under programmatic dependent launch (PDL)
  the dependent kernel starts before the one it depends on has finished and waits inside its own kernel time;
  time in which two kernels run at once is counted once (an `OVERLAP` entry takes the second count back), so
  the kernel sum is the time the device spent in the call's kernels.
- **host µs per call**: the CPU time one Python call costs (argument checks, config resolution, dispatch,
  launches, allocations). N calls are issued back to back while the GPU is kept busy by a spin, so no call waits
  on the GPU; the wall clock of issuing them, divided by N.

Both follow the cold-L2 protocol of `measure.py` (flush and spin before every call, neither counted).
"""

from __future__ import annotations

import math
import time
from typing import Callable

import torch

from .results import percentile


def spin(cycles: int) -> None:
    """Keep the GPU busy for `cycles` clock cycles (a single kernel)."""
    torch.cuda._sleep(int(cycles))


# The breakdown's entry (negative, µs per call) for device time two of the call's kernels ran at once.
OVERLAP = "(overlap: counted once)"


def overlap_us(intervals: list[tuple[float, float]]) -> float:
    """Time covered by more than one of the (start, end) intervals, counted once per extra cover: the sum of
    the lengths minus the length of their union."""
    total = union = 0.0
    reach = float("-inf")
    for start, end in sorted(intervals):
        total += end - start
        if end > reach:
            union += end - max(start, reach)
            reach = end
    return total - union


# One kernel as the profiler saw it: (name, start µs, end µs, device µs).
Kernel = tuple[str, float, float, float]


def _device_kernels(prof) -> list[Kernel]:
    """The device events of a torch.profiler session, in the order they started."""
    from torch.autograd import DeviceType

    out = []
    for evt in prof.events():
        if getattr(evt, "device_type", None) != DeviceType.CUDA:
            continue
        t = getattr(evt, "device_time_total", None)
        if t is None:
            t = getattr(evt, "cuda_time_total", 0.0)
        span = getattr(evt, "time_range", None)
        start, end = (float(span.start), float(span.end)) if span is not None else (math.inf, math.inf)
        out.append((evt.name, start, end, float(t)))
    return sorted(out, key=lambda k: k[1])  # an event without a time range (none seen) sorts last


def call_kernels(kernels: list[Kernel], prologue: list[Kernel], reps: int) -> list[Kernel] | None:
    """The kernels of `reps` calls profiled one after another, each behind the prologue (flush + spin) whose own
    profile, `reps` runs of it alone, is `prologue`: every run of the prologue's kernel sequence (by name, in
    stream order) is taken out, by position, so that none of its time is counted and a call's own kernels
    of the same names (a peer's fills) are kept. None when the prologue's runs cannot be told apart (its profile
    is not `reps` times one sequence, or the calls' profile does not hold exactly `reps` runs of it)."""
    if reps <= 0 or not prologue or len(prologue) % reps:
        return None
    names = [k[0] for k in prologue]
    size = len(names) // reps
    sequence = names[:size]
    if names != sequence * reps:
        return None
    out, found, i = [], 0, 0
    while i < len(kernels):
        if [k[0] for k in kernels[i:i + size]] == sequence:
            found += 1
            i += size
        else:
            out.append(kernels[i])
            i += 1
    return out if found == reps else None


def _by_name(kernels: list[Kernel]) -> dict[str, float]:
    totals: dict[str, float] = {}
    for name, _, _, t in kernels:
        totals[name] = totals.get(name, 0.0) + t
    return totals


def profile_kernels(fn: Callable[[], object], *, prologue: Callable[[], None], device: torch.device,
                    reps: int = 5) -> dict[str, float]:
    """Device time (µs per call) of each kernel `fn` launches, slowest first. `prologue` (flush + spin) runs
    before every call; it is profiled alone too, and its kernels are taken out of the calls' profile by position
    (`call_kernels`). Where they cannot be, its per-name totals are subtracted instead (noisier: what is left of
    a flush that ran longer than in its own profile counts as a kernel of the call's)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        prologue()
        fn()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            prologue()
            fn()
        torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as base:
        for _ in range(reps):
            prologue()
        torch.cuda.synchronize(device)
    kernels, overhead = _device_kernels(prof), _device_kernels(base)
    own = call_kernels(kernels, overhead, reps)
    if own is not None:
        totals = {name: t / reps for name, t in _by_name(own).items()}
    else:
        own = kernels
        less = _by_name(overhead)
        totals = {name: (t - less.get(name, 0.0)) / reps for name, t in _by_name(kernels).items()}
        totals = {name: t for name, t in totals.items() if t > 0.05}
    out = dict(sorted(totals.items(), key=lambda kv: -kv[1]))
    # The prologue's kernels run alone (stream order); only the call's own kernels can overlap (PDL).
    twice = overlap_us([(k[1], k[2]) for k in own if math.isfinite(k[1])]) / reps
    if twice > 0.05:
        out[OVERLAP] = -twice
    return out


def kernel_sum(kernels: dict[str, float]) -> float | None:
    """The kernel-sum view of a `profile_kernels` breakdown (None when there is none)."""
    values = [v for v in kernels.values() if v == v]  # a failed profile holds NaN
    return sum(values) if values and len(values) == len(kernels) else None


# Longest spin issued ahead of host-timed calls: 0.2 s at 2 GHz.
MAX_SPIN_CYCLES = 400_000_000


def host_us_per_call(fn: Callable[[], object], *, device: torch.device, calls: int = 20, reps: int = 5,
                     cycles_per_us: float = 2000.0) -> float:
    """Median over `reps` of the host wall clock (µs) of issuing `calls` back-to-back calls of `fn`, divided by
    `calls`. On a GPU the calls are issued behind a spin sized to outlast them (twice a first estimate), so that
    the host never waits on the device. On CPU (the interpreter) a call's work is host work: the figure is the
    call's whole time."""
    calls, reps = max(1, calls), max(1, reps)
    on_gpu = device.type == "cuda"
    fn()
    spin_cycles = 0
    if on_gpu:
        torch.cuda.synchronize(device)
        t = time.perf_counter()
        fn()
        estimate_us = (time.perf_counter() - t) * 1e6
        torch.cuda.synchronize(device)
        spin_cycles = min(MAX_SPIN_CYCLES, int((2 * calls * estimate_us + 100) * cycles_per_us))
    times = []
    for _ in range(reps):
        if on_gpu:
            torch.cuda.synchronize(device)
            spin(spin_cycles)
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t) * 1e6 / calls)
    if on_gpu:
        torch.cuda.synchronize(device)
    return percentile(times, 50)
