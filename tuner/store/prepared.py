"""The statements a sweep runs for every trial, executed on the DBAPI cursor of the caller's connection.

SQLAlchemy compiles each statement once per dialect and set of parameter names (the SQL text, the parameters'
order and their bind processors: dates, booleans, enums as the dialect stores them); an execution then only
converts the values and calls the driver, skipping Core's per-call work (an execution context, the compiled
cache's key, result metadata), which cost more than SQLite's own work on these short statements. The statement
runs in the caller's transaction, on the same DBAPI connection, so commits, rollbacks and the SQLite writers'
queue (`sqlite_writers.py`) are as with Core. A driver error is raised as SQLAlchemy's own exception
(`IntegrityError` and the rest), as Core raises it. RETURNING rows come as the driver gives them (ids, numbers). A statement that needs what only Core's execution does (a
Python-side column default, an expanding or literal parameter, an escaped parameter name) is executed by Core."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError


@dataclass(frozen=True)
class _Form:
    sql: str
    names: tuple[str, ...]  # the parameters in the order the driver takes them (positional styles), else all names
    positional: bool
    processors: tuple[Callable[[Any], Any] | None, ...]  # per name, the dialect's bind processor (None: as is)
    bind: Callable[[dict], dict]  # a row → every parameter's value (the statement's own literals included)

    def values(self, row: dict):
        bound = self.bind(row)
        values = [v if p is None or v is None else p(v)
                  for p, v in zip(self.processors, (bound[n] for n in self.names))]
        return values if self.positional else dict(zip(self.names, values))


@dataclass
class Outcome:
    """What an execution returns: the rows it changed, with RETURNING its first row, and the driver's last
    inserted row id (SQLite)."""

    rowcount: int
    row: tuple | None = None
    lastrowid: int | None = None


# (dialect, statement's id, parameter names) → (the statement, kept so that its id stays its own; its form, None
# where Core executes it).
_FORMS: dict[tuple, tuple[Any, _Form | None]] = {}


def _form(conn: Connection, statement, keys: tuple[str, ...]) -> _Form | None:
    key = (conn.dialect.name, id(statement), keys)
    found = _FORMS.get(key)
    if found is not None:
        return found[1]
    # for_executemany: no RETURNING of the primary key unless the statement asks for it (Core adds one where it
    # reports inserted_primary_key, which these executions never do)
    compiled = statement.compile(dialect=conn.dialect, column_keys=list(keys), for_executemany=True)
    needs_core = (getattr(compiled, "insert_prefetch", None) or getattr(compiled, "update_prefetch", None)
                  or getattr(compiled, "literal_execute_params", None) or getattr(compiled, "escaped_bind_names", None)
                  or any(b.expanding for b in compiled.binds.values()))
    form = None
    if not needs_core:
        positional = bool(compiled.positional)
        names = tuple(compiled.positiontup) if positional else tuple(dict.fromkeys(compiled.bind_names.values()))
        processors = compiled._bind_processors  # noqa: SLF001 - the dialect's converters, as Core applies them
        form = _Form(str(compiled), names, positional, tuple(processors.get(n) for n in names), compiled.construct_params)
    _FORMS[key] = (statement, form)
    return form


def execute(conn: Connection, statement, params: dict | list[dict]) -> Outcome:
    """Execute a prebuilt Core `statement` with `params` (one row, or several with the same keys) in `conn`'s
    transaction."""
    rows = params if isinstance(params, list) else [params]
    form = _form(conn, statement, tuple(sorted(rows[0])))
    if form is None:
        result = conn.execute(statement, params)
        first = result.first() if result.returns_rows else None
        return Outcome(result.rowcount, tuple(first) if first is not None else None,
                       getattr(result, "lastrowid", None) if conn.dialect.name == "sqlite" else None)
    values = [form.values(row) for row in rows]
    dbapi = conn.dialect.loaded_dbapi
    cursor = None
    try:
        cursor = conn.connection.dbapi_connection.cursor()
        if len(values) == 1:
            cursor.execute(form.sql, values[0])
        else:
            cursor.executemany(form.sql, values)
        first = cursor.fetchone() if cursor.description is not None else None  # RETURNING rows
        return Outcome(cursor.rowcount, tuple(first) if first is not None else None,
                       cursor.lastrowid if conn.dialect.name == "sqlite" else None)
    except dbapi.Error as err:
        # A lost connection is invalidated, as Core does, so that the pool does not hand it out again.
        lost = conn.dialect.is_disconnect(err, conn.connection.dbapi_connection, cursor)
        wrapped = DBAPIError.instance(form.sql, values[0], err, dbapi.Error, connection_invalidated=lost,
                                      dialect=conn.dialect)
        if lost:
            conn.invalidate(wrapped)
        raise wrapped from err
    finally:
        if cursor is not None:
            try:
                cursor.close()
            except dbapi.Error:  # the connection is gone: nothing to close
                pass


# (dialect, the INSERT's id) → (the INSERT, its variant returning the primary key).
_WITH_ID: dict[tuple, tuple[Any, Any]] = {}


def insert(conn: Connection, statement, row: dict) -> int:
    """Execute a prebuilt INSERT of one `row` in `conn`'s transaction; the new row's id. SQLite reports it on the
    cursor; elsewhere the statement returns it (RETURNING costs SQLite more than the insert itself)."""
    if conn.dialect.name == "sqlite":
        return execute(conn, statement, row).lastrowid
    key = (conn.dialect.name, id(statement))
    if key not in _WITH_ID:
        _WITH_ID[key] = (statement, statement.returning(*statement.table.primary_key.columns))
    return execute(conn, _WITH_ID[key][1], row).row[0]
