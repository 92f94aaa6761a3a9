"""Opening a results database: its URL, its engine (read-write or read-only), the schema check, the schema's
creation and upgrade, and the one-line errors all of that may end in.

Rules, whatever the backend:
- A database that holds tables of somebody else and no normtune schema is refused and never touched; so is one
  with a table of an Optuna table's name but not Optuna's columns (it is not Optuna's, whoever wrote it).
- An in-memory SQLite database is refused: every connection would see another, empty one, and the results would
  be lost when the command ends.
- A database of a schema version this normtune cannot read is refused with both versions and never touched.
- Read-only opens never write: SQLite is opened as a `mode=ro` URI (no WAL switch, no table, a missing file is
  an error; a WAL file whose `-shm` index cannot be created, in a folder this user may not write, is opened
  `immutable=1` when its write-ahead log is empty), PostgreSQL sessions are read-only transactions.
- Several processes may open a fresh database at once: creation steps that race (SQLite's journal-mode switch,
  `CREATE TABLE` checks, Optuna's version rows) are retried until the other opener is done.
"""

from __future__ import annotations

import importlib.util
import os
import sqlite3
import time
from typing import Any, Callable

from sqlalchemy import create_engine, event, inspect, select
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import (ArgumentError, DisconnectionError, IntegrityError, NoSuchModuleError, OperationalError,
                            ProgrammingError, SQLAlchemyError)

from . import upgrades
from .models import (KNOB_COLUMNS, READABLE_VERSIONS, SCHEMA_VERSION, Base, MeasurementModel, MetaModel,
                           OlderSchemaError, SchemaVersionError, StoreError)
from .sqlite_writers import QueuedConnection

# Versions a writing command upgrades in place (every readable one but the current).
OLDER_VERSIONS = tuple(v for v in READABLE_VERSIONS if v != str(SCHEMA_VERSION))

# How long any connection (ours and Optuna's) waits for another process's SQLite write lock before failing.
# Writes are single rows (milliseconds); the wait only matters when many workers write at the same moment.
BUSY_TIMEOUT_S = 60.0
# Columns each of Optuna's tables has had in every Optuna release with an RDB storage: a table of one of these
# names without them is somebody else's (a user's `studies(x text)`), and the database is not ours to change.
OPTUNA_COLUMNS = {
    "studies": {"study_id", "study_name"}, "study_directions": {"study_id", "direction"},
    "study_user_attributes": {"study_id", "key", "value_json"},
    "study_system_attributes": {"study_id", "key", "value_json"},
    "trials": {"trial_id", "number", "study_id", "state"}, "trial_params": {"trial_id", "param_name", "param_value"},
    "trial_values": {"trial_id", "value"}, "trial_intermediate_values": {"trial_id", "step"},
    "trial_user_attributes": {"trial_id", "key", "value_json"},
    "trial_system_attributes": {"trial_id", "key", "value_json"}, "trial_heartbeats": {"trial_id", "heartbeat"},
    "version_info": {"schema_version", "library_version"}, "alembic_version": {"version_num"}}
# Tables Optuna's RDB storage creates: they may share a database with ours (they are not "foreign").
OPTUNA_TABLES = frozenset(OPTUNA_COLUMNS)
DRIVER_HINTS = {"postgresql": "pip install 'normtune[postgres]' (psycopg2)", "mysql": "pip install mysqlclient",
                "mssql": "pip install pyodbc"}
_TRANSIENT = ("locked", "busy", "already exists", "duplicate key", "unique constraint")


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


def display_url(url: str) -> str:
    """The URL as it may be printed: without its password."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return url


def short_reason(err: BaseException) -> str:
    """The driver's own message, first line only: never the SQL statement or its parameters."""
    reason = str(getattr(err, "orig", None) or err).strip().splitlines()
    return reason[0][:300] if reason else type(err).__name__


def sqlite_path(url: str) -> str | None:
    """The file of a SQLite URL; None for other backends and in-memory databases."""
    u = make_url(url)
    if u.get_backend_name() != "sqlite" or u.database in (None, "", ":memory:"):
        return None
    return u.database


