"""`normtune status`: a sweep's state from the database alone."""

from __future__ import annotations

from typing import Annotated

import typer

from .common import DEFAULT_DB, Storage, read_only_store, run_checked


def status(
    db: Storage = DEFAULT_DB,
    prefix: Annotated[str, typer.Option(help="Study-name prefix: normtune: for sweeps, normtune-validate: for "
                                             "validation sweeps")] = "normtune:",
):
    """State of a running or finished sweep from the database alone: per problem the finished, failed and
    running trials and the best time vs the default config's; the workers and whether they are alive."""
    from rich.console import Console

    from normtune.tuner.sweep.progress import render_table, snapshot, worker_lines

    console = Console()
    with run_checked(read_only_store, db) as store:
        snap = run_checked(snapshot, store, prefix)
        if not snap.problems:
            console.print(f"no sweep studies named {prefix}… in {store.display_url}")
            return
        console.print(render_table(snap, f"sweep status — {store.display_url}"))
        lines = worker_lines(snap, costs=True)
        alive = sum(w.alive for w in snap.workers)
        console.print(f"workers: {alive} alive of {len(lines)}" + ("" if lines else " (none recorded heartbeats)"))
        for line in lines:
            console.print("  " + line)
