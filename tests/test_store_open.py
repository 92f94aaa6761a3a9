"""Opening a results database: read-only opens, foreign and missing databases, damaged files, unknown schemes
and drivers, the upgrade of schema-1 files, and one-line errors (never a statement with its parameters)."""

from __future__ import annotations

import dataclasses
import os
import shutil
import sqlite3
from pathlib import Path

import pytest
from typer.testing import CliRunner

from normtune.cli import app
from normtune.kernels.config import BackwardConfig
from normtune.tuner.store.database import SCHEMA_VERSION, SchemaVersionError, Store, StoreError
from normtune.tuner.store.workers import Workers
from test_store import CONFIG, H100, RMS, ok

REPO = Path(__file__).resolve().parents[1]


def _filled(path: Path) -> str:
    url = f"sqlite:///{path}"
    with Store(url) as s:
        run_id = s.start_run(H100, kind="sweep", command_line="x")
        s.add_measurement(run_id, RMS, CONFIG, ok(80.0), source="sweep")
        s.end_run(run_id)
    return url


def _files(folder: Path) -> dict[str, bytes]:
    """The folder's files and bytes, without the -wal/-shm files SQLite itself keeps beside a WAL-mode database
    (a reader of such a database needs them; the database file is what must not change)."""
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if not p.name.endswith(("-wal", "-shm"))}


def test_read_only_open_reads_and_never_writes(tmp_path):
    url = _filled(tmp_path / "results.db")
    before = _files(tmp_path)
    with Store(url, read_only=True) as s:
        assert [m.median_us for m in s.measurements()] == [80.0]
        with pytest.raises(StoreError) as err:
            s.start_run(H100, kind="sweep", command_line="y")
    message = str(err.value)
    assert "\n" not in message and "INSERT" not in message and "read-only" in message
    assert _files(tmp_path) == before


def test_read_only_open_of_a_missing_file_is_an_error_and_creates_nothing(tmp_path):
    with pytest.raises(StoreError, match="no such database file"):
        Store(f"sqlite:///{tmp_path / 'missing.db'}", read_only=True)
    assert list(tmp_path.iterdir()) == []
    result = CliRunner().invoke(app, ["status", "--db", str(tmp_path / "missing.db")])
    assert result.exit_code == 1 and result.output.startswith("error: --db ") and "no such" in result.output
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("read_only", [False, True])
def test_a_database_of_somebody_else_is_refused_untouched(tmp_path, read_only):
    path = tmp_path / "shop.db"
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT)")
    con.execute("INSERT INTO customers VALUES (1, 'Ada')")
    con.commit()
    con.close()
    before = _files(tmp_path)
    with pytest.raises(StoreError, match=r"holds other tables \(customers\) and no normtune results; it was left "
                                         "untouched"):
        Store(f"sqlite:///{path}", read_only=read_only)
    assert _files(tmp_path) == before  # no normtune or Optuna table, no WAL switch
    assert sorted(os.listdir(tmp_path)) == ["shop.db"]  # not even SQLite's -wal/-shm: it never became WAL


@pytest.mark.parametrize("url, words", [
    ("foo://bar", "unknown database scheme 'foo'"),
    ("mysql://user@localhost/db", "driver is not installed"),
])
def test_unusable_urls_are_one_line_errors_naming_the_url_and_the_fix(url, words):
    if "mysql" in url:
        pytest.importorskip("sqlalchemy")
        if any(__import__("importlib").util.find_spec(m) for m in ("MySQLdb",)):
            pytest.skip("a MySQL driver is installed here")
    with pytest.raises(StoreError) as err:
        Store(url)
    message = str(err.value)
    assert words in message and url.split("://")[0] in message and "\n" not in message
    result = CliRunner().invoke(app, ["status", "--db", url])
    assert result.exit_code == 1 and result.output.count("\n") == 1 and result.output.startswith("error: --db")


def _damaged(path: Path, first_page: int = 1) -> str:
    """A filled database whose pages from `first_page` on (page 0 holds the schema) are garbage."""
    url = _filled(path)
    with Store(url) as s:  # checkpoint the WAL into the file, so that the damage below is what SQLite reads
        with s.session_scope() as session:
            session.connection().exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
    data = bytearray(path.read_bytes())
    page = 4096
    for start in range(first_page * page, len(data), page):
        data[start:start + page] = bytes([0xA5]) * page
    path.write_bytes(bytes(data))
    return url


@pytest.mark.parametrize("first_page", [1, 3])
def test_report_on_a_damaged_file_is_one_error_line(tmp_path, first_page):
    """`normtune report` on a damaged database: the store's StoreError becomes one `error:` line, exit code 1."""
    url = _damaged(tmp_path / "results.db", first_page)
    result = CliRunner().invoke(app, ["report", "--gpu", "h100", "--db", url, "--out", str(tmp_path / "report")])
    assert result.exit_code == 1, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: --db {url}"), lines
    assert "malformed" in lines[0] and "restore" in lines[0] and "Traceback" not in result.output


