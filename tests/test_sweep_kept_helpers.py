"""Sweeps run one after another with `KeptHelpers` (as `normtune tune` runs its rounds): one measuring process
serves them all, each sweep's trials are measured and stored as without it, an answer left uncollected makes the
next sweep start a fresh process, and closing the helpers leaves no process behind."""

from __future__ import annotations

import sqlite3

from sweep_support import INTERPRETER_ONLY

from normtune.kernels.config import Problem
from normtune.tuner.sweep import SweepOptions, run
from normtune.tuner.sweep.engine import KeptHelpers

pytestmark = INTERPRETER_ONLY

PROBLEM = Problem("rms_norm", 40, 96, "bf16")


def options(url: str, trials: int) -> SweepOptions:
    return SweepOptions(gpu_key="interpret", problems=[PROBLEM], trials=trials, sampler="random", interpret=True,
                        compile_workers=0, storage=url)


def test_sweeps_share_one_measuring_process_and_leave_it_to_its_owner(tmp_path):
    url = f"sqlite:///{tmp_path / 'results.db'}"
    with KeptHelpers(0, True, 0) as helpers:
        first = run(options(url, 2), helpers=helpers)
        measurer, _ = helpers.lend()
        pid = measurer._proc.pid
        assert measurer._proc.is_alive()  # the sweep left it running
        second = run(options(url, 4), helpers=helpers)
        assert helpers.lend()[0]._proc.pid == pid  # the same process measured the second sweep
        assert (first.problems[0].measured_now, second.problems[0].measured_now) == (2, 2)
        proc = measurer._proc
    proc.join(10)
    assert not proc.is_alive()  # closing the helpers ended it
    statuses = [s for (s,) in sqlite3.connect(tmp_path / "results.db").execute(
        "SELECT status FROM normtune_measurements")]
    assert statuses == ["ok"] * 4


def test_an_answer_left_uncollected_gets_the_next_sweep_a_fresh_process(tmp_path):
    from normtune.kernels.config import default_config

    with KeptHelpers(0, True, 0) as helpers:
        measurer, _ = helpers.lend()
        measurer.measure(PROBLEM, default_config(PROBLEM), 120)  # started and answered once: ready
        old = measurer._proc
        measurer.submit(PROBLEM, default_config(PROBLEM))  # a trial in flight that nobody collects
        old_answered = measurer._conn.poll(120)
        assert old_answered
        helpers.lend()
        assert not old.is_alive()  # replaced: its stale answer can't be taken for the next trial's
        result = run(options(f"sqlite:///{tmp_path / 'results.db'}", 2), helpers=helpers)
        assert result.problems[0].measured_now == 2


def test_a_sweep_with_its_own_timing_starts_its_own_measuring_process(tmp_path):
    """The kept measuring process times with the sweep preset: a sweep asking for other repetitions does not use
    it (nor starts it)."""
    import dataclasses

    from normtune.tuner.measure.harness import TIMING

    with KeptHelpers(0, True, 0) as helpers:
        opts = dataclasses.replace(options(f"sqlite:///{tmp_path / 'results.db'}", 2), timing=TIMING["bench"])
        assert run(opts, helpers=helpers).problems[0].measured_now == 2
        assert helpers._helpers is None