def snapshot(path: str, folder: str) -> str:
    """A copy of the SQLite file `path` in `folder` through SQLite's backup (what its write-ahead log holds
    included), opened read-only: the file is left as it is. Returns the copy's path."""
    copy = os.path.join(folder, os.path.basename(path))
    source = sqlite3.connect(f"file:{os.path.abspath(path)}?{read_only_mode(path, path)}", uri=True)
    target = sqlite3.connect(copy)
    try:
        source.backup(target)
    finally:
        target.close()
        source.close()
    return copy


def read_only_mode(path: str, shown: str) -> str:
    """The URI parameters that open the SQLite file `path` without writing: `mode=ro`, or `mode=ro&immutable=1`
    when a read-only open fails because SQLite cannot create the `-shm` index a WAL database needs (a folder or
    file this user may not write) and the write-ahead log holds nothing (so that skipping it loses nothing)."""
    uri = f"file:{os.path.abspath(path)}"
    try:
        con = sqlite3.connect(f"{uri}?mode=ro", uri=True)
        try:
            con.execute("SELECT count(*) FROM sqlite_master").fetchone()
            return "mode=ro"
        finally:
            con.close()
    except sqlite3.DatabaseError as err:
        reason = str(err).lower()
        if "readonly" not in reason and "read-only" not in reason and "unable to open" not in reason:
            return "mode=ro"  # damaged or not a database: the schema check says so in one line
        wal = f"{path}-wal"
        if os.path.exists(wal) and os.path.getsize(wal) > 0:
            raise StoreError(f"--db {shown}: a WAL database that cannot be read without write access here, and "
                             f"its write-ahead log {wal} holds commits not yet in the file; open it once where it "
                             "is writable (any normtune command checkpoints it), or pass a copy") from None
        return "mode=ro&immutable=1"


def create(url: str, *, read_only: bool) -> Engine:
    """The engine of `url` (normalized), with our connection settings; StoreError for an unusable URL."""
    shown = display_url(url)
    try:
        u = make_url(url)
    except ArgumentError:
        raise StoreError(f"--db {shown}: not a database URL; use a file path, sqlite:///PATH or "
                         "postgresql://USER:PASSWORD@HOST/DATABASE") from None
    backend = u.get_backend_name()
    path = sqlite_path(url)
    kwargs: dict[str, Any] = {"pool_pre_ping": True}
    if backend == "sqlite":
        kwargs = {"connect_args": {"timeout": BUSY_TIMEOUT_S, "factory": QueuedConnection}}
        if path is None:
            raise StoreError(f"--db {url}: names no database file (SQLite in memory would keep "
                             "nothing, and each connection would see another, empty database); pass a file path, "
                             "e.g. --db results.db")
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise StoreError(f"--db {shown}: the folder {folder} does not exist; create it, or pass a path in an "
                             "existing folder")
        if read_only:
            if not os.path.isfile(path):
                raise StoreError(f"--db {shown}: no such database file; pass the path of an existing results "
                                 "database (e.g. --db results.db)")
            url = f"sqlite:///file:{os.path.abspath(path)}?{read_only_mode(path, shown)}&uri=true"
    elif read_only and backend == "postgresql":
        kwargs["connect_args"] = {"options": "-c default_transaction_read_only=on"}
    try:
        engine = create_engine(url, **kwargs)
    except NoSuchModuleError:
        raise StoreError(f"--db {shown}: unknown database scheme {u.drivername!r}; use a file path, "
                         "sqlite:///PATH or postgresql://USER:PASSWORD@HOST/DATABASE") from None
    except ImportError as err:
        hint = DRIVER_HINTS.get(backend, f"install the Python driver of {backend}")
        raise StoreError(f"--db {shown}: the {backend} driver is not installed ({err}); {hint}") from None
    _install_connection_hooks(engine, backend == "sqlite")
    return engine


def _install_connection_hooks(engine: Engine, is_sqlite: bool) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection, connection_record):
        connection_record.info["pid"] = os.getpid()
        if is_sqlite:
            cursor = dbapi_connection.cursor()
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.execute(f"PRAGMA busy_timeout={int(BUSY_TIMEOUT_S * 1000)}")
            cursor.execute(SQLITE_SYNCHRONOUS)
            cursor.close()

    @event.listens_for(engine, "checkout")
    def _on_checkout(dbapi_connection, connection_record, connection_proxy):
        # A pooled connection inherited through fork belongs to the parent: drop it and connect afresh
        # (SQLAlchemy's recipe for engines used across os.fork()).
        if connection_record.info["pid"] != os.getpid():
            connection_record.dbapi_connection = connection_proxy.dbapi_connection = None
            raise DisconnectionError(f"connection belongs to pid {connection_record.info['pid']}")


