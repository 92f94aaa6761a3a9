"""`normtune status`: a sweep's state from the database alone."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .common import WritingStorage, read_only_store, refuse, run_checked, user_db

# The study-name prefixes of the sweeps (`normtune sweep`) and of validation's unseeded reference sweeps
# (`tuner.tables.validate.REFERENCE_PREFIX`).
PREFIXES = ("normtune:", "normtune-validate-unseeded:")


def status(
    db: WritingStorage = None,
    prefix: Annotated[str, typer.Option(help=f"Study-name prefix: {PREFIXES[0]} for sweeps, {PREFIXES[1]} for "
                                             "validation's reference sweeps")] = PREFIXES[0],
):
    """State of a running or finished sweep from the database alone (by default the one `normtune sweep` writes
    by default): per problem the finished, failed and running trials and the best time vs the default config's;
    the workers and whether they are alive."""
    from rich.console import Console

    from normtune.tuner.sweep.progress import render_table, snapshot, worker_lines

    console = Console()
    url = run_checked(user_db, db, make=False)
    if db is None and not Path(url.removeprefix("sqlite:///")).exists():
        run_checked(refuse, f"no sweep has written {url} yet (`normtune sweep` writes it when --db is not given): "
                            "pass --db, e.g. --db results.db")
    with run_checked(read_only_store, url) as store:
        snap = run_checked(snapshot, store, prefix)
        if not snap.problems:
            console.print(f"no sweep studies named {prefix}… in {store.display_url}", markup=False)
            for line in _other_contents(store, prefix):
                console.print(line, markup=False, soft_wrap=True)
            return
        console.print(render_table(snap, f"sweep status — {store.display_url}"))
        alive = sum(w.alive for w in snap.workers)
        console.print(f"workers: {alive} alive of {len(snap.workers)}"
                      + ("" if snap.workers else " (none recorded heartbeats)"))
        for line in worker_lines(snap, costs=True):
            console.print("  " + line, markup=False)


def _other_contents(store, prefix: str) -> list[str]:
    """What a database without studies named `prefix` holds: the study-name prefixes it has, and its runs (whose
    results `normtune report` renders)."""
    lines = []
    others = sorted({p for p in PREFIXES if p != prefix and store.workers.study_progress(p)})
    if others:
        lines.append(f"it holds studies named {', '.join(o + '…' for o in others)}: pass --prefix")
    runs = store.runs()
    if runs:
        lines.append(f"it holds {len(runs)} runs (no open studies: their measurements are kept); `normtune report "
                     f"--gpu KEY --db {store.display_url}` renders their results:")
        lines += [f"  run {r.id}: {r.kind} on {r.gpu_key}, {r.status}, started {r.started_at:%Y-%m-%d %H:%M}"
                  for r in runs]
    return lines