def test_a_damaged_file_is_a_one_line_error(tmp_path):
    path = tmp_path / "results.db"
    url = _damaged(path)
    with pytest.raises(StoreError) as err:
        with Store(url, read_only=True) as s:
            s.measurements()
    message = str(err.value)
    assert "\n" not in message and str(path) in message
    assert "malformed" in message or "not a database" in message
    assert "restore" in message


def test_a_schema_1_database_is_read_as_it_is_and_upgraded_when_written(tmp_path):
    shipped = REPO / "results.db"
    con = sqlite3.connect(f"file:{shipped}?mode=ro", uri=True)
    version = con.execute("SELECT value FROM normtune_meta WHERE key = 'schema_version'").fetchone()
    con.close()
    if version != ("1",):
        pytest.skip("the repository's results.db is not a schema-1 database any more")
    old = tmp_path / "old.db"
    shutil.copy(shipped, old)
    before = old.read_bytes()
    with Store(f"sqlite:///{old}", read_only=True) as s:
        runs = s.runs()
        assert runs and s.schema_version == "1"
    assert old.read_bytes() == before
    with Store(f"sqlite:///{old}") as s:
        assert [r.id for r in s.runs()] == [r.id for r in runs]
        run_id = s.start_run(H100, kind="sweep", command_line="after the upgrade")
        s.workers.beat(run_id, grace_s=0.0)
        assert run_id in s.workers.mark_dead_runs()  # 'dead' is a run status now
        assert s.runs()[-1].status == "dead"
        assert s.count_measurements() > 0
    con = sqlite3.connect(old)
    assert con.execute("SELECT value FROM normtune_meta").fetchone() == (str(SCHEMA_VERSION),)
    assert con.execute("PRAGMA foreign_key_check").fetchall() == []
    assert con.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    con.close()


OLDER = [("3", ("column_accumulators", "pipelined_split")), ("4", ("pipelined_split",))]


def _aged(path: Path, version: str, knobs: tuple[str, ...]) -> tuple[str, BackwardConfig]:
    """A database made to look written by schema `version`: without the columns of `knobs` (added since), its
    measurement's config without their keys. Returns its URL and that config as this normtune reads it (the knobs
    at their defaults: what an older normtune ran)."""
    config = BackwardConfig(dataclasses.replace(CONFIG.kernel_1, **{knob: False for knob in knobs}), CONFIG.kernel_2)
    url = f"sqlite:///{path}"
    with Store(url) as s:
        run_id = s.start_run(H100, kind="sweep", command_line="x")
        s.add_measurement(run_id, RMS, config, ok(80.0), source="sweep")
        s.end_run(run_id)
    con = sqlite3.connect(path)
    old_json = config.to_json()
    for knob in knobs:
        for (name,) in con.execute("SELECT name FROM sqlite_master WHERE type = 'index' AND sql LIKE "
                                   f"'%k1_{knob}%'").fetchall():
            con.execute(f"DROP INDEX {name}")
        con.execute(f"ALTER TABLE normtune_measurements DROP COLUMN k1_{knob}")
        old_json = old_json.replace(f',"{knob}":false', "")
    assert old_json != config.to_json()
    con.execute("UPDATE normtune_measurements SET config_json = ?, config_hash = 'stale'", (old_json,))
    con.execute("UPDATE normtune_meta SET value = ? WHERE key = 'schema_version'", (version,))
    con.commit()
    con.close()
    return url, config


@pytest.mark.parametrize("version,knobs", OLDER)
def test_an_older_database_is_refused_read_only_and_upgraded_when_written(tmp_path, version, knobs):
    """Schema 3 lacks k1_column_accumulators and k1_pipelined_split, schema 4 the latter, and stored configs
    written before a knob existed lack its key: writing adds the columns (old rows ran without the knobs) and
    rewrites each config in canonical JSON, so a lookup by config finds the old measurement."""
    path = tmp_path / "results.db"
    url, config = _aged(path, version, knobs)
    before = path.read_bytes()
    with pytest.raises(SchemaVersionError, match="upgrades it in place"):
        Store(url, read_only=True)
    assert path.read_bytes() == before
    with Store(url) as s:
        assert s.schema_version == str(SCHEMA_VERSION)
        found = s.measurements(config=config)
        assert found and all(m.config == config for m in found)
        assert s.count_measurements(config=config) == s.count_measurements()
    con = sqlite3.connect(path)
    for knob in knobs:
        assert con.execute(f"SELECT DISTINCT k1_{knob} FROM normtune_measurements").fetchall() == [(0,)]
    assert con.execute("SELECT DISTINCT config_json FROM normtune_measurements").fetchall() == [(config.to_json(),)]
    con.close()


