"""`tuner/files.py`: a file written whole keeps the permissions of the one it replaces, and leaves no temporary."""

from __future__ import annotations

import os
import stat

import pytest

from normtune.tuner.files import mode_for, write_atomic


def test_a_rewrite_keeps_the_files_permissions_and_leaves_nothing_beside_it(tmp_path):
    path = tmp_path / "bench.csv"
    write_atomic(path, "a,b\r\n1,2\r\n")
    mask = os.umask(0o022)
    os.umask(mask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~mask
    assert path.read_bytes() == b"a,b\r\n1,2\r\n"  # line ends as given
    path.chmod(0o640)
    write_atomic(path, b"new")
    assert path.read_bytes() == b"new" and mode_for(path) == 0o640
    assert [p.name for p in tmp_path.iterdir()] == ["bench.csv"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "gated.json"
    path.write_text("old")

    def no_rename(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", no_rename)
    with pytest.raises(OSError):
        write_atomic(path, "new")
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["gated.json"]
