"""`normtune merge` (tuner/store/merge.py): runs copied from one results database into another with their problems,
measurements, peer results, heartbeats and costs, under the destination's ids; merging again adds nothing; the
source is only read, byte for byte; refusals are one line naming the option and leave both databases as they were;
a failure part-way leaves the destination as it was; a table fitted on the source's runs re-emits from the
destination. The destination runs on SQLite and, with a test server, on PostgreSQL."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import shutil
import sqlite3
from pathlib import Path

import pytest
from pg_support import backend_database
from sqlalchemy import create_engine, select, text
from test_report import GPU, LN, RMS, add_bench, add_sweep, add_validation, config, ok
from typer.testing import CliRunner

from normtune.cli import app
from normtune.kernels.config import ProblemFamily
from normtune.tuner.store import merge as M
from normtune.tuner.store.database import SCHEMA_VERSION, Store
from normtune.tuner.tables import emit

runner = CliRunner()
HEARTBEATS, COSTS = M.PER_RUN_TABLES
OTHER = dataclasses.replace(GPU, name="NVIDIA Other GPU", key="othergpu", host="node-2")
GATED = ProblemFamily.from_key("rms_norm/bf16/wbf16/nobias/save-input/gate-before-silu").problem(4096, 128)


def make_source(path: Path) -> str:
    """Runs 1 (sweep of LN and RMS, with a heartbeat and costs, one trial named in an Optuna study), 2 (validate),
    3 (bench: measurements and peer results), 4 (sweep of a gated problem, still running)."""
    url = f"sqlite:///{path}"
    with Store(url) as store:
        run = add_sweep(store)
        store.add_measurement(run, RMS, config(RMS, 4, 8), ok(17.5), source="sweep", study_name="normtune:t:rms",
                              trial_number=0)
        store.workers.beat(run, grace_s=30.0, device=0, costs={"measure": 1.5, "compile": 0.25})
        store.end_run(run)
        add_validation(store)
        add_bench(store)
        gated = store.start_run(GPU, kind="sweep", command_line="normtune sweep --shapes gated-tiny")
        store.add_measurement(gated, GATED, config(GATED, 8, 4), ok(30.0), source="sweep")
    return url


@pytest.fixture
def source(tmp_path) -> str:
    folder = tmp_path / "source"
    folder.mkdir()
    return make_source(folder / "tune.db")


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def target(request, tmp_path):
    """An empty results database (its schema, no runs) on each backend."""
    folder = tmp_path / "target"
    folder.mkdir()
    with backend_database(request.param, folder, "the merge tests") as url:
        Store(url).close()
        yield url


def stored(url: str) -> dict[tuple, tuple]:
    """Each run by its identity (`merge.RUN_IDENTITY`): its record and its rows, every id and run id left out
    (measurements also without the study they were a trial of), its heartbeat and costs."""
    with Store(url, read_only=True) as store:
        runs = store.runs()
        out = {}
        engine = create_engine(store.url)
        try:
            with engine.connect() as conn:
                beats = {r.run_id: tuple(r[1:]) for r in conn.execute(select(HEARTBEATS.c.run_id, HEARTBEATS.c.host,
                                                                              HEARTBEATS.c.pid, HEARTBEATS.c.device,
                                                                              HEARTBEATS.c.grace_s,
                                                                              HEARTBEATS.c.beat_at))}
                costs = dict(conn.execute(select(COSTS.c.run_id, COSTS.c.costs_json)).all())
        finally:
            engine.dispose()
        for run in runs:
            identity = (run.kind, run.gpu_key, run.gpu_name, run.device.host, run.started_at, run.command_line)
            measurements = [dataclasses.replace(m, id=0, run_id=0, study_name=None, trial_number=None)
                            for m in store.measurements(run_id=run.id)]
            peers = [dataclasses.replace(p, id=0, run_id=0) for p in store.peer_results(run_id=run.id)]
            out[identity] = (dataclasses.replace(run, id=0), measurements, peers, beats.get(run.id),
                             costs.get(run.id))
    return out


def files(folder: Path) -> dict[str, str]:
    """Every file of `folder` by its sha256, but the `-shm` index and an empty `-wal` that SQLite keeps beside a
    WAL database while anyone reads it."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())
            if not p.name.endswith("-shm") and not (p.name.endswith("-wal") and p.stat().st_size == 0)}


def dump(url: str) -> list[str]:
    con = sqlite3.connect(f"file:{url.removeprefix('sqlite:///')}?mode=ro", uri=True)
    try:
        return list(con.iterdump())
    finally:
        con.close()


# ------------------------------------------------------------------------------------------------ the store


