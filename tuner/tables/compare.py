"""Configs timed head to head, and `normtune compare OLD.json NEW.json`: the regression gate for tables.

Head to head means the same process, the same inputs, cold L2 (one `measure.MeasureSession` times every
candidate), interleaved: each round times every candidate once, in an order rotated from round to round, so that
clock drift and thermal state fall on all of them alike. A candidate's time is its rounds pooled (`spread.Timing`).

`compare` resolves each shape's config as the runtime would with each table (its rule, adapted; the analytic
default where no rule applies), times OLD and NEW head to head and fails a shape where NEW is slower than OLD
by more than the threshold *and* beyond the measured spread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from normtune.kernels.config import BackwardConfig, Problem, default_config
from normtune.kernels.limits import DeviceLimits
from normtune.kernels.select.select import on_device

from ..render import MISSING, geomean, interval, markdown_table, num, problem_label
from ..measure.spread import Ratio, Timing, slower_beyond_spread

if TYPE_CHECKING:  # the session (torch) is made by the caller
    from ..measure.harness import MeasureSession

ROUNDS = 5  # interleaved rounds per head-to-head (each round is itself a median over cold-L2 repetitions)
THRESHOLD = 0.03  # compare: NEW may be slower than OLD by up to this fraction before the gate fails


def head_to_head(session: MeasureSession, problem: Problem, configs: dict[str, BackwardConfig], *,
                 rounds: int = ROUNDS, on_result: Callable | None = None) -> dict[str, Timing | None]:
    """Each named config's pooled time over `rounds` interleaved rounds (None: it never ran correctly).
    `on_result(name, config, result)` sees every measurement (validate stores them)."""
    names = list(configs)
    results: dict[str, list] = {name: [] for name in names}
    for i in range(rounds):
        for name in names[i % len(names):] + names[:i % len(names)]:
            result = session.measure_problem(problem, configs[name])
            results[name].append(result)
            if on_result is not None:
                on_result(name, configs[name], result)
    return {name: Timing.pool(rs) for name, rs in results.items()}


def config_for(table, problem: Problem, limits: DeviceLimits | None = None) -> BackwardConfig:
    """What the runtime would run with `table` (None: no table) on the device of `limits` (None: the reference
    device, as on CPU): its rule adapted, in the form the device runs (`select.on_device`), else the analytic
    default sized for the device."""
    config = table.lookup(problem) if table is not None else None
    return on_device(config, problem, limits)[0] if config is not None else default_config(problem, limits)


@dataclass
class Comparison:
    problem: Problem
    old_config: BackwardConfig
    new_config: BackwardConfig
    old: Timing | None = None
    new: Timing | None = None

    @property
    def same_config(self) -> bool:
        return self.old_config == self.new_config

    @property
    def ratio(self) -> Ratio | None:
        """NEW ÷ OLD (above 1: NEW is slower)."""
        return Ratio.of(self.new, self.old)

    def verdict(self, threshold: float) -> str:
        if self.same_config:
            return "same config"
        if self.new is None:
            return "NEW failed"
        if self.old is None:
            return "ok (OLD failed)"
        return "SLOWER" if slower_beyond_spread(self.new, self.old, threshold) else "ok"

    def fails(self, threshold: float) -> bool:
        return self.verdict(threshold) in ("SLOWER", "NEW failed")


def compare_tables(old, new, problems: list[Problem], session: MeasureSession, *, rounds: int = ROUNDS,
                   progress: Callable[[int, Comparison], None] | None = None) -> list[Comparison]:
    """One `Comparison` per problem, each table's config as the runtime would run it on the session's GPU; shapes
    where both tables pick the same config are not timed."""
    from ..gpu_info import measured_limits

    limits = measured_limits(session.device)
    out = []
    for i, problem in enumerate(problems):
        row = Comparison(problem, config_for(old, problem, limits), config_for(new, problem, limits))
        if not row.same_config:
            times = head_to_head(session, problem, {"old": row.old_config, "new": row.new_config}, rounds=rounds)
            row.old, row.new = times["old"], times["new"]
        out.append(row)
        if progress is not None:
            progress(i, row)
    return out


def config_changes(old, new, problems: list[Problem], limits: DeviceLimits | None = None) -> list[Comparison]:
    """One untimed `Comparison` per problem where the two tables pick different configs on the device of `limits`
    (what the gate times there)."""
    rows = [Comparison(p, config_for(old, p, limits), config_for(new, p, limits)) for p in problems]
    return [r for r in rows if not r.same_config]


def changes_markdown(changes: list[Comparison], total: int) -> list[str]:
    """The shapes whose config changes, with both configs: the gate's plan, timed by nothing."""
    body = [[problem_label(r.problem), f"`{r.old_config}`",
             f"`{r.new_config}`"] for r in changes]
    return ([f"{len(changes)} of {total} shapes change config (nothing timed: the gate would time these).", ""]
            + (markdown_table(["problem", "OLD", "NEW"], body) if body else []))


def where_line(gpu_name: str, gpu_key: str, *, interpret: bool, rounds: int) -> str:
    """The line naming where a comparison ran: the GPU (name and key) and the timing method."""
    method = ("Triton interpreter on CPU, host wall-clock (not GPU time)" if interpret
              else "cold-L2 device time, medians")
    return (f"Measured on {gpu_name} (`{gpu_key}`); timing: {method}, OLD and NEW interleaved in {rounds} rounds per "
            "shape.")


def comparison_markdown(rows: list[Comparison], threshold: float, *, interpret: bool,
                        where: str | None = None) -> list[str]:
    """The gate's table and its one-line verdict, after `where` (`where_line`) when given."""
    unit = "interpreter µs (host wall-clock, not GPU time)" if interpret else "µs (cold L2, median [p10–p90])"

    def cell(t: Timing | None) -> str:
        return MISSING if t is None else f"{num(t.median)} [{num(t.p10)}–{num(t.p90)}]"

    body = []
    for r in rows:
        ratio = r.ratio
        body.append([problem_label(r.problem), cell(r.old), cell(r.new),
                     interval(ratio.value, ratio.low, ratio.high) if ratio else MISSING, r.verdict(threshold)])
    failed = sum(r.fails(threshold) for r in rows)
    g = geomean(r.ratio.value for r in rows if r.ratio)
    return ([where, ""] if where else []) + ([f"OLD vs NEW, {unit}; NEW ÷ OLD with bounds from the spread; a shape fails when NEW is more than "
             f"{threshold:.1%} slower beyond the spread.", ""]
            + markdown_table(["problem", "OLD", "NEW", "NEW ÷ OLD", "verdict"], body)
            + ["", f"{failed} of {len(rows)} shapes slower; geometric-mean NEW ÷ OLD over the timed shapes "
                   f"{num(g, 3)}." + (" FAIL" if failed else " PASS")])
