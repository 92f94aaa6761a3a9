"""Contract suite of `normtune.tuner.store.database`, run against every backend through the `url` fixture (Optuna's way).

SQLite always runs (a file under tmp_path). PostgreSQL runs when NORMTUNE_TEST_POSTGRES_URL names a role that may
create databases; each test gets a fresh database. Start a local server with:

    eval "$(bash tests/postgres.sh)" && python -m pytest tests/test_store.py
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import multiprocessing
import os
import queue as queue_module
import sqlite3
import threading
import time

import pytest
from sqlalchemy import create_engine, inspect, select, text, update
from sqlalchemy.engine import make_url

from pg_support import backend_database

from normtune.kernels.config import STRATEGIES, BackwardConfig, Kernel1Config, Kernel2Config, Problem, kernel_1_config
from normtune.kernels.strategies.configs import FLAT_LAYOUT
from normtune.tuner.store import database as store_module
from normtune.tuner.gpu_info import DeviceInfo
from normtune.tuner.measure.harness import STATUSES, MeasureResult
from normtune.tuner.store.database import (CONFIG_COLUMNS, SCHEMA_VERSION, MeasurementModel, MetaModel, SchemaVersionError,
                                  Store, StoreError, StoreIntegrityError)


H100 = DeviceInfo(name="NVIDIA H100 80GB HBM3", key="h100", compute_capability="9.0", sm_count=132,
                  l2_bytes=50 * 2**20, memory_bytes=85_520_809_984, driver="560.35.03", cuda="12.6",
                  torch="2.6.0", triton="3.2.0", normtune="0.1.0", git_revision="0123abcd-dirty", host="gpu-7",
                  python="3.11.9", interpret=False)
H200 = dataclasses.replace(H100, name="NVIDIA H200", key="h200", sm_count=132, memory_bytes=150_000_000_000)
INTERP = dataclasses.replace(H100, name="cpu (triton interpreter)", key="interpret", compute_capability=None,
                             sm_count=4, driver=None, cuda=None, git_revision=None, interpret=True)

RMS = Problem("rms_norm", 4096, 8192, "bf16", weight_dtype="fp32")
LN = Problem("layer_norm", 2**33, 1024, "fp16", zero_centered=True, save="output")
_K1 = kernel_1_config(block_row=2, block_col=8192, num_warps=16, num_stages=2, programs_per_sm=3,
                    eviction_policy="evict_first")
# Every on/off knob switched on, whichever kernel_1 has today, so that a new knob is round-tripped too.
CONFIG = BackwardConfig(dataclasses.replace(_K1, **{f.name: True for f in dataclasses.fields(_K1)
                                                   if f.type in (bool, "bool")}),
                        Kernel2Config(block_m=128, block_n=32, num_warps=8, num_stages=3, pdl=True))


def ok(median: float, **more) -> MeasureResult:
    values = dict(status="ok", median_us=median, p10_us=median * 0.98, p90_us=median * 1.03, reps=57,
                  kernel_1_us=median * 0.8, kernel_2_us=median * 0.2, compile_s=1.25, bytes_moved=3 * 2**33,
                  gbps=2789.5, floor_us=median * 0.7, floor_fraction=0.7, programs=264,
                  errors={"dx": 1.5e-3, "dw": 2.25e-4})
    return MeasureResult(**values | more)


# ---------------------------------------------------------------------------------------------- backends


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def url(request, tmp_path):
    with backend_database(request.param, tmp_path, "the storage suite") as db_url:
        yield db_url


@pytest.fixture
def store(url):
    with Store(url) as s:
        yield s


def _tables(url: str) -> set[str]:
    engine = create_engine(url)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


# ------------------------------------------------------------------------------------------------- runs


def test_run_round_trip_and_provenance(store):
    before = dt.datetime.now(dt.timezone.utc)
    run_id = store.start_run(H100, kind="sweep", command_line="normtune sweep --gpu h100", copy_bandwidth_gbps=2931.5)
    (run,) = store.runs()
    assert run.id == run_id and run.kind == "sweep" and run.status == "running" and run.ended_at is None
    assert run.device == H100  # every provenance field back as recorded
    assert (run.gpu_name, run.gpu_key, run.device.normtune) == (H100.name, "h100", "0.1.0")
    assert run.command_line == "normtune sweep --gpu h100" and run.copy_bandwidth_gbps == 2931.5
    assert before - dt.timedelta(seconds=1) <= run.started_at <= dt.datetime.now(dt.timezone.utc)

    store.end_run(run_id, "interrupted")
    (run,) = store.runs()
    assert run.status == "interrupted" and run.ended_at >= run.started_at


def test_runs_filters_and_latest(store):
    first = store.start_run(H100, kind="sweep", command_line="a")
    interp = store.start_run(INTERP, kind="sweep", command_line="b")
    bench = store.start_run(H200, kind="bench", command_line="c")
    last = store.start_run(H100, kind="sweep", command_line="d")
    assert [r.id for r in store.runs()] == [first, interp, bench, last]
    assert [r.id for r in store.runs(kind="sweep", gpu_key="h100")] == [first, last]
    assert store.runs(gpu_key="interpret")[0].device == INTERP
    assert store.latest_run("sweep").id == last
    assert store.latest_run("sweep", gpu_key="interpret").id == interp
    assert store.latest_run("emit") is None
    with pytest.raises(ValueError, match="'done' is not allowed: use one of 'running', 'finished'"):
        store.end_run(first, "done")
    with pytest.raises(StoreError, match="no run 999"):
        store.end_run(999)


# --------------------------------------------------------------------------------------------- problems


def test_problem_id_get_or_create(store):
    a = store.problem_id(RMS)
    assert store.problem_id(RMS) == a
    assert store.problem_id(LN) != a
    assert store.problem_id(RMS.with_shape(4096, 8192)) == a
    with Store(store.url) as other:  # another process's view: no cache, same id
        assert other.problem_id(RMS) == a
    assert store.problems() == []  # only problems with measurements are listed


# ----------------------------------------------------------------------------------------- measurements


def test_measurement_round_trip(store):
    run_id = store.start_run(H100, kind="sweep", command_line="x")
    result = ok(81.5, error=None)
    mid = store.add_measurement(run_id, LN, CONFIG, result, source="sweep", study_name="s", trial_number=7)
    (m,) = store.measurements()
    assert m.id == mid and m.run_id == run_id
    assert m.problem == LN and m.problem.M == 2**33
    assert m.config == CONFIG
    assert m.to_result() == result  # every figure back equal
    assert (m.source, m.study_name, m.trial_number, m.gpu_key, m.gpu_name) == ("sweep", "s", 7, "h100", H100.name)
    assert m.errors == {"dx": 1.5e-3, "dw": 2.25e-4} and m.created_at.tzinfo is not None
    assert store.problems() == [LN]

    failed = MeasureResult(status="compile_error", error="CompilationError: at 12:4\n" + "é" * 5000,
                           compile_s=None, interpret=True)
    half = BackwardConfig(dataclasses.replace(CONFIG.kernel_1, programs_per_sm=0.5), CONFIG.kernel_2)
    store.add_measurement(run_id, RMS, half, failed, source="seed")
    (m,) = store.measurements(status="compile_error")
    assert m.to_result() == failed and m.config == half and m.config.kernel_1.programs_per_sm == 0.5


def test_nan_figures_are_stored_as_missing(store):
    # floor_us is NaN without a copy bandwidth; SQLite cannot keep NaN, so no backend does.
    run_id = store.start_run(H100, kind="bench", command_line="x")
    store.add_measurement(run_id, RMS, CONFIG, ok(50.0, floor_us=float("nan"), floor_fraction=None), source="bench")
    assert store.measurements()[0].floor_us is None


def test_config_columns_cover_config_fields():
    """Indexed columns for the knobs every config has; unindexed ones for the frozen flat layout's (which the
    built-in strategies' JSON states); none for a knob of one strategy's own declared since."""
    columns = {c.name for c in MeasurementModel.__table__.columns}
    k1 = {c[3:] for c in columns if c.startswith("k1_")}
    k2 = {c[3:] for c in columns if c.startswith("k2_")}
    shared = {f.name for f in dataclasses.fields(Kernel1Config)} | {"strategy"}
    assert k1 == shared | set(FLAT_LAYOUT), "a shared knob has no k1_ column"
    assert k2 == {f.name for f in dataclasses.fields(Kernel2Config)}, "a Kernel2Config field has no k2_ column"
    assert set(CONFIG_COLUMNS.values()) == {f"k1_{n}" for n in k1} | {f"k2_{n}" for n in k2}
    assert {c for c in CONFIG_COLUMNS.values() if MeasurementModel.__table__.c[c].index} \
        == {f"k1_{n}" for n in shared} | {f"k2_{n}" for n in k2}
    assert {k.name for s in STRATEGIES.values() for k in s.knobs} <= set(FLAT_LAYOUT)


def test_config_columns_hold_the_config(store):
    run_id = store.start_run(H100, kind="sweep", command_line="x")
    mid = store.add_measurement(run_id, RMS, CONFIG, ok(80.0), source="sweep")
    with store.session_scope() as session:
        row = session.get(MeasurementModel, mid)
        for (kernel, name), column in CONFIG_COLUMNS.items():
            assert getattr(row, column) == CONFIG.to_dict()[kernel][name], column
        assert row.config_json == CONFIG.to_json() and len(row.config_hash) == 40
        # Queries by knob work on the columns.
        assert session.scalars(select(MeasurementModel.id).where(MeasurementModel.k2_pdl.is_(True),
                                                                 MeasurementModel.k1_block_col == 8192)).all() == [mid]
    assert [m.id for m in store.measurements(config=CONFIG)] == [mid]
    assert store.measurements(config=BackwardConfig()) == []


def test_status_is_an_enum(store):
    run_id = store.start_run(H100, kind="sweep", command_line="x")
    assert list(MeasurementModel.__table__.c.status.type.enums) == list(STATUSES)
    with pytest.raises(ValueError, match="status='crashed' is not allowed: use one of 'ok'"):
        store.add_measurement(run_id, RMS, CONFIG, MeasureResult(status="crashed"), source="sweep")
    with pytest.raises(ValueError, match="is not allowed"):
        store.add_peer_result(run_id, RMS, "quack", status="slow")
    mid = store.add_measurement(run_id, RMS, CONFIG, MeasureResult(status="timeout"), source="sweep")
    # The database itself refuses a state outside the enum (a CHECK constraint declared in the model).
    with pytest.raises(StoreIntegrityError):
        with store.session_scope() as session:
            session.execute(update(MeasurementModel).where(MeasurementModel.id == mid).values(status="crashed"))
    assert store.measurements()[0].status == "timeout"


def test_foreign_keys_are_enforced(store):
    with pytest.raises(StoreIntegrityError):
        store.add_measurement(12345, RMS, CONFIG, ok(1.0), source="sweep")
    assert store.count_measurements() == 0


def test_trial_is_stored_once(store):
    run_id = store.start_run(H100, kind="sweep", command_line="x")
    first = store.add_measurement(run_id, RMS, CONFIG, ok(80.0), source="sweep", study_name="s", trial_number=3)
    again = store.add_measurement(run_id, RMS, CONFIG, ok(99.0), source="sweep", study_name="s", trial_number=3)
    assert again == first and store.count_measurements() == 1
    assert store.measurements()[0].median_us == 80.0  # the first write stands
    other_study = store.add_measurement(run_id, RMS, CONFIG, ok(80.0), source="sweep", study_name="t",
                                        trial_number=3)
    assert other_study != first
    # Rows without a trial (NULL study/trial) never collide.
    seeds = {store.add_measurement(run_id, RMS, CONFIG, ok(80.0), source="seed") for _ in range(3)}
    assert len(seeds) == 3 and store.count_measurements() == 5
    assert store.count_measurements(study_name="s") == 1
    with pytest.raises(ValueError, match="study_name"):
        store.add_measurement(run_id, RMS, CONFIG, ok(1.0), source="sweep", trial_number=1)


def test_measurement_filters(store):
    h100 = store.start_run(H100, kind="sweep", command_line="x")
    h200 = store.start_run(H200, kind="sweep", command_line="y")
    interp = store.start_run(INTERP, kind="sweep", command_line="z")
    store.add_measurement(h100, RMS, CONFIG, ok(80.0), source="sweep")
    store.add_measurement(h100, LN, CONFIG, MeasureResult(status="incorrect", error="dx"), source="sweep")
    store.add_measurement(h200, RMS, CONFIG, ok(70.0), source="validate-table")
    store.add_measurement(interp, LN, CONFIG, ok(9000.0, interpret=True), source="sweep")

    def ids(**filters):
        found = [m.id for m in store.measurements(**filters)]
        assert store.count_measurements(**filters) == len(found)
        return len(found)

    assert ids() == 4
    assert ids(gpu_key="h100") == 2 and ids(gpu_key="h200") == 1
    assert ids(problem=RMS) == 2 and ids(family_key=LN.family.key) == 2
    assert ids(status="ok") == 3 and ids(status=("ok", "incorrect")) == 4
    assert ids(source="validate-table") == 1 and ids(interpret=True) == 1 and ids(run_id=h100) == 2
    assert ids(gpu_key="h100", problem=RMS, status="ok") == 1
    assert store.problems(gpu_key="h200") == [RMS]
    assert store.problems(interpret=True) == [LN]
    assert set(store.problems()) == {RMS, LN}


def test_best_ignores_failures_other_gpus_and_the_interpreter(store):
    h100 = store.start_run(H100, kind="sweep", command_line="x")
    h200 = store.start_run(H200, kind="sweep", command_line="y")
    interp = store.start_run(INTERP, kind="sweep", command_line="z")
    assert store.best(RMS, gpu_key="h100") is None
    slow = store.add_measurement(h100, RMS, CONFIG, ok(90.0), source="sweep")
    fast = store.add_measurement(h100, RMS, BackwardConfig(), ok(60.0), source="seed")
    # Faster figures that must not count: wrong results, failures, another GPU, another problem, the interpreter.
    store.add_measurement(h100, RMS, CONFIG, ok(10.0, status="incorrect", error="dx"), source="sweep")
    store.add_measurement(h100, RMS, CONFIG, MeasureResult(status="out_of_resources", error="smem"), source="sweep")
    store.add_measurement(h200, RMS, CONFIG, ok(20.0), source="sweep")
    store.add_measurement(h100, LN, CONFIG, ok(5.0), source="sweep")
    store.add_measurement(interp, RMS, CONFIG, ok(1.0, interpret=True), source="sweep")
    best = store.best(RMS, gpu_key="h100")
    assert best.id == fast and best.config == BackwardConfig() and best.median_us == 60.0
    assert store.best(RMS, gpu_key="h200").median_us == 20.0
    assert store.best(RMS, gpu_key="h100", interpret=True) is None
    assert store.best(RMS, gpu_key="interpret", interpret=True).median_us == 1.0
    assert slow != fast


# ------------------------------------------------------------------------------------------ peer results


def test_peer_result_round_trip(store):
    run_id = store.start_run(H100, kind="bench", command_line="normtune bench")
    other = store.start_run(H200, kind="bench", command_line="normtune bench")
    pid = store.add_peer_result(run_id, RMS, "quack", status="ok", median_us=84.0, p10_us=83.0, p90_us=86.5,
                                reps=100, kernels={"rmsnorm_bwd": 70.5, "reduce": 13.5},
                                note="quack needs fp32 weights")
    store.add_peer_result(run_id, LN, "liger", status="unavailable", error="No module named 'liger_kernel'")
    store.add_peer_result(other, RMS, "torch.compile", status="error", error="InductorError: ...")
    first, unavailable, _ = store.peer_results()
    assert (first.id, first.run_id, first.problem, first.peer, first.status) == (pid, run_id, RMS, "quack", "ok")
    assert (first.median_us, first.p10_us, first.p90_us, first.reps) == (84.0, 83.0, 86.5, 100)
    assert first.kernels == {"rmsnorm_bwd": 70.5, "reduce": 13.5} and first.note == "quack needs fp32 weights"
    assert first.error is None and (first.gpu_key, first.gpu_name) == ("h100", H100.name)
    assert unavailable.median_us is None and unavailable.kernels == {} and unavailable.reps == 0
    assert unavailable.error == "No module named 'liger_kernel'"
    assert [p.peer for p in store.peer_results(gpu_key="h200")] == ["torch.compile"]
    assert [p.peer for p in store.peer_results(run_id=run_id)] == ["quack", "liger"]
    assert [p.peer for p in store.peer_results(problem=RMS)] == ["quack", "torch.compile"]
    assert store.problems() == []  # peers alone do not make a problem "measured"


# ---------------------------------------------------------------------------------------------- concurrency


def _writer(url: str, barrier, worker: int, trials: list[int], queue) -> None:
    barrier.wait()  # both processes open the (fresh) database and write at the same moment
    with Store(url) as s:
        run_id = s.start_run(H100, kind="sweep", command_line=f"worker {worker}")
        ids = {}
        for i, t in enumerate(trials):
            problem = RMS.with_shape(1024 * (1 + i % 4), 4096)  # both create the same problems at once
            ids[t] = s.add_measurement(run_id, problem, CONFIG, ok(50.0 + t), source="sweep", study_name="shared",
                                       trial_number=t)
            s.add_measurement(run_id, problem, CONFIG, ok(60.0), source="seed")  # never deduplicated
        s.end_run(run_id)
    queue.put((worker, ids))


def test_concurrent_writers(url):
    ctx = multiprocessing.get_context("spawn")  # fresh interpreters, as separate sweep processes would be
    barrier, queue = ctx.Barrier(2), ctx.Queue()
    # Both start with trials 15..29, so they race on the same (study, trial) rows, then write their own.
    trials = {0: [*range(15, 30), *range(0, 15)], 1: [*range(15, 30), *range(30, 45)]}
    procs = [ctx.Process(target=_writer, args=(url, barrier, w, t, queue)) for w, t in trials.items()]
    for p in procs:
        p.start()
    results = dict(_collect(procs, queue))
    with Store(url) as s:
        stored = s.measurements(study_name="shared")
        assert sorted(m.trial_number for m in stored) == list(range(45))  # nothing lost, nothing twice
        by_trial = {m.trial_number: m.id for m in stored}
        for worker, ids in results.items():
            assert ids == {t: by_trial[t] for t in trials[worker]}  # a raced trial: both got the stored id
        assert s.count_measurements(source="seed") == 60
        assert len(s.problems()) == 4
        assert [r.status for r in s.runs()] == ["finished", "finished"]


def test_a_runs_costs_written_at_once_from_two_threads_keep_one_row(store):
    """The heartbeat thread and the run's end may both write a run's first costs row at the same moment."""
    for attempt in range(20):  # a fresh run each time: the race is on the row's first write
        run_id = store.start_run(H100, kind="sweep", command_line=f"race {attempt}")
        barrier, errors = threading.Barrier(2), []

        def write(phase: str) -> None:
            barrier.wait()
            try:
                store.workers.save_costs(run_id, {"phase": phase, "wall_s": 1.0})
            except Exception as err:  # noqa: BLE001 - the assertion below names it
                errors.append(err)

        threads = [threading.Thread(target=write, args=(phase,)) for phase in ("heartbeat", "end")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        store.workers.save_costs(run_id, {"phase": "last", "wall_s": 2.0})  # a later write replaces the row
        store.workers.beat(run_id, grace_s=60.0)
        (state,) = [w for w in store.workers.states() if w.run_id == run_id]
        assert state.costs == {"phase": "last", "wall_s": 2.0}


def _fork_child(s: Store, queue) -> None:
    queue.put(s.problem_id(LN))


def _collect(procs, queue, timeout_s: float = 120.0):
    """The items the processes put on `queue` (one each), failing fast when one of them dies instead of waiting
    out the timeout."""
    items, deadline = [], time.monotonic() + timeout_s
    while len(items) < len(procs):
        try:
            items.append(queue.get(timeout=0.5))
        except queue_module.Empty:
            codes = [p.exitcode for p in procs]
            assert not any(c not in (None, 0) for c in codes), f"a writer process failed (exit codes {codes})"
            assert time.monotonic() < deadline, "the writer processes timed out"
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return items


def test_store_inherited_through_fork_reconnects(tmp_path):
    s = Store(f"sqlite:///{tmp_path / 'results.db'}")
    s.problem_id(RMS)  # a pooled connection now exists in the parent
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_fork_child, args=(s, queue))
    child.start()
    (child_id,) = _collect([child], queue)
    assert s.problem_id(LN) == child_id
    s.close()


# ---------------------------------------------------------------------------------------- schema version


def _set_schema_version(url: str, value: str) -> None:
    with Store(url) as s, s.session_scope() as session:
        session.get(MetaModel, "schema_version").value = value


def _snapshot(url: str) -> object:
    """What "untouched" means: the file's bytes (SQLite), or every table's rows (PostgreSQL)."""
    u = make_url(url)
    if u.get_backend_name() == "sqlite":
        files = sorted(os.listdir(os.path.dirname(u.database)))
        with open(u.database, "rb") as f:
            return files, f.read()
    engine = create_engine(url)
    with engine.connect() as conn:
        snapshot = {t: sorted(map(tuple, conn.execute(text(f'SELECT * FROM "{t}"')))) for t in
                    sorted(inspect(conn).get_table_names())}
    engine.dispose()
    return snapshot


@pytest.mark.parametrize("found, advice", [("0", "release that wrote it"), (str(SCHEMA_VERSION + 1), "upgrade normtune")])
def test_schema_version_mismatch_leaves_the_database_untouched(url, found, advice):
    with Store(url) as s:
        run_id = s.start_run(H100, kind="sweep", command_line="x")
        s.add_measurement(run_id, RMS, CONFIG, ok(80.0), source="sweep")
    _set_schema_version(url, found)
    before = _snapshot(url)
    with pytest.raises(SchemaVersionError) as err:
        Store(url)
    message = str(err.value)
    assert f"database schema {found}, this normtune expects {SCHEMA_VERSION}" in message
    assert advice in message and "left unchanged" in message
    assert isinstance(err.value, StoreError)
    assert _snapshot(url) == before


def test_missing_column_is_refused(url):
    # A table layout older than this normtune's (a column added without bumping the schema): refused up front.
    with Store(url) as s:
        s.start_run(H100, kind="sweep", command_line="x")
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(text("ALTER TABLE normtune_measurements DROP COLUMN floor_fraction"))
    engine.dispose()
    before = _snapshot(url)
    with pytest.raises(SchemaVersionError, match="normtune_measurements.floor_fraction"):
        Store(url)
    assert _snapshot(url) == before


def test_a_missing_knob_column_is_added_by_a_writing_open(url):
    """A knob column is generated from the config layout: a database without it (written before the knob) gains
    it on a writing open, at the knob's default and indexed, with no schema version; a read-only open refuses
    to read it as it is and leaves it unchanged."""
    with Store(url) as s:
        run_id = s.start_run(H100, kind="sweep", command_line="x")
        s.add_measurement(run_id, RMS, CONFIG, ok(80.0), source="sweep")
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(text("DROP INDEX ix_normtune_measurements_k2_pdl"))
        conn.execute(text("ALTER TABLE normtune_measurements DROP COLUMN k2_pdl"))
    engine.dispose()
    before = _snapshot(url)
    with pytest.raises(SchemaVersionError, match="k2_pdl.*upgrades it in place"):
        Store(url, read_only=True)
    assert _snapshot(url) == before
    with Store(url) as s:
        assert s.schema_version == str(SCHEMA_VERSION)
        assert s.count_measurements(config=CONFIG) == 1
    engine = create_engine(url)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT DISTINCT k2_pdl FROM normtune_measurements")).all() == [(True,)]
        assert "ix_normtune_measurements_k2_pdl" in {i["name"] for i in inspect(conn).get_indexes(
            "normtune_measurements")}
    engine.dispose()


def test_old_sqlite_file_is_byte_identical_after_refusal(tmp_path):
    # A file another normtune wrote (rollback journal, not WAL): opening must not even switch its journal mode.
    path = tmp_path / "old.db"
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE normtune_meta (key VARCHAR(64) PRIMARY KEY, value VARCHAR(255) NOT NULL)")
    con.execute("INSERT INTO normtune_meta VALUES ('schema_version', '0')")
    con.execute("CREATE TABLE normtune_results (id INTEGER PRIMARY KEY, payload TEXT)")
    con.commit()
    con.close()
    before = path.read_bytes()
    with pytest.raises(SchemaVersionError, match=f"database schema 0, this normtune expects {SCHEMA_VERSION}"):
        Store(f"sqlite:///{path}")
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["old.db"]  # no -wal/-shm left behind either


def test_schema_version_is_recorded(store, url):
    with store.session_scope() as session:
        assert session.get(MetaModel, "schema_version").value == str(SCHEMA_VERSION)
    Store(url).close()  # reopening an up-to-date database is fine
    assert {"normtune_meta", "normtune_runs", "normtune_problems", "normtune_measurements",
            "normtune_peer_results"} <= _tables(url)


# -------------------------------------------------------------------------------------------------- optuna


def test_optuna_study_shares_the_database(url):
    optuna = pytest.importorskip("optuna")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    # Optuna first: a database with only Optuna's tables gets ours created beside them.
    study = optuna.create_study(storage=store_module.normalize_url(url), study_name="rms-bf16",
                                sampler=optuna.samplers.RandomSampler(seed=0))
    study.optimize(lambda trial: trial.suggest_int("block_row", 1, 8), n_trials=3)
    with Store(url) as s:
        run_id = s.start_run(H100, kind="sweep", command_line="normtune sweep")
        for trial in study.trials:
            s.add_measurement(run_id, RMS, CONFIG, ok(trial.value * 10.0), source="sweep",
                              study_name=study.study_name, trial_number=trial.number)
        # Then Optuna keeps working in a database that holds ours too.
        study = optuna.load_study(storage=s.optuna_storage(), study_name="rms-bf16",
                                  sampler=optuna.samplers.RandomSampler(seed=1))
        study.optimize(lambda trial: trial.suggest_int("block_row", 1, 8), n_trials=2)
        assert len(study.trials) == 5
        assert s.count_measurements(study_name="rms-bf16") == 3
    tables = _tables(url)
    assert {"studies", "trials", "normtune_runs", "normtune_measurements"} <= tables
    with Store(url) as s:
        assert s.count_measurements() == 3


def test_sqlite_settings(tmp_path):
    path = tmp_path / "results.db"
    with Store(str(path)) as s:  # a bare path means a SQLite file
        assert s.url == f"sqlite:///{path}"
        with s.session_scope() as session:
            assert session.execute(text("PRAGMA journal_mode")).scalar() == "wal"
            assert session.execute(text("PRAGMA foreign_keys")).scalar() == 1
            assert session.execute(text("PRAGMA busy_timeout")).scalar() == int(store_module.BUSY_TIMEOUT_S * 1000)
        # Optuna's storage is handed over by the store: same file, same busy timeout.
        storage = s.optuna_storage()
        assert storage.engine.url.database == str(path)
        with storage.engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == int(store_module.BUSY_TIMEOUT_S * 1000)
    normalize = store_module.normalize_url
    assert normalize("postgres://u@h/db") in ("postgresql://u@h/db", "postgresql+psycopg2://u@h/db")
    assert normalize("postgresql+psycopg://u@h/db") == "postgresql+psycopg://u@h/db"  # explicit driver kept


def test_the_store_imports_nothing_that_times():
    """Storage sits below measuring: opening results must not import the stopwatch (torch timing, L2 flush)."""
    import subprocess
    import sys

    timing = ("normtune.tuner.measure.harness", "normtune.tuner.measure.views", "normtune.tuner.measure.cases")
    code = ("import sys, normtune.tuner.store.database, normtune.tuner.store.models; "
            f"print([m for m in {timing!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
