"""The notes below the report's best-config tables: why a kernel_1 time can exceed its total (†) and a % floor
100 (‡), naming the problems where either goes beyond the noise of the measurement."""

from __future__ import annotations

from ..render import num
from .data import ProblemSummary

SPLIT_OUTLIER = 1.25  # kernel_1 this far above the total: the split's series was disturbed, not merely noisy


def _problems(count: int) -> str:
    return f"{count} problem{'' if count == 1 else 's'}"


def _name(s: ProblemSummary) -> str:
    p = s.problem
    gate = f", the norm {p.gate} a {p.gate_activation} gate," if p.gate is not None else ""
    return f"{p.norm} {p.dtype}{' + residual add' if p.residual else ''}{gate} {p.M}×{p.N}"


def split_and_floor_notes(summaries: list[ProblemSummary]) -> list[str]:
    """The † and ‡ notes as Markdown paragraphs (none where no row carries the mark)."""
    above = [s for s in summaries if s.split_above_total]
    outliers = [s for s in above if s.split_above_total > SPLIT_OUTLIER]
    over = [s for s in summaries if s.floor_fraction and s.floor_fraction > 1]
    notes = []
    if above:
        far = ("; ".join(f"{_name(s)}, kernel_1 {num(s.best.kernel_1_us)} µs against {num(s.best.median_us)} µs "
                         f"(run {s.best.run_id})" for s in outliers))
        notes.append(f"† kernel_1 above the total ({_problems(len(above))}): the total is the median of repetitions of "
                     "the whole backward with no event between the kernels; kernel_1 and kernel_2 are medians of a "
                     "separate, shorter series with an event between them, so each has its own noise. Where kernel_1 "
                     "is (nearly) the whole backward (kernel_2 0.0: no second kernel runs) the two differ by that "
                     "noise, a few percent."
                     + (f" Far beyond it, the split's series was disturbed and does not describe the total, which the "
                        f"row's other figures agree with: {far}." if outliers else ""))
    if over:
        rows = "; ".join(f"{_name(s)} {100 * s.floor_fraction:.1f} % (run {s.best.run_id})" for s in over)
        notes.append(f"‡ % floor above 100 ({_problems(len(over))}: {rows}): the backward moved its bytes faster than "
                     "the copy timed with its run. The floor is an estimate at that copy's bandwidth (a 1 GiB "
                     "device-to-device copy timed as the run starts, as many bytes read as written, several percent "
                     "apart from run to run), not a bound: the backward reads at least two bytes for each one it "
                     "writes.")
    return [line for note in notes for line in (note, "")]
