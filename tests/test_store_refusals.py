"""Databases a command must not change or cannot use: a file of somebody else's tables (Optuna's names included),
`prune --dry-run` on anything (it never writes), in-memory URLs, a damaged file under `prune`, and a read-only
WAL database that the reading commands must still read. Files are compared by hash before and after."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sqlite3
import stat
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
from typer.testing import CliRunner

from normtune.cli import app
from normtune.kernels.config import default_config
from normtune.tuner.store.database import Store, StoreError
from normtune.tuner.sweep.options import study_name
from test_store import H100, RMS, ok

# Runs each command line of the JSON list in argv[1] through the CLI, one JSON line per command: exit code, output.
RUN_COMMANDS = """
import json, sys
from typer.testing import CliRunner
from normtune.cli import app
for args in json.loads(sys.argv[1]):
    result = CliRunner().invoke(app, args)
    print(json.dumps({"code": result.exit_code, "output": result.output + repr(result.exception or '')}))
"""


def _hashes(folder: Path) -> dict[str, str]:
    """Every file of `folder` by its sha256, but the `-shm` index and an empty `-wal` that SQLite itself keeps
    beside a WAL database while anyone reads it (what was written would be in the database or its log)."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())
            if not p.name.endswith("-shm") and not (p.name.endswith("-wal") and p.stat().st_size == 0)}