@pytest.mark.parametrize("version,knobs", OLDER)
def test_an_older_database_is_read_through_an_upgraded_copy(tmp_path, version, knobs):
    """A reading command on an older SQLite file reads an upgraded snapshot of it: lookups by today's config find
    the old measurements, the file stays byte for byte as it was, the copy goes on close, and the command says so
    in one line."""
    folder = tmp_path / "db"
    folder.mkdir()
    url, config = _aged(folder / "results.db", version, knobs)
    before = _files(folder)
    with Store.for_reading(url) as s:
        assert s.upgraded_from == version and s.read_only
        assert [m.config for m in s.measurements(config=config)] == [config]
        scratch = Path(s._scratch)
        assert scratch.is_dir() and not scratch.is_relative_to(tmp_path)
        with pytest.raises(StoreError):
            s.start_run(H100, kind="sweep", command_line="y")
    assert not scratch.exists() and _files(folder) == before
    result = CliRunner().invoke(app, ["status", "--db", str(folder / "results.db")])
    assert result.exit_code == 0, result.output
    assert f"note: --db {folder / 'results.db'} has schema {version}; read through a copy" in result.output
    assert _files(folder) == before
    Store(url).close()  # upgraded in place: read as it is from now on
    with Store.for_reading(url) as s:
        assert s.upgraded_from is None and s._scratch is None and s.schema_version == str(SCHEMA_VERSION)


def test_the_store_holds_its_worker_coordination(tmp_path):
    """Heartbeats and trial slots are a component of the store (`store.workers`), not a base class of it."""
    assert Store.__bases__ == (object,)
    with Store(f"sqlite:///{tmp_path / 'results.db'}") as s:
        assert isinstance(s.workers, Workers)
        run_id = s.start_run(H100, kind="sweep", command_line="one worker")
        assert s.workers.claim_slot("normtune:h100:" + RMS.key, 1, run_id) == (0, None)
        s.workers.beat(run_id, grace_s=60.0, device=0)
        (state,) = s.workers.states()
        assert state.run_id == run_id and state.alive


def test_a_worker_claims_the_slot_after_its_last_in_one_transaction_and_free_slots_below_later(tmp_path,
                                                                                                 monkeypatch):
    """Consecutive claims read no slots; a slot given back below them, or the one after the last claim taken by
    another worker, is found by reading the slots."""
    study = "normtune:h100:" + RMS.key
    with Store(f"sqlite:///{tmp_path / 'results.db'}") as s:
        mine = s.start_run(H100, kind="sweep", command_line="this worker")
        other = s.start_run(H100, kind="sweep", command_line="another worker")
        for run in (mine, other):
            s.workers.beat(run, grace_s=60.0, device=0)
        reads = []
        read = s.workers.slots
        monkeypatch.setattr(s.workers, "slots", lambda name: reads.append(name) or read(name))
        assert [s.workers.claim_slot(study, 6, mine) for _ in range(3)] == [(0, None), (1, None), (2, None)]
        assert len(reads) == 1  # the first claim only: the others took the slot after the last
        s.workers.release_slot(study, 1, mine)  # given back unmeasured
        assert s.workers.claim_slot(study, 6, other) == (1, None)  # another worker's first claim: the lowest
        assert s.workers.claim_slot(study, 6, other) == (3, None)  # the slot after its last (2) is mine: read
        assert s.workers.claim_slot(study, 6, mine) == (4, None)  # 3 is taken: the slots are read
        assert s.workers.claim_slot(study, 6, mine) == (5, None)
        s.workers.release_slot(study, 4, mine)
        assert s.workers.claim_slot(study, 6, mine) == (4, None)  # past the target: the free one below
        assert s.workers.claim_slot(study, 6, mine) is None


def test_status_reads_a_database_without_changing_it(tmp_path):
    url = _filled(tmp_path / "results.db")
    with Store(url) as s:
        run_id = s.start_run(H100, kind="sweep", command_line="a worker that died")
        s.workers.beat(run_id, grace_s=0.0, device=1)
        s.workers.claim_slot("normtune:h100:" + RMS.key, 3, run_id)
        s.add_measurement(run_id, RMS, CONFIG, ok(70.0), source="sweep", study_name="normtune:h100:" + RMS.key,
                          trial_number=0)
    before = _files(tmp_path)
    result = CliRunner().invoke(app, ["status", "--db", url], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert f"{RMS.norm} {RMS.M}x{RMS.N} {RMS.dtype}" in result.output
    assert "workers: 0 alive of 1" in result.output and "GPU 1" in result.output and "dead" in result.output
    assert _files(tmp_path) == before
    with Store(url, read_only=True) as s:
        assert [r.status for r in s.runs()] == ["finished", "running"]  # status only reads; a sweep marks it


def test_sqlite_connections_commit_without_fsync_in_wal_mode(tmp_path):
    """Both engines on a SQLite file (normtune's tables and Optuna's) run WAL with synchronous=NORMAL: no fsync
    per commit, nothing a killed process committed is lost."""
    pytest.importorskip("optuna")
    url = f"sqlite:///{tmp_path / 'r.db'}"
    with Store(url) as s:
        with s._engine.connect() as con:
            assert con.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert con.exec_driver_sql("PRAGMA synchronous").scalar() == 1  # NORMAL
        storage = s.optuna_storage()
        with storage.engine.connect() as con:
            assert con.exec_driver_sql("PRAGMA synchronous").scalar() == 1
