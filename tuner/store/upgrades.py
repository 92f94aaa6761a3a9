"""Upgrading an older results database in place, each step one transaction: schema 1's run-status check, and
the knob columns and canonical config JSON of configs stored before a shared knob existed (no schema version is
needed for a new shared knob: its column is generated from the config types, `models.KNOB_COLUMNS`; a knob of one
strategy's own needs nothing, as its configs stored before it read it at its default and keep their JSON).
`schema` decides when, and turns errors into one line."""

from __future__ import annotations

import sqlite3
from typing import Any

from sqlalchemy import bindparam, inspect, select, text
from sqlalchemy.engine import Engine

from normtune.kernels.config import BackwardConfig

from .models import (KNOB_COLUMNS, RUN_STATUSES, SCHEMA_VERSION, SHARED_COLUMNS, MeasurementModel, MetaModel,
                     RunModel, config_from_columns, hash_config, knob_values)


def missing_knob_columns(engine: Engine) -> list[str]:
    with engine.connect() as conn:
        have = {c["name"] for c in inspect(conn).get_columns(MeasurementModel.__tablename__)}
    return [column for column, _, _ in KNOB_COLUMNS.values() if column not in have]


def sql_literal(value: Any) -> str:
    if isinstance(value, bool):
        return "TRUE" if value else "FALSE"
    if isinstance(value, str):
        return "'" + value.replace("'", "''") + "'"
    return repr(value)


def upgrade_knobs(conn) -> None:
    """In the caller's transaction: the knob columns this normtune's configs have and the database lacks
    (each row's value read from its stored config: the knob's default where the config predates it; the shared
    knobs' indexed), every stored config rewritten in today's canonical JSON (so that a lookup by config finds
    measurements stored before a knob existed), and the version recorded. No schema version is needed for a new
    shared knob."""
    table = MeasurementModel.__tablename__
    have = {c["name"] for c in inspect(conn).get_columns(table)}
    added = []
    for (kernel, name), (column, sql_type, default) in KNOB_COLUMNS.items():
        if column not in have:
            ddl = f"{sql_type.compile(dialect=conn.dialect)} NOT NULL DEFAULT {sql_literal(default)}"
            conn.exec_driver_sql(f"ALTER TABLE {table} ADD COLUMN {column} {ddl}")
            if column in SHARED_COLUMNS:
                conn.exec_driver_sql(f"CREATE INDEX IF NOT EXISTS ix_{table}_{column} ON {table} ({column})")
            added.append((kernel, name, column))
    canonical_configs(conn, tuple(added))
    meta = MetaModel.__table__
    conn.execute(meta.update().where(meta.c.key == "schema_version").values(value=str(SCHEMA_VERSION)))


def ensure_knob_indexes(conn) -> None:
    """The shared knob columns' indexes, where a compacted file (`normtune slim`) left them out: recreated on a
    writing open, so that queries by knob stay indexed wherever measurements are added."""
    table = MeasurementModel.__tablename__
    for column in SHARED_COLUMNS:
        conn.exec_driver_sql(f"CREATE INDEX IF NOT EXISTS ix_{table}_{column} ON {table} ({column})")


def canonical_configs(conn, added: tuple[tuple[str, str, str], ...] = ()) -> None:
    """Rewrite each stored config in today's canonical JSON (every field, the new knobs at the values those
    measurements ran with) and its hash, so that a lookup by config finds measurements stored before a knob
    existed; the knob columns just `added` ((kernel, field, column)) take each config's values. One statement for
    all rows (executemany): tens of thousands of measurements take seconds."""
    table = MeasurementModel.__table__
    canonical: dict[str, tuple[str, dict]] = {}
    changed = []
    columns = [table.c[column] for column, _, _ in KNOB_COLUMNS.values() if column in table.c]
    for row in conn.execute(select(table.c.id, table.c.config_json, *columns)).mappings().all():
        row_id, stored = row["id"], row["config_json"]
        if not stored:  # a compacted file's row: its knob columns hold its config
            stored = config_from_columns(dict(row)).to_json()
        if stored not in canonical:
            config = BackwardConfig.from_json(stored)
            knobs = knob_values(config)
            canonical[stored] = (config.to_json(), {f"v_{column}": knobs[column] for _, _, column in added})
        text_, values = canonical[stored]
        if text_ != stored or added:
            changed.append({"row_id": row_id, "json": text_, "hash": hash_config(text_), **values})
    if changed:
        conn.execute(table.update().where(table.c.id == bindparam("row_id"))
                     .values(config_json=bindparam("json"), config_hash=bindparam("hash"),
                             **{column: bindparam(f"v_{column}") for _, _, column in added}), changed)