# ------------------------------------------------------------------------------------------------- checks


def check(engine: Engine, shown: str, *, read_only: bool) -> str | None:
    """Refuse what must not be opened (foreign tables, another schema version, missing columns), before anything
    writes. Returns the schema version found (None: no normtune schema yet)."""
    try:
        with engine.connect() as conn:
            inspector = inspect(conn)
            tables = set(inspector.get_table_names())
            found = None
            if MetaModel.__tablename__ in tables:
                found = conn.execute(select(MetaModel.value).where(MetaModel.key == "schema_version")).scalar()
            missing = [f"{table.name}.{column}" for table in Base.metadata.sorted_tables if table.name in tables
                       for column in sorted(set(table.c.keys()) - {c["name"] for c in
                                                                   inspector.get_columns(table.name)})]
            impostors = sorted(name for name in tables & OPTUNA_TABLES
                               if not OPTUNA_COLUMNS[name] <= {c["name"] for c in inspector.get_columns(name)})
    except SQLAlchemyError as err:
        raise StoreError(f"--db {shown}: cannot read it ({short_reason(err)}); pass a normtune results database, "
                         "or restore this one from a copy if it is damaged") from None
    ours = {t.name for t in Base.metadata.sorted_tables}
    foreign = sorted(tables - ours - OPTUNA_TABLES)
    if impostors:
        listed = ", ".join(impostors[:5]) + (", …" if len(impostors) > 5 else "")
        raise StoreError(f"--db {shown}: its table(s) {listed} have Optuna's names but not Optuna's columns, so "
                         "neither normtune nor Optuna wrote it; it was left untouched. Pass a new file or a database "
                         "that normtune created.")
    if found is None and MetaModel.__tablename__ not in tables and foreign:
        listed = ", ".join(foreign[:5]) + (", …" if len(foreign) > 5 else "")
        raise StoreError(f"--db {shown}: holds other tables ({listed}) and no normtune results; it was left "
                         "untouched. Pass a new file or a database that normtune created.")
    if read_only and MetaModel.__tablename__ not in tables:
        raise StoreError(f"--db {shown}: holds no normtune results; pass the database a sweep or bench wrote")
    if found is not None and found not in READABLE_VERSIONS:
        newer = found.isdigit() and int(found) > SCHEMA_VERSION
        advice = ("upgrade normtune to read it" if newer else
                  f"open it with the normtune release that wrote it (schema {found})")
        raise SchemaVersionError(
            f"database schema {found}, this normtune expects {SCHEMA_VERSION}: {shown} was written by "
            f"{'a newer' if newer else 'an older'} normtune and was left unchanged. To use it, {advice}; to start "
            f"afresh, pass another database (e.g. --db results-v{SCHEMA_VERSION}.db).")
    knobs = {f"{MeasurementModel.__tablename__}.{column}" for column, _, _ in KNOB_COLUMNS.values()}
    if found in OLDER_VERSIONS:
        if read_only:
            raise OlderSchemaError(
                f"database schema {found}, this normtune expects {SCHEMA_VERSION}: {shown} was written by an older "
                "normtune and was left unchanged; a writing command (e.g. normtune sweep) upgrades it in place.", found)
        missing = [m for m in missing if m not in knobs]
    elif found is not None:
        stale = sorted(m.split(".", 1)[1] for m in missing if m in knobs)
        missing = [m for m in missing if m not in knobs]
        if read_only and not missing and stale:
            raise OlderSchemaError(
                f"{shown} predates knob column(s) {', '.join(stale)} of this normtune and was left unchanged; a "
                "writing command (e.g. normtune sweep) upgrades it in place.", found)
    if missing:
        # A column added without bumping SCHEMA_VERSION: refuse rather than fail on the first insert.
        raise SchemaVersionError(
            f"database schema {found}, this normtune expects {SCHEMA_VERSION} with column(s) {', '.join(missing)} "
            f"that {shown} lacks: it was written by a normtune of the same schema version but an older table "
            "layout (a change that should have bumped SCHEMA_VERSION), and was left unchanged. Open it with the "
            "normtune that wrote it, or pass another database.")
    return found


