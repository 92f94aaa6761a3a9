"""The results store: runs with provenance, problems, measurements and peer results, in one SQL database.

SQLAlchemy lives in this module only. Callers (sweep, bench, validate, emit, report) hand `Store` plain values
(`DeviceInfo`, `Problem`, `BackwardConfig`, `MeasureResult`) and get frozen records back, never ORM objects.

One model class per table, constraints declared in the class, Enum columns for states, and one `session_scope`
that commits, rolls back and turns `SQLAlchemyError` into `StoreError` -- the shape of Optuna's RDB storage,
whose study lives in the same database (our tables carry the `normtune_` prefix so the two never collide).

SQLite (`results.db`) is the embedded default: WAL journal mode and a busy timeout let several processes write
at once. PostgreSQL runs the same code, so many workers on many hosts can share one study and one store.

The database records `SCHEMA_VERSION`. A database written under another version is refused with both values
and is never altered; a database holding only Optuna's tables gets ours created beside them.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import importlib.util
import json
import math
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

from sqlalchemy import (BigInteger, Boolean, DateTime, Enum, Float, ForeignKey, Index, Integer, MetaData, String,
                        Text, UniqueConstraint, create_engine, event, func, inspect, select)
from sqlalchemy.engine import make_url
from sqlalchemy.exc import (DisconnectionError, IntegrityError, OperationalError, ProgrammingError,
                            SQLAlchemyError)
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

from normtune.kernels.config import BackwardConfig, Kernel1Config, Kernel2Config, Problem
from normtune.tuner.device import DeviceInfo
from normtune.tuner.measure import STATUSES, MeasureResult

SCHEMA_VERSION = 2
# Columns each schema version added to normtune_measurements, with the value rows written before it take (the
# knob's value when it did not exist yet). Opening a database of an older version for writing adds them.
MIGRATIONS = {
    2: (("k1_row_split", "INTEGER NOT NULL DEFAULT 1"), ("k1_strategy", "VARCHAR(16) NOT NULL DEFAULT 'rows'"),
        ("k2_fused", "BOOLEAN NOT NULL DEFAULT FALSE")),
}
RUN_STATUSES = ("running", "finished", "interrupted", "failed")
PEER_STATUSES = ("ok", "error", "unavailable")
# How long a SQLite writer waits for another process's write lock before failing. Writes here are single rows
# (milliseconds); Optuna's own connections use its default unless the sweep passes a timeout too.
BUSY_TIMEOUT_S = 60.0

# Config field -> column, for both kernels. tests/test_store.py checks these columns exist on the table, so a
# new Kernel1Config/Kernel2Config field without a column fails CI instead of silently going unstored. A new
# column is a schema change: bump SCHEMA_VERSION (databases of the old layout are then refused, not corrupted).
CONFIG_COLUMNS = {("kernel_1", f.name): f"k1_{f.name}" for f in dataclasses.fields(Kernel1Config)}
CONFIG_COLUMNS |= {("kernel_2", f.name): f"k2_{f.name}" for f in dataclasses.fields(Kernel2Config)}


class StoreError(Exception):
    """A database operation failed; the message says which database and why."""


class StoreIntegrityError(StoreError):
    """A constraint (unique key, foreign key, enum check) rejected a write."""


class SchemaVersionError(StoreError):
    """The database was written by a normtune with another `SCHEMA_VERSION`."""


# ---------------------------------------------------------------------------------------------------- models


class Base(DeclarativeBase):
    # Explicit constraint names: the same DDL on SQLite and PostgreSQL, and migrations can name what they change.
    metadata = MetaData(naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s", "uq": "uq_%(table_name)s_%(column_0_N_name)s",
        "ck": "ck_%(table_name)s_%(constraint_name)s", "fk": "fk_%(table_name)s_%(column_0_name)s",
        "pk": "pk_%(table_name)s"})


def _enum(name: str, values: tuple[str, ...]) -> Enum:
    # A VARCHAR with a CHECK constraint rather than a PostgreSQL ENUM type: same DDL everywhere, no type objects.
    return Enum(*values, name=name, native_enum=False, create_constraint=True, length=32)


class MetaModel(Base):
    __tablename__ = "normtune_meta"
    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(String(255))


class RunModel(Base):
    __tablename__ = "normtune_runs"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    kind: Mapped[str] = mapped_column(String(32), index=True)
    gpu_name: Mapped[str] = mapped_column(String(255))
    gpu_key: Mapped[str] = mapped_column(String(64), index=True)
    compute_capability: Mapped[str | None] = mapped_column(String(16))
    sm_count: Mapped[int] = mapped_column(Integer)
    l2_bytes: Mapped[int] = mapped_column(BigInteger)
    memory_bytes: Mapped[int] = mapped_column(BigInteger)
    driver: Mapped[str | None] = mapped_column(String(64))
    cuda: Mapped[str | None] = mapped_column(String(64))
    torch: Mapped[str] = mapped_column(String(64))
    triton: Mapped[str] = mapped_column(String(64))
    normtune_version: Mapped[str] = mapped_column(String(64))
    git_revision: Mapped[str | None] = mapped_column(String(64))
    host: Mapped[str] = mapped_column(String(255))
    python: Mapped[str] = mapped_column(String(32))
    command_line: Mapped[str] = mapped_column(Text)
    interpret: Mapped[bool] = mapped_column(Boolean)
    copy_bandwidth_gbps: Mapped[float | None] = mapped_column(Float)
    started_at: Mapped[dt.datetime] = mapped_column(DateTime)
    ended_at: Mapped[dt.datetime | None] = mapped_column(DateTime)
    status: Mapped[str] = mapped_column(_enum("run_status", RUN_STATUSES))


class ProblemModel(Base):
    __tablename__ = "normtune_problems"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    key: Mapped[str] = mapped_column(String(255), unique=True)
    family_key: Mapped[str] = mapped_column(String(255), index=True)
    norm: Mapped[str] = mapped_column(String(32))
    M: Mapped[int] = mapped_column(BigInteger)
    N: Mapped[int] = mapped_column(Integer)
    dtype: Mapped[str] = mapped_column(String(16))
    weight_dtype: Mapped[str] = mapped_column(String(16))
    has_weight: Mapped[bool] = mapped_column(Boolean)
    has_bias: Mapped[bool] = mapped_column(Boolean)
    zero_centered: Mapped[bool] = mapped_column(Boolean)
    save: Mapped[str] = mapped_column(String(16))


class MeasurementModel(Base):
    __tablename__ = "normtune_measurements"
    # One Optuna trial is stored at most once; rows without a trial (NULLs) never collide.
    __table_args__ = (UniqueConstraint("study_name", "trial_number"), Index(None, "problem_id", "status"))
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("normtune_runs.id"), index=True)
    problem_id: Mapped[int] = mapped_column(ForeignKey("normtune_problems.id"), index=True)
    config_json: Mapped[str] = mapped_column(Text)
    config_hash: Mapped[str] = mapped_column(String(40), index=True)
    k1_block_row: Mapped[int] = mapped_column(Integer, index=True)
    k1_block_col: Mapped[int] = mapped_column(Integer, index=True)
    k1_num_warps: Mapped[int] = mapped_column(Integer, index=True)
    k1_num_stages: Mapped[int] = mapped_column(Integer, index=True)
    k1_programs_per_sm: Mapped[float] = mapped_column(Float, index=True)  # fractions (0.5) leave SMs idle
    k1_two_pass: Mapped[bool] = mapped_column(Boolean, index=True)
    k1_eviction_policy: Mapped[str] = mapped_column(String(32), index=True)
    k1_prefetch: Mapped[bool] = mapped_column(Boolean, index=True)
    k1_recompute: Mapped[bool] = mapped_column(Boolean, index=True)
    k1_row_split: Mapped[int] = mapped_column(Integer, index=True, default=1)
    k1_strategy: Mapped[str] = mapped_column(String(16), index=True, default="rows")
    k2_block_m: Mapped[int] = mapped_column(Integer, index=True)
    k2_block_n: Mapped[int] = mapped_column(Integer, index=True)
    k2_num_warps: Mapped[int] = mapped_column(Integer, index=True)
    k2_num_stages: Mapped[int] = mapped_column(Integer, index=True)
    k2_pdl: Mapped[bool] = mapped_column(Boolean, index=True)
    k2_fused: Mapped[bool] = mapped_column(Boolean, index=True, default=False)
    status: Mapped[str] = mapped_column(_enum("measurement_status", STATUSES))
    error: Mapped[str | None] = mapped_column(Text)
    median_us: Mapped[float | None] = mapped_column(Float)
    p10_us: Mapped[float | None] = mapped_column(Float)
    p90_us: Mapped[float | None] = mapped_column(Float)
    reps: Mapped[int] = mapped_column(Integer)
    kernel_1_us: Mapped[float | None] = mapped_column(Float)
    kernel_2_us: Mapped[float | None] = mapped_column(Float)
    compile_s: Mapped[float | None] = mapped_column(Float)
    bytes_moved: Mapped[int | None] = mapped_column(BigInteger)
    gbps: Mapped[float | None] = mapped_column(Float)
    floor_us: Mapped[float | None] = mapped_column(Float)
    floor_fraction: Mapped[float | None] = mapped_column(Float)
    programs: Mapped[int | None] = mapped_column(Integer)
    errors_json: Mapped[str] = mapped_column(Text)
    interpret: Mapped[bool] = mapped_column(Boolean, index=True)
    source: Mapped[str] = mapped_column(String(64), index=True)
    study_name: Mapped[str | None] = mapped_column(String(512))
    trial_number: Mapped[int | None] = mapped_column(Integer)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime)


class PeerResultModel(Base):
    __tablename__ = "normtune_peer_results"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("normtune_runs.id"), index=True)
    problem_id: Mapped[int] = mapped_column(ForeignKey("normtune_problems.id"), index=True)
    peer: Mapped[str] = mapped_column(String(64), index=True)
    status: Mapped[str] = mapped_column(_enum("peer_status", PEER_STATUSES))
    error: Mapped[str | None] = mapped_column(Text)
    median_us: Mapped[float | None] = mapped_column(Float)
    p10_us: Mapped[float | None] = mapped_column(Float)
    p90_us: Mapped[float | None] = mapped_column(Float)
    reps: Mapped[int] = mapped_column(Integer)
    kernels_json: Mapped[str] = mapped_column(Text)  # per-kernel breakdown {kernel name: µs}
    note: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime)


# --------------------------------------------------------------------------------------------------- records


@dataclass(frozen=True)
class RunRecord:
    id: int
    kind: str
    gpu_name: str
    gpu_key: str
    compute_capability: str | None
    sm_count: int
    l2_bytes: int
    memory_bytes: int
    driver: str | None
    cuda: str | None
    torch: str
    triton: str
    normtune_version: str
    git_revision: str | None
    host: str
    python: str
    command_line: str
    interpret: bool
    copy_bandwidth_gbps: float | None
    started_at: dt.datetime
    ended_at: dt.datetime | None
    status: str

    @property
    def device(self) -> DeviceInfo:
        """The provenance as the `DeviceInfo` it was recorded from."""
        return DeviceInfo(name=self.gpu_name, key=self.gpu_key, normtune=self.normtune_version,
                          **{f: getattr(self, f) for f in _DEVICE_FIELDS})


@dataclass(frozen=True)
class MeasurementRecord:
    id: int
    run_id: int
    problem: Problem
    config: BackwardConfig
    config_hash: str
    status: str
    error: str | None
    median_us: float | None
    p10_us: float | None
    p90_us: float | None
    reps: int
    kernel_1_us: float | None
    kernel_2_us: float | None
    compile_s: float | None
    bytes_moved: int | None
    gbps: float | None
    floor_us: float | None
    floor_fraction: float | None
    programs: int | None
    errors: dict[str, float]
    interpret: bool
    source: str
    study_name: str | None
    trial_number: int | None
    created_at: dt.datetime
    gpu_key: str  # of the run that measured it
    gpu_name: str

    def to_result(self) -> MeasureResult:
        return MeasureResult(**{f.name: getattr(self, f.name) for f in dataclasses.fields(MeasureResult)})


@dataclass(frozen=True)
class PeerRecord:
    id: int
    run_id: int
    problem: Problem
    peer: str
    status: str
    error: str | None
    median_us: float | None
    p10_us: float | None
    p90_us: float | None
    reps: int
    kernels: dict[str, float]
    note: str | None
    created_at: dt.datetime
    gpu_key: str
    gpu_name: str


_DEVICE_FIELDS = ("compute_capability", "sm_count", "l2_bytes", "memory_bytes", "driver", "cuda", "torch",
                  "triton", "git_revision", "host", "python", "interpret")
_FIGURES = ("median_us", "p10_us", "p90_us", "kernel_1_us", "kernel_2_us", "compile_s", "gbps", "floor_us",
            "floor_fraction")


def _now() -> dt.datetime:
    # Stored naive in UTC (SQLite has no time zones); records carry the zone again.
    return dt.datetime.now(dt.timezone.utc).replace(tzinfo=None)


def _utc(value: dt.datetime | None) -> dt.datetime | None:
    return None if value is None else value.replace(tzinfo=dt.timezone.utc)


def _figure(value: float | None) -> float | None:
    # NaN means "no figure": SQLite would store it as NULL anyway, so every backend does.
    return None if value is None or math.isnan(value) else float(value)


def _config_hash(config_json: str) -> str:
    return hashlib.sha1(config_json.encode()).hexdigest()


def _check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not allowed: use one of {', '.join(map(repr, allowed))}")


def _problem(row: ProblemModel) -> Problem:
    return Problem(row.norm, row.M, row.N, row.dtype, row.weight_dtype, row.has_weight, row.has_bias,
                   row.zero_centered, row.save)


def _run_record(row: RunModel) -> RunRecord:
    values = {f.name: getattr(row, f.name) for f in dataclasses.fields(RunRecord)}
    return RunRecord(**values | {"started_at": _utc(row.started_at), "ended_at": _utc(row.ended_at)})


def _measurement_record(row: MeasurementModel, problem: ProblemModel, run: RunModel) -> MeasurementRecord:
    skip = {"problem", "config", "errors", "created_at", "gpu_key", "gpu_name"}
    values = {f.name: getattr(row, f.name) for f in dataclasses.fields(MeasurementRecord) if f.name not in skip}
    return MeasurementRecord(**values, problem=_problem(problem), config=BackwardConfig.from_json(row.config_json),
                             errors=json.loads(row.errors_json), created_at=_utc(row.created_at),
                             gpu_key=run.gpu_key, gpu_name=run.gpu_name)


def _peer_record(row: PeerResultModel, problem: ProblemModel, run: RunModel) -> PeerRecord:
    skip = {"problem", "kernels", "created_at", "gpu_key", "gpu_name"}
    values = {f.name: getattr(row, f.name) for f in dataclasses.fields(PeerRecord) if f.name not in skip}
    return PeerRecord(**values, problem=_problem(problem), kernels=json.loads(row.kernels_json),
                      created_at=_utc(row.created_at), gpu_key=run.gpu_key, gpu_name=run.gpu_name)


def normalize_url(url: str) -> str:
    """A database URL; a bare path ('results.db') means the SQLite file at that path.

    A PostgreSQL URL without a driver gets psycopg2 when it is installed (the `postgres` extra): SQLAlchemy 2.1
    otherwise defaults to psycopg 3, and 'postgres://' (what many hosting services print) is accepted too.
    """
    url = str(url)
    if "://" not in url:
        return f"sqlite:///{url}"
    scheme, rest = url.split("://", 1)
    if scheme in ("postgres", "postgresql") and importlib.util.find_spec("psycopg2") is not None:
        return f"postgresql+psycopg2://{rest}"
    return f"postgresql://{rest}" if scheme == "postgres" else url


def optuna_storage_url(url: str) -> str:
    """The URL to give Optuna so its study lives in the same database as the store.

    For SQLite that is the same file: Optuna's RDBStorage creates its own tables (studies, trials, ...) beside
    ours, and since WAL mode is a property of the file, its connections share our journal mode. Optuna's SQLite
    connections wait only pysqlite's default 5 s for a lock; with several writing processes, pass
    `optuna.storages.RDBStorage(url, engine_kwargs={"connect_args": {"timeout": BUSY_TIMEOUT_S}})`.
    """
    return normalize_url(url)


# ------------------------------------------------------------------------------------------------------ store


class Store:
    """Results of runs, measurements and peers in one database (`sqlite:///results.db` by default).

    Safe to use from several processes at once (each opens its own `Store`; one inherited through fork
    reconnects). Every method is one transaction.
    """

    def __init__(self, url: str = "sqlite:///results.db"):
        self.url = normalize_url(url)
        self.display_url = make_url(self.url).render_as_string(hide_password=True)
        is_sqlite = make_url(self.url).get_backend_name() == "sqlite"
        kwargs: dict[str, Any] = {"pool_pre_ping": True}
        if is_sqlite:
            kwargs = {"connect_args": {"timeout": BUSY_TIMEOUT_S}}
        self._engine = create_engine(self.url, **kwargs)
        _install_connection_hooks(self._engine, is_sqlite)
        self._sessions = sessionmaker(self._engine, expire_on_commit=False)
        self._problem_ids: dict[str, int] = {}
        try:
            self._open(is_sqlite)
        except BaseException:
            self._engine.dispose()
            raise

    def _open(self, is_sqlite: bool) -> None:
        # Check before anything writes: a database of another schema version is left exactly as it was, except
        # an older one this version knows how to extend (MIGRATIONS).
        self._migrate()
        self._check_schema_version()
        try:
            with self._engine.connect() as conn:
                if is_sqlite and make_url(self.url).database not in (None, "", ":memory:"):
                    _retry_while_locked(conn, _enable_wal)
                _retry_while_locked(conn, Base.metadata.create_all)  # only the missing tables
        except SQLAlchemyError as err:
            raise StoreError(f"cannot create the normtune tables in {self.display_url}: {err}") from err
        try:
            with self.session_scope() as session:
                if session.get(MetaModel, "schema_version") is None:
                    session.add(MetaModel(key="schema_version", value=str(SCHEMA_VERSION)))
        except StoreIntegrityError:
            pass  # recorded already (by us or by a concurrent opener)
        self._check_schema_version()

    def _migrate(self) -> None:
        """Add the columns of newer schema versions to a database written by an older one."""
        try:
            with self._engine.begin() as conn:
                if not inspect(conn).has_table(MetaModel.__tablename__):
                    return
                found = conn.execute(select(MetaModel.value).where(MetaModel.key == "schema_version")).scalar()
                if found is None or not found.isdigit() or int(found) >= SCHEMA_VERSION:
                    return
                for version in range(int(found) + 1, SCHEMA_VERSION + 1):
                    for column, ddl in MIGRATIONS.get(version, ()):
                        conn.exec_driver_sql(f"ALTER TABLE normtune_measurements ADD COLUMN {column} {ddl}")
                conn.execute(MetaModel.__table__.update().where(MetaModel.key == "schema_version")
                             .values(value=str(SCHEMA_VERSION)))
        except SQLAlchemyError as err:
            raise StoreError(f"cannot upgrade {self.display_url} to schema {SCHEMA_VERSION}: {err}") from err

    def _check_schema_version(self) -> None:
        """Refuse a database of another schema version, or one whose tables lack columns this version writes."""
        try:
            with self._engine.connect() as conn:
                inspector = inspect(conn)
                if not inspector.has_table(MetaModel.__tablename__):
                    return
                found = conn.execute(select(MetaModel.value).where(MetaModel.key == "schema_version")).scalar()
                missing = [f"{table.name}.{column}" for table in Base.metadata.sorted_tables
                           if inspector.has_table(table.name)
                           for column in sorted(set(table.c.keys()) - {c["name"] for c in
                                                                       inspector.get_columns(table.name)})]
        except SQLAlchemyError as err:
            raise StoreError(f"cannot read {self.display_url}: {err}") from err
        if found is not None and found != str(SCHEMA_VERSION):
            newer = found.isdigit() and int(found) > SCHEMA_VERSION
            advice = ("upgrade normtune to read it" if newer else
                      f"open it with the normtune release that wrote it (schema {found})")
            raise SchemaVersionError(
                f"database schema {found}, this normtune expects {SCHEMA_VERSION}: {self.display_url} was written "
                f"by {'a newer' if newer else 'an older'} normtune and was left unchanged. To use it, {advice}; to "
                f"start afresh, pass another database (e.g. --db results-v{SCHEMA_VERSION}.db).")
        if missing:
            # A column added without bumping SCHEMA_VERSION: refuse rather than fail on the first insert.
            raise SchemaVersionError(
                f"database schema {found}, this normtune expects {SCHEMA_VERSION} with column(s) "
                f"{', '.join(missing)} that {self.display_url} lacks: it was written by a normtune of the same "
                "schema version but an older table layout (a change that should have bumped SCHEMA_VERSION), and "
                "was left unchanged. Open it with the normtune that wrote it, or pass another database.")

    @contextmanager
    def session_scope(self) -> Iterator[Session]:
        """One transaction: commit on success, roll back on any error; SQLAlchemy errors become `StoreError`."""
        session = self._sessions()
        try:
            yield session
            session.commit()
        except IntegrityError as err:
            session.rollback()
            raise StoreIntegrityError(f"{self.display_url} rejected a write: {err.orig}") from err
        except SQLAlchemyError as err:
            session.rollback()
            raise StoreError(f"{type(err).__name__} on {self.display_url}: {err}") from err
        except BaseException:
            session.rollback()
            raise
        finally:
            session.close()

    def close(self) -> None:
        self._engine.dispose()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------------ writes

    def start_run(self, info: DeviceInfo, *, kind: str, command_line: str,
                  copy_bandwidth_gbps: float | None = None) -> int:
        row = RunModel(kind=kind, gpu_name=info.name, gpu_key=info.key, normtune_version=info.normtune,
                       command_line=command_line, copy_bandwidth_gbps=_figure(copy_bandwidth_gbps),
                       started_at=_now(), status="running", **{f: getattr(info, f) for f in _DEVICE_FIELDS})
        with self.session_scope() as session:
            session.add(row)
            session.flush()
            return row.id

    def end_run(self, run_id: int, status: str = "finished") -> None:
        _check_choice("status", status, RUN_STATUSES)
        with self.session_scope() as session:
            row = session.get(RunModel, run_id)
            if row is None:
                raise StoreError(f"no run {run_id} in {self.display_url}")
            row.status, row.ended_at = status, _now()

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
                                       **{f.name: getattr(problem, f.name) for f in dataclasses.fields(Problem)})
                    session.add(row)
                    session.flush()
                    found = row.id
            except StoreIntegrityError:  # another writer inserted it first
                with self.session_scope() as session:
                    found = session.execute(query).scalar_one()
        self._problem_ids[problem.key] = found
        return found

    def add_measurement(self, run_id: int, problem: Problem, config: BackwardConfig, result: MeasureResult, *,
                        source: str, study_name: str | None = None, trial_number: int | None = None) -> int:
        """Store one measurement. With (study_name, trial_number), a trial stored before returns its id."""
        _check_choice("status", result.status, STATUSES)
        if trial_number is not None and study_name is None:
            raise ValueError("trial_number needs the study_name it belongs to")
        if study_name is not None and trial_number is not None:
            if (found := self._trial_measurement(study_name, trial_number)) is not None:
                return found
        config_json = config.to_json()
        row = MeasurementModel(
            run_id=run_id, problem_id=self.problem_id(problem), config_json=config_json,
            config_hash=_config_hash(config_json),
            **{column: getattr(getattr(config, kernel), name) for (kernel, name), column in CONFIG_COLUMNS.items()},
            status=result.status, error=result.error, reps=result.reps, bytes_moved=result.bytes_moved,
            programs=result.programs, errors_json=json.dumps(result.errors, sort_keys=True),
            interpret=result.interpret, source=source, study_name=study_name, trial_number=trial_number,
            created_at=_now(), **{f: _figure(getattr(result, f)) for f in _FIGURES})
        try:
            with self.session_scope() as session:
                session.add(row)
                session.flush()
                return row.id
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
        _check_choice("status", status, PEER_STATUSES)
        row = PeerResultModel(run_id=run_id, problem_id=self.problem_id(problem), peer=peer, status=status,
                              error=error, median_us=_figure(median_us), p10_us=_figure(p10_us),
                              p90_us=_figure(p90_us), reps=reps, kernels_json=json.dumps(kernels or {}, sort_keys=True),
                              note=note, created_at=_now())
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
                      (MeasurementModel.config_hash, _config_hash(config.to_json()) if config is not None else None)]
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
            return [_measurement_record(*row) for row in session.execute(query.order_by(MeasurementModel.id))]

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
            return None if row is None else _measurement_record(*row)

    def problems(self, *, gpu_key: str | None = None, interpret: bool | None = None) -> list[Problem]:
        """Problems that have measurements (on `gpu_key`, interpreted or not), by family then shape."""
        ids = self._measurement_query((MeasurementModel.problem_id,), gpu_key=gpu_key, interpret=interpret)
        query = (select(ProblemModel).where(ProblemModel.id.in_(ids))
                 .order_by(ProblemModel.family_key, ProblemModel.M, ProblemModel.N))
        with self.session_scope() as session:
            return [_problem(row) for row in session.scalars(query)]

    def runs(self, *, kind: str | None = None, gpu_key: str | None = None) -> list[RunRecord]:
        """Runs, oldest first."""
        query = select(RunModel).order_by(RunModel.id)
        if kind is not None:
            query = query.where(RunModel.kind == kind)
        if gpu_key is not None:
            query = query.where(RunModel.gpu_key == gpu_key)
        with self.session_scope() as session:
            return [_run_record(row) for row in session.scalars(query)]

    def latest_run(self, kind: str, gpu_key: str | None = None) -> RunRecord | None:
        query = select(RunModel).where(RunModel.kind == kind)
        if gpu_key is not None:
            query = query.where(RunModel.gpu_key == gpu_key)
        with self.session_scope() as session:
            row = session.scalars(query.order_by(RunModel.id.desc()).limit(1)).first()
            return None if row is None else _run_record(row)

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
            return [_peer_record(*row) for row in session.execute(query)]


def _enable_wal(conn) -> None:
    # WAL is a property of the file: once any opener has switched it, everyone's connections use it.
    if conn.exec_driver_sql("PRAGMA journal_mode").scalar() != "wal":
        conn.exec_driver_sql("PRAGMA journal_mode=WAL")


_TRANSIENT = ("locked", "busy", "already exists", "duplicate key")


def _retry_while_locked(conn, step: Callable[[Any], None]) -> None:
    """Run `step(conn)` and commit, retrying while another opener holds the lock it needs or races it to create
    a table. Switching the journal mode fails at once when locked (SQLite's busy timeout does not cover it), and
    creating tables checks for each one before creating it, so two fresh openers can collide there too."""
    deadline = time.monotonic() + BUSY_TIMEOUT_S
    while True:
        try:
            step(conn)
            conn.commit()
            return
        except (OperationalError, IntegrityError, ProgrammingError) as err:
            conn.rollback()
            transient = any(word in str(err.orig).lower() for word in _TRANSIENT)
            if not transient or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _install_connection_hooks(engine, is_sqlite: bool) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection, connection_record):
        connection_record.info["pid"] = os.getpid()
        if is_sqlite:
            cursor = dbapi_connection.cursor()
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.execute(f"PRAGMA busy_timeout={int(BUSY_TIMEOUT_S * 1000)}")
            cursor.close()

    @event.listens_for(engine, "checkout")
    def _on_checkout(dbapi_connection, connection_record, connection_proxy):
        # A pooled connection inherited through fork belongs to the parent: drop it and connect afresh
        # (SQLAlchemy's recipe for engines used across os.fork()).
        if connection_record.info["pid"] != os.getpid():
            connection_record.dbapi_connection = connection_proxy.dbapi_connection = None
            raise DisconnectionError(f"connection belongs to pid {connection_record.info['pid']}")
