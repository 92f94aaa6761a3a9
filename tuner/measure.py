"""The stopwatch: cold-L2 timing of one (problem, config) with a per-kernel breakdown, a correctness gate, and the
memory floor it is judged against.

Protocol for every timed repetition (ours and peers alike):
    flush L2 (write a buffer of >= 2x the device's L2) → spin the GPU for a while (so the host has queued every
    launch of the repetition before the timed region starts: host launch overhead never shows up as device time)
    → event → kernel_1 → event → kernel_2 → event.
The forward is run once, untimed. Repetitions continue until `min_reps` are done and either `max_reps` or the time
budget is reached; the median, p10 and p90 are reported.

Failures are results, not crashes: a config that does not compile is `compile_error`, one that needs more
registers or shared memory than the GPU has is `out_of_resources`, one that computes wrong values is `incorrect`.
"""

from __future__ import annotations

import math
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from normtune.kernels import backward as kbackward
from normtune.kernels import forward as kforward
from normtune.kernels import reference
from normtune.kernels.config import BackwardConfig, ConfigError, Problem

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# Correctness gate: relative error ‖out − ref‖ / ‖ref‖ allowed against the fp32 PyTorch reference on the same
# inputs. Both sides round to the output dtype, so a right kernel differs by about one rounding of that dtype
# (bf16: 2^-8), a wrong one by O(1).
GATE_TOLERANCE = {"fp32": 1e-4, "fp16": 4e-3, "bf16": 3e-2}

STATUSES = ("ok", "incorrect", "compile_error", "out_of_resources", "timeout", "error", "invalid")

# GPU cycles to spin before each timed repetition: ~250 µs at Hopper clocks, longer than the host needs to queue
# a repetition's launches (a Triton launch costs a few µs of host time; a peer's autograd call tens of µs).
SPIN_CYCLES = 500_000


