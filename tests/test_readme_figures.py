"""The README's Results table against the committed results.db: every figure it states is recomputed with the
report's own code (`normtune report`'s Summary section) from the runs the database keeps, and a cell that says
"not measured yet" has no such run behind it. docs/new-gpu.md's example validation is checked the same way.

Only the GPU's runs, its bench runs' rows and its validate runs' measurements are read (not every measurement of
the GPU, which the full report loads), so the check takes seconds.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from normtune.tuner.report import ReportData, bench_rows, bench_runs, validation_rows
from normtune.tuner.report.markdown import summary_section
from normtune.tuner.store.database import Store

ROOT = Path(__file__).resolve().parents[1]
REPO_DB = ROOT / "results.db"
GPU_KEYS = {"H100": "h100", "H200": "h200"}

BENCH_CELL = re.compile(r"(\d+) of (\d+) faster, (\d\.\d{3})× \(bench run (\d+)\)")
VALIDATE_CELL = re.compile(r"regret (\d\.\d{3}) on (\d+) shapes \(validate run (\d+)\b")
NOT_MEASURED = "not measured yet"


def results_table() -> dict[str, list[str]]:
    """GPU name → its row's cells (seed bench, held-out validation, residual held-out validation)."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Results\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| H")]
    return {cells[0]: cells[1:] for cells in ([c.strip() for c in row.strip("|").split("|")] for row in rows)}


def report_summary(store: Store, gpu_key: str) -> dict:
    """The figures of the report's Summary for `gpu_key`, from `markdown.summary_section` as `write_report` calls
    it, fed only the runs those figures rest on."""
    runs = [r for r in store.runs(gpu_key=gpu_key) if not r.interpret]
    validating = [m for r in runs if r.kind == "validate" for m in store.measurements(run_id=r.id)]
    data = ReportData(gpu_key, runs, False, validating)
    shown, _ = bench_runs(store, data)
    validation = [(form, run, validation_rows(store, run)) for form, run in data.latest_validations()]
    lines = summary_section(data, [], shown, bench_rows(store, shown.run if shown else None), validation)
    figures: dict = {"validate": {}}
    for line in lines:
        if m := re.search(r"bench run (\d+)\): faster on (\d+) of (\d+) shapes, geometric-mean speedup "
                          r"\*\*(\d\.\d{3})×\*\*", line):
            figures["bench"] = (int(m[2]), int(m[3]), m[4], int(m[1]))
        elif m := re.search(r"\*\*Held-out validation(, fused residual add)?\*\* \(run (\d+), [^)]*, (\d+) shapes\): "
                            r"the table's regret is (\d\.\d{3}) \(geometric mean; worst (\d\.\d{3})\)", line):
            figures["validate"]["residual" if m[1] else ""] = (m[4], int(m[3]), int(m[2]))
            figures["worst", "residual" if m[1] else ""] = m[5]
    return figures


@pytest.fixture(scope="module")
def summaries() -> dict[str, dict]:
    if not REPO_DB.is_file():
        pytest.skip("no committed results.db")
    with Store.for_reading(f"sqlite:///{REPO_DB}") as store:
        return {gpu: report_summary(store, key) for gpu, key in GPU_KEYS.items()}


def test_the_results_table_has_a_row_per_gpu_with_the_three_columns():
    table = results_table()
    assert set(table) == set(GPU_KEYS), table
    for gpu, cells in table.items():
        assert len(cells) == 3, f"{gpu}: {cells}"
        assert BENCH_CELL.search(cells[0]), f"{gpu}: the seed bench cell states no figure: {cells[0]!r}"
        for cell in cells[1:]:
            assert VALIDATE_CELL.search(cell) or cell == NOT_MEASURED, f"{gpu}: {cell!r}"


@pytest.mark.parametrize("gpu", sorted(GPU_KEYS))
def test_the_seed_bench_figure_is_what_the_report_computes_from_results_db(summaries, gpu):
    wins, shapes, speedup, run = BENCH_CELL.search(results_table()[gpu][0]).groups()
    assert summaries[gpu].get("bench") == (int(wins), int(shapes), speedup, int(run)), (
        f"README's {gpu} seed bench says {wins} of {shapes} faster, {speedup}× (run {run}); the report computes "
        f"{summaries[gpu].get('bench')} (wins, shapes, speedup, run) from results.db")


@pytest.mark.parametrize("gpu", sorted(GPU_KEYS))
@pytest.mark.parametrize("column, form", [(1, ""), (2, "residual")])
def test_the_held_out_regret_is_what_the_report_computes_from_results_db(summaries, gpu, column, form):
    cell = results_table()[gpu][column]
    computed = summaries[gpu]["validate"].get(form)
    if cell == NOT_MEASURED:
        assert computed is None, f"README's {gpu} says {cell!r}, but results.db holds validate run {computed[2]}"
        return
    regret, shapes, run = VALIDATE_CELL.search(cell).groups()
    assert computed == (regret, int(shapes), int(run)), (
        f"README's {gpu} {form or 'plain'} regret says {regret} on {shapes} shapes (run {run}); the report "
        f"computes {computed} (regret, shapes, run) from results.db")


def test_the_figures_are_the_ones_the_committed_reports_show(summaries):
    """The rendered reports in docs/ were made from the same database: their Summary states the same figures."""
    for gpu, key in GPU_KEYS.items():
        report = (ROOT / "docs" / f"report-{key}" / "report.md").read_text()
        wins, shapes, speedup, run = summaries[gpu]["bench"]
        assert (f"bench run {run}): faster on {wins} of {shapes} shapes, geometric-mean speedup **{speedup}×**"
                in report), gpu
        for form, (regret, count, run) in summaries[gpu]["validate"].items():
            what = "Held-out validation" + (", fused residual add" if form else "")
            assert f"**{what}** (run {run}," in report and f"{count} shapes): the table's regret is {regret}" in report


def test_the_new_gpu_guide_quotes_the_h100_validation_as_the_report_computes_it(summaries):
    text = " ".join((ROOT / "docs" / "new-gpu.md").read_text().split())
    m = re.search(r"the H100 table: geometric mean (\d\.\d{3}), worst (\d\.\d{3}) on (\d+) held-out problems, "
                  r"validate run (\d+)", text)
    assert m, "docs/new-gpu.md no longer quotes the H100 table's validation"
    regret, count, run = summaries["H100"]["validate"][""]
    assert (m[1], m[2], int(m[3]), int(m[4])) == (regret, summaries["H100"]["worst", ""], count, run)
