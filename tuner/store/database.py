"""The results store: runs with provenance, problems, measurements and peer results, in one SQL database.

SQLAlchemy lives in the store's modules only (`models`: tables and records; `schema`: opening, checking,
creating; `workers`: what sweep workers coordinate through, held as `Store.workers`). Callers (sweep, bench,
validate, emit, report) hand `Store` plain values (`DeviceInfo`, `Problem`, `BackwardConfig`, `MeasureResult`) and
get frozen records back, never ORM objects.

One `session_scope` commits, rolls back and turns `SQLAlchemyError` into a one-line `StoreError` -- the shape of
Optuna's RDB storage, whose study lives in the same database: `Store.optuna_storage()` hands it over, so the
sweep never builds a second connection from a parallel URL string.

SQLite (`results.db`) is the embedded default: WAL journal mode and one busy timeout let several processes write
at once. PostgreSQL runs the same code, so many workers on many hosts can share one study and one store.

The database records `SCHEMA_VERSION`. A database written under a version this normtune cannot read is refused
with both values and is never altered; a database holding only Optuna's tables gets ours created beside them; a
database holding somebody else's tables is refused untouched. `Store(url, read_only=True)` never writes.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import shutil
import tempfile
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator

from sqlalchemy import Connection, func, insert, inspect, select
from sqlalchemy.exc import IntegrityError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from normtune.kernels.config import BackwardConfig, Problem
from normtune.tuner.gpu_info import DeviceInfo
from normtune.tuner.measure.results import STATUSES, MeasureResult

from . import prepared, schema, sqlite_files
from .models import (FIGURES, CONFIG_COLUMNS, PEER_STATUSES, RESIDUAL_FIELDS, RUN_STATUSES, SCHEMA_VERSION,
                           MeasurementModel, MeasurementRecord, MetaModel, OlderSchemaError, PeerRecord,
                           PeerResultModel, ProblemModel, RunModel, RunRecord, SchemaVersionError, StoreError,
                           StoreIntegrityError, check_value, hash_config, figure_value, measurement_record, utc_now,
                           knob_values, peer_record, problem_from_row, run_record, device_columns)
from .schema import BUSY_TIMEOUT_S, display_url, normalize_url, short_reason
from .workers import Workers

__all__ = ["BUSY_TIMEOUT_S", "CONFIG_COLUMNS", "SCHEMA_VERSION", "MeasurementModel", "MeasurementRecord",
           "MetaModel", "PeerRecord", "RunRecord", "SchemaVersionError", "Store", "StoreError",
           "StoreIntegrityError", "normalize_url", "user_database_url"]


_INSERT_MEASUREMENT = insert(MeasurementModel.__table__)  # built once: executed with each row's values


class Store:
    """Results of runs, measurements and peers in one database (`sqlite:///results.db` by default).

    Safe to use from several processes at once (each opens its own `Store`; one inherited through fork
    reconnects). Every method is one transaction. `read_only=True` opens without writing anything, ever.
    """

    def __init__(self, url: str = "sqlite:///results.db", *, read_only: bool = False):
        self.url = normalize_url(url)
        self.display_url = display_url(self.url)
        self.read_only = read_only
        # A read-only open of a WAL file creates its -wal/-shm files; `close` removes those it created.
        self._sidecars = sqlite_files.missing_sidecars(self.url) if read_only else []
        self._engine = schema.create(self.url, read_only=read_only)
        self._sessions = sessionmaker(self._engine, expire_on_commit=False)
        self._problem_ids: dict[str, int] = {}
        self.workers = Workers(self)  # heartbeats, trial slots, study progress: `workers.py`
        self.upgraded_from: str | None = None  # `for_reading`: the older schema of the file read through a copy
        self._scratch: str | None = None  # `for_reading`: the folder of that copy
        try:
            # Check before anything writes: a database that is not ours to change is left exactly as it was.
            self.schema_version = schema.check(self._engine, self.display_url, read_only=read_only)
            if not read_only:
                schema.create_schema(self._engine, self.url, self.display_url)
                self.schema_version = str(SCHEMA_VERSION)
        except BaseException:
            self._engine.dispose()
            sqlite_files.release_sidecars(self.url, self._sidecars)  # a refused read leaves the file as it was
            raise

    @classmethod
    def for_reading(cls, url: str) -> "Store":
        """Read-only (`read_only=True`); a SQLite file of an older schema is read through an upgraded snapshot in a
        temporary folder, removed on `close`, and the file is left as it is (a writing command upgrades it in
        place). `upgraded_from` then names the file's schema."""
        try:
            return cls(url, read_only=True)
        except OlderSchemaError as err:
            path, found = schema.sqlite_path(normalize_url(url)), err.found
            if path is None:
                raise
        folder = tempfile.mkdtemp(prefix="normtune-upgraded-")
        try:
            copy = f"sqlite:///{schema.snapshot(path, folder)}"
            cls(copy).close()  # opening it for writing upgrades it
            store = cls(copy, read_only=True)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        store.upgraded_from, store._scratch = found, folder
        return store

    def vacuum(self) -> None:
        """SQLite: give the pages of deleted rows back to the file system (no-op elsewhere)."""
        if schema.sqlite_path(self.url) is None:
            return
        try:
            with self._engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
                conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
                conn.exec_driver_sql("VACUUM")
        except SQLAlchemyError as err:
            raise StoreError(f"--db {self.display_url}: VACUUM failed: {short_reason(err)}" + _advice(err)) from None

    def optuna_storage(self, **rdb_options: Any):
        """Optuna's `RDBStorage` on this database (same file or server, same busy timeout), for the studies;
        `rdb_options` are RDBStorage's own (heartbeat_interval, grace_period, …)."""
        if self.read_only:
            raise StoreError(f"{self.display_url} was opened read-only: Optuna's storage needs a writable store")
        return schema.optuna_storage(self.url, self.display_url, **rdb_options)

    @contextmanager
    def session_scope(self) -> Iterator[Session]:
        """One transaction: commit on success, roll back on any error; SQLAlchemy errors become a one-line
        `StoreError` (the driver's reason, never the statement and its parameters)."""
        session = self._sessions()
        try:
            yield session
            session.commit()
        except IntegrityError as err:
            session.rollback()
            raise StoreIntegrityError(f"{self.display_url} rejected a write: {short_reason(err)}") from err
        except SQLAlchemyError as err:
            session.rollback()
            raise StoreError(f"--db {self.display_url}: {type(err).__name__}: {short_reason(err)}"
                             + _advice(err)) from err
        except BaseException:
            session.rollback()
            raise
        finally:
            session.close()

    @contextmanager
    def connection_scope(self) -> Iterator[Connection]:
        """`session_scope` on a bare connection (SQLAlchemy Core, no ORM session): for the statements a sweep
        runs per trial, whose ORM bookkeeping cost more than the statements."""
        try:
            with self._engine.begin() as conn:
                yield conn
        except IntegrityError as err:
            raise StoreIntegrityError(f"{self.display_url} rejected a write: {short_reason(err)}") from err
        except SQLAlchemyError as err:
            raise StoreError(f"--db {self.display_url}: {type(err).__name__}: {short_reason(err)}"
                             + _advice(err)) from err

    def table_names(self) -> set[str]:
        with self._engine.connect() as conn:
            return set(inspect(conn).get_table_names())

    def close(self) -> None:
        self._engine.dispose()
        sqlite_files.release_sidecars(self.url, self._sidecars)
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------------ writes

    def start_run(self, info: DeviceInfo, *, kind: str, command_line: str,
                  copy_bandwidth_gbps: float | None = None, started_at: dt.datetime | None = None) -> int:
        """A new run, `running` until `end_run`. `started_at` (aware) records a run stored after it ran (bench)
        with the time it really began; default: now."""
        row = RunModel(kind=kind, command_line=command_line, copy_bandwidth_gbps=figure_value(copy_bandwidth_gbps),
                       started_at=utc_now(started_at), status="running", **device_columns(info))
        with self.session_scope() as session:
            session.add(row)
            session.flush()
            return row.id

    def end_run(self, run_id: int, status: str = "finished") -> None:
        check_value("status", status, RUN_STATUSES)
        with self.session_scope() as session:
            row = session.get(RunModel, run_id)
            if row is None:
                raise StoreError(f"no run {run_id} in {self.display_url}")
            row.status, row.ended_at = status, utc_now()

    def problem_id(self, problem: Problem) -> int:
        """The problem's id, inserting it on first use (safe against concurrent writers)."""
        if problem.key in self._problem_ids:
            return self._problem_ids[problem.key]
        query = select(ProblemModel.id).where(ProblemModel.key == problem.key)
        with self.session_scope() as session:
            found = session.execute(query).scalar()
        if found is None:
            try:
                with self.session_scope() as session:
                    row = ProblemModel(key=problem.key, family_key=problem.family.key,
                                       **{f.name: getattr(problem, f.name) for f in dataclasses.fields(Problem)
                                          if f.name not in RESIDUAL_FIELDS})
                    session.add(row)
                    session.flush()
                    found = row.id
            except StoreIntegrityError:  # another writer inserted it first
                with self.session_scope() as session:
                    found = session.execute(query).scalar_one()
        self._problem_ids[problem.key] = found
        return found

    def add_measurement(self, run_id: int, problem: Problem, config: BackwardConfig, result: MeasureResult, *,
                        source: str, study_name: str | None = None, trial_number: int | None = None,
                        slot: int | None = None, also: Callable[[Session], None] | None = None) -> int | None:
        """Store one measurement. With (study_name, trial_number), a trial stored before returns its id. With the
        `slot` the run claimed for the trial, it is stored only while the run still holds that slot (in the same
        transaction that marks the slot measured); None when the slot was taken over meanwhile. `also(conn)`
        writes more in the transaction that stores it, on its Core connection (the sweep tells the trial there);
        it does not run where the measurement is not stored by this call."""
        check_value("status", result.status, STATUSES)
        if trial_number is not None and study_name is None:
            raise ValueError("trial_number needs the study_name it belongs to")
        if slot is not None and trial_number is None:
            raise ValueError("a claimed slot needs the trial_number that fills it")
        if study_name is not None and trial_number is not None and slot is None:
            if (found := self._trial_measurement(study_name, trial_number)) is not None:
                return found
        config_json = config.to_json()
        row = dict(
            run_id=run_id, problem_id=self.problem_id(problem), config_json=config_json,
            config_hash=hash_config(config_json),
            **knob_values(config),
            status=result.status, error=result.error, reps=result.reps, bytes_moved=result.bytes_moved,
            programs=result.programs, errors_json=json.dumps(result.errors, sort_keys=True),
            interpret=result.interpret, source=source, study_name=study_name, trial_number=trial_number,
            created_at=utc_now(), **{f: figure_value(getattr(result, f)) for f in FIGURES})
        try:
            with self.connection_scope() as conn:
                if slot is not None and not self.workers.mark_measured(conn, study_name, slot, run_id, trial_number):
                    return None
                row_id = prepared.insert(conn, _INSERT_MEASUREMENT, row)
                if also is not None:
                    also(conn)
                return row_id
        except StoreIntegrityError:
            if study_name is not None and (found := self._trial_measurement(study_name, trial_number)) is not None:
                return found  # a concurrent writer stored the same trial
            raise

    def _trial_measurement(self, study_name: str, trial_number: int) -> int | None:
        with self.session_scope() as session:
            return session.execute(select(MeasurementModel.id).where(
                MeasurementModel.study_name == study_name, MeasurementModel.trial_number == trial_number)).scalar()

    def add_peer_result(self, run_id: int, problem: Problem, peer: str, *, status: str,
                        median_us: float | None = None, p10_us: float | None = None, p90_us: float | None = None,
                        reps: int = 0, kernels: dict[str, float] | None = None, error: str | None = None,
                        note: str | None = None) -> int:
        check_value("status", status, PEER_STATUSES)
        row = PeerResultModel(run_id=run_id, problem_id=self.problem_id(problem), peer=peer, status=status,
                              error=error, median_us=figure_value(median_us), p10_us=figure_value(p10_us),
                              p90_us=figure_value(p90_us), reps=reps, kernels_json=json.dumps(kernels or {}, sort_keys=True),
                              note=note, created_at=utc_now())
        with self.session_scope() as session:
            session.add(row)
            session.flush()
            return row.id

    # ------------------------------------------------------------------------------------------------- reads

    def _measurement_query(self, columns, *, gpu_key=None, problem=None, family_key=None, status=None,
                           source=None, interpret=None, run_id=None, study_name=None, config=None):
        query = (select(*columns).join(ProblemModel, MeasurementModel.problem_id == ProblemModel.id)
                 .join(RunModel, MeasurementModel.run_id == RunModel.id))
        conditions = [(RunModel.gpu_key, gpu_key), (ProblemModel.family_key, family_key),
                      (MeasurementModel.source, source), (MeasurementModel.interpret, interpret),
                      (MeasurementModel.run_id, run_id), (MeasurementModel.study_name, study_name),
                      (ProblemModel.key, problem.key if problem is not None else None),
                      (MeasurementModel.config_hash, hash_config(config.to_json()) if config is not None else None)]
        query = query.where(*(column == value for column, value in conditions if value is not None))
        if status is not None:
            query = query.where(MeasurementModel.status.in_([status] if isinstance(status, str) else list(status)))
        return query

    def measurements(self, *, gpu_key: str | None = None, problem: Problem | None = None,
                     family_key: str | None = None, status: str | Iterable[str] | None = None,
                     source: str | None = None, interpret: bool | None = None, run_id: int | None = None,
                     study_name: str | None = None, config: BackwardConfig | None = None) -> list[MeasurementRecord]:
        """Measurements matching every given filter, oldest first."""
        query = self._measurement_query((MeasurementModel, ProblemModel, RunModel), gpu_key=gpu_key, problem=problem,
                                        family_key=family_key, status=status, source=source, interpret=interpret,
                                        run_id=run_id, study_name=study_name, config=config)
        with self.session_scope() as session:
            return [measurement_record(*row) for row in session.execute(query.order_by(MeasurementModel.id))]

    def count_measurements(self, **filters: Any) -> int:
        """How many measurements `measurements(**filters)` would return."""
        query = self._measurement_query((func.count(MeasurementModel.id),), **filters)
        with self.session_scope() as session:
            return session.execute(query).scalar_one()

    def best(self, problem: Problem, *, gpu_key: str, interpret: bool = False) -> MeasurementRecord | None:
        """The fastest correct measurement of `problem` on `gpu_key` (lowest median; failures never count)."""
        query = self._measurement_query((MeasurementModel, ProblemModel, RunModel), gpu_key=gpu_key,
                                        problem=problem, status="ok", interpret=interpret)
        query = query.where(MeasurementModel.median_us.is_not(None))
        with self.session_scope() as session:
            row = session.execute(query.order_by(MeasurementModel.median_us, MeasurementModel.id).limit(1)).first()
            return None if row is None else measurement_record(*row)

    def problems(self, *, gpu_key: str | None = None, interpret: bool | None = None) -> list[Problem]:
        """Problems that have measurements (on `gpu_key`, interpreted or not), by family then shape."""
        ids = self._measurement_query((MeasurementModel.problem_id,), gpu_key=gpu_key, interpret=interpret)
        query = (select(ProblemModel).where(ProblemModel.id.in_(ids))
                 .order_by(ProblemModel.family_key, ProblemModel.M, ProblemModel.N))
        with self.session_scope() as session:
            return [problem_from_row(row) for row in session.scalars(query)]

    def runs(self, *, kind: str | None = None, gpu_key: str | None = None) -> list[RunRecord]:
        """Runs, oldest first."""
        query = select(RunModel).order_by(RunModel.id)
        if kind is not None:
            query = query.where(RunModel.kind == kind)
        if gpu_key is not None:
            query = query.where(RunModel.gpu_key == gpu_key)
        with self.session_scope() as session:
            return [run_record(row) for row in session.scalars(query)]

    def latest_run(self, kind: str, gpu_key: str | None = None) -> RunRecord | None:
        query = select(RunModel).where(RunModel.kind == kind)
        if gpu_key is not None:
            query = query.where(RunModel.gpu_key == gpu_key)
        with self.session_scope() as session:
            row = session.scalars(query.order_by(RunModel.id.desc()).limit(1)).first()
            return None if row is None else run_record(row)

    def peer_results(self, *, run_id: int | None = None, gpu_key: str | None = None,
                     problem: Problem | None = None) -> list[PeerRecord]:
        """Peer results, oldest first."""
        query = (select(PeerResultModel, ProblemModel, RunModel)
                 .join(ProblemModel, PeerResultModel.problem_id == ProblemModel.id)
                 .join(RunModel, PeerResultModel.run_id == RunModel.id).order_by(PeerResultModel.id))
        if run_id is not None:
            query = query.where(PeerResultModel.run_id == run_id)
        if gpu_key is not None:
            query = query.where(RunModel.gpu_key == gpu_key)
        if problem is not None:
            query = query.where(ProblemModel.key == problem.key)
        with self.session_scope() as session:
            return [peer_record(*row) for row in session.execute(query)]


def user_database_url(make: bool = True) -> str:
    """The database a writing command uses when none is named (--db): results.db in the user directory, the one
    the user tables live in ($NORMTUNE_HOME, else $XDG_CONFIG_HOME/normtune, else ~/.config/normtune), made where
    missing unless `make` is false. Never a file of the repository: its committed results.db is written only when
    named."""
    from normtune.kernels.select.table_chain import user_dir

    folder = user_dir()
    try:
        if make:
            folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise StoreError(f"the user directory {folder} cannot be made ({err.strerror or err}): set $NORMTUNE_HOME to "
                         "a writable folder, or name the database with --db") from None
    return f"sqlite:///{folder / 'results.db'}"


def _advice(err: SQLAlchemyError) -> str:
    reason = short_reason(err).lower()
    if "malformed" in reason or "not a database" in reason:
        return "; the file is damaged: restore it from a copy, or pass another --db"
    if "readonly" in reason or "read-only" in reason:
        return "; the database is read-only here: pass a writable copy"
    return ""