def status_check_sql() -> str:
    return "status IN (" + ", ".join(f"'{s}'" for s in RUN_STATUSES) + ")"


def upgrade_from_1(engine: Engine, path: str | None, timeout: float) -> None:
    """Schema 1 -> 2: the new tables exist already (create_all); the run-status CHECK gains 'dead'. One
    transaction that re-reads the version first, so concurrent openers upgrade once. `path`: the SQLite file (None
    for a server database)."""
    check_name = f"ck_{RunModel.__tablename__}_run_status"
    if path is not None:
        upgrade_sqlite_from_1(path, timeout)
        return
    with engine.begin() as conn:
        version = conn.execute(select(MetaModel.value).where(MetaModel.key == "schema_version")
                               .with_for_update()).scalar()
        if version != "1":
            return
        conn.execute(text(f"ALTER TABLE normtune_runs DROP CONSTRAINT IF EXISTS {check_name}"))
        conn.execute(text(f"ALTER TABLE normtune_runs ADD CONSTRAINT {check_name} CHECK ({status_check_sql()})"))
        conn.execute(MetaModel.__table__.update().where(MetaModel.key == "schema_version")
                     .values(value=str(SCHEMA_VERSION)))


def upgrade_sqlite_from_1(path: str, timeout: float) -> None:
    """SQLite cannot alter a CHECK constraint: rebuild normtune_runs with the new one (SQLite's documented
    12-step procedure), under BEGIN IMMEDIATE so that no other process writes meanwhile."""
    con = sqlite3.connect(path, timeout=timeout, isolation_level=None)
    try:
        con.execute("PRAGMA foreign_keys=OFF")
        con.execute("BEGIN IMMEDIATE")
        version = con.execute("SELECT value FROM normtune_meta WHERE key = 'schema_version'").fetchone()
        if version is None or version[0] != "1":
            con.execute("ROLLBACK")
            return
        (sql,) = con.execute("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'normtune_runs'")\
            .fetchone()
        old_check = "status IN (" + ", ".join(f"'{s}'" for s in RUN_STATUSES if s != "dead") + ")"
        if old_check not in sql:
            raise sqlite3.DatabaseError(f"unexpected normtune_runs layout: {sql[:200]}")
        indexes = [row[0] for row in con.execute(
            "SELECT sql FROM sqlite_master WHERE type = 'index' AND tbl_name = 'normtune_runs' AND sql IS NOT NULL")]
        new_sql = sql.replace(old_check, status_check_sql()).replace("normtune_runs", "normtune_runs_new", 1)
        con.execute(new_sql)
        con.execute("INSERT INTO normtune_runs_new SELECT * FROM normtune_runs")
        con.execute("DROP TABLE normtune_runs")
        con.execute("ALTER TABLE normtune_runs_new RENAME TO normtune_runs")
        for index in indexes:
            con.execute(index)
        con.execute(f"UPDATE normtune_meta SET value = '{SCHEMA_VERSION}' WHERE key = 'schema_version'")
        if con.execute("PRAGMA foreign_key_check").fetchall():
            raise sqlite3.DatabaseError("foreign keys broken by the rebuild of normtune_runs")
        con.execute("COMMIT")
    except BaseException:
        if con.in_transaction:
            con.execute("ROLLBACK")
        raise
    finally:
        con.close()
