"""`normtune prune`: drop the Optuna studies of search spaces no sweep opens any more (their measurements stay)."""

from __future__ import annotations

from typing import Annotated

import typer

from .common import WritingStorage, existing_store, read_only_store, run_checked, user_db


def prune(
    db: WritingStorage = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="List what would be dropped; write nothing (the "
                                                            "database is opened read-only)")] = False,
):
    """Drop the Optuna studies of superseded search spaces (a sweep opens a new study once a problem's space
    grows) and their slot claims, keeping every normtune measurement: emission, validation and reports read those
    alone. Studies with a running trial or a held slot are kept. On SQLite the file then shrinks (VACUUM)."""
    from normtune.tuner.upkeep.superseded_studies import prune as drop, superseded_studies

    db = run_checked(user_db, db, make=False)
    with run_checked(read_only_store if dry_run else existing_store, db) as store:
        studies = run_checked(superseded_studies, store)
        trials = sum(s.trials for s in studies)
        verb = "would drop" if dry_run else "dropped"
        if not dry_run:
            run_checked(drop, store, studies)
        typer.echo(f"{verb} {len(studies)} superseded studies ({trials} trials) from {store.display_url}; "
                   "every measurement kept")
