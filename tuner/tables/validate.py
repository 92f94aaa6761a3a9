"""`normtune validate`: how much a heuristic table loses on shapes it was not fitted on, against a reference
that owes the table nothing.

Per shape:
1. Reference: an *unseeded* sweep (its own Optuna studies, `REFERENCE_TRIALS` trials; neither the table's config
   nor the analytic default is enqueued, so the search cannot start from the answer it is judged against). Its
   measurements are stored as source "validate-sweep", which `emit` never fits on.
2. Head to head: the table's config, the reference sweep's best config and the analytic default, timed
   interleaved over `ROUNDS` rounds in one process (`compare.head_to_head`), each with its p10-p90 spread, stored
   as validate-table / validate-reference / validate-default in a "validate" run.
3. Regret = table ÷ the fastest of the three (≥ 1; 1.0: the table's config was the fastest), with bounds from
   the spreads (a lower bound below 1 means the difference is within the noise); speedup = default ÷ table.
"""

from __future__ import annotations

from dataclasses import dataclass

from normtune.kernels.config import BackwardConfig, Problem, default_config

from .compare import ROUNDS, config_for, head_to_head
from ..gpu_info import DeviceInfo, measured_limits
from ..gpu_info import command_line as device_command_line
from ..render import geomean
from ..measure.spread import Ratio, Timing, slower_beyond_spread

REFERENCE_TRIALS = 40
REFERENCE_PREFIX = "normtune-validate-unseeded"  # the reference sweeps' own studies
REFERENCE_SOURCE = "validate-sweep"
CANDIDATES = ("table", "reference", "default")  # head-to-head names, stored as validate-<name>
LEGACY_NAMES = {"best": "reference"}  # runs before the unseeded reference stored its best as validate-best


@dataclass
class ValidationRow:
    problem: Problem
    configs: dict[str, BackwardConfig | None]  # by CANDIDATES name
    times: dict[str, Timing | None]
    reference_trials: int | None = None

    def fastest(self) -> Timing | None:
        return min((t for t in self.times.values() if t is not None), key=lambda t: t.median, default=None)

    @property
    def regret(self) -> Ratio | None:
        """Table ÷ the fastest candidate, with bounds."""
        return Ratio.of(self.times.get("table"), self.fastest())

    @property
    def speedup_vs_default(self) -> Ratio | None:
        """Default ÷ table (above 1: the table is faster)."""
        return Ratio.of(self.times.get("default"), self.times.get("table"))

    @property
    def slower_than_default(self) -> bool:
        table, default = self.times.get("table"), self.times.get("default")
        return bool(table and default and slower_beyond_spread(table, default))

    def to_dict(self) -> dict:
        def ratio(r):
            return None if r is None else {"value": r.value, "low": r.low, "high": r.high}

        return {"norm": self.problem.norm, "M": self.problem.M, "N": self.problem.N, "dtype": self.problem.dtype,
                "problem": self.problem.key, "reference_trials": self.reference_trials,
                "times_us": {k: None if t is None else {"median": t.median, "p10": t.p10, "p90": t.p90,
                                                        "rounds": t.count} for k, t in self.times.items()},
                "regret": ratio(self.regret), "speedup_vs_default": ratio(self.speedup_vs_default),
                "slower_than_default": self.slower_than_default,
                "configs": {k: None if c is None else c.to_dict() for k, c in self.configs.items()}}


# ---------------------------------------------------------------------------------------- the reference


class ReferenceInterrupted(Exception):
    """A signal stopped the reference sweep: validating against an unfinished reference would understate regret.
    Its trials are stored; the same command continues it."""

    def __init__(self, exit_code: int, signal: str):
        super().__init__(f"{signal} during the reference sweep: its trials are saved; run the same command again to "
                         "finish it (no head-to-head was timed)")
        self.exit_code = exit_code


def reference_sweep(store, info: DeviceInfo, gpu_key: str, problems: list[Problem], *, trials: int,
                    storage_url: str, compile_workers: int, progress=None) -> dict[str, tuple]:
    """problem key → (best config or None, trials measured) of an unseeded sweep of `trials` trials."""
    from ..sweep import Sweep, SweepOptions, study_name

    names = {p.key: study_name(gpu_key, p, info.interpret, REFERENCE_PREFIX) for p in problems}
    opts = SweepOptions(gpu_key=gpu_key, problems=problems, trials=trials, interpret=info.interpret,
                        compile_workers=compile_workers, study_prefix=REFERENCE_PREFIX, source=REFERENCE_SOURCE,
                        seeded=False)
    summary = Sweep(opts, store, info, on_event=progress).run()
    if summary.signal:
        raise ReferenceInterrupted(summary.exit_code, summary.signal)
    out = {}
    for p in problems:
        measured = store.measurements(study_name=names[p.key])
        ok = [m for m in measured if m.status == "ok" and m.median_us]
        best = min(ok, key=lambda m: (m.median_us, m.id), default=None)
        out[p.key] = (best.config if best else None, len(measured))
    return out


