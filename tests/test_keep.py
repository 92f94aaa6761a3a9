"""`normtune slim` (tuner/upkeep/kept_subset.py): the shipped results.db keeps the runs its tables were fitted on and each GPU's
latest validate and bench runs, drops the rest and Optuna's studies, and a table still re-emits from it byte for
byte. Also: a read-only command leaves no -wal/-shm files beside a WAL database, and the committed file's size."""

from __future__ import annotations

import dataclasses
import sqlite3
from pathlib import Path

import pytest
from test_report import GPU, LN, RMS, add_bench, add_sweep, add_validation, config, ok
from typer.testing import CliRunner

from normtune.cli import app
from normtune.kernels.config import ProblemFamily
from normtune.tuner.tables import emit
from normtune.tuner.upkeep import kept_subset as keep
from normtune.tuner.store.database import Store
from normtune.tuner.store.models import SHARED_COLUMNS

REPO_DB = Path(__file__).resolve().parents[1] / "results.db"
SIZE_LIMIT = 30_000_000  # bytes: the most results.db may weigh in the repository (docs/results-db.md)


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """Runs 1 (sweep, fitted), 2 (sweep, not fitted), 3 (validate), 4 (bench bf16), 5 (sweep of another GPU),
    6 (validate, later), 7 (bench fp16); run 2's measurements name an Optuna study."""
    path = tmp_path_factory.mktemp("keep") / "results.db"
    store = Store(f"sqlite:///{path}")
    assert add_sweep(store) == 1
    run = store.start_run(GPU, kind="sweep", command_line="normtune sweep (not fitted)")
    store.add_measurement(run, LN, config(LN, 2, 8), ok(8.0), source="sweep", study_name="normtune:testgpu:ln",
                          trial_number=0)
    store.end_run(run)
    add_validation(store)
    add_bench(store)
    other = store.start_run(dataclasses.replace(GPU, key="othergpu"), kind="sweep", command_line="other")
    store.add_measurement(other, RMS, config(RMS, 1, 8), ok(5.0), source="sweep")
    store.end_run(other)
    add_validation(store)
    bench = store.start_run(GPU, kind="bench", command_line="normtune bench --dtype fp16")
    fp16 = dataclasses.replace(LN, dtype="fp16", weight_dtype="fp16")
    store.add_measurement(bench, fp16, config(fp16, 1, 8), ok(12.0), source="bench-table")
    store.add_peer_result(bench, fp16, "torch", status="ok", median_us=20.0, reps=20)
    store.end_run(bench)
    import optuna

    optuna.create_study(storage=store.optuna_storage(), study_name="normtune:testgpu:ln")
    table = emit.build_table(store, "testgpu", selection=emit.Selection(run_ids=(1,)))
    store.close()
    return path, table


def test_plan_keeps_the_fitted_runs_and_the_latest_validate_and_benches(full):
    path, table = full
    with Store(f"sqlite:///{path}", read_only=True) as store:
        kept = keep.plan(store, {"testgpu.json": table})
    assert {r.id: r.reasons for r in kept} == {
        1: ("fitted testgpu.json",), 6: ("latest testgpu validate",),
        4: ("latest testgpu bf16 bench of its 2 shapes",), 7: ("latest testgpu fp16 bench of its 1 shapes",)}


def test_plan_keeps_the_latest_validation_of_each_problem_form(tmp_path):
    """A residual-form validation is kept beside a later plain one (and the older plain one goes)."""
    store = Store(f"sqlite:///{tmp_path / 'forms.db'}")
    assert add_sweep(store) == 1
    add_validation(store)  # 2: plain, superseded by 4
    run = store.start_run(GPU, kind="validate", command_line="validate --residual")
    residual = dataclasses.replace(RMS, residual=True)
    store.add_measurement(run, residual, config(residual, 1, 8), ok(9.0), source="validate-table")
    store.end_run(run)  # 3
    add_validation(store)  # 4
    table = emit.build_table(store, "testgpu", selection=emit.Selection(run_ids=(1,)))
    kept = keep.plan(store, {"testgpu.json": table})
    store.close()
    assert {r.id: r.reasons for r in kept} == {
        1: ("fitted testgpu.json",), 3: ("latest testgpu residual validate",), 4: ("latest testgpu validate",)}


