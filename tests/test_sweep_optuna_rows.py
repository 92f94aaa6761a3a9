"""The sweep's own writes of Optuna's rows (`optuna_rows`, the one module that reaches Optuna's storage internals): the
same rows Optuna's public calls write and Optuna reads back as its own (checked against the installed Optuna,
within the range pyproject.toml pins), fewer statements and
transactions, and what is written together is committed together (a trial and the slot it fills; a measurement
and its trial's tell)."""

from __future__ import annotations

import optuna
import pytest
from optuna.distributions import CategoricalDistribution, IntDistribution
from optuna.trial import TrialState as TS
from sqlalchemy import event, text
from sweep_support import instant_measuring_process

from normtune.kernels.config import Problem, default_config
from normtune.tuner.measure.harness import MeasureResult
from normtune.tuner.store.database import Store
from normtune.tuner.sweep.optuna_rows import create_running_trial, finish_trial_in

DISTRIBUTIONS = {"k1.num_warps": CategoricalDistribution([1, 2, 4, 8]), "k1.block_row": IntDistribution(1, 16)}


def _template():
    return optuna.trial.create_trial(state=TS.RUNNING, params={"k1.num_warps": 4, "k1.block_row": 3},
                                     distributions=DISTRIBUTIONS, system_attrs={"proposal": {"a": 1}},
                                     user_attrs={"origin": "seed"})


@pytest.fixture()
def store(tmp_path):
    with Store(f"sqlite:///{tmp_path / 'results.db'}") as s:
        yield s


@pytest.fixture(params=["sqlite", "postgresql"])
def any_store(request, tmp_path):
    """A store on SQLite, and on the test PostgreSQL server where one runs (`tests/postgres.sh`)."""
    import os

    from pg_support import POSTGRES_ENV, fresh_database

    if request.param == "sqlite":
        with Store(f"sqlite:///{tmp_path / 'results.db'}") as s:
            yield s
        return
    if not os.environ.get(POSTGRES_ENV):
        pytest.skip(f"{POSTGRES_ENV} is not set: run `eval \"$(bash tests/postgres.sh)\"` for the PostgreSQL case")
    with fresh_database(os.environ[POSTGRES_ENV]) as url, Store(url) as s:
        yield s


def test_a_trial_written_by_the_sweep_has_the_rows_optunas_public_calls_write(store):
    storage = store.optuna_storage()
    study = optuna.create_study(study_name="rows", storage=storage)
    ours, _, _ = create_running_trial(storage, study._study_id, _template())
    with store.session_scope() as session:
        assert finish_trial_in(session, storage, ours, TS.COMPLETE, 12.5, {"status": "ok", "config": "{}"})
    public = storage.create_new_trial(study._study_id, template_trial=_template())
    storage.record_heartbeat(public)
    for key, value in {"status": "ok", "config": "{}"}.items():
        storage.set_trial_user_attr(public, key, value)
    study.tell(storage.get_trial_number_from_id(public), 12.5)
    a, b = storage.get_trial(ours), storage.get_trial(public)
    assert (a.params, a.distributions, a.user_attrs, a.system_attrs, a.values, a.state) == \
        (b.params, b.distributions, b.user_attrs, b.system_attrs, b.values, b.state)
    assert (a.number, b.number) == (0, 1)
    with store.session_scope() as session:
        beats = session.execute(text("SELECT trial_id FROM trial_heartbeats ORDER BY trial_id")).scalars().all()
    assert beats == [ours, public]


def test_a_finished_trial_is_left_as_it_is(store):
    storage = store.optuna_storage()
    study = optuna.create_study(study_name="rows", storage=storage)
    trial_id, number, _ = create_running_trial(storage, study._study_id, _template())
    storage.set_trial_state_values(trial_id, state=TS.FAIL)  # failed as stale meanwhile
    with store.session_scope() as session:
        assert finish_trial_in(session, storage, trial_id, TS.COMPLETE, 1.0, {"status": "ok"}) is False
    assert storage.get_trial(trial_id).state == TS.FAIL and "status" not in storage.get_trial(trial_id).user_attrs


