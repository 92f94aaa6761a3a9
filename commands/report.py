"""`normtune report`: the Markdown + PNG report from stored data (no GPU needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from .common import DEFAULT_DB, Storage, read_only_store, refuse, run_checked


def report(
    gpu: Annotated[str, typer.Option("--gpu", help="GPU key whose data to report (h100, h200, interpret, …)")],
    db: Storage = DEFAULT_DB,
    out: Annotated[Path, typer.Option(help="Folder for report.md and its PNGs")] = Path("report"),
    problem: Annotated[Optional[str], typer.Option(help="Problem key for the parameter heatmaps [default: the "
                                                        "most measured]")] = None,
    table: Annotated[Optional[Path], typer.Option(help="Table whose rules to show [default: configs/<gpu>.json in "
                                                       "this folder (where emit writes), else the shipped one]")]
    = None,
):
    """Markdown + PNG report from the stored data (no GPU needed): best configs, per-kernel split, heatmaps,
    emitted rules, validation regret, normtune vs peers."""
    from rich.console import Console

    from normtune.tuner.report import write_report

    console = Console(stderr=True)
    if db == DEFAULT_DB and not Path("results.db").exists():
        run_checked(refuse, "results.db not found here: run from the repository root or pass --db sqlite:///PATH")
    if table is not None:  # a broken table is said before anything is read or written
        from normtune.kernels.select.tables import read_table

        run_checked(read_table, str(table))
    store = run_checked(read_only_store, db)
    try:  # a table's TableError is a ValueError; a damaged database's read fails with the store's StoreError
        paths = run_checked(write_report, store, gpu.strip().lower(), out, heatmap_problem=problem,
                            table_path=str(table) if table else None)
    finally:
        store.close()
    console.print(f"wrote {paths[0]} and {len(paths) - 1} plots in {out}")
