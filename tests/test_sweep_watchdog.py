"""A sweep whose thread blocks past its time budget and its trial timeout is ended by its guard
(`sweep/watchdog.py`): it returns as a sweep at its time budget does, with what it stored kept and its run closed,
so that the command calling it (`tune`) goes on. In-process sweeps with a stand-in measuring process."""

from __future__ import annotations

import threading
import time

from sweep_support import instant_measuring_process
from test_sweep_costs import INFO

from normtune.kernels.config import Problem
from normtune.tuner.store.database import Store
from normtune.tuner.sweep import SweepOptions, driver, study_name
from normtune.tuner.sweep import proposer as P
from normtune.tuner.sweep import watchdog

PROBLEMS = [Problem("rms_norm", 40, 96, "bf16"), Problem("layer_norm", 24, 200, "bf16")]


class HangingProposer(P.Proposer):
    """A proposer that never answers its first request: the worker's thread blocks in it for good."""

    def take(self, book):
        threading.Event().wait()


def test_a_sweep_blocked_past_its_budget_ends_with_what_it_stored(tmp_path, monkeypatch):
    monkeypatch.setattr(driver, "MeasuringProcess", instant_measuring_process())
    monkeypatch.setattr(driver, "Proposer", HangingProposer)
    monkeypatch.setattr(watchdog, "OVERRUN_S", 1.0)
    opts = SweepOptions(gpu_key="interpret", problems=PROBLEMS, trials=30, interpret=True, compile_workers=0,
                        propose_ahead=True, time_budget_s=2.0, trial_timeout_s=1.0)
    url = f"sqlite:///{tmp_path / 'results.db'}"
    started = time.monotonic()
    with Store(url) as store:
        summary = driver.Sweep(opts, store, INFO).run()
        assert time.monotonic() - started < 60
        assert summary.stopped == "time budget"
        stored = sum(len(store.measurements(study_name=study_name("interpret", p, True))) for p in PROBLEMS)
        assert stored >= 1  # the seeds measured before the sampler's first proposal blocked
    import sqlite3

    with sqlite3.connect(tmp_path / "results.db") as con:
        assert con.execute("select status, ended_at is not null from normtune_runs").fetchall() == [("finished", 1)]


def test_without_a_time_budget_or_off_the_main_thread_there_is_no_guard(monkeypatch):
    from types import SimpleNamespace

    monkeypatch.setattr(watchdog, "OVERRUN_S", 0.1)
    summary = SimpleNamespace(stopped=None)
    with watchdog.overrun_guard(None, 0.1, summary):
        time.sleep(0.5)
    left = []

    def off_main():
        with watchdog.overrun_guard(0.1, 0.1, summary):
            time.sleep(0.5)
        left.append(True)

    thread = threading.Thread(target=off_main)
    thread.start()
    thread.join()
    assert left == [True] and summary.stopped is None
