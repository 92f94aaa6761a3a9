"""Files written whole (`write_atomic`): a reader, or a kill in the middle of a write, finds the old file or the new
one, never a part of either. Used for what a command leaves in place of an earlier result: tables, bench files."""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path


def write_atomic(path: Path, data: bytes | str, mode: int | None = None) -> None:
    """`data` (text is written as UTF-8, its line ends as given) into `path` through a temporary file of the same
    folder, flushed to disk and renamed over it. `mode`: the permissions it gets (None: `mode_for(path)`)."""
    payload = data.encode() if isinstance(data, str) else data
    mode = mode_for(path) if mode is None else mode
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(payload)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def mode_for(path: Path) -> int:
    """The permissions a rewrite of `path` keeps: its own where it exists, else what the umask gives a new file."""
    try:
        return stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:
        mask = os.umask(0o022)
        os.umask(mask)
        return 0o666 & ~mask
