"""What a measurement produced, as plain values (no torch): statuses, statistics, bytes and the memory floor,
and `MeasureResult`. The store, the report and the emitter read these without importing the stopwatch."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from normtune.kernels.config import Problem

STATUSES = ("ok", "incorrect", "compile_error", "out_of_resources", "timeout", "error", "invalid")


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
    """The memory floor's bytes: read grad and the saved activation, write grad_input (3·M·N·itemsize). The
    residual form makes it 4 passes: read grad, the saved h (or y) and the stream's gradient dh, write grad_input
    (h's gradient), the last three in the residual dtype (y in the activation dtype). The gated form makes it 5
    passes: read grad, x and the gate z, write dx and dz."""
    if problem.gate is not None:
        return 5 * problem.M * problem.N * problem.itemsize
    if problem.residual:
        res = problem.residual_itemsize
        saved = res if problem.save == "input" else problem.itemsize
        return problem.M * problem.N * (problem.itemsize + saved + 2 * res)
    return 3 * problem.M * problem.N * problem.itemsize


def forward_floor_bytes(problem: Problem) -> int:
    """The forward's memory floor: read x, write y (2 passes); the residual form also reads the residual and
    writes h (4 passes, those two in the residual dtype); the gated form also reads z (3 passes)."""
    if problem.gate is not None:
        return 3 * problem.M * problem.N * problem.itemsize
    passes = 2 * problem.itemsize + (2 * problem.residual_itemsize if problem.residual else 0)
    return problem.M * problem.N * passes


def bytes_moved(problem: Problem, partial_rows: int) -> int:
    """Every byte the two kernels move: the floor's bytes, the per-row stats, the weight (and bias when
    recovering x̂ from y), the fp32 partials written by kernel_1 and read by kernel_2, and dw/db."""
    M, N = problem.M, problem.N
    wsize = 4 if problem.weight_dtype == "fp32" else problem.itemsize
    stats = 4 * M * (1 if problem.norm == "rms_norm" or problem.save == "output" else 2)
    params = N * wsize * (int(problem.has_weight) + int(bool(problem.has_bias) and problem.save == "output"))
    n_partials = int(problem.has_weight) + int(bool(problem.has_bias))
    partials = 2 * 4 * partial_rows * N * n_partials
    outputs = N * wsize * n_partials
    return floor_bytes(problem) + stats + params + partials + outputs


def floor_us(problem: Problem, bandwidth_gbps: float) -> float:
    """Time to move the floor's bytes at the measured copy bandwidth (GB/s = 1e9 B/s)."""
    return floor_bytes(problem) / (bandwidth_gbps * 1e3) if bandwidth_gbps > 0 else math.nan


# ------------------------------------------------------------------------------------ one measurement


@dataclass
class MeasureResult:
    """Everything one measurement produced; `status` says whether the figures mean anything.

    `median_us` is the GPU time of the whole backward with the host hidden (events around kernel_1 + kernel_2).
    `kernel_1_us` is kernel_1 alone; `kernel_2_us` is what the backward costs after kernel_1: kernel_2 and its
    launch gap (with programmatic dependent launch, the total minus kernel_1, since an event between the kernels
    would break their overlap); 0 when no second kernel runs (dual, columns, the fused reduction on a GPU)."""

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


def error_text(err: BaseException, limit: int = 4000) -> str:
    """`Type: message`, its middle cut when longer than `limit` characters."""
    text = f"{type(err).__name__}: {err}".strip()
    if len(text) > limit:
        text = text[:limit // 2] + "\n…\n" + text[-limit // 2:]
    return text
