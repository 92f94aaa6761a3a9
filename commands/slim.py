"""`normtune slim`: write a copy of a SQLite results database that keeps only what the shipped file keeps."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from .common import DEFAULT_DB, Storage, read_only_store, refuse, run_checked


def slim(
    out: Annotated[Path, typer.Option("--out", help="The new, smaller SQLite file (must not exist yet)")],
    db: Storage = DEFAULT_DB,
    table: Annotated[Optional[list[Path]], typer.Option(
        "--table", help="A table whose fitted runs to keep (repeatable) [default: every configs/*.json]")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="List the runs kept and why; write nothing")] = False,
):
    """Copy a SQLite results database keeping only the runs the tables were fitted on and each GPU's latest
    validate run and latest bench run per dtype and shape set (docs/results-db.md); Optuna's studies are dropped.
    The source is only read."""
    from normtune.tuner.upkeep import kept_subset as keep
    from normtune.tuner.store.schema import sqlite_path

    tables = table or sorted(Path("configs").glob("*.json"))
    if not tables:
        run_checked(refuse, "no tables: pass --table configs/h100.json (or run from the repository root)")
    loaded = run_checked(keep.load_tables, tables)
    store = run_checked(read_only_store, db)
    try:
        source = sqlite_path(store.url)
        if source is None or store.upgraded_from is not None:
            run_checked(refuse, f"--db {db}: slim copies a SQLite file of the current schema; open it once with a "
                                "writing command (or pass a sqlite:/// URL)")
        kept = run_checked(keep.plan, store, loaded)
    finally:
        store.close()
    for run in kept:
        typer.echo(f"keep run {run.id:>4} {run.kind:<8} {run.gpu_key:<8} {'; '.join(run.reasons)}")
    if dry_run:
        typer.echo(f"would keep {len(kept)} runs")
        return
    size = run_checked(keep.write_slim, source, str(out), [r.id for r in kept])
    typer.echo(f"wrote {out}: {len(kept)} runs, {size / 2**20:.1f} MiB")
