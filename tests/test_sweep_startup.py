"""A sweep's start-up: the measuring process starts before the command imports torch and opens the database,
the first trial is measured before the rest of the look-ahead is proposed, and the stored costs say when each
start-up step happened (no timings asserted: only what comes before what)."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys

from sweep_support import INTERPRETER_ONLY, instant_measuring_process, run_sweep, sweep_args, sweep_env

from normtune.tuner.sweep import timeline
from normtune.tuner.sweep.costs import line
from normtune.tuner.sweep.measuring import MeasuringProcess

pytestmark = INTERPRETER_ONLY


def test_the_sweep_modules_a_spawned_process_imports_first_import_neither_torch_nor_optuna():
    code = ("import sys; import normtune.tuner.sweep as S, normtune.tuner.sweep.measuring, "
            "normtune.tuner.sweep.compiling, normtune.tuner.sweep.device_workers, normtune.tuner.sweep.timeline; "
            "heavy = [m for m in ('torch', 'optuna', 'sqlalchemy', 'triton') if m in sys.modules]; "
            "assert not heavy, heavy; assert S.Sweep.__name__ == 'Sweep' and 'optuna' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_stored_timeline_shows_the_measuring_process_started_before_the_database_opened(tmp_path):
    url = f"sqlite:///{tmp_path / 'results.db'}"
    done = run_sweep(sweep_args(url, trials=2), sweep_env(tmp_path), tmp_path)
    assert done.returncode == 0, done.stderr
    (costs,) = [json.loads(c) for (c,) in sqlite3.connect(tmp_path / "results.db").execute(
        "SELECT costs_json FROM normtune_run_costs")]
    steps = costs["timeline"]
    order = sorted(steps, key=steps.get)  # stored as JSON with sorted keys: ordered by when they happened
    assert order.index("options") < order.index("measurer_spawned") < order.index("store_open") \
        < order.index("first_study") < order.index("first_sent") < order.index("first_result") \
        < order.index("first_stored"), steps
    assert "measurer_ready" in steps and all(v >= 0 for v in steps.values())
    assert "since the command started: options" in line(costs)
    assert "first stored" in " ".join(done.stderr.split())


def test_a_measuring_process_that_cannot_start_reports_it_as_the_trials_error_without_a_traceback(capfd):
    from normtune.kernels.config import Problem, default_config

    problem = Problem("rms_norm", 8, 64, "fp32")
    measurer = MeasuringProcess(0, False)  # a CUDA device on a host without one
    measurer.start()
    try:
        measurer.submit(problem, default_config(problem))
        result = measurer.collect(60)
    finally:
        measurer.close()
    assert result.status == "error" and result.error.startswith("the measuring process failed to start: ")
    assert "Traceback" not in capfd.readouterr().err


def test_marks_count_from_the_command_start_recorded_for_spawned_processes(monkeypatch):
    monkeypatch.setenv(timeline.ENV, "1000.0")
    monkeypatch.setattr(timeline, "_marks", {})
    timeline.mark("b", at=1002.5)
    timeline.mark("a", at=1001.0)
    timeline.mark("a", at=1003.0)  # only the first time counts
    assert timeline.marks() == {"a": 1.0, "b": 2.5}
    assert timeline.start_command() != 1000.0  # a command counts from its own start, not an inherited one


def test_the_first_trial_is_measured_before_the_trials_after_it_are_proposed(tmp_path, monkeypatch):
    from normtune.kernels.config import Problem
    from normtune.tuner.measure.harness import MeasureResult
    from normtune.tuner.store.database import Store
    from normtune.tuner.sweep import SweepOptions, driver

    from test_sweep_costs import INFO

    held_at_submit: list[int] = []


    monkeypatch.setattr(driver, "MeasuringProcess", instant_measuring_process(
        lambda problem, config: held_at_submit.append(len(sweeps[0].pending.running))))
    opts = SweepOptions(gpu_key="interpret", problems=[Problem("rms_norm", 40, 96, "bf16")], trials=4,
                        sampler="random", interpret=True, compile_workers=0, lookahead=6)
    with Store(f"sqlite:///{tmp_path / 'results.db'}") as store:
        sweeps = [driver.Sweep(opts, store, INFO)]
        sweeps[0].run()
    assert held_at_submit[0] == 1 and len(held_at_submit) == 4, held_at_submit


def test_a_sweep_ends_its_measuring_process_without_waiting_for_its_teardown():
    import signal

    from normtune.kernels.config import Problem, default_config

    problem = Problem("rms_norm", 8, 64, "fp32")
    measurer = MeasuringProcess(0, True)
    measurer.start()
    proc = measurer._proc
    assert measurer.measure(problem, default_config(problem), 120).status == "ok"
    measurer.close()
    assert proc.exitcode == -signal.SIGKILL and measurer._proc is None


def _busy_job(started: str) -> None:
    import pathlib
    import time

    pathlib.Path(started).touch()
    time.sleep(60)


def test_stopping_a_compile_pool_kills_its_busy_processes_so_a_second_stop_does_not_wait(tmp_path):
    """A pool's processes in the middle of a compile are killed, not left to finish it: the pool's thread would
    wait for them holding the lock that the command's own stop (after the sweep's) waits on."""
    import multiprocessing as mp
    import time
    from concurrent.futures import ProcessPoolExecutor

    from normtune.tuner.sweep.compiling import stop_pool

    pool = ProcessPoolExecutor(1, mp_context=mp.get_context("spawn"))
    started = tmp_path / "started"
    pool.submit(_busy_job, str(started))
    deadline = time.monotonic() + 120
    while not started.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert started.exists()
    (proc,) = pool._processes.values()
    t = time.monotonic()
    stop_pool(pool)  # the sweep's
    stop_pool(pool)  # the command's, once the sweep is done
    assert time.monotonic() - t < 30, "the second stop waited for the job"
    # The process is gone or a zombie: the pool's own thread may reap it at the same time as a join here, which
    # can leave this Process object without its exit status, so the check asks the system rather than the object.
    deadline = time.monotonic() + 30
    while not _ended(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _ended(proc.pid)


def _ended(pid: int) -> bool:
    """Whether process `pid` has ended: gone, or a zombie waiting to be reaped."""
    import os

    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True
    except OSError:  # no /proc: ask the process table
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False


def test_a_slow_compile_does_not_hold_up_the_compiled_trials_behind_it(tmp_path, monkeypatch):
    import threading
    from concurrent.futures import Future, InvalidStateError

    from normtune.kernels.config import BackwardConfig, Problem
    from normtune.tuner.store.database import Store
    from normtune.tuner.sweep import SweepOptions, driver

    from test_sweep_costs import INFO

    created: list[str] = []
    measured: list[str] = []

    slow: Future = Future()

    def finish_slow() -> None:
        try:
            slow.set_result(("ok", 3.0, None))
        except InvalidStateError:  # finished already
            pass

    fallback = threading.Timer(30.0, finish_slow)
    fallback.daemon = True

    class Pool:
        """The first config's compile ends once the three others are measured (or after a long while, where a
        regression holds them up behind it); the others are compiled at once."""

        def submit(self, fn, problem, config_json, sms):
            created.append(config_json)
            if len(created) == 1:
                fallback.start()
                return slow
            future = Future()
            future.set_result(("ok", 0.1, None))
            return future

        def shutdown(self, wait=False, cancel_futures=True):
            pass

    def on_measure(problem, config) -> None:
        measured.append(config.to_json())
        if len(measured) == 3:
            finish_slow()

    opts = SweepOptions(gpu_key="interpret", problems=[Problem("rms_norm", 40, 96, "bf16")], trials=4,
                        sampler="random", interpret=True, compile_workers=0)
    with Store(f"sqlite:///{tmp_path / 'results.db'}") as store:
        measurer = instant_measuring_process(on_measure, busy_s=0.3)
        driver.Sweep(opts, store, INFO, helpers=(measurer(), Pool())).run()
    fallback.cancel()
    assert sorted(measured) == sorted(created) and len(measured) == 4
    assert measured[0] != created[0] and measured[-1] == created[0], (created, measured)
    assert all(BackwardConfig.from_json(c) for c in measured)


def test_a_second_sweep_in_one_process_records_its_own_steps(tmp_path, monkeypatch):
    import time

    from normtune.kernels.config import Problem
    from normtune.tuner.store.database import Store
    from normtune.tuner.sweep import SweepOptions, driver

    from test_sweep_costs import INFO


    monkeypatch.setattr(driver, "MeasuringProcess", instant_measuring_process())
    steps = []
    for name in ("a", "b"):
        opts = SweepOptions(gpu_key="interpret", problems=[Problem("rms_norm", 40, 96, "bf16")], trials=2,
                            sampler="random", interpret=True, compile_workers=0)
        with Store(f"sqlite:///{tmp_path / name}.db") as store:
            steps.append(driver.Sweep(opts, store, INFO).run().costs["timeline"])
        time.sleep(0.2)
    assert steps[1]["first_sent"] > steps[0]["first_stored"], steps
