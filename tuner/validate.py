"""`normtune validate`: how much a heuristic table loses on shapes it was not fitted on.

For each shape: a short fresh sweep (its own studies, seeded with the default config, its neighbours and the
table's config) finds a best config; then the table's config, that best config and the analytic default are
timed head to head, interleaved over several rounds in one process (the same conditions for all three), and
the regret is table ÷ best (1.0 = the table found the best; below 1 the table beat the short sweep), plus the
speedup of the table over the defaults.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from normtune.kernels.config import BackwardConfig, Problem, default_config
from normtune.kernels.tables import Table

from .device import DeviceInfo

HEAD_TO_HEAD_ROUNDS = 3


@dataclass
class ValidationRow:
    problem: Problem
    table_config: BackwardConfig
    best_config: BackwardConfig
    table_us: float | None
    best_us: float | None
    default_us: float | None

    @property
    def regret(self) -> float | None:
        if self.table_us and self.best_us:
            return self.table_us / self.best_us
        return None

    @property
    def speedup_vs_default(self) -> float | None:
        if self.table_us and self.default_us:
            return self.default_us / self.table_us
        return None

    def to_dict(self) -> dict:
        return {"norm": self.problem.norm, "M": self.problem.M, "N": self.problem.N, "problem": self.problem.key,
                "table_us": self.table_us, "best_us": self.best_us, "default_us": self.default_us,
                "regret": self.regret, "speedup_vs_default": self.speedup_vs_default,
                "table_config": self.table_config.to_dict(), "best_config": self.best_config.to_dict()}


def geomean(xs) -> float | None:
    xs = [x for x in xs if x and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def head_to_head(store, run_id: int, info: DeviceInfo, problem: Problem, configs: dict[str, BackwardConfig],
                 *, rounds: int = HEAD_TO_HEAD_ROUNDS) -> dict[str, float | None]:
    """Median µs of each named config over `rounds` interleaved measurements (stored as validate-<name>)."""
    import torch

    from . import measure

    device = torch.device("cpu" if info.interpret else "cuda")
    bandwidth = math.nan if info.interpret else measure.copy_bandwidth(device, nbytes=2**28, reps=5)
    flusher = None if info.interpret else measure.L2Flusher(device, info.l2_bytes)
    timing = dict(min_reps=1, max_reps=2, budget_s=0.0, warmup=0) if info.interpret else \
        dict(min_reps=20, max_reps=100, budget_s=0.25)
    case = measure.make_case(problem, device)
    ref = case.reference()
    times: dict[str, list[float]] = {k: [] for k in configs}
    for _ in range(rounds if not info.interpret else 1):
        for name, cfg in configs.items():
            r = measure.measure_config(case, cfg, flusher=flusher, bandwidth_gbps=bandwidth, reference_grads=ref,
                                       **timing)
            store.add_measurement(run_id, problem, cfg, r, source=f"validate-{name}")
            if r.status == "ok":
                times[name].append(r.median_us)
    return {k: (statistics.median(v) if v else None) for k, v in times.items()}


def run_validate(store, info: DeviceInfo, gpu_key: str, problems: list[Problem], table: Table | None, *,
                 trials: int, storage_url: str, compile_workers: int = 8, progress=None) -> list[ValidationRow]:
    from .sweep import Sweep, SweepOptions

    def table_config(p: Problem) -> BackwardConfig:
        cfg = table.lookup(p) if table is not None else None
        return cfg if cfg is not None else default_config(p)

    seeds = {p.key: [table_config(p).to_dict()] for p in problems}
    opts = SweepOptions(gpu_key=gpu_key, problems=problems, trials=trials,
                        interpret=info.interpret, compile_workers=compile_workers, study_prefix="normtune-validate",
                        source="validate-sweep", extra_seeds=seeds)
    summary = Sweep(opts, store, info, on_event=progress).run()
    best = {ps.problem.key: ps.best_config for ps in summary.problems}
    run_id = store.start_run(info, kind="validate", command_line="validate head-to-head")
    rows = []
    try:
        for p in problems:
            t_cfg = table_config(p)
            b_cfg = best.get(p.key) or t_cfg
            d_cfg = default_config(p)
            res = head_to_head(store, run_id, info, p, {"table": t_cfg, "best": b_cfg, "default": d_cfg})
            row = ValidationRow(p, t_cfg, b_cfg, res["table"], res["best"], res["default"])
            rows.append(row)
            if progress:
                progress("validated", {"row": row})
        store.end_run(run_id)
    except BaseException:
        store.end_run(run_id, status="interrupted")
        raise
    return rows


def summarize(rows: list[ValidationRow]) -> dict:
    regrets = [r.regret for r in rows if r.regret]
    speedups = [r.speedup_vs_default for r in rows if r.speedup_vs_default]
    return {"shapes": len(rows), "geomean_regret": geomean(regrets), "worst_regret": max(regrets, default=None),
            "geomean_speedup_vs_default": geomean(speedups)}


def markdown(rows: list[ValidationRow], info: DeviceInfo, table_path: str | None) -> str:
    s = summarize(rows)

    def f(x, d=1):
        return "–" if x is None else f"{x:.{d}f}"

    lines = [f"# normtune validate — {info.name}", "",
             f"Table: `{table_path or 'none (analytic defaults)'}`. Regret = table µs ÷ best µs of a short fresh "
             "sweep, timed head to head (median of interleaved rounds, cold L2).", "",
             "| problem | table µs | best µs | default µs | regret | speedup vs default |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.problem.norm} {r.problem.M}×{r.problem.N} | {f(r.table_us)} | {f(r.best_us)} | "
                     f"{f(r.default_us)} | {f(r.regret, 3)} | {f(r.speedup_vs_default, 3)} |")
    lines += ["", f"Geometric-mean regret {f(s['geomean_regret'], 3)}, worst {f(s['worst_regret'], 3)}; "
                  f"geometric-mean speedup over the analytic defaults {f(s['geomean_speedup_vs_default'], 3)}.", ""]
    return "\n".join(lines)
