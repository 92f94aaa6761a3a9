"""The -wal/-shm files SQLite keeps beside a database in WAL mode, and removing those a read-only use created."""

from __future__ import annotations

import os
import sqlite3

from sqlalchemy.exc import ArgumentError

from .schema import BUSY_TIMEOUT_S, sqlite_path


def missing_sidecars(url: str) -> list[str]:
    """The -wal/-shm files of a SQLite file that do not exist yet (none for other databases or unusable URLs)."""
    try:
        path = sqlite_path(url)
    except ArgumentError:
        return []  # `create` refuses it
    return [] if path is None else [p for p in (path + "-wal", path + "-shm") if not os.path.exists(p)]


def release_sidecars(url: str, created: list[str]) -> None:
    """After a read-only use: remove the -wal/-shm files that reading a WAL file created (`created`, from
    `missing_sidecars` before opening). SQLite itself does it: the last connection to close checkpoints the (empty)
    WAL and deletes both, and leaves them while any other process holds the file open."""
    path = sqlite_path(url)
    if path is None or not any(os.path.exists(p) for p in created):
        return
    try:
        conn = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S)
        try:
            conn.execute("SELECT 1 FROM sqlite_master LIMIT 1").fetchall()
        finally:
            conn.close()
    except sqlite3.Error:  # an unwritable folder: the files stay, as SQLite left them
        pass
