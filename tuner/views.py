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


def _kernel_intervals(prof) -> list[tuple[float, float]]:
    from torch.autograd import DeviceType

    out = []
    for evt in prof.events():
        span = getattr(evt, "time_range", None)
        if getattr(evt, "device_type", None) == DeviceType.CUDA and span is not None:
            out.append((float(span.start), float(span.end)))
    return out


def _device_events(prof) -> dict[str, float]:
    """Total device time (µs) per kernel name recorded by a torch.profiler session."""
    from torch.autograd import DeviceType

    totals: dict[str, float] = {}
    for evt in prof.events():
        if getattr(evt, "device_type", None) != DeviceType.CUDA:
            continue
        t = getattr(evt, "device_time_total", None)
        if t is None:
            t = getattr(evt, "cuda_time_total", 0.0)
        totals[evt.name] = totals.get(evt.name, 0.0) + float(t)
    return totals


def profile_kernels(fn: Callable[[], object], *, prologue: Callable[[], None], device: torch.device,
                    reps: int = 5) -> dict[str, float]:
    """Device time (µs per call) of each kernel `fn` launches, slowest first. `prologue` (flush + spin) runs
    before every call; it is profiled alone too and subtracted by kernel name, so a peer's own fills are kept."""
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
    totals, overhead = _device_events(prof), _device_events(base)
    out = {}
    for name, t in totals.items():
        per_call = (t - overhead.get(name, 0.0)) / reps
        if per_call > 0.05:
            out[name] = per_call
    out = dict(sorted(out.items(), key=lambda kv: -kv[1]))
    # The prologue's kernels run alone (stream order); only the call's own kernels can overlap (PDL).
    twice = overlap_us(_kernel_intervals(prof)) / reps
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