# ----------------------------------------------------------------------------------------- creation, upgrade


def create_schema(engine: Engine, url: str, shown: str) -> None:
    """Our tables (only the missing ones), the recorded version, and the upgrade of a version-1 database."""
    try:
        with engine.connect() as conn:
            if sqlite_path(url) is not None:
                retry_while_busy(conn, _enable_wal)
            retry_while_busy(conn, Base.metadata.create_all)
            retry_while_busy(conn, _record_version)
    except SQLAlchemyError as err:
        raise StoreError(f"--db {shown}: cannot create the normtune tables ({short_reason(err)})") from None
    found = check(engine, shown, read_only=False)
    try:
        if found == "1":
            upgrades.upgrade_from_1(engine, sqlite_path(url), BUSY_TIMEOUT_S)
        if found in OLDER_VERSIONS or upgrades.missing_knob_columns(engine):
            with engine.begin() as conn:
                upgrades.upgrade_knobs(conn)
        with engine.begin() as conn:
            upgrades.ensure_knob_indexes(conn)
    except (SQLAlchemyError, sqlite3.Error) as err:
        raise StoreError(f"--db {shown}: cannot upgrade its schema from {found} to {SCHEMA_VERSION} "
                         f"({short_reason(err)})") from None


def _enable_wal(conn) -> None:
    # WAL is a property of the file: once any opener has switched it, everyone's connections use it.
    if conn.exec_driver_sql("PRAGMA journal_mode").scalar() != "wal":
        conn.exec_driver_sql("PRAGMA journal_mode=WAL")


def _record_version(conn) -> None:
    if conn.execute(select(MetaModel.value).where(MetaModel.key == "schema_version")).scalar() is None:
        conn.execute(MetaModel.__table__.insert().values(key="schema_version", value=str(SCHEMA_VERSION)))


def retry_while_busy(conn, step: Callable[[Any], None]) -> None:
    """Run `step(conn)` and commit, retrying while another opener holds the lock it needs or races it to create
    the same table or row. Switching the journal mode fails at once when locked (SQLite's busy timeout does not
    cover it), and creating tables checks for each one before creating it, so two fresh openers collide there."""
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


# --------------------------------------------------------------------------------------------------- optuna


# WAL mode (set when the schema is created) with synchronous=NORMAL: a commit is written to the WAL without an
# fsync, so a killed process loses nothing it committed (the OS has the pages); only a power loss can drop the last
# commits. A sweep commits several times per trial, and an fsync each time cost more than measuring a trial.
SQLITE_SYNCHRONOUS = "PRAGMA synchronous=NORMAL"


def _sqlite_synchronous_normal(dbapi_connection, connection_record) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute(SQLITE_SYNCHRONOUS)
    cursor.close()


def optuna_storage(url: str, shown: str, **kwargs):
    """Optuna's RDB storage on the same database and with our busy timeout, created while other processes may
    be creating Optuna's tables and version rows at the same moment (retried until they are done)."""
    import optuna

    engine_kwargs: dict[str, Any] = {"pool_pre_ping": True}
    if make_url(url).get_backend_name() == "sqlite":
        engine_kwargs = {"connect_args": {"timeout": BUSY_TIMEOUT_S, "factory": QueuedConnection}}
    deadline = time.monotonic() + BUSY_TIMEOUT_S
    while True:
        try:
            storage = optuna.storages.RDBStorage(url, engine_kwargs=engine_kwargs, **kwargs)
            if make_url(url).get_backend_name() == "sqlite":
                event.listen(storage.engine, "connect", _sqlite_synchronous_normal)
                storage.engine.dispose()  # connections opened while creating the tables reconnect with it
            return storage
        except (OperationalError, IntegrityError, ProgrammingError) as err:
            transient = any(word in str(err.orig).lower() for word in _TRANSIENT)
            if not transient or time.monotonic() > deadline:
                raise StoreError(f"--db {shown}: cannot open Optuna's study tables ({short_reason(err)})") from None
            time.sleep(0.05)
        except SQLAlchemyError as err:
            raise StoreError(f"--db {shown}: cannot open Optuna's study tables ({short_reason(err)})") from None