def test_a_trial_and_what_its_creation_writes_after_it_are_one_transaction(store):
    storage = store.optuna_storage()
    study = optuna.create_study(study_name="rows", storage=storage)

    def failing(session, number):
        session.execute(text("UPDATE studies SET study_name = 'renamed'"))
        raise RuntimeError("stop")

    with pytest.raises(RuntimeError):
        create_running_trial(storage, study._study_id, _template(), after=failing)
    assert storage.get_all_trials(study._study_id) == [] and optuna.get_all_study_names(storage) == ["rows"]


def test_a_measurement_and_what_is_written_with_it_are_one_transaction(store):
    from normtune.tuner.gpu_info import detect

    problem = Problem("rms_norm", 8, 64, "bf16")
    run_id = store.start_run(detect(interpret=True), kind="sweep", command_line="normtune sweep")
    result = MeasureResult(status="ok", median_us=3.0, reps=2, interpret=True)

    def failing(session):
        raise RuntimeError("stop")

    with pytest.raises(RuntimeError):
        store.add_measurement(run_id, problem, default_config(problem), result, source="seed", also=failing)
    assert store.measurements() == []
    written = []
    store.add_measurement(run_id, problem, default_config(problem), result, source="seed", also=written.append)
    assert len(store.measurements()) == 1 and len(written) == 1


def test_a_sweep_trial_takes_fewer_transactions(tmp_path, monkeypatch):
    """Two transactions a trial: its slot's claim with its creation, its measurement with its tell (and the slot's
    mark); the study's opening and summaries add a few per study."""
    from test_sweep_costs import INFO

    from normtune.tuner.sweep import SweepOptions, driver


    monkeypatch.setattr(driver, "MeasuringProcess", instant_measuring_process())
    opts = SweepOptions(gpu_key="interpret", problems=[Problem("rms_norm", 40, 96, "bf16")], trials=30,
                        sampler="random", interpret=True, compile_workers=0)
    with Store(f"sqlite:///{tmp_path / 'results.db'}") as s:
        sweep = driver.Sweep(opts, s, INFO)
        commits = []
        for engine in (s._engine, sweep.storage.engine):
            event.listen(engine, "commit", lambda conn: commits.append(1))
        sweep.run()
    # 7 a trial when each write was its own transaction, 4.4 when the claim was apart from the creation
    assert len(commits) / 30 < 3.5, len(commits) / 30


def _supported_range() -> str:
    """The optuna requirement of pyproject.toml's tune extra (the versions these rows were checked against)."""
    import re
    import tomllib
    from pathlib import Path

    data = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    (spec,) = [r for r in data["project"]["optional-dependencies"]["tune"] if re.match(r"optuna\b", r)]
    return spec


