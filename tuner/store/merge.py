"""Copying runs from one results database into another (`normtune merge`): each run with its problems,
measurements, peer results, heartbeat and costs, under the destination's own ids.

- A run is known by what was recorded when it started (`RUN_IDENTITY`: kind, GPU, host, start time to the
  microsecond, command line); a run the destination already holds is left as it is, so merging twice adds nothing.
  A run still `running` in the source is copied as it stands: what it stores later is not added by merging again.
- Problems are matched by their key (`normtune_problems.key`), and the missing ones added.
- Optuna's studies are not copied, nor the trial slots claimed in them: a copied measurement names no study
  (`study_name` and `trial_number` blank), so a study of the same name in the destination numbers its trials
  afresh without colliding with it (what `normtune slim` does for the same reason).
- The source is only read (the caller opens it read-only). The destination is written in one transaction, which
  first updates the schema-version row: that takes SQLite's write lock, or on PostgreSQL that row's lock, so two
  merges into one database run one after the other and the second finds the runs of the first.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterable, Sequence

from sqlalchemy import insert, select, update
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from .models import MeasurementModel, MetaModel, PeerResultModel, ProblemModel, RunHeartbeatModel, RunModel
from .schema import normalize_url, sqlite_path
from .workers import RunCostsModel

# The run columns recorded at its start that tell one run from another (a run has no other lasting identity).
RUN_IDENTITY = ("kind", "gpu_key", "gpu_name", "host", "started_at", "command_line")
# Tables of one row per run, copied with their run: a sweep worker's last heartbeat and where its time went.
PER_RUN_TABLES = (RunHeartbeatModel.__table__, RunCostsModel.__table__)

_RUNS, _PROBLEMS = RunModel.__table__, ProblemModel.__table__
_MEASUREMENTS, _PEERS = MeasurementModel.__table__, PeerResultModel.__table__


@dataclass(frozen=True)
class MergedRun:
    """One source run and where it is in the destination: `target_id` (None in a dry run for a run not there
    yet), `added` (False: the destination held it already)."""

    source_id: int
    kind: str
    gpu_key: str
    status: str
    target_id: int | None
    added: bool
    measurements: int
    peer_results: int


@dataclass(frozen=True)
class MergeResult:
    runs: list[MergedRun]
    problems_added: int

    @property
    def added(self) -> list[MergedRun]:
        return [r for r in self.runs if r.added]

    @property
    def present(self) -> list[MergedRun]:
        return [r for r in self.runs if not r.added]


@dataclass
class _SourceRun:
    row: dict
    measurements: list[dict]
    peer_results: list[dict]
    per_run: dict[str, list[dict]]  # table name -> its rows of this run

    @property
    def identity(self) -> tuple:
        return tuple(self.row[c] for c in RUN_IDENTITY)


def same_database(a: str, b: str) -> bool:
    """Whether two database URLs (or SQLite paths) name one database: the same SQLite file (through links too),
    or the same server, port and database name."""
    try:
        a, b = normalize_url(a), normalize_url(b)
        pa, pb = sqlite_path(a), sqlite_path(b)
        if pa is not None or pb is not None:
            if pa is None or pb is None:
                return False
            try:
                return os.path.samefile(pa, pb)
            except OSError:  # a file missing: compare the paths (opening it then says it is missing)
                return os.path.realpath(pa) == os.path.realpath(pb)
        ua, ub = make_url(a), make_url(b)
    except ArgumentError:
        return False

    def server(u) -> tuple:
        return u.get_backend_name(), u.host or "localhost", u.port, u.database

    return server(ua) == server(ub)


def read_runs(source, run_ids: Sequence[int] | None = None) -> tuple[list[_SourceRun], dict[int, dict]]:
    """The runs `run_ids` of the store `source` (default: all), oldest first, with their rows, and the problems
    their rows name (source id -> row), in one read transaction. Raises ValueError naming the ids the source
    lacks."""
    per_run = [t for t in PER_RUN_TABLES if t.name in source.table_names()]
    with source.connection_scope() as conn:
        query = select(_RUNS).order_by(_RUNS.c.id)
        if run_ids is not None:
            query = query.where(_RUNS.c.id.in_(sorted(set(run_ids))))
        runs = [dict(r) for r in conn.execute(query).mappings()]
        if run_ids is not None:
            missing = sorted(set(run_ids) - {r["id"] for r in runs})
            if missing:
                known = [i for (i,) in conn.execute(select(_RUNS.c.id).order_by(_RUNS.c.id))]
                raise ValueError(f"--runs {_span(missing)}: no such run in {source.display_url} (its runs: "
                                 f"{_span(known) or 'none'}); name runs of the database to copy from")

        def rows(table, run_id: int) -> list[dict]:
            query = select(table).where(table.c.run_id == run_id)
            if "id" in table.c:
                query = query.order_by(table.c.id)
            return [dict(r) for r in conn.execute(query).mappings()]

        out = [_SourceRun(run, rows(_MEASUREMENTS, run["id"]), rows(_PEERS, run["id"]),
                          {t.name: rows(t, run["id"]) for t in per_run}) for run in runs]
        problem_ids = sorted({row["problem_id"] for run in out for row in run.measurements + run.peer_results})
        problems = {r["id"]: dict(r) for r in conn.execute(
            select(_PROBLEMS).where(_PROBLEMS.c.id.in_(problem_ids))).mappings()} if problem_ids else {}
    return out, problems


def merge_runs(source, target, run_ids: Sequence[int] | None = None, *, dry_run: bool = False) -> MergeResult:
    """Copy the runs `run_ids` of the store `source` (default: all) into the store `target`, as the module says.
    `dry_run`: find what would be copied and write nothing (`target` may be read-only). Raises ValueError for run
    ids the source lacks or for one database given twice; a failure while writing leaves `target` as it was."""
    if same_database(source.url, target.url):
        raise ValueError(f"--from {source.display_url} is the destination database itself: name another database "
                         "to copy runs from")
    runs, problems = read_runs(source, run_ids)
    with target.connection_scope() as conn:
        if not dry_run:
            # The first statement writes: the transaction holds the database's write lock (SQLite) or the
            # version row's (PostgreSQL) before it reads which runs are there.
            conn.execute(update(MetaModel.__table__).where(MetaModel.key == "schema_version")
                         .values(value=MetaModel.value))
        known = _known_runs(conn, runs)
        keys = sorted({row["key"] for row in problems.values()})
        target_problems = dict(conn.execute(select(_PROBLEMS.c.key, _PROBLEMS.c.id)
                                            .where(_PROBLEMS.c.key.in_(keys))).all()) if keys else {}
        needed = {problems[row["problem_id"]]["key"] for run in runs if run.identity not in known
                  for row in run.measurements + run.peer_results}
        new_keys = sorted(needed - set(target_problems))
        if dry_run:
            return MergeResult([_merged(run, known.get(run.identity), run.identity not in known) for run in runs],
                               len(new_keys))
        by_key = {row["key"]: row for row in problems.values()}
        for key in new_keys:
            target_problems[key] = conn.execute(insert(_PROBLEMS).values(**_without(by_key[key], "id"))) \
                .inserted_primary_key[0]
        problem_ids = {source_id: target_problems[row["key"]] for source_id, row in problems.items()
                       if row["key"] in target_problems}
        merged = [_merged(run, known[run.identity], False) if run.identity in known
                  else _merged(run, copy_run(conn, run, problem_ids), True) for run in runs]
        return MergeResult(merged, len(new_keys))


def copy_run(conn, run: _SourceRun, problem_ids: dict[int, int]) -> int:
    """Insert `run` and its rows on the destination's connection `conn`; returns its id there."""
    run_id = conn.execute(insert(_RUNS).values(**_without(run.row, "id"))).inserted_primary_key[0]
    measurements = [{**_without(m, "id"), "run_id": run_id, "problem_id": problem_ids[m["problem_id"]],
                     "study_name": None, "trial_number": None} for m in run.measurements]
    peers = [{**_without(p, "id"), "run_id": run_id, "problem_id": problem_ids[p["problem_id"]]}
             for p in run.peer_results]
    for table, rows in ((_MEASUREMENTS, measurements), (_PEERS, peers)):
        if rows:
            conn.execute(insert(table), rows)
    for table in PER_RUN_TABLES:
        rows = [{**row, "run_id": run_id} for row in run.per_run.get(table.name, [])]
        if rows:
            conn.execute(insert(table), rows)
    return run_id


def _known_runs(conn, runs: list[_SourceRun]) -> dict[tuple, int]:
    """identity -> id of the destination's runs that have the identity of one of `runs`."""
    starts = sorted({run.row["started_at"] for run in runs})
    if not starts:
        return {}
    wanted = {run.identity for run in runs}
    columns = [_RUNS.c[c] for c in RUN_IDENTITY]
    found = conn.execute(select(_RUNS.c.id, *columns).where(_RUNS.c.started_at.in_(starts))
                         .order_by(_RUNS.c.id)).all()
    out: dict[tuple, int] = {}
    for row in found:
        identity = tuple(row[1:])
        if identity in wanted:
            out.setdefault(identity, row[0])
    return out


def _merged(run: _SourceRun, target_id: int | None, added: bool) -> MergedRun:
    return MergedRun(run.row["id"], run.row["kind"], run.row["gpu_key"], run.row["status"], target_id, added,
                     len(run.measurements), len(run.peer_results))


def _without(row: dict, *names: str) -> dict:
    return {k: v for k, v in row.items() if k not in names}


def _span(ids: Iterable[int]) -> str:
    return ",".join(map(str, ids))
