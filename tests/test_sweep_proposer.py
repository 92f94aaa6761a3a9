"""TPE's proposals made ahead in the proposer process: they become the sweep's trials with the claims' guarantees
intact, a proposer that is gone or finds nothing leaves the worker proposing itself, and proposals not created
yet count as running trials for the next ones.

In-process sweeps with a stand-in measuring process (no kernels run) and a real proposer process.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time

import optuna
import pytest
from pg_support import backend_database
from sweep_support import check_studies, instant_measuring_process
from test_sweep_costs import INFO

from normtune.kernels.config import BackwardConfig, Problem, default_config
from normtune.kernels.device import INTERPRET_SM_COUNT
from normtune.tuner.space import Space
from normtune.tuner.store.database import Store
from normtune.tuner.sweep import SweepOptions, driver, study_name
from normtune.tuner.sweep import proposer as P
from normtune.tuner.sweep.sampling import Sampling, _OneRead

PROBLEMS = [Problem("rms_norm", 40, 96, "bf16"), Problem("layer_norm", 24, 200, "bf16")]
TS = optuna.trial.TrialState


class AnsweringProposer(P.Proposer):
    """A proposer whose process has started before the sweep's first proposal, so that the sweep's proposals
    after each study's first come from it whatever the machine's speed."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._start()
        deadline = time.monotonic() + 120
        while not self._answering and time.monotonic() < deadline:
            self._receive(1.0)
        assert self._answering, "the proposer process did not start"


def proposer_processes() -> list:
    return [p for p in mp.active_children() if p.name == "normtune-proposer"]


def sweep(tmp_path, monkeypatch, proposer_class, trials: int = 30, url: str | None = None):
    monkeypatch.setattr(driver, "MeasuringProcess", instant_measuring_process(busy_s=0.02))
    monkeypatch.setattr(driver, "Proposer", proposer_class)
    monkeypatch.setattr(P, "WAIT_S", 30.0)  # a loaded machine's proposal is waited for, not made twice
    opts = SweepOptions(gpu_key="interpret", problems=PROBLEMS, trials=trials, interpret=True, compile_workers=0,
                        propose_ahead=True)
    url = url or f"sqlite:///{tmp_path / 'results.db'}"
    with Store(url) as store:
        summary = driver.Sweep(opts, store, INFO).run()
    return url, opts, summary


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def database(request, tmp_path):
    with backend_database(request.param, tmp_path, "the proposer's sweep") as url:
        yield url


def test_proposals_made_ahead_become_the_trials_with_exact_counts_and_no_process_left(tmp_path, monkeypatch,
                                                                                       database):
    url, opts, summary = sweep(tmp_path, monkeypatch, AnsweringProposer, url=database)
    names = [study_name("interpret", p, True) for p in PROBLEMS]
    studies = check_studies(url, names, 30)
    proposals = summary.costs["proposals"]
    # Every sampled trial after each study's first came from the process (its first is the worker's own).
    assert proposals["ahead"] >= 1 and proposals["ahead"] == proposals["kept"] - len(PROBLEMS), proposals
    assert summary.costs["proposer_s"] > 0
    for problem, name in zip(PROBLEMS, names):
        space = Space(problem, INTERPRET_SM_COUNT)
        configs = [BackwardConfig.from_json(t.user_attrs["config"]) for t in studies[name]["trials"]
                   if t.state == TS.COMPLETE]
        assert len(configs) == 30 and all(space.why_not(c) is None for c in configs)
    assert proposer_processes() == []  # the sweep ended its proposer