def test_the_installed_optuna_is_a_supported_one_and_reads_the_rows_written_here_as_its_own(any_store):
    """Trials written here in every state the sweep leaves them in, read back with Optuna's public API: a study
    loaded afresh, its best trial, its dataframe, the next number Optuna gives, and its stale-trial check."""
    from packaging.specifiers import SpecifierSet

    from normtune.tuner.sweep import optuna_rows

    spec = _supported_range()
    assert optuna.__version__ in SpecifierSet(spec.removeprefix("optuna")), (optuna.__version__, spec)
    assert optuna_rows.SUPPORTED, f"optuna {optuna.__version__}: its RDB rows are not the layout optuna_rows writes"
    storage = optuna.storages.RDBStorage(any_store.url, heartbeat_interval=1, grace_period=2)
    study = optuna.create_study(study_name="rows", storage=storage)
    sid = optuna_rows.study_id(study)
    ends = [(TS.COMPLETE, 12.5), (TS.FAIL, None), (TS.PRUNED, None), (TS.COMPLETE, 3.25), (TS.COMPLETE, float("inf"))]
    ids = [create_running_trial(storage, sid, _template())[0] for _ in ends]
    for tid, (state, value) in zip(ids, ends):
        with any_store.session_scope() as session:
            assert finish_trial_in(session, storage, tid, state, value, {"status": state.name.lower()})
    running, number, _ = create_running_trial(storage, sid, _template())
    assert number == len(ends)
    loaded = optuna.load_study(study_name="rows", storage=any_store.url)
    trials = loaded.get_trials()
    assert [t.number for t in trials] == list(range(len(ends) + 1))
    assert [(t.state, t.value) for t in trials[:-1]] == [(s, v) for s, v in ends]
    assert trials[-1].state == TS.RUNNING and trials[-1].datetime_start is not None
    for t in trials:
        assert t.params == {"k1.num_warps": 4, "k1.block_row": 3} and t.distributions == DISTRIBUTIONS
        assert t.system_attrs == {"proposal": {"a": 1}} and t.user_attrs["origin"] == "seed"
    assert [t.user_attrs["status"] for t in trials[:-1]] == [s.name.lower() for s, _ in ends]
    assert trials[0].datetime_complete >= trials[0].datetime_start
    assert loaded.best_trial.number == 3 and loaded.best_value == 3.25
    optuna_rows.describe_study(storage, study, {"seeded": False, "problem": {"M": 8}}, ["first µs"])
    optuna_rows.describe_study(storage, study, {"seeded": True}, ["backward µs"])  # replaces what it set
    again = optuna.load_study(study_name="rows", storage=any_store.url)
    assert again.user_attrs == {"seeded": True, "problem": {"M": 8}} and again.metric_names == ["backward µs"]
    frame = loaded.trials_dataframe()
    assert list(frame["number"]) == list(range(len(ends) + 1)) and frame["params_k1.num_warps"].tolist() == [4] * 6
    assert loaded.ask().number == len(ends) + 1  # Optuna numbers its own trials after ours
    assert optuna_rows.trials_with_heartbeats(storage, ids + [running]) == set(ids + [running])
    # Optuna's own stale check sees the first beat written here (on the database's clock).
    import time

    time.sleep(3)
    optuna.storages.fail_stale_trials(optuna.load_study(study_name="rows", storage=storage))
    assert storage.get_trial(running).state == TS.FAIL



def test_a_trial_created_while_another_writer_holds_the_lock_is_numbered_after_that_writers_trial(store):
    """The number is the study's count of trials read under the lock of the insert: a trial created while another
    connection is inserting one (and holds SQLite's write lock) gets the number after it, never the same one."""
    import sqlite3
    import threading
    import time

    storage = store.optuna_storage()
    study = optuna.create_study(study_name="rows", storage=storage)
    holder = sqlite3.connect(store.url.removeprefix("sqlite:///"), timeout=60, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    holder.execute("INSERT INTO trials (number, study_id, state, datetime_start) VALUES (0, ?, 'RUNNING', "
                   "CURRENT_TIMESTAMP)", (study._study_id,))
    created = []
    thread = threading.Thread(target=lambda: created.append(create_running_trial(storage, study._study_id,
                                                                                 _template())))
    thread.start()
    time.sleep(1.0)  # the creation waits for the lock
    holder.execute("COMMIT")
    holder.close()
    thread.join(60)
    assert created and created[0][1] == 1, created
    assert sorted(t.number for t in optuna.load_study(study_name="rows", storage=store.url).get_trials()) == [0, 1]


def test_a_distributions_json_is_optunas_own_for_fresh_equal_distributions():
    """The rows' distribution_json is Optuna's serialization, also when looked up by choices for a fresh object."""
    from optuna.distributions import CategoricalDistribution, IntDistribution, distribution_to_json

    from normtune.tuner.sweep.optuna_rows import _distribution_json

    for make in (lambda: CategoricalDistribution([1, 2, 4]), lambda: CategoricalDistribution(["a", None, True]),
                 lambda: CategoricalDistribution([1.5, 2]), lambda: IntDistribution(1, 8)):
        first, again = make(), make()
        assert _distribution_json(first) == distribution_to_json(first)
        assert _distribution_json(again) == distribution_to_json(again)
    assert _distribution_json(CategoricalDistribution([1, 2])) != _distribution_json(CategoricalDistribution([2, 1]))
    assert _distribution_json(CategoricalDistribution([1])) != _distribution_json(CategoricalDistribution([True]))