# ----------------------------------------------------------------------------------------------- validate


def run_validate(store, info: DeviceInfo, gpu_key: str, problems: list[Problem], table, *, storage_url: str,
                 trials: int = REFERENCE_TRIALS, rounds: int = ROUNDS, compile_workers: int = 8,
                 command_line: str | None = None, progress=None) -> list[ValidationRow]:
    """Reference sweep, then the head-to-head per problem (see the module docstring). `progress(kind, data)`
    receives the sweep's events and ("validated", {"index", "total", "row"})."""
    reference = reference_sweep(store, info, gpu_key, problems, trials=trials, storage_url=storage_url,
                                compile_workers=compile_workers, progress=progress)
    from ..measure.harness import TIMING, MeasureSession

    session = MeasureSession.for_device(info, timing=TIMING["validate"])
    limits = measured_limits(session.device)  # the table's config and the default as the runtime runs them here
    run_id = store.start_run(info, kind="validate", command_line=command_line or device_command_line(),
                             copy_bandwidth_gbps=session.recorded_bandwidth_gbps)
    rows = []
    try:
        for i, p in enumerate(problems):
            best, measured = reference[p.key]
            configs = {"table": config_for(table, p, limits), "reference": best,
                       "default": default_config(p, limits)}
            timed = {k: c for k, c in configs.items() if c is not None}

            def store_result(name, config, result, p=p):
                store.add_measurement(run_id, p, config, result, source=f"validate-{name}")

            times = head_to_head(session, p, timed, rounds=rounds, on_result=store_result)
            row = ValidationRow(p, configs, {k: times.get(k) for k in CANDIDATES}, measured)
            rows.append(row)
            if progress:
                progress("validated", {"index": i, "total": len(problems), "row": row})
        store.end_run(run_id)
    except BaseException:
        store.end_run(run_id, status="interrupted")
        raise
    return rows


def rows_from_measurements(measurements) -> list[ValidationRow]:
    """A validate run's rows from its stored head-to-head measurements (in the order measured)."""
    results: dict[Problem, dict[str, list]] = {}
    configs: dict[Problem, dict[str, BackwardConfig]] = {}
    for m in measurements:
        name = m.source.removeprefix("validate-")
        name = LEGACY_NAMES.get(name, name)
        if name in CANDIDATES:
            results.setdefault(m.problem, {}).setdefault(name, []).append(m)
            configs.setdefault(m.problem, {}).setdefault(name, m.config)
    return [ValidationRow(p, {k: configs[p].get(k) for k in CANDIDATES},
                          {k: Timing.pool(results[p].get(k, [])) for k in CANDIDATES}) for p in results]


def summarize(rows: list[ValidationRow]) -> dict:
    regrets = [r.regret.value for r in rows if r.regret]
    speedups = [r.speedup_vs_default.value for r in rows if r.speedup_vs_default]
    return {"shapes": len(rows), "geomean_regret": geomean(regrets), "worst_regret": max(regrets, default=None),
            "geomean_speedup_vs_default": geomean(speedups),
            "slower_than_default": [r.problem.key for r in rows if r.slower_than_default]}


def markdown(rows: list[ValidationRow], info: DeviceInfo, table_path: str | None, trials: int) -> str:
    """validate.md."""
    from ..render import validation_summary, validation_table

    timing = ("Triton-interpreter timings: host wall-clock on CPU, not GPU time" if info.interpret else
              "median µs of cold-L2 repetitions, pooled over interleaved rounds")
    return "\n".join(
        [f"# normtune validate — {info.name}", "",
         f"Table: `{table_path or 'none (analytic defaults)'}`. Reference: the best config of an unseeded sweep of "
         f"{trials} trials per shape. The table's config, the reference and the analytic default were timed head "
         f"to head ({timing}). Regret = table ÷ the fastest of the three (1.000: the table's config was the "
         "fastest); bounds from the p10–p90 spreads.", ""]
        + _short_references(rows, trials)
        + validation_table(rows) + ["", validation_summary(summarize(rows)), ""])


def _short_references(rows: list[ValidationRow], trials: int) -> list[str]:
    """A warning line naming the shapes whose reference sweep has fewer than `trials` trials (a time budget or an
    earlier run with fewer trials): their regret is measured against a weaker reference."""
    short = [f"{r.problem.norm} {r.problem.M}×{r.problem.N} {r.problem.dtype} ({r.reference_trials})" for r in rows
             if r.reference_trials is not None and r.reference_trials < trials]
    if not short:
        return []
    return [f"**Reference short of {trials} trials on {len(short)} of {len(rows)} problems** (their regret is against "
            f"a weaker reference): {', '.join(short)}.", ""]