class GoneProposer(AnsweringProposer):
    """A proposer whose process dies once it has started."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._proc.kill()
        self._proc.join()


def test_a_proposer_that_is_gone_leaves_the_worker_proposing_itself(tmp_path, monkeypatch):
    url, opts, summary = sweep(tmp_path, monkeypatch, GoneProposer)
    check_studies(url, [study_name("interpret", p, True) for p in PROBLEMS], 30)
    proposals = summary.costs["proposals"]
    assert proposals["ahead"] == 0 and proposals["kept"] > len(PROBLEMS), proposals


class FakeBook:
    def __init__(self, name: str):
        self.name, self.problem = name, PROBLEMS[0]
        self.space = Space(PROBLEMS[0], INTERPRET_SM_COUNT)
        self.opts = SweepOptions(gpu_key="interpret", problems=PROBLEMS, interpret=True)


def wired_proposer():
    """A `Proposer` talking to the test through a pipe in place of its process."""
    mine, theirs = mp.Pipe(duplex=True)
    prop = P.Proposer("sqlite://")
    prop._proc, prop._conn = mp.current_process(), mine  # any live process object: `_start` is not called
    return prop, theirs


def message(kind, name, pid=0, values=None, record=None, rejected=0, busy=0.0):
    return (kind, name, pid, values, record, rejected, busy)


def test_the_worker_asks_for_a_study_then_takes_took_and_drops_its_proposals():
    prop, other = wired_proposer()
    book = FakeBook("s")
    assert prop.take(book) is None  # the first proposal of a study is the worker's own; the process starts on it
    kind, name, spec, count = other.recv()
    assert (kind, name, count) == ("want", "s", P.AHEAD)
    assert Problem.from_dict(spec["problem"]) == book.problem and spec["sampler"] == "tpe"
    assert prop.take(book) is None  # the process is not answering yet: nothing is waited for
    other.send(message("ready", None))
    other.send(message("proposal", "s", 7, {"k1.strategy": "rows"}, {"params": {}}, rejected=3, busy=0.5))
    got = prop.take(book)
    assert (got.pid, got.values, got.rejected) == (7, {"k1.strategy": "rows"}, 3)
    prop.took(book, got)
    assert other.recv() == ("took", "s", 7)
    prop.done(book)
    assert other.recv() == ("drop", "s")
    other.send(message("proposal", "s", 8))  # made before the drop reached the process: not kept
    assert prop.take(book) is None and other.recv()[0] == "want"


def test_each_proposal_is_handed_to_the_hook_as_it_arrives_and_its_compile_is_taken_over_by_its_trial():
    """The driver hooks the compile-ahead to the proposer: a proposal's config compiles from its receipt, a turn
    of the worker's problems before its trial is created, and that trial takes the job over."""
    from test_sweep_compile_ahead import RecordingPool

    from normtune.tuner.sweep.compile_ahead import CompileAhead
    from normtune.tuner.sweep.costs import Costs

    book, costs, pool = FakeBook("s"), Costs(), RecordingPool(workers=2)
    ahead = CompileAhead(pool, INTERPRET_SM_COUNT, warm_jobs=2, costs=costs)
    received = []
    prop, other = wired_proposer()
    prop.on_proposal = lambda name, values: (received.append(name), ahead.proposed({"k": book})(name, values))
    config = book.space.canonical(default_config(book.problem, book.space.limits))
    values = book.space.params(config)
    assert prop.take(book) is None and other.recv()[0] == "want"
    other.send(message("ready", None))
    other.send(message("proposal", "s", 1, values, {"params": {}}))
    other.send(message("proposal", "other study", 2, values, {"params": {}}))  # not wanted: no compile
    got = prop.take(book)
    assert got.values == values and received == ["s"]
    assert pool.jobs == [(book.problem.key, config.to_json())]
    assert ahead.job(book.problem, config) is pool.futures[0] and costs.compiles == {"ahead": 1, "at_claim": 0}
    ahead.proposed({"k": book})("a study of another worker", values)  # no book of this worker: nothing compiles
    assert len(pool.jobs) == 1
    pool.shutdown()


def test_a_study_the_process_cannot_propose_for_is_proposed_by_the_worker_without_waiting():
    prop, other = wired_proposer()
    book = FakeBook("s")
    prop.take(book)
    other.recv()
    other.send(message("ready", None))
    other.send(message("own", "s", -1, rejected=500))  # e.g. nothing the space accepts came
    t = time.perf_counter()
    assert prop.take(book) is None and prop.take(book) is None
    assert time.perf_counter() - t < P.WAIT_S


