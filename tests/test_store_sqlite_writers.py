"""The writers of one SQLite file queue on a lock file beside it (`tuner.store.sqlite_writers`): a transaction's
first write waits for the writer before it to commit, reads never wait, a killed writer's place is freed by the
kernel, a writer that waits past its timeout goes on as SQLite alone would let it, and the queue file is gone once
the last connection closes."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time

import pytest

from normtune.tuner.store.database import Store
from normtune.tuner.store.sqlite_writers import QueuedConnection, queue_path

pytestmark = pytest.mark.skipif(not hasattr(os, "fork") or sys.platform == "win32", reason="flock is POSIX")


def _connect(path, timeout=5.0):
    conn = sqlite3.connect(path, timeout=timeout, factory=QueuedConnection, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    return conn


def _table(path):
    conn = _connect(path)
    conn.execute("CREATE TABLE IF NOT EXISTS t (x INTEGER)")
    conn.commit()
    conn.close()


def test_a_second_writer_waits_for_the_first_to_commit_while_readers_never_wait(tmp_path):
    path = str(tmp_path / "q.db")
    _table(path)
    first, second = _connect(path), _connect(path)
    first.execute("INSERT INTO t VALUES (1)")  # the first write of its transaction: first in the queue
    assert os.path.exists(queue_path(path))
    assert second.execute("SELECT COUNT(*) FROM t").fetchone() == (0,)  # a read does not queue
    done = []

    def write():
        second.execute("INSERT INTO t VALUES (2)")
        done.append(time.monotonic())
        second.commit()

    writer = threading.Thread(target=write)
    writer.start()
    time.sleep(0.3)
    assert not done  # still waiting for the first writer
    committed = time.monotonic()
    first.commit()
    writer.join(5)
    assert done and done[0] >= committed and done[0] - committed < 0.2  # it went right after the commit
    assert first.execute("SELECT x FROM t ORDER BY x").fetchall() == [(1,), (2,)]
    first.close()
    second.close()
    assert not os.path.exists(queue_path(path))  # the last connection removed the queue file


def test_a_rollback_leaves_the_queue_and_the_file_stays_while_another_connection_holds_it(tmp_path):
    path = str(tmp_path / "q.db")
    _table(path)
    a, b = _connect(path), _connect(path)
    a.execute("INSERT INTO t VALUES (1)")
    a.rollback()
    b.execute("INSERT INTO t VALUES (2)")  # would wait its whole timeout if the rollback had kept the place
    a.close()  # b holds the queue: the file stays
    assert os.path.exists(queue_path(path))
    b.commit()
    b.close()
    assert not os.path.exists(queue_path(path))


_HOLD = """
import sqlite3, sys, time
from normtune.tuner.store.sqlite_writers import QueuedConnection
conn = sqlite3.connect(sys.argv[1], timeout=5, factory=QueuedConnection)
conn.execute("INSERT INTO t VALUES (9)")
print("holding", flush=True)
time.sleep(60)
"""


def test_a_killed_writers_place_is_freed_at_once(tmp_path):
    path = str(tmp_path / "q.db")
    _table(path)
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, path], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(10)
        t = time.monotonic()
        conn = _connect(path)
        conn.execute("INSERT INTO t VALUES (1)")
        conn.commit()
        assert time.monotonic() - t < 1.0
        assert conn.execute("SELECT x FROM t").fetchall() == [(1,)]  # the killed writer's row never committed
        conn.close()
    finally:
        holder.kill()


def test_a_writer_that_waits_past_its_timeout_goes_on_as_sqlite_alone_would(tmp_path):
    import fcntl

    path = str(tmp_path / "q.db")
    _table(path)
    fd = os.open(queue_path(path), os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # someone holds the queue but not SQLite's write lock
    try:
        conn = _connect(path, timeout=0.3)
        t = time.monotonic()
        conn.execute("INSERT INTO t VALUES (1)")
        conn.commit()
        assert 0.25 < time.monotonic() - t < 2.0
        conn.close()
    finally:
        os.close(fd)


def test_a_store_leaves_no_queue_file_and_a_read_only_store_never_makes_one(tmp_path):
    from normtune.tuner.gpu_info import detect

    path = tmp_path / "results.db"
    with Store(f"sqlite:///{path}") as store:
        run_id = store.start_run(detect(interpret=True), kind="sweep", command_line="test")
        store.end_run(run_id, status="finished")
    assert path.exists() and not os.path.exists(queue_path(str(path)))
    with Store(f"sqlite:///{path}", read_only=True) as store:
        assert len(store.runs()) == 1
        assert not os.path.exists(queue_path(str(path)))