def test_merge_into_an_empty_database_copies_every_run_with_its_rows(source, target):
    with Store(source, read_only=True) as src, Store(target) as dst:
        result = M.merge_runs(src, dst)
    assert [(r.source_id, r.target_id, r.added) for r in result.runs] == [(1, 1, True), (2, 2, True), (3, 3, True),
                                                                         (4, 4, True)]
    assert [(r.kind, r.status, r.measurements, r.peer_results) for r in result.runs] == [
        ("sweep", "finished", 10, 0), ("validate", "finished", 18, 0), ("bench", "finished", 2, 4),
        ("sweep", "running", 1, 0)]
    assert result.problems_added == 5  # LN, RMS, their two held-out shapes, the gated problem
    assert stored(target) == stored(source)
    with Store(target, read_only=True) as dst:
        # A copied measurement names no study: Optuna's studies stay behind.
        assert {m.study_name for m in dst.measurements()} == {None}
        assert dst.best(GATED, gpu_key=GPU.key).median_us == 30.0
        assert "studies" not in dst.table_names() or not _count(target, "studies")


def _count(url: str, table: str) -> int:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return conn.execute(text(f"SELECT count(*) FROM {table}")).scalar()  # noqa: S608 - a fixed name
    finally:
        engine.dispose()


def test_merge_into_a_database_with_other_runs_takes_new_ids_and_shares_problems(source, target):
    with Store(target) as dst:
        add_sweep(dst, OTHER)  # run 1 of the destination: problems LN and RMS already there
        add_bench(dst)
    before = stored(target)
    with Store(source, read_only=True) as src, Store(target) as dst:
        result = M.merge_runs(src, dst, [3, 1])
    assert [(r.source_id, r.target_id) for r in result.runs] == [(1, 3), (3, 4)]
    assert result.problems_added == 0  # the bench and sweep's problems were there
    after = stored(target)
    assert {k: v for k, v in after.items() if k in before} == before  # the destination's own runs as they were
    mine = stored(source)
    assert {k: v for k, v in after.items() if k not in before} == {k: v for k, v in mine.items()
                                                                   if k[-1].startswith("normtune bench")
                                                                   or k[-1] == "normtune sweep --gpu testgpu"}
    with Store(target, read_only=True) as dst:
        assert len(dst.problems()) == 2


def test_merging_again_adds_nothing(source, target):
    with Store(source, read_only=True) as src, Store(target) as dst:
        first = M.merge_runs(src, dst, [2])
        everything = M.merge_runs(src, dst)
        again = M.merge_runs(src, dst)
    assert [(r.source_id, r.target_id, r.added) for r in first.runs] == [(2, 1, True)]
    assert [(r.source_id, r.target_id, r.added) for r in everything.runs] == [
        (1, 2, True), (2, 1, False), (3, 3, True), (4, 4, True)]
    assert not again.added and [r.target_id for r in again.present] == [2, 1, 3, 4] and again.problems_added == 0
    assert stored(target) == stored(source)


def test_a_dry_run_writes_nothing_and_says_what_a_merge_would_copy(source, target):
    with Store(source, read_only=True) as src, Store(target) as dst:
        M.merge_runs(src, dst, [1])
    before = stored(target)
    with Store(source, read_only=True) as src, Store(target, read_only=True) as dst:
        planned = M.merge_runs(src, dst, dry_run=True)
    assert [(r.source_id, r.target_id, r.added) for r in planned.runs] == [
        (1, 1, False), (2, None, True), (3, None, True), (4, None, True)]
    assert planned.problems_added == 3  # the held-out shapes and the gated problem
    assert stored(target) == before


def test_a_failure_part_way_leaves_the_destination_as_it_was(source, tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path / 'dest.db'}"
    with Store(url) as dst:
        add_sweep(dst, OTHER)
    before = dump(url)
    copied = []
    copy_run = M.copy_run

    def copy_then_fail(conn, run, problem_ids):
        if copied:
            raise RuntimeError("the disk is full")
        copied.append(copy_run(conn, run, problem_ids))  # the first run is written, then the second fails
        return copied[-1]

    monkeypatch.setattr(M, "copy_run", copy_then_fail)
    with Store(source, read_only=True) as src, Store(url) as dst, pytest.raises(RuntimeError, match="disk is full"):
        M.merge_runs(src, dst)
    assert copied == [2]
    assert dump(url) == before


def test_same_database_sees_one_file_through_any_path_and_one_server_database(tmp_path):
    path = tmp_path / "a.db"
    path.write_bytes(b"")
    (tmp_path / "link.db").symlink_to(path)
    assert M.same_database(str(path), f"sqlite:///{tmp_path / 'link.db'}")
    assert M.same_database(f"sqlite:///{path}", f"sqlite:///{tmp_path}/../{tmp_path.name}/a.db")
    assert not M.same_database(str(path), str(tmp_path / "b.db"))
    assert M.same_database("postgresql://u:p@host/db", "postgres://other@host/db")
    assert not M.same_database("postgresql://u@host/db", "postgresql://u@host/db2")
    assert not M.same_database("postgresql://u@host/db", str(path))