def test_proposals_not_created_yet_count_as_running_trials_of_their_params(tmp_path):
    """The process's liars: each outstanding proposal is a RUNNING trial with its params, numbered apart from
    the study's trials and from the trial being proposed, and the sampler's view of the study holds them."""
    url = f"sqlite:///{tmp_path / 'results.db'}"
    with Store(url) as store:
        name = study_name("interpret", PROBLEMS[0], True)
        optuna.create_study(study_name=name, storage=store.optuna_storage())
        spec = P._spec(FakeBook(name))
        entry = P._Study(name, spec, store.optuna_storage())
        first = entry.propose()
        second = entry.propose()
        assert first[0] is not None and second[0] is not None
        entry.outstanding = {1: first[1], 2: second[1]}
        liars = entry.liars()
        assert [t.state for t in liars] == [TS.RUNNING, TS.RUNNING]
        assert [t.params for t in liars] == [first[1]["params"], second[1]["params"]]
        assert len({t.number for t in liars}) == 2 and all(t._trial_id < -1 for t in liars)
        view = _OneRead(entry.study, liars)
        assert [t.params for t in view.get_trials(states=(TS.RUNNING,))] == [t.params for t in liars]
        # The sampler proposes against that view: a proposal with liars is made as one without.
        values, record = Sampling("tpe", entry.space, 0).propose(entry.study, liars=liars)
        assert set(record["params"]) <= set(values)


def _stat(pid: int) -> list[str] | None:
    """A process's state and parent (and the rest of /proc/PID/stat after its name); None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _children(pid: int) -> list[int]:
    """The running processes whose parent is `pid`."""

    return [int(e) for e in os.listdir("/proc") if e.isdigit() and (s := _stat(int(e))) and int(s[1]) == pid
            and s[0] != "Z"]


def _running(pids: list[int]) -> list[int]:
    return [pid for pid in pids if (s := _stat(pid)) and s[0] != "Z"]


def _killed_worker(url: str) -> None:

    driver.MeasuringProcess = instant_measuring_process(busy_s=0.05)
    driver.Proposer = AnsweringProposer
    opts = SweepOptions(gpu_key="interpret", problems=PROBLEMS, trials=30, interpret=True, compile_workers=0,
                        propose_ahead=True, heartbeat_interval=1, grace_period=2)
    with Store(url) as store:
        driver.Sweep(opts, store, INFO).run()
    os._exit(0)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_worker_killed_while_its_proposer_runs_loses_nothing_and_leaves_no_proposer(tmp_path, monkeypatch):
    import signal
    import sqlite3

    url = f"sqlite:///{tmp_path / 'results.db'}"
    worker = mp.get_context("fork").Process(target=_killed_worker, args=(url,))
    worker.start()
    deadline = time.monotonic() + 120
    sampled = 0
    while sampled < 3 and time.monotonic() < deadline and worker.is_alive():  # its proposer is making trials
        time.sleep(0.2)
        try:
            sampled = sqlite3.connect(tmp_path / "results.db").execute(
                "SELECT COUNT(*) FROM normtune_measurements WHERE source = 'sweep'").fetchone()[0]
        except sqlite3.Error:
            pass
    assert sampled >= 3 and worker.is_alive(), "the worker did not reach its sampled trials"
    helpers = _children(worker.pid)
    assert helpers, "the worker's proposer process was not found"
    os.kill(worker.pid, signal.SIGKILL)
    worker.join(10)
    deadline = time.monotonic() + 10
    while _running(helpers) and time.monotonic() < deadline:  # they notice their parent is gone
        time.sleep(0.1)
    assert not _running(helpers), f"processes of the killed worker still running: {_running(helpers)}"
    time.sleep(2.5)  # past the grace period: the dead worker's slots are taken over
    sweep(tmp_path, monkeypatch, AnsweringProposer)
    check_studies(url, [study_name("interpret", p, True) for p in PROBLEMS], 30)


def test_a_study_the_process_cannot_open_is_left_to_the_worker(tmp_path):
    url = f"sqlite:///{tmp_path / 'results.db'}"
    with Store(url):
        pass
    prop = AnsweringProposer(url)
    try:
        book = FakeBook("no-such-study")
        assert prop.take(book) is None  # asked for; the process cannot load the study
        deadline = time.monotonic() + 60
        while book.name not in prop._own and time.monotonic() < deadline:
            prop._receive(0.5)
        assert book.name in prop._own and prop.take(book) is None
        assert prop._proc.is_alive()  # it goes on serving the other studies
    finally:
        prop.close()
    assert proposer_processes() == []
