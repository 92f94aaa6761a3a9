"""The report's data: what the store knows about one GPU, summarized per problem, with one meaning per number.

- best: the fastest correct measurement of the problem, of any run;
- default: today's analytic default config on the run's GPU (`default_config` sized by its limits, or its
  canonical form as the sweep seeds it), timed in the *same run* as the best (else not shown: a default from
  another run or another day's default would compare different conditions);
- % floor: the memory floor at the copy bandwidth measured and stored with the best's run (runs that stored
  none show n/a: never another run's bandwidth);
- GB/s: every byte both kernels move ÷ the best time.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass

from normtune.kernels.strategies import partial_rows
from normtune.kernels.config import BackwardConfig, ConfigError, Problem, default_config
from normtune.kernels.limits import DeviceLimits

from ..gpu_info import run_limits
from ..measure.bench import OURS
from ..measure.harness import bytes_moved, floor_bytes
from ..space import Space
from ..store.database import MeasurementRecord, RunRecord
from ..tables.validate import ValidationRow, rows_from_measurements


@dataclass(frozen=True)
class ReportData:
    gpu_key: str
    runs: list[RunRecord]
    interpret: bool  # only Triton-interpreter runs: host wall-clock on CPU, not GPU timings
    measurements: list[MeasurementRecord]  # of the runs that match `interpret`

    def run(self, run_id: int) -> RunRecord | None:
        return next((r for r in self.runs if r.id == run_id), None)

    def latest(self, kind: str) -> RunRecord | None:
        return max((r for r in self.runs if r.kind == kind), key=lambda r: r.id, default=None)

    def latest_validations(self) -> list[tuple[str, RunRecord]]:
        """(form, run) of the latest validate run of each problem form: "" for the plain norms, "residual" for
        the fused residual form (a run that validated both counts for both); the plain form first."""
        residual = {m.run_id for m in self.measurements if m.problem.residual}
        plain = {m.run_id for m in self.measurements if not m.problem.residual}
        latest: dict[str, RunRecord] = {}
        for run in sorted((r for r in self.runs if r.kind == "validate"), key=lambda r: r.id):
            for form in [f for f, ids in (("", plain), ("residual", residual)) if run.id in ids] or [""]:
                latest[form] = run
        return sorted(latest.items())


@dataclass(frozen=True)
class ProblemSummary:
    problem: Problem
    best: MeasurementRecord | None  # the fastest ok measurement (lowest median, then oldest)
    gbps: float | None  # of the best measurement
    floor_us: float | None  # at the bandwidth stored with the best's run; None when that run stored none
    default_us: float | None  # today's analytic default, timed in the best's run
    trials: int
    failures: dict[str, int]  # status -> count, statuses other than ok

    @property
    def floor_fraction(self) -> float | None:
        return self.floor_us / self.best.median_us if self.floor_us and self.best else None

    @property
    def split_above_total(self) -> float | None:
        """kernel_1 ÷ the total where the best's kernel_1 took longer than its whole backward, else None. The two
        come from separate series of repetitions (`measure.harness`): the total without an event between the
        kernels, the split with one; each median has its own noise."""
        b = self.best
        return b.kernel_1_us / b.median_us if b and b.kernel_1_us and b.median_us and b.kernel_1_us > b.median_us \
            else None


def load_report_data(store, gpu_key: str) -> ReportData:
    runs = store.runs(gpu_key=gpu_key)
    if not runs:
        keys = sorted({r.gpu_key for r in store.runs()})
        raise ValueError(f"no runs for GPU key {gpu_key!r} in {store.display_url}; GPU keys present: "
                         f"{', '.join(keys) if keys else 'none (the database is empty)'}")
    # Interpreter figures never mix with GPU ones: they are reported only when there is nothing else.
    interpret = all(r.interpret for r in runs)
    runs = [r for r in runs if r.interpret == interpret]
    return ReportData(gpu_key, runs, interpret, store.measurements(gpu_key=gpu_key, interpret=interpret))


def run_floor_us(problem: Problem, run: RunRecord | None) -> float | None:
    """The memory floor at the copy bandwidth stored with `run` (None when it stored none)."""
    if run is None or not run.copy_bandwidth_gbps:
        return None
    return floor_bytes(problem) / (run.copy_bandwidth_gbps * 1e3)


def summarize_problems(data: ReportData) -> list[ProblemSummary]:
    """One summary per problem, by family, then N, then M."""
    by_problem: dict[Problem, list[MeasurementRecord]] = defaultdict(list)
    for m in data.measurements:
        by_problem[m.problem].append(m)
    out = []
    for problem in sorted(by_problem, key=lambda p: (p.family.key, p.N, p.M)):
        rows = by_problem[problem]
        ok = [m for m in rows if m.status == "ok" and m.median_us]
        best = min(ok, key=lambda m: (m.median_us, m.id), default=None)
        default_us = gbps = floor = None
        if best is not None:
            run = data.run(best.run_id)
            limits = run_limits(run.device)
            defaults = [m.median_us for m in ok
                        if m.run_id == best.run_id and is_default(m, run.device.sm_count, limits)]
            default_us = statistics.median(defaults) if defaults else None
            gbps, floor = _gbps(best, run.device.sm_count), run_floor_us(problem, run)
        failures = dict(sorted(Counter(m.status for m in rows if m.status != "ok").items()))
        out.append(ProblemSummary(problem, best, gbps, floor, default_us, len(rows), failures))
    return out


def _gbps(m: MeasurementRecord, sm_count: int | None) -> float | None:
    """The measurement's bandwidth over every byte both kernels move. Bench rows store no byte count: it is
    derived as `measure.measure_config` derives it, from the grid the config launches on the run's SMs."""
    if m.gbps is not None:
        return m.gbps
    moved = m.bytes_moved or (sm_count and bytes_moved(m.problem, partial_rows(m.problem.M, m.config, sm_count)))
    return moved / (m.median_us * 1e3) if moved else None  # B / µs / 1e3 = GB/s