# ---------------------------------------------------------------------------------------------- statistics


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100] (numpy's default method)."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass
class Stats:
    median: float
    p10: float
    p90: float
    count: int

    @classmethod
    def of(cls, values: list[float]) -> "Stats":
        return cls(percentile(values, 50), percentile(values, 10), percentile(values, 90), len(values))


# ------------------------------------------------------------------------------------------ bytes and floor


def floor_bytes(problem: Problem) -> int:
    """The memory floor's bytes: read grad and the saved activation, write grad_input (3·M·N·itemsize)."""
    return 3 * problem.M * problem.N * problem.itemsize


def bytes_moved(problem: Problem, programs: int) -> int:
    """Every byte the two kernels move: the floor's bytes, the per-row stats, the weight (and bias when
    recovering x̂ from y), the fp32 partials written by kernel_1 and read by kernel_2, and dw/db."""
    M, N = problem.M, problem.N
    wsize = 4 if problem.weight_dtype == "fp32" else problem.itemsize
    stats = 4 * M * (1 if problem.norm == "rms_norm" or problem.save == "output" else 2)
    params = N * wsize * (int(problem.has_weight) + int(bool(problem.has_bias) and problem.save == "output"))
    n_partials = int(problem.has_weight) + int(bool(problem.has_bias))
    partials = 2 * 4 * programs * N * n_partials
    outputs = N * wsize * n_partials
    return floor_bytes(problem) + stats + params + partials + outputs


def floor_us(problem: Problem, bandwidth_gbps: float) -> float:
    """Time to move the floor's bytes at the measured copy bandwidth (GB/s = 1e9 B/s)."""
    return floor_bytes(problem) / (bandwidth_gbps * 1e3) if bandwidth_gbps > 0 else math.nan


# ---------------------------------------------------------------------------------------- L2 and bandwidth


class L2Flusher:
    """Evicts L2 by writing a buffer of at least twice its size (and at least 64 MiB)."""

    def __init__(self, device: torch.device, l2_bytes: int):
        self.nbytes = flush_size(l2_bytes)
        self.buffer = torch.empty(self.nbytes // 4, dtype=torch.int32, device=device)

    def __call__(self) -> None:
        self.buffer.zero_()


def flush_size(l2_bytes: int) -> int:
    return max(2 * int(l2_bytes), 64 * 2**20)


def copy_bandwidth(device: torch.device, nbytes: int = 2**30, reps: int = 20) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written; median of `reps`."""
    n = nbytes // 4
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize(device)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e-3)
    del src, dst
    return 2 * n * 4 / percentile(times, 50) / 1e9


# ------------------------------------------------------------------------------------------------- inputs


@dataclass
class Case:
    """Inputs of one backward: the forward has run, `saved` is x or y according to problem.save."""

    problem: Problem
    x: torch.Tensor
    weight: torch.Tensor | None
    bias: torch.Tensor | None
    grad: torch.Tensor
    saved: torch.Tensor
    rstd: torch.Tensor
    mean: torch.Tensor

    def launch(self, config: BackwardConfig) -> kbackward.BackwardLaunch:
        return kbackward.BackwardLaunch(self.problem, config, self.grad, self.saved, self.weight, self.bias,
                                        self.rstd, self.mean)

    def reference(self):
        p = self.problem
        return reference.backward(self.grad, self.saved, self.weight, self.bias, self.rstd, self.mean,
                                  is_rms=p.norm == "rms_norm", zero_centered=p.zero_centered,
                                  from_output=p.save == "output")


def make_case(problem: Problem, device: torch.device | str, seed: int = 0) -> Case:
    """Random inputs (never zeros: they hide unwritten outputs), forward run once with the Triton kernel."""
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    dt, wdt = TORCH_DTYPES[problem.dtype], TORCH_DTYPES[problem.weight_dtype]
    M, N = problem.M, problem.N

    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)

    x = (randn(M, N) + 0.5).to(dt)
    weight = None
    if problem.has_weight:
        weight = (0.1 * randn(N)).to(wdt) if problem.zero_centered else (1.0 + 0.1 * randn(N)).to(wdt)
    bias = (0.1 * randn(N)).to(wdt) if problem.has_bias else None
    grad = randn(M, N).to(dt)
    is_rms = problem.norm == "rms_norm"
    store_mean = not is_rms and problem.save == "input"
    y, rstd, mean = kforward.forward(x, weight, bias, 1e-5, is_rms=is_rms, zero_centered=problem.zero_centered,
                                     store_mean=store_mean)
    saved = y if problem.save == "output" else x
    return Case(problem, x, weight, bias, grad, saved, rstd, mean)


# ----------------------------------------------------------------------------------------- the gate


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return math.inf
    denom = ref.norm().item()
    diff = (out - ref).norm().item()
    return diff / denom if denom > 0 else diff


def gate(problem: Problem, got, ref) -> tuple[bool, dict[str, float], str]:
    """Compare (dx, dw, db) with the reference; returns (passed, errors, message)."""
    tol = GATE_TOLERANCE[problem.dtype]
    if problem.save == "output":
        tol *= 2  # x̂ is recovered from the rounded y
    errors, bad = {}, []
    for name, a, b in zip(("dx", "dw", "db"), got, ref):
        if b is None:
            continue
        err = relative_error(a, b)
        errors[name] = err
        if not err <= tol:
            bad.append(f"{name} relative error {err:.3g} > {tol:g}")
    return not bad, errors, "; ".join(bad)


# ---------------------------------------------------------------------------------------- timing


def _spin(cycles: int = SPIN_CYCLES) -> None:
    torch.cuda._sleep(cycles)


# Hopper SM clock under load is ~1.98 GHz: cycles per µs of spin.
CYCLES_PER_US = 2000


def host_launch_us(fn: Callable[[], object], device: torch.device, reps: int = 5) -> float:
    """Median host time (µs) to *issue* fn, measured behind a long spin so that the GPU is busy meanwhile.
    Sizes the spin before timed repetitions: if a peer needs 400 µs of host work to queue its kernels, a
    shorter spin would leave the GPU idle inside the timed region and bill the peer for its Python overhead."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize(device)
        _spin(20 * SPIN_CYCLES)
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e6)
    torch.cuda.synchronize(device)
    return percentile(times, 50)


def time_kernels(steps: list[Callable[[], None]], *, flusher: L2Flusher | None, split: bool = True,
                 warmup: int = 3, min_reps: int = 20, max_reps: int = 200, budget_s: float = 1.0,
                 device: torch.device | None = None, spin_cycles: int = SPIN_CYCLES) -> list[Stats]:
    """Time a sequence of launches (e.g. [kernel_1, kernel_2]) per repetition.

    split=True records an event between consecutive steps and returns one `Stats` per step and, last, their
    total; split=False records events only around the whole sequence (an event between kernels would break a
    programmatic dependent launch's overlap) and returns [total]. On CPU (interpreter) host wall-clock is used
    and nothing is flushed."""
    on_gpu = device is not None and device.type == "cuda"
    for _ in range(warmup):
        for step in steps:
            step()
    n_marks = len(steps) + 1 if split else 2
    per_step: list[list[float]] = [[] for _ in range(n_marks - 1)]
    if not on_gpu:
        for _ in range(max(1, min_reps)):
            marks = [time.perf_counter()]
            for step in steps:
                step()
                if split:
                    marks.append(time.perf_counter())
            if not split:
                marks.append(time.perf_counter())
            for i in range(n_marks - 1):
                per_step[i].append((marks[i + 1] - marks[i]) * 1e6)
    else:
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        done = 0
        while done < max_reps:
            batch = min(10, max_reps - done)
            events = [[torch.cuda.Event(enable_timing=True) for _ in range(n_marks)] for _ in range(batch)]
            for evs in events:
                if flusher is not None:
                    flusher()
                _spin(spin_cycles)
                evs[0].record()
                for i, step in enumerate(steps):
                    step()
                    if split:
                        evs[i + 1].record()
                if not split:
                    evs[1].record()
            events[-1][-1].synchronize()
            for evs in events:
                for i in range(n_marks - 1):
                    per_step[i].append(evs[i].elapsed_time(evs[i + 1]) * 1e3)
            done += batch
            if done >= min_reps and time.perf_counter() - start >= budget_s:
                break
    stats = [Stats.of(v) for v in per_step]
    if split:
        stats.append(Stats.of([sum(t) for t in zip(*per_step)]))
    return stats


# ------------------------------------------------------------------------------------ one measurement


@dataclass
class MeasureResult:
    """Everything one measurement produced; `status` says whether the figures mean anything."""

    status: str
    error: str | None = None
    median_us: float | None = None
    p10_us: float | None = None
    p90_us: float | None = None
    reps: int = 0
    kernel_1_us: float | None = None
    kernel_2_us: float | None = None
    compile_s: float | None = None
    bytes_moved: int | None = None
    gbps: float | None = None
    floor_us: float | None = None
    floor_fraction: float | None = None  # floor_us / median_us: 1.0 would be at the copy bandwidth
    programs: int | None = None
    errors: dict[str, float] = field(default_factory=dict)
    interpret: bool = False

    def to_dict(self) -> dict:
        return asdict(self)


def classify_exception(err: BaseException) -> str:
    """compile_error / out_of_resources / error, from an exception raised while compiling or launching."""
    name = type(err).__name__
    text = str(err)
    if name == "OutOfResources" or "out of resource" in text.lower() or "OutOfResources" in text:
        return "out_of_resources"
    module = type(err).__module__ or ""
    if "CompilationError" in name or "triton.compiler" in module or "PTXAS" in text.upper() or "MLIR" in text:
        return "compile_error"
    return "error"


def _error_text(err: BaseException) -> str:
    text = f"{type(err).__name__}: {err}".strip()
    if len(text) > 4000:
        text = text[:2000] + "\n…\n" + text[-2000:]
    return text


def measure_config(case: Case, config: BackwardConfig, *, flusher: L2Flusher | None, bandwidth_gbps: float,
                   reference_grads=None, warmup: int = 3, min_reps: int = 20, max_reps: int = 200,
                   budget_s: float = 1.0, check: bool = True) -> MeasureResult:
    """Gate then time `config` on `case`. Never raises for a bad config: the status says what went wrong."""
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
        for out in (launch.dw, launch.db):
            if out is not None:
                out.fill_(math.nan)
        t0 = time.perf_counter()
        got = launch.run()
        if not interpret:
            torch.cuda.synchronize(device)
        compile_s = time.perf_counter() - t0
    except Exception as err:  # noqa: BLE001 - every failure becomes a status
        return MeasureResult(status=classify_exception(err), error=_error_text(err), interpret=interpret)
    result = MeasureResult(status="ok", compile_s=compile_s, programs=launch.programs, interpret=interpret)
    if check:
        ref = reference_grads if reference_grads is not None else case.reference()
        passed, errors, message = gate(problem, got, ref)
        result.errors = errors
        if not passed:
            result.status, result.error = "incorrect", message
            return result
    try:
        steps = [launch.kernel_1, launch.kernel_2]
        (total,) = time_kernels(steps, flusher=flusher, split=False, warmup=warmup, min_reps=min_reps,
                                max_reps=max_reps, budget_s=budget_s, device=device)
        # The per-kernel split, from fewer repetitions with an event between the kernels.
        k1, k2, _ = time_kernels(steps, flusher=flusher, split=True, warmup=0, min_reps=max(1, min_reps // 2),
                                 max_reps=max(1, max_reps // 4), budget_s=budget_s / 4, device=device)
    except Exception as err:  # noqa: BLE001
        return MeasureResult(status="error", error=_error_text(err) + "\n" + traceback.format_exc(limit=3),
                             interpret=interpret)
    result.median_us, result.p10_us, result.p90_us, result.reps = total.median, total.p10, total.p90, total.count
    result.kernel_1_us, result.kernel_2_us = k1.median, k2.median
    result.bytes_moved = bytes_moved(problem, launch.programs)
    result.gbps = result.bytes_moved / (total.median * 1e3) if total.median > 0 else None
    result.floor_us = floor_us(problem, bandwidth_gbps)
    if result.floor_us == result.floor_us and total.median > 0:  # not NaN
        result.floor_fraction = result.floor_us / total.median
    return result


# ------------------------------------------------------------------------------- peers: time and breakdown


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


def profile_kernels(fn: Callable[[], object], *, flusher: L2Flusher | None, device: torch.device,
                    reps: int = 5) -> dict[str, float]:
    """Per-kernel device time (µs per call) of `fn`, under the same cold-L2 protocol. The flush and spin
    kernels are profiled alone too and subtracted by name, so a peer's own fills are kept."""
    from torch.profiler import ProfilerActivity, profile

    def prologue():
        if flusher is not None:
            flusher()
        _spin()

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
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def time_callable(fn: Callable[[], object], *, flusher: L2Flusher | None, device: torch.device, warmup: int = 3,
                  min_reps: int = 20, max_reps: int = 200, budget_s: float = 1.0) -> Stats:
    """Cold-L2 device time of a whole callable (e.g. a peer's backward), same protocol as our kernels, with
    the spin stretched to cover the callable's host-side launch time (twice over)."""
    for _ in range(warmup):
        fn()
    host_us = host_launch_us(fn, device) if device.type == "cuda" else 0.0
    spin = max(SPIN_CYCLES, int(2 * host_us * CYCLES_PER_US))
    (total,) = time_kernels([fn], flusher=flusher, split=False, warmup=0, min_reps=min_reps,
                            max_reps=max_reps, budget_s=budget_s, device=device, spin_cycles=spin)
    return total
