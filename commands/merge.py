"""`normtune merge`: copy runs from one results database into another (`tuner/store/merge.py`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from .common import (CLIError, WritingStorage, existing_store, one_line, read_only_store, refuse, run_checked,
                     run_ids_option, user_db)


def merge(
    source: Annotated[str, typer.Option("--from", help="The results database to copy runs from (a file path or "
                                                       "SQLAlchemy URL); only read")],
    db: WritingStorage = None,
    runs: Annotated[Optional[str], typer.Option("--runs", help="Copy only these runs of --from (comma list of its "
                                                               "run ids) [default: every run]")] = None,
    runs_of: Annotated[Optional[Path], typer.Option("--runs-of", help="Copy the runs a table was fitted on in "
                                                                      "--from (its provenance.runs)")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="List what would be copied; write nothing (--db is "
                                                            "opened read-only)")] = False,
):
    """Copy runs of another results database (--from) into this one (--db), with their problems, measurements,
    peer results and provenance, under new run ids. A run --db already holds (the same kind, GPU, host, start time
    and command line) is left as it is, so merging again adds nothing. Optuna's studies are not copied. --from is
    only read; --db changes in one transaction, or not at all."""
    from normtune.tuner.store.merge import merge_runs, same_database

    db = run_checked(user_db, db, make=False)
    if runs is not None and runs_of is not None:
        run_checked(refuse, "--runs and --runs-of both name the runs to copy: give one of them")
    run_ids = run_checked(run_ids_option, runs, "--runs")
    if runs_of is not None:
        run_ids = run_checked(_table_runs, runs_of)
    if same_database(source, db):
        run_checked(refuse, f"--from {source} is the destination (--db {db}) itself: name the database to copy "
                             "runs from, and the one to copy them into with --db")
    with run_checked(_open_source, source) as source_store:
        with run_checked(read_only_store if dry_run else existing_store, db) as target:
            result = run_checked(merge_runs, source_store, target, run_ids, dry_run=dry_run)
            shown = target.display_url
    verb = "would copy" if dry_run else "copied"
    for run in result.runs:
        what = f"{run.kind:<8} {run.gpu_key:<9} {run.status:<11} {run.measurements} measurements, " \
               f"{run.peer_results} peer results"
        if not run.added:
            typer.echo(f"run {run.source_id:>4} is run {run.target_id} of {shown} already: left as it is ({what})")
        else:
            where = f"as run {run.target_id}" if run.target_id is not None else "as a new run"
            typer.echo(f"run {run.source_id:>4} {verb} {where}: {what}")
    added = result.added
    typer.echo(f"{verb} {len(added)} of {len(result.runs)} runs ({sum(r.measurements for r in added)} "
               f"measurements, {sum(r.peer_results for r in added)} peer results, {result.problems_added} new "
               f"problems) from {source} into {shown}; {len(result.present)} were there already")
    if not dry_run and result.runs:
        typer.echo(f"their run ids in {shown}: {','.join(str(r.target_id) for r in result.runs)}")


def _table_runs(path: Path) -> tuple[int, ...]:
    """The runs the table at `path` records it was fitted on (ids of the database it was emitted from)."""
    from normtune.kernels.select.tables import TableError, read_json
    from normtune.tuner.tables.emit import recorded_runs

    try:
        data = read_json(str(path))
    except TableError as err:
        raise CLIError(f"--runs-of {path}: {str(err).removeprefix(f'heuristic table {path}: ')}") from None
    try:
        return recorded_runs(data if isinstance(data, dict) else {})
    except ValueError as err:
        raise CLIError(f"--runs-of {path}: {err}; name a table normtune emitted, or give --runs") from None


def _open_source(url: str):
    """--from, opened read-only (a SQLite file of an older schema is read through an upgraded copy and left as
    it is); a refusal names --from."""
    import os

    from sqlalchemy.exc import ArgumentError

    from normtune.tuner.store.database import SCHEMA_VERSION, Store
    from normtune.tuner.store.models import StoreError
    from normtune.tuner.store.schema import normalize_url, sqlite_path

    try:
        path = sqlite_path(normalize_url(url))
    except ArgumentError:
        path = None  # opening it says what is wrong with the URL
    if path is not None and not os.path.isfile(path):
        raise CLIError(f"--from {url}: no such database file; name the results database to copy runs from (a "
                       "file path or database URL)")
    try:
        store = Store.for_reading(url)
    except StoreError as err:
        message = one_line(err)
        raise CLIError(f"--from{message[4:]}" if message.startswith("--db ") else f"--from {url}: {message}") \
            from None
    if store.upgraded_from is not None:
        typer.secho(f"note: --from {url} has schema {store.upgraded_from}; read through a copy upgraded to schema "
                    f"{SCHEMA_VERSION} and left unchanged", err=True)
    return store