def test_a_gated_validation_is_a_form_of_its_own(tmp_path):
    """A validation of the gated RMSNorm (merged from a tune's database, say) does not stand in for the plain
    norms' latest one: both are kept."""
    store = Store(f"sqlite:///{tmp_path / 'gated.db'}")
    assert add_sweep(store) == 1
    add_validation(store)  # 2: plain
    run = store.start_run(GPU, kind="validate", command_line="validate --shapes gated-tiny")
    gated = ProblemFamily.from_key("rms_norm/bf16/wbf16/nobias/save-input/gate-after-silu").problem(64, 256)
    store.add_measurement(run, gated, config(gated, 1, 8), ok(9.0), source="validate-table")
    store.end_run(run)  # 3
    table = emit.build_table(store, "testgpu", selection=emit.Selection(run_ids=(1,)))
    kept = keep.plan(store, {"testgpu.json": table})
    store.close()
    assert {r.id: r.reasons for r in kept} == {
        1: ("fitted testgpu.json",), 2: ("latest testgpu validate",), 3: ("latest testgpu gated validate",)}

def test_slim_copy_reproduces_the_table_and_drops_the_rest(full, tmp_path):
    path, table = full
    out = tmp_path / "slim.db"
    result = CliRunner().invoke(app, ["slim", "--db", f"sqlite:///{path}", "--out", str(out),
                                      "--table", str(_write(tmp_path / "testgpu.json", table))])
    assert result.exit_code == 0, result.output
    assert "keep run    1 sweep" in result.output and f"wrote {out}: 4 runs" in result.output
    with Store(f"sqlite:///{out}", read_only=True) as slim:
        assert [r.id for r in slim.runs()] == [1, 4, 6, 7]
        assert emit.dumps(emit.build_table(slim, "testgpu", selection=emit.Selection(run_ids=(1,)))) == \
            emit.dumps(table)
        assert len(slim.peer_results(run_id=4)) == 4 and not slim.measurements(run_id=2)
        assert all(m.study_name is None for m in slim.measurements())
    con = sqlite3.connect(f"file:{out}?mode=ro", uri=True)
    try:
        assert con.execute("SELECT count(*) FROM studies").fetchone() == (0,)
        assert con.execute("PRAGMA journal_mode").fetchone() == ("delete",)
    finally:
        con.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["slim.db", "testgpu.json"]
    # The source is only read, and an existing output is never overwritten.
    again = CliRunner().invoke(app, ["slim", "--db", f"sqlite:///{path}", "--out", str(out),
                                     "--table", str(tmp_path / "testgpu.json")])
    assert again.exit_code == 1 and "already exists" in again.stderr


def test_slim_blanks_the_configs_its_knob_columns_describe_and_reads_them_back(full, tmp_path):
    """The slim file keeps a config only in its knob columns (most of a row's bytes were its JSON): every reader
    gets the same configs and hashes back, and a writing open recreates the knob indexes the file left out."""
    path, table = full
    out = tmp_path / "slim.db"
    result = CliRunner().invoke(app, ["slim", "--db", f"sqlite:///{path}", "--out", str(out),
                                      "--table", str(_write(tmp_path / "testgpu.json", table))])
    assert result.exit_code == 0, result.output
    con = sqlite3.connect(f"file:{out}?mode=ro", uri=True)
    try:
        blank, total = con.execute("SELECT sum(config_json = ''), count(*) FROM normtune_measurements").fetchone()
        knob_indexes = con.execute("SELECT count(*) FROM sqlite_master WHERE type = 'index' AND name LIKE "
                                   "'ix_normtune_measurements_k%'").fetchone()[0]
    finally:
        con.close()
    assert total > 0 and blank == total and knob_indexes == 0
    with Store(f"sqlite:///{path}", read_only=True) as full_store, \
            Store(f"sqlite:///{out}", read_only=True) as slim:
        before = {m.id: (m.config, m.config_hash) for m in full_store.measurements() if m.run_id in (1, 4, 6, 7)}
        after = {m.id: (m.config, m.config_hash) for m in slim.measurements()}
    assert after == before
    Store(f"sqlite:///{out}").close()  # a writing open
    con = sqlite3.connect(out)
    try:
        knob_indexes = con.execute("SELECT count(*) FROM sqlite_master WHERE type = 'index' AND name LIKE "
                                   "'ix_normtune_measurements_k%'").fetchone()[0]
    finally:
        con.close()
    assert knob_indexes == len(SHARED_COLUMNS)  # the shared knobs' (the flat layout's columns have none)