def is_default(m: MeasurementRecord, sm_count: int | None, limits: DeviceLimits | None = None) -> bool:
    """Whether `m` timed today's analytic default on the device of `limits` (the run's: `device.run_limits`;
    programs_per_sm values giving the same grid are one)."""
    try:
        default = default_config(m.problem, limits)
    except ConfigError:  # no analytic config runs this problem: there is nothing to compare with
        return False
    return m.config == default or bool(sm_count) and m.config == Space(m.problem, sm_count, limits).canonical(default)


def choose_heatmap_problem(summaries: list[ProblemSummary], key: str | None) -> ProblemSummary | None:
    """The summary of problem `key`, or of the problem with most measurements among those that ran correctly
    (ties: the first by key)."""
    if key is None:
        return min((s for s in summaries if s.best), key=lambda s: (-s.trials, s.problem.key), default=None)
    found = [s for s in summaries if s.problem.key == key]
    if not found:
        raise ValueError(f"heatmap problem {key!r} has no measurements on this GPU; measured problems: "
                         + ", ".join(sorted(s.problem.key for s in summaries)))
    return found[0]


def config_value(config: BackwardConfig, param: str):
    """A knob by its column name: 'k1_block_row' → config.kernel_1.block_row."""
    kernel = {"k1": config.kernel_1, "k2": config.kernel_2}[param[:2]]
    return getattr(kernel, param[3:])


def heatmap_cells(measurements: list[MeasurementRecord], x_param: str, y_param: str) -> dict[tuple, float]:
    """(x value, y value) → the best (lowest) median µs among the ok measurements with those values."""
    cells: dict[tuple, float] = {}
    for m in measurements:
        if m.status == "ok" and m.median_us:
            cell = (config_value(m.config, x_param), config_value(m.config, y_param))
            cells[cell] = min(m.median_us, cells.get(cell, math.inf))
    return cells


def validation_rows(store, run: RunRecord | None) -> list[ValidationRow]:
    """The validate run's head-to-head rows, pooled per candidate (see `validate.rows_from_measurements`). A
    default that is not today's analytic default (an older run's) is left out: the column means today's."""
    if run is None:
        return []
    measurements = store.measurements(run_id=run.id)
    rows = rows_from_measurements(measurements)
    for row in rows:
        timed = next((m for m in measurements if m.problem == row.problem and m.config == row.configs["default"]),
                     None)
        if timed is not None and not is_default(timed, run.device.sm_count, run_limits(run.device)):
            row.times["default"] = row.configs["default"] = None
    return rows


def bench_rows(store, run: RunRecord | None) -> list[dict]:
    """The bench run as `bench.run_bench` rows (normtune from its bench-* measurements, peers from its peer
    results), so that best peer, speedup and wins are computed by `bench.summary`, as `normtune bench` does.
    The floor is the one at the bench run's stored bandwidth."""
    if run is None:
        return []
    rows = [{"norm": m.problem.norm, "M": m.problem.M, "N": m.problem.N, "impl": OURS, "status": m.status,
             "median_us": m.median_us, "kernel_1_us": m.kernel_1_us, "kernel_2_us": m.kernel_2_us,
             "floor_us": run_floor_us(m.problem, run),
             "floor_fraction": (run_floor_us(m.problem, run) or 0) / m.median_us if m.median_us and
             run.copy_bandwidth_gbps else None}
            for m in store.measurements(run_id=run.id) if m.source.startswith("bench-")]
    rows += [{"norm": p.problem.norm, "M": p.problem.M, "N": p.problem.N, "impl": p.peer, "status": p.status,
              "median_us": p.median_us, "kernel_1_us": None, "kernel_2_us": None, "floor_us": None,
              "floor_fraction": None} for p in store.peer_results(run_id=run.id)]
    return rows


@dataclass(frozen=True)
class BenchRun:
    run: RunRecord
    dtypes: tuple[str, ...]  # activation dtypes it timed
    shapes: int  # distinct (norm, M, N) it timed
    seed: bool  # it timed every seed shape of both norms

    @property
    def dtype(self) -> str:
        return "+".join(self.dtypes)


def bench_runs(store, data: ReportData) -> tuple[BenchRun | None, list[BenchRun]]:
    """(the bench run the peers section shows, the others worth a line). Shown: the latest bf16 run that timed
    every seed shape, else the latest bf16 run, else the latest run. The others: the latest run of each other
    dtype and shape set (older repeats of a set are left out)."""
    from ..upkeep.kept_subset import bench_shapes
    from ..shapes import SEED

    seed = {(norm, m, n) for norm in ("layer_norm", "rms_norm") for m, n in SEED}
    latest: dict[tuple, BenchRun] = {}
    for run in (r for r in data.runs if r.kind == "bench"):
        by_dtype = bench_shapes(store, run.id)
        if not by_dtype:
            continue
        shapes = frozenset().union(*by_dtype.values())
        latest[(tuple(sorted(by_dtype)), shapes)] = BenchRun(run, tuple(sorted(by_dtype)), len(shapes),
                                                             seed <= shapes)
    runs = sorted(latest.values(), key=lambda b: b.run.id)
    if not runs:
        return None, []
    bf16 = [b for b in runs if b.dtypes == ("bf16",)]
    shown = max((b for b in bf16 if b.seed), key=lambda b: b.run.id, default=None) or (bf16 or runs)[-1]
    return shown, [b for b in runs if b is not shown]
