"""Regret is the table's time ÷ the fastest of the candidates timed head to head, the table among them
(`tables.validate.ValidationRow.regret`), so it is never below 1. No page a reader meets (README.md,
DEVELOPERS.md, docs/*.md, the rendered reports) may state one that is; ratios of another kind (speedups, gate
ratios, a range's bounds in brackets) are not regrets.
"""

from __future__ import annotations

import re
from pathlib import Path

from normtune.kernels.config import Problem
from normtune.tuner.measure.spread import Timing
from normtune.tuner.tables.validate import ValidationRow

ROOT = Path(__file__).resolve().parents[1]
# A decimal figure such as 0.988 or 1.05: not a range's second bound, not a speedup (×), not part of a longer number.
FIGURE = re.compile(r"(?<![\d.–-])(\d\.\d{2,3})(?![\d×])")


def pages() -> list[Path]:
    return [ROOT / "README.md", ROOT / "DEVELOPERS.md", *sorted((ROOT / "docs").glob("*.md")),
            *sorted((ROOT / "docs").glob("report-*/report.md"))]


def clauses(text: str) -> list[str]:
    """The text's sentences and ;-separated clauses, each on one line; a table row is its own paragraph."""
    out = []
    for paragraph in re.split(r"\n\s*\n|\n(?=\|)", text):
        flat = " ".join(paragraph.split())
        out += re.split(r"(?<=\.)\s+(?=[A-Z(*`])|;\s*", flat)
    return out


def regrets_below_one(text: str) -> list[str]:
    found = []
    for clause in clauses(text):
        if "regret" in clause.lower():
            bare = re.sub(r"\[[^\]]*\]", "", clause)  # bounds of a p10–p90 spread may dip below 1
            found += [f"{n} in: {clause[:160]}" for n in FIGURE.findall(bare) if float(n) < 1]
    return found


def test_the_definition_never_gives_a_regret_below_one():
    times = [Timing(median, median - 0.5, median + 0.5) for median in (10.0, 12.0, 14.0)]
    for table in times:
        others = [t for t in times if t is not table]
        row = ValidationRow(Problem("rms_norm", 512, 2048, "bf16"), {},
                            {"table": table, "reference": others[0], "default": others[1]})
        assert row.regret.value == table.median / 10.0 >= 1.0


def test_the_check_finds_a_regret_below_one_however_it_is_worded():
    assert regrets_below_one("Regret of the table, timed head to head (the H100 table: geometric mean 0.988, "
                             "worst 1.087 on 24 held-out shapes).")
    assert regrets_below_one("| rule | H200 | regret 1.171 and 1.191 (the H100 had shown 0.955) |")
    assert not regrets_below_one("regret 1.000 [0.974–1.027], speedup 0.97× over the default. The gate ran "
                                 "0.955 of the old time.")


def test_no_page_states_a_regret_below_one():
    found = {str(page.relative_to(ROOT)): hits for page in pages() if (hits := regrets_below_one(page.read_text()))}
    assert not found, found
