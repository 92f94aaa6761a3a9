"""`normtune report`: what the database knows about one GPU, as Markdown with PNG plots, made without a GPU.

report.md holds, in order: a summary of the results; normtune against the peers (the GPU's bf16 bench run, the
other bench runs in one line each, labelled by dtype); per problem the best config against today's analytic
default; the per-kernel breakdown; the launch-knob heatmaps; the heuristic table's rules; the latest validation's
regret on held-out shapes; provenance as counts and ranges, with every run in runs.csv. `data` gathers and
defines the numbers, `markdown` and `provenance` write the sections (`notes` the notes below the best-config
tables), `plots` draws the pictures; the PNGs and runs.csv lie beside report.md.
"""

from __future__ import annotations

from pathlib import Path

from .data import (BenchRun, ProblemSummary, ReportData, bench_rows, bench_runs,  # noqa: F401
                   choose_heatmap_problem, heatmap_cells, load_report_data, summarize_problems, validation_rows)
from .markdown import (header_section, heatmap_section, kernels_section, peers_section, problems_section,
                       rules_section, summary_section, validation_section)
from .plots import Pictures
from .provenance import provenance_section, write_runs_csv


def write_report(store, gpu_key: str, out_dir, *, heatmap_problem: str | None = None,
                 table_path: str | None = None) -> list[Path]:
    """Write report.md, runs.csv and the PNGs for `gpu_key` into `out_dir`; return their paths, report.md first.

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
    shown, others = bench_runs(store, data)
    peer_rows = bench_rows(store, shown.run if shown else None)
    validation = [(form, run, validation_rows(store, run)) for form, run in data.latest_validations()]
    lines = (header_section(data) + summary_section(data, summaries, shown, peer_rows, validation)
             + peers_section(data, shown, peer_rows, [(o, bench_rows(store, o.run)) for o in others], pictures)
             + problems_section(summaries, data, pictures) + kernels_section(summaries, data, pictures)
             + heatmap_section(data, focus, pictures) + rules_section(store, data, table_path)
             + validation_section(data, validation, pictures) + provenance_section(data))
    report = out / "report.md"
    report.write_text("\n".join(lines).rstrip() + "\n")
    return [report, write_runs_csv(data, out)] + pictures.paths