# --------------------------------------------------------------------------------------------------- the CLI


def test_cli_merge_prints_each_run_and_a_second_merge_adds_nothing(source, tmp_path):
    dest = tmp_path / "dest.db"
    with Store(f"sqlite:///{dest}") as dst:
        add_sweep(dst, OTHER)
    result = runner.invoke(app, ["merge", "--from", source, "--db", str(dest), "--runs", "1,3"])
    assert result.exit_code == 0, result.output
    assert "run    1 copied as run 2: sweep" in result.output and "run    3 copied as run 3: bench" in result.output
    assert "copied 2 of 2 runs (12 measurements, 4 peer results, 0 new problems)" in result.output
    assert f"their run ids in sqlite:///{dest}: 2,3" in result.output
    again = runner.invoke(app, ["merge", "--from", source, "--db", str(dest)])
    assert again.exit_code == 0, again.output
    assert f"run    1 is run 2 of sqlite:///{dest} already: left as it is" in again.output
    assert "copied 2 of 4 runs" in again.output and "2 were there already" in again.output
    dry = runner.invoke(app, ["merge", "--from", source, "--db", str(dest), "--dry-run"])
    assert dry.exit_code == 0, dry.output
    assert "would copy 0 of 4 runs" in dry.output and "their run ids" not in dry.output


@pytest.mark.parametrize("journal", ["wal", "delete"])
def test_cli_merge_leaves_the_source_byte_for_byte(source, tmp_path, journal):
    folder = Path(source.removeprefix("sqlite:///")).parent
    con = sqlite3.connect(folder / "tune.db")
    con.execute(f"PRAGMA journal_mode={journal}")
    con.close()
    dest = tmp_path / "dest.db"
    Store(f"sqlite:///{dest}").close()
    before = files(folder)
    for args in ([], ["--dry-run"], ["--runs", "2"]):
        result = runner.invoke(app, ["merge", "--from", source, "--db", str(dest), *args])
        assert result.exit_code == 0, result.output
        assert files(folder) == before, args


def test_cli_merge_reads_an_older_source_through_an_upgraded_copy(source, tmp_path):
    """A source of schema 4 (no k1_pipelined_split column): read through an upgraded copy, said in one note line,
    the file left as it was; its configs arrive as this normtune reads them."""
    path = Path(source.removeprefix("sqlite:///"))
    with Store(source, read_only=True) as src:
        configs = [m.config for m in src.measurements(run_id=1)]
    con = sqlite3.connect(path)
    for (name,) in con.execute("SELECT name FROM sqlite_master WHERE type = 'index' AND sql LIKE "
                               "'%k1_pipelined_split%'").fetchall():
        con.execute(f"DROP INDEX {name}")
    con.execute("ALTER TABLE normtune_measurements DROP COLUMN k1_pipelined_split")
    con.execute("UPDATE normtune_meta SET value = '4' WHERE key = 'schema_version'")
    con.commit()
    con.close()
    before = files(path.parent)
    dest = tmp_path / "dest.db"
    Store(f"sqlite:///{dest}").close()
    result = runner.invoke(app, ["merge", "--from", str(path), "--db", str(dest), "--runs", "1"])
    assert result.exit_code == 0, result.output
    assert f"note: --from {path} has schema 4; read through a copy upgraded" in result.output
    assert files(path.parent) == before
    with Store(f"sqlite:///{dest}", read_only=True) as dst:
        assert [m.config for m in dst.measurements(run_id=1)] == configs


def _one_error(result) -> str:
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 1 and len(lines) == 1 and lines[0].startswith("error: "), result.output
    return lines[0]


def _newer(path: Path) -> None:
    con = sqlite3.connect(path)
    con.execute("UPDATE normtune_meta SET value = '99' WHERE key = 'schema_version'")
    con.commit()
    con.close()


