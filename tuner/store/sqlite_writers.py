"""The writers of one SQLite file queue in the kernel instead of in SQLite's busy handler.

SQLite lets one connection write at a time. A connection that finds the write lock taken sleeps in SQLite's busy
handler, in steps of growing length however briefly the lock is held: with two sweep workers on one file, each
committing a few short transactions per trial, those sleeps cost more than the writes. Here a connection takes an
exclusive `flock` on a file beside the database before its transaction's first write and gives it back when the
transaction ends: a waiting writer tries again every POLL_S, and SQLite's own write lock is then never
contended among the processes that queue here (Optuna's storage and ours alike). Reads never queue.

The queue file, `<database>-writers`, is removed by the last connection to close; one that finds the file gone or
replaced after locking it locks the new one (so a removal never lets two writers in at once). A killed process's
lock is released by the kernel. Where `flock` does not exist the connections write as SQLite alone lets them.
"""

from __future__ import annotations

import os
import sqlite3
import time

try:
    import fcntl
except ImportError:  # not POSIX: no queue
    fcntl = None

POLL_S = 0.0001  # between two tries for a held lock: far below the first sleep of SQLite's busy handler

# Statements that take SQLite's write lock (the sqlite3 module begins a transaction before the DML ones).
_WRITES = ("insert", "update", "delete", "replace", "create", "drop", "alter")


def queue_path(database: str) -> str:
    return f"{database}-writers"


class _Queue:
    """One connection's place in the writers' queue of one database."""

    def __init__(self, path: str):
        self.path, self.fd = path, None

    def acquire(self, timeout_s: float) -> None:
        """Wait for the lock, polling every POLL_S; past `timeout_s` go on without it (SQLite's busy timeout then
        decides, as it would without the queue)."""
        if self.fd is not None or fcntl is None:
            return
        deadline = time.monotonic() + timeout_s
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        os.close(fd)
                        return
                    time.sleep(POLL_S)
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                self.fd = fd
                return
            os.close(fd)  # removed (or replaced) while we waited: queue on the file there now

    def release(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            os.close(fd)  # closing the descriptor releases its lock

    def close(self) -> None:
        """Release, and remove the queue file when no other connection holds or waits for it."""
        self.release()
        if fcntl is None:
            return
        try:
            fd = os.open(self.path, os.O_RDWR)
        except FileNotFoundError:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.path.samestat(os.fstat(fd), os.stat(self.path)):
                os.unlink(self.path)
        except (BlockingIOError, FileNotFoundError):
            pass  # another connection holds it (it removes the file itself), or it is gone already
        finally:
            os.close(fd)


class _Cursor(sqlite3.Cursor):
    def execute(self, sql, parameters=(), /):
        self.connection._before(sql)
        return super().execute(sql, parameters)

    def executemany(self, sql, seq_of_parameters, /):
        self.connection._before(sql)
        return super().executemany(sql, seq_of_parameters)


class QueuedConnection(sqlite3.Connection):
    """A `sqlite3.Connection` that queues for writing (`sqlite3.connect(..., factory=QueuedConnection)`): its
    transaction's first write waits for the database's writers' queue, its commit or rollback leaves it."""

    def __init__(self, database, *args, **kwargs):
        super().__init__(database, *args, **kwargs)
        self._wait_s = float(kwargs.get("timeout", args[0] if args else 5.0))
        path = str(database)
        if path.startswith("file:"):  # a URI (read-only opens): never writes
            path = None
        self._queue = _Queue(queue_path(os.path.abspath(path))) if path else None

    def cursor(self, factory=_Cursor):
        return super().cursor(factory)

    def execute(self, sql, parameters=(), /):
        self._before(sql)
        return super().execute(sql, parameters)

    def _before(self, sql: str) -> None:
        if self._queue is not None and self._queue.fd is None and sql.lstrip()[:7].lower().startswith(_WRITES):
            self._queue.acquire(self._wait_s)

    def commit(self):
        try:
            super().commit()
        finally:
            if self._queue is not None and not self.in_transaction:
                self._queue.release()

    def rollback(self):
        try:
            super().rollback()
        finally:
            if self._queue is not None:
                self._queue.release()

    def close(self):
        try:
            super().close()
        finally:
            if self._queue is not None:
                self._queue.close()
