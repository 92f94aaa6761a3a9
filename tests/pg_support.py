"""A fresh PostgreSQL database per test on the loopback test server (not a test module itself).

Dropping it uses `WITH (FORCE)`, which terminates the sessions still connected. The test role may terminate its
own sessions but not the server's autovacuum worker: when autovacuum has just connected to the database, the
drop fails with InsufficientPrivilege (seen once in CI). `tests/postgres.sh` starts its server without
autovacuum, and the drop is retried for a server started otherwise.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid

from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError

from normtune.tuner.store.database import normalize_url

DROP_ATTEMPTS = 20
POSTGRES_ENV = "NORMTUNE_TEST_POSTGRES_URL"  # the test server's admin URL (`tests/postgres.sh` prints it)


def drop_database(admin, name: str) -> None:
    """Drop `name` through the AUTOCOMMIT engine `admin`, retrying while a session we may not end holds it."""
    for attempt in range(DROP_ATTEMPTS):
        try:
            with admin.connect() as conn:
                conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
            return
        except DBAPIError:
            if attempt == DROP_ATTEMPTS - 1:
                raise
            time.sleep(0.25)


@contextlib.contextmanager
def fresh_database(admin_url: str):
    """Yields the URL of a new, empty database on the server of `admin_url`, dropped afterwards."""
    admin_url = normalize_url(admin_url)
    name = f"normtune_test_{uuid.uuid4().hex[:12]}"
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
        try:
            yield make_url(admin_url).set(database=name).render_as_string(hide_password=False)
        finally:
            drop_database(admin, name)
    finally:
        admin.dispose()


@contextlib.contextmanager
def backend_database(backend: str, tmp_path, purpose: str):
    """Yields a fresh database URL: a SQLite file in `tmp_path` ("sqlite"), or a new PostgreSQL database on the
    test server ("postgresql"; the test is skipped, naming the fix, where no server is configured)."""
    if backend == "sqlite":
        yield f"sqlite:///{tmp_path / 'results.db'}"
        return
    import pytest

    admin_url = os.environ.get(POSTGRES_ENV)
    if not admin_url:
        pytest.skip(f"{POSTGRES_ENV} is not set: run `eval \"$(bash tests/postgres.sh)\"` to start a local "
                    f"PostgreSQL server for {purpose}")
    with fresh_database(admin_url) as url:
        yield url