REFUSALS = {
    # name: (how the files are spoilt, the merge's extra arguments, what the line says)
    "missing source": (lambda s, d: s.unlink(), [], "--from {s}: no such database file"),
    "missing destination": (lambda s, d: d.unlink(), [], "--db sqlite:///{d}: no such database file"),
    "source not a database": (lambda s, d: s.write_bytes(b"not a database" * 100), [],
                              "--from sqlite:///{s}: cannot read it"),
    "destination not a database": (lambda s, d: d.write_bytes(b"not a database" * 100), [],
                                   "--db sqlite:///{d}: cannot read it"),
    "source of a newer schema": (lambda s, d: _newer(s), [],
                                 "--from {s}: database schema 99, this normtune expects " f"{SCHEMA_VERSION}"),
    "destination of a newer schema": (lambda s, d: _newer(d), [],
                                      f"database schema 99, this normtune expects {SCHEMA_VERSION}: sqlite:///{{d}}"),
    "the destination as source": (lambda s, d: None, ["--from", "{d}"], "--from {d} is the destination"),
    "a link to the destination": (lambda s, d: (d.parent / "link.db").symlink_to(d), ["--from", "{link}"],
                                  "--from {link} is the destination"),
    "an unknown run": (lambda s, d: None, ["--runs", "2,9"], "--runs 9: no such run in"),
    "a bad run list": (lambda s, d: None, ["--runs", "x"], "--runs 'x': use a comma list of run ids"),
    "two run lists": (lambda s, d: None, ["--runs", "1", "--runs-of", "{s}"], "--runs and --runs-of both"),
    "a table without runs": (lambda s, d: (d.parent / "t.json").write_text('{"provenance": {}}'),
                             ["--runs-of", "{table}"], "--runs-of {table}: the table records no fitted runs"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_cli_refusals_are_one_line_and_change_neither_database(source, tmp_path, case):
    spoil, extra, needle = REFUSALS[case]
    s = Path(source.removeprefix("sqlite:///"))
    d = tmp_path / "dest" / "results.db"
    d.parent.mkdir()
    with Store(f"sqlite:///{d}") as dst:
        add_sweep(dst, OTHER)
    spoil(s, d)
    names = {"s": s, "d": d, "link": d.parent / "link.db", "table": d.parent / "t.json"}
    extra = [arg.format(**names) for arg in extra]
    args = ["merge", "--from", str(s), "--db", str(d), *extra]
    if "--from" in extra:  # the case names its own source
        args = ["merge", *extra, "--db", str(d)]
    before = {folder: files(folder) for folder in (s.parent, d.parent)}
    line = _one_error(runner.invoke(app, args))
    assert needle.format(**names) in line, line
    assert {folder: files(folder) for folder in (s.parent, d.parent)} == before


# ----------------------------------------------------------------------------------------------- re-emission


def fitted_source(path: Path) -> tuple[str, dict]:
    """A source with two sweeps of the test GPU (runs 1, 2) and a validation (3), and the table fitted on the
    sweeps."""
    url = f"sqlite:///{path}"
    with Store(url) as store:
        add_sweep(store)
        run = store.start_run(GPU, kind="sweep", command_line="normtune sweep --gpu testgpu (more trials)")
        for problem, warps, median in ((LN, 16, 9.0), (RMS, 16, 17.9), (RMS, 4, 18.0)):
            store.add_measurement(run, problem, config(problem, 4, warps), ok(median), source="sweep")
        store.end_run(run)
        add_validation(store)
        table = emit.build_table(store, GPU.key, selection=emit.Selection(run_ids=(1, 2)))
    return url, table


def test_a_table_fitted_on_the_source_re_emits_from_the_merged_destination(tmp_path):
    source, table = fitted_source(tmp_path / "tune.db")
    path = tmp_path / "tuned.json"
    path.write_text(emit.dumps(table))
    # Into an empty database the runs keep their ids: `emit --runs-of` reproduces the table byte for byte.
    empty = tmp_path / "empty.db"
    Store(f"sqlite:///{empty}").close()
    result = runner.invoke(app, ["merge", "--from", source, "--db", str(empty), "--runs-of", str(path)])
    assert result.exit_code == 0, result.output
    out = tmp_path / "check.json"
    shutil.copy(path, out)
    result = runner.invoke(app, ["emit", "--gpu", GPU.key, "--db", str(empty), "--runs-of", str(path), "--out",
                                 str(out), "--check"])
    assert result.exit_code == 0, result.output
    # Into a database with runs of its own they get new ids: fitted on those, the table's families come out the
    # same, and its provenance differs only in the run ids and the fingerprint of the inputs (which holds ids).
    other = tmp_path / "other.db"
    with Store(f"sqlite:///{other}") as dst:
        add_sweep(dst, OTHER)
        add_bench(dst)
    result = runner.invoke(app, ["merge", "--from", source, "--db", str(other), "--runs-of", str(path)])
    assert result.exit_code == 0, result.output
    ids = tuple(int(i) for i in re.search(r"their run ids in \S+: ([\d,]+)", result.output).group(1).split(","))
    assert ids == (3, 4)
    with Store(f"sqlite:///{other}", read_only=True) as dst:
        again = emit.build_table(dst, GPU.key, selection=emit.Selection(run_ids=ids))
    assert again["families"] == table["families"] and again["gpu"] == table["gpu"]
    differ = {k for k in table["provenance"] if again["provenance"][k] != table["provenance"][k]}
    assert differ == {"runs", "fingerprint"} and again["provenance"]["runs"] == list(ids)
    json.dumps(again)  # plain JSON, as emitted


def test_merge_is_a_listed_command():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0 and re.search(r"^\s+merge\s", result.output, re.M), result.output