def _one_error(result) -> str:
    """The one `error:` line a refused command ends with (a banner such as --interpret's may come before it)."""
    lines = [line for line in result.output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert result.exit_code != 0 and len(errors) == 1 and lines[-1] == errors[0], result.output
    assert "Traceback" not in result.output
    return errors[0]


def _foreign(path: Path, ddl: str) -> None:
    con = sqlite3.connect(path)
    con.execute(ddl)
    con.execute(f"INSERT INTO {ddl.split()[2]} VALUES ('mine')")
    con.commit()
    con.close()


def _commands(url: str, tmp_path: Path) -> dict[str, list[str]]:
    return {
        "prune --dry-run": ["prune", "--dry-run", "--db", url],
        "prune": ["prune", "--db", url],
        "status": ["status", "--db", url],
        "emit": ["emit", "--gpu", "h100", "--db", url, "--out", str(tmp_path / "out" / "h100.json")],
        "report": ["report", "--gpu", "h100", "--db", url, "--out", str(tmp_path / "out" / "report")],
        "sweep": ["sweep", "--interpret", "--shapes", "8x64", "--trials", "1", "--db", url],
        "validate": ["validate", "--interpret", "--shapes", "8x64", "--trials", "1", "--db", url],
        "bench": ["bench", "--interpret", "--shapes", "8x64", "--peers", "none", "--budget", "0.01",
                  "--out", str(tmp_path / "out" / "bench"), "--db", url],
    }


@pytest.mark.parametrize("command", list(_commands("", Path())))
@pytest.mark.parametrize("ddl", ["CREATE TABLE studies (x TEXT)", "CREATE TABLE notes (x TEXT)"])
def test_every_command_refuses_a_database_of_somebody_else_without_writing(tmp_path, command, ddl):
    """A user's file with a table named like one of Optuna's (`studies(x text)`) is no more ours than one of any
    other name: refused in one line, byte for byte unchanged, no table added, never switched to WAL."""
    folder = tmp_path / "db"
    folder.mkdir()
    path = folder / "foreign.db"
    _foreign(path, ddl)
    before = _hashes(folder)
    result = CliRunner().invoke(app, _commands(f"sqlite:///{path}", tmp_path)[command])
    line = _one_error(result)
    assert "left untouched" in line or "holds no normtune results" in line, line
    assert _hashes(folder) == before
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    assert [name for (name,) in con.execute("SELECT name FROM sqlite_master")] == [ddl.split()[2]]
    con.close()


@pytest.mark.parametrize("kind", ["missing", "zero-byte", "empty"])
@pytest.mark.parametrize("dry_run", [True, False])
def test_prune_never_creates_a_database(tmp_path, kind, dry_run):
    """`prune --dry-run` writes nothing at all, and `prune` has nothing to prune in a file that holds no normtune
    results: neither creates the schema in a missing, zero-byte or empty SQLite file."""
    path = tmp_path / "results.db"
    if kind == "zero-byte":
        path.write_bytes(b"")
    elif kind == "empty":  # a valid SQLite file without any table
        con = sqlite3.connect(path)
        con.execute("PRAGMA user_version = 7")
        con.close()
    before = _hashes(tmp_path)
    line = _one_error(CliRunner().invoke(app, ["prune", "--db", f"sqlite:///{path}"] + ["--dry-run"] * dry_run))
    assert "no such database file" in line or "holds no normtune results" in line, line
    assert _hashes(tmp_path) == before


def _old_study(path: Path, trials: int = 30) -> tuple[str, str]:
    """A normtune database with one superseded study of RMS (another search-space tag), `trials` trials."""
    url = f"sqlite:///{path}"
    name = study_name("h100", RMS).rsplit(":space-", 1)[0] + ":space-00000000"
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    with Store(url) as store:
        run_id = store.start_run(H100, kind="sweep", command_line="x")
        store.add_measurement(run_id, RMS, default_config(RMS), ok(80.0), source="sweep")
        store.end_run(run_id)
        storage = store.optuna_storage()
        study = optuna.create_study(study_name=name, storage=storage)
        study.set_user_attr("problem", RMS.to_dict())
        study.optimize(lambda t: t.suggest_float("x", 0.0, 1.0), n_trials=trials)
        storage.engine.dispose()
        with store.session_scope() as session:  # everything into the file: what is damaged below is what is read
            session.connection().exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
    return url, name


def test_prune_dry_run_of_a_normtune_database_writes_nothing(tmp_path):
    url, _ = _old_study(tmp_path / "results.db")
    before = _hashes(tmp_path)
    result = CliRunner().invoke(app, ["prune", "--dry-run", "--db", url])
    assert result.exit_code == 0 and "would drop 1 superseded studies (30 trials)" in result.output, result.output
    assert _hashes(tmp_path) == before


def _damage_table(path: Path, table: str) -> None:
    con = sqlite3.connect(path)
    (root,) = con.execute("SELECT rootpage FROM sqlite_master WHERE name = ?", (table,)).fetchone()
    (size,) = con.execute("PRAGMA page_size").fetchone()
    con.close()
    data = bytearray(path.read_bytes())
    data[(root - 1) * size:root * size] = bytes([0xA5]) * size
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("dry_run", [True, False])
def test_prune_of_a_damaged_database_is_one_error_line(tmp_path, dry_run):
    path = tmp_path / "results.db"
    url, _ = _old_study(path)
    _damage_table(path, "trials")
    line = _one_error(CliRunner().invoke(app, ["prune", "--db", url] + ["--dry-run"] * dry_run))
    assert line.startswith(f"error: --db {url}") and "malformed" in line and "restore" in line, line


@pytest.mark.parametrize("url", ["", "sqlite://", "sqlite:///", "sqlite:///:memory:"])
def test_sweep_refuses_an_in_memory_database_in_one_line(tmp_path, url):
    result = CliRunner().invoke(app, ["sweep", "--interpret", "--shapes", "8x64", "--trials", "1", "--db", url])
    line = _one_error(result)
    assert "names no database file" in line and "--db results.db" in line, line
    with pytest.raises(StoreError, match="names no database file"):
        Store(url)


def _unprivileged() -> list[str]:
    """A command prefix under which this user cannot write a folder it may only read: nothing for an ordinary
    user; for root, no capability to override file permissions (setpriv)."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("root without setpriv: cannot make a folder read-only to this user")
    return ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--inh-caps=-all"]


def test_reading_commands_read_a_read_only_wal_database(tmp_path):
    """A WAL database in a folder this user cannot write (no `-shm` can be created): status, emit, report and
    prune --dry-run read it (opened immutable, its write-ahead log being empty) and change nothing."""
    folder = tmp_path / "ro"
    folder.mkdir()
    url, _ = _old_study(folder / "results.db")
    assert sorted(os.listdir(folder)) == ["results.db"]  # closed: SQLite removed the empty -wal and -shm
    os.chmod(folder / "results.db", stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)
    os.chmod(folder, stat.S_IRUSR | stat.S_IXUSR | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH)
    before = _hashes(folder)
    out = tmp_path / "out"
    commands = [
        (["status", "--db", url], "no sweep studies"),
        (["prune", "--dry-run", "--db", url], "would drop 1 superseded studies"),
        (["emit", "--gpu", "h100", "--db", url, "--out", str(out / "h100.json")], "wrote"),
        (["report", "--gpu", "h100", "--db", url, "--out", str(out / "report")], "wrote"),
    ]
    try:  # one unprivileged process runs the four commands in turn (one interpreter start, not four)
        result = subprocess.run(_unprivileged() + [sys.executable, "-c", RUN_COMMANDS,
                                                   json.dumps([args for args, _ in commands])],
                                capture_output=True, text=True,
                                env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}, timeout=300)
    finally:
        os.chmod(folder, stat.S_IRWXU)
    assert result.returncode == 0, result.stderr[-3000:]
    outcomes = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(outcomes) == len(commands), result.stdout[-3000:]
    for (args, expect), outcome in zip(commands, outcomes):
        assert outcome["code"] == 0 and expect in outcome["output"], (args, outcome["output"][-3000:])
    assert _hashes(folder) == before
