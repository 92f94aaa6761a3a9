"""`normtune report`: what the database knows about one GPU, as Markdown with PNG plots, made without a GPU.

report.md holds, in order: provenance of the GPU's runs; per problem the best config, its time, bandwidth and
kernel_1/kernel_2 split against the memory floor, today's analytic default timed in the same run, and the trial
counts; the heuristic table's rules (and what emission dropped); the latest validation's regret on held-out
shapes; the latest bench against the peers. `data` gathers and defines the numbers, `markdown` writes the
sections, `plots` draws the pictures; the PNGs lie beside report.md.
"""

from __future__ import annotations

from pathlib import Path

from .data import (ProblemSummary, ReportData, bench_rows, choose_heatmap_problem, heatmap_cells,  # noqa: F401
                   load_report_data, summarize_problems, validation_rows)
from .markdown import (header_section, heatmap_section, peers_section, problems_section, provenance_section,
                       rules_section, validation_section)
from .plots import Pictures


def write_report(store, gpu_key: str, out_dir, *, heatmap_problem: str | None = None,
                 table_path: str | None = None) -> list[Path]:
    """Write report.md and its PNGs for `gpu_key` into `out_dir`; return their paths, report.md first.

    `heatmap_problem` is a problem key (default: the problem with most measurements); `table_path` a heuristic
    table (default: the shipped configs/<gpu_key>.json, else one fitted now from the store). Raises ValueError for
    a GPU key without runs (naming the keys present) or a heatmap problem that was never measured, and
    `kernels.tables.TableError` (a ValueError) or OSError for a `table_path` that cannot be used."""
    data = load_report_data(store, gpu_key)
    summaries = summarize_problems(data)
    focus = choose_heatmap_problem(summaries, heatmap_problem)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pictures = Pictures(out)
    lines = (header_section(data) + provenance_section(data) + problems_section(summaries, data, pictures)
             + heatmap_section(data, focus, pictures) + rules_section(store, data, table_path)
             + validation_section(data, validation_rows(store, data.latest("validate")), pictures)
             + peers_section(data, bench_rows(store, data.latest("bench")), pictures))
    report = out / "report.md"
    report.write_text("\n".join(lines).rstrip() + "\n")
    return [report] + pictures.paths
