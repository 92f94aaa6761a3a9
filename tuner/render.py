"""Figures as text, one way everywhere: the geometric mean, number and ratio formatting, Markdown tables, and the
head-to-head table that `validate`, `compare` and `report` all show.

Pure Python (no torch, no database): every command and the no-GPU report can import it.
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

MISSING = "–"  # a figure that does not exist (not measured, failed, not applicable)


def geomean(values: Iterable[float | None]) -> float | None:
    """Geometric mean of the positive finite values; None when there is none (never 0, never inf)."""
    xs = [x for x in values if x is not None and x > 0 and math.isfinite(x)]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def num(x: float | None, digits: int = 1) -> str:
    """A figure with `digits` decimals, or MISSING for None/NaN/inf."""
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return MISSING
    return f"{x:.{digits}f}"


def ratio(numerator: float | None, denominator: float | None, digits: int = 2) -> str:
    """numerator / denominator with `digits` decimals and a times sign, or MISSING when either side is missing or zero."""
    if not numerator or not denominator:
        return MISSING
    return num(numerator / denominator, digits) + "×"


def interval(value: float | None, low: float | None, high: float | None, digits: int = 3) -> str:
    """'1.034 [0.990–1.080]': a ratio and its bounds from the measured spread."""
    if value is None:
        return MISSING
    if low is None or high is None:
        return num(value, digits)
    return f"{num(value, digits)} [{num(low, digits)}–{num(high, digits)}]"


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    """Markdown lines of a table; '|' inside a cell is replaced so that it cannot split the row."""
    def line(cells):
        return "| " + " | ".join(str(c).replace("|", "/") for c in cells) + " |"

    return [line(headers), "|" + "---|" * len(headers)] + [line(r) for r in rows]


def problem_label(problem) -> str:
    """A table row's problem (a `Problem`): norm, M×N, dtype, and its form where it is not the plain one (the
    residual form, or the gate's position and activation): 'rms_norm 4096×8192 bf16 residual'."""
    form = (" residual" if problem.residual else "") + (
        f" gate-{problem.gate}-{problem.gate_activation}" if problem.gate is not None else "")
    return f"{problem.norm} {problem.M}×{problem.N} {problem.dtype}{form}"


def timing_cell(timing, digits: int = 1) -> str:
    """A pooled time (`spread.Timing`) as its median, or MISSING."""
    return MISSING if timing is None else num(timing.median, digits)


def ratio_cell(r, digits: int = 3) -> str:
    """A `spread.Ratio` as 'value [low–high]', or MISSING."""
    return MISSING if r is None else interval(r.value, r.low, r.high, digits)


def validation_table(rows) -> list[str]:
    """The head-to-head table of `validate` (rows: `validate.ValidationRow`), as validate.md, the command's
    output and the report show it."""
    body = [[problem_label(r.problem),
             timing_cell(r.times.get("table")), timing_cell(r.times.get("reference")),
             timing_cell(r.times.get("default")), ratio_cell(r.regret), ratio_cell(r.speedup_vs_default)]
            for r in rows]
    return markdown_table(["problem", "table µs", "reference µs", "default µs", "regret [bounds]",
                           "default ÷ table [bounds]"], body)


def validation_summary(summary: dict) -> str:
    """One sentence from `validate.summarize`."""
    slower = summary["slower_than_default"]
    return (f"Geometric-mean regret {num(summary['geomean_regret'], 3)}, worst {num(summary['worst_regret'], 3)} "
            f"over {summary['shapes']} shapes; geometric-mean speedup over the analytic default "
            f"{num(summary['geomean_speedup_vs_default'], 3)}×; slower than the default beyond the spread on "
            + (", ".join(slower) if slower else "no shape") + ".")
