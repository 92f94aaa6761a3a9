"""`tuner/store/prepared.py`: a prebuilt statement run on the DBAPI cursor writes what Core writes, on SQLite and
PostgreSQL: converted values (dates, booleans, enums), RETURNING rows, row counts, new ids, SQLAlchemy's own
errors, and Core's execution where a statement needs it."""

from __future__ import annotations

import datetime as dt
import enum

import pytest
from sqlalchemy import (Boolean, Column, DateTime, Enum, Integer, MetaData, String, Table, bindparam, create_engine,
                        insert, select, update)
from sqlalchemy.exc import DBAPIError, IntegrityError

from normtune.tuner.store import prepared
from normtune.tuner.store.database import normalize_url
from pg_support import backend_database


class State(enum.Enum):
    RUNNING = 1
    COMPLETE = 2


META = MetaData()
ROWS = Table("rows", META, Column("id", Integer, primary_key=True), Column("name", String(32), unique=True),
             Column("flag", Boolean, nullable=False), Column("state", Enum(State), nullable=False),
             Column("at", DateTime, nullable=False), Column("note", String(32), default=lambda: "python default"))
INSERT = insert(ROWS)
INSERT_RETURNING = insert(ROWS).returning(ROWS.c.id, ROWS.c.state)
FINISH = (update(ROWS).where(ROWS.c.name == bindparam("the_name"), ROWS.c.state == State.RUNNING)
          .values(state=bindparam("new_state", type_=ROWS.c.state.type), flag=True))
WHEN = dt.datetime(2026, 11, 29, 9, 30, 15, 123456)


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def engine(request, tmp_path):
    with backend_database(request.param, tmp_path, "the prepared statements' tests") as url:
        eng = create_engine(normalize_url(url))
        META.create_all(eng)
        try:
            yield eng
        finally:
            eng.dispose()


def _row(name: str, **more) -> dict:
    return {"name": name, "flag": False, "state": State.RUNNING, "at": WHEN, "note": "given", **more}


def test_rows_written_read_back_as_core_writes_them(engine):
    with engine.begin() as conn:
        first = prepared.insert(conn, INSERT, _row("a"))
        returned = prepared.execute(conn, INSERT_RETURNING, _row("b")).row
        many = prepared.execute(conn, INSERT, [_row("c"), _row("d", flag=True)])
        conn.execute(INSERT, _row("e"))  # Core's own, for comparison
    assert returned[1] in (State.RUNNING, "RUNNING") and many.rowcount == 2
    with engine.connect() as conn:
        got = {r.name: r for r in conn.execute(select(ROWS))}
    assert got["a"].id == first and got["b"].id == returned[0]
    for name in "abcde":
        r = got[name]
        assert (r.state, r.at, r.note) == (State.RUNNING, WHEN, "given")
        assert r.flag is (name == "d")


def test_row_counts_and_the_dialects_converters_on_update(engine):
    with engine.begin() as conn:
        prepared.insert(conn, INSERT, _row("a"))
        assert prepared.execute(conn, FINISH, {"the_name": "a", "new_state": State.COMPLETE}).rowcount == 1
        assert prepared.execute(conn, FINISH, {"the_name": "a", "new_state": State.COMPLETE}).rowcount == 0
    with engine.connect() as conn:
        (r,) = conn.execute(select(ROWS)).all()
    assert (r.state, r.flag) == (State.COMPLETE, True)


def test_a_driver_error_is_sqlalchemys_own_and_the_transaction_rolls_back(engine):
    with pytest.raises(IntegrityError):
        with engine.begin() as conn:
            prepared.insert(conn, INSERT, _row("a"))
            prepared.insert(conn, INSERT, _row("a"))  # the name is unique
    with engine.connect() as conn:
        assert conn.execute(select(ROWS)).all() == []


def test_a_python_side_default_is_left_to_core(engine):
    row = _row("a")
    del row["note"]
    with engine.begin() as conn:
        new_id = prepared.insert(conn, INSERT, row)
    with engine.connect() as conn:
        (r,) = conn.execute(select(ROWS)).all()
    assert r.id == new_id and r.note == "python default"


def test_a_lost_connection_is_invalidated_as_core_does(tmp_path):
    eng = create_engine(f"sqlite:///{tmp_path / 'lost.db'}")
    META.create_all(eng)
    with eng.connect() as conn:
        conn.connection.dbapi_connection.close()  # the driver's connection is gone under the pool's
        with pytest.raises(DBAPIError) as caught:
            prepared.insert(conn, INSERT, _row("a"))
        assert caught.value.connection_invalidated and conn.invalidated
    with eng.begin() as conn:  # the pool connects afresh
        prepared.insert(conn, INSERT, _row("b"))
    eng.dispose()