def test_a_table_fitted_on_missing_runs_is_refused(full, tmp_path):
    path, table = full
    table = {**table, "provenance": {**table["provenance"], "runs": [1, 99]}}
    with Store(f"sqlite:///{path}", read_only=True) as store, pytest.raises(ValueError, match="runs 99"):
        keep.plan(store, {"t.json": table})


def test_a_read_only_command_leaves_no_wal_files(full, tmp_path):
    import shutil

    path, _ = full
    db = tmp_path / "results.db"
    shutil.copy(path, db)
    con = sqlite3.connect(db)
    assert con.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    con.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.db"]
    result = CliRunner().invoke(app, ["report", "--gpu", "testgpu", "--db", f"sqlite:///{db}",
                                      "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "results.db"]


def test_slim_reads_a_wal_database_in_a_folder_it_cannot_write(full, tmp_path):
    """A WAL database in a read-only folder: the store reads it `immutable` (no -shm can be made there), and so
    must slim's copy (sqlite3.OperationalError 'unable to open database file' before). The folder is made
    read-only by a bind mount in a mount namespace of the command's own (`unshare`), since root ignores a
    folder's permission bits."""
    import shutil
    import subprocess
    import sys

    path, table = full
    folder = tmp_path / "ro"
    folder.mkdir()
    db = folder / "results.db"
    source, con = sqlite3.connect(f"file:{path}?mode=ro", uri=True), sqlite3.connect(db)
    source.backup(con)  # with what the source's write-ahead log holds
    source.close()
    assert con.execute("PRAGMA journal_mode=WAL").fetchone() == ("wal",)
    con.close()
    out = tmp_path / "slim.db"
    read_only = f"mount --bind {folder} {folder} && mount -o remount,bind,ro {folder}"
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", f"{read_only} && ! touch {folder}/probe"],
                           capture_output=True, text=True) if shutil.which("unshare") else None
    if probe is None or probe.returncode != 0:
        pytest.skip("no read-only bind mount here (needs unshare with user and mount namespaces)")
    cli = [sys.executable, "-c", "from normtune.cli import app; app(prog_name='normtune')"]
    script = read_only + ' && exec "$@"'
    result = subprocess.run(["unshare", "-rm", "sh", "-c", script, "sh", *cli, "slim", "--db", f"sqlite:///{db}",
                             "--out", str(out), "--table", str(_write(tmp_path / "testgpu.json", table))],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert f"wrote {out}: 4 runs" in result.stdout, result.stdout
    assert sorted(p.name for p in folder.iterdir()) == ["results.db"]


def test_the_committed_results_db_is_within_its_size_limit():
    """docs/results-db.md: the file keeps only what its policy names; `normtune slim` writes it."""
    assert REPO_DB.is_file(), "results.db is missing from the repository root"
    size = REPO_DB.stat().st_size
    assert size <= SIZE_LIMIT, (f"results.db is {size / 1e6:.1f} MB, above {SIZE_LIMIT / 1e6:.0f} MB: rebuild it "
                                "with `normtune slim --out slim.db` (docs/results-db.md) and commit that file")


def _write(path: Path, table: dict) -> Path:
    path.write_text(emit.dumps(table))
    return path
