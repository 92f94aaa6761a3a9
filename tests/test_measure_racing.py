"""A sweep's trial races its problem's best so far, and a measuring session keeps several problems' inputs.

A config whose first repetitions put it clearly beyond the best stops there; one within the margin gets every
repetition. The sweep worker sends each trial the best time it has collected for the trial's problem. The session
keeps the inputs and float64 reference of as many problems as fit its memory budget, so that a sweep's problems
taking turns trial by trial are not made anew for each trial.
"""

from __future__ import annotations

import dataclasses
import time

from normtune.kernels.config import Problem, default_config
from normtune.kernels.device import INTERPRET_SM_COUNT
from normtune.tuner.gpu_info import DeviceInfo, detect
from normtune.tuner.measure.cases import CaseCache, tensor_bytes
from normtune.tuner.measure.harness import MeasureResult, MeasureSession, Timing
from normtune.tuner.measure.stopwatch import time_kernels
from normtune.tuner.store.database import Store
from normtune.tuner.sweep import SweepOptions, driver

STEP_S = 0.002  # one repetition of the stand-in step, long enough to stand far above the timer's noise


def _step():
    time.sleep(STEP_S)


def test_a_race_stops_a_loser_after_its_first_repetitions_and_lets_a_contender_run():
    (lost,) = time_kernels([_step], flusher=None, split=False, warmup=0, min_reps=20,
                           stop_above_us=STEP_S * 1e6 / 4, stop_after=5)
    (kept,) = time_kernels([_step], flusher=None, split=False, warmup=0, min_reps=20,
                           stop_above_us=STEP_S * 1e6 * 50, stop_after=5)
    (unraced,) = time_kernels([_step], flusher=None, split=False, warmup=0, min_reps=20)
    assert (lost.count, kept.count, unraced.count) == (5, 20, 20)
    # The split run races on the whole sequence's time: two steps of 2 ms each lose against 3 ms.
    *_, total = time_kernels([_step, _step], flusher=None, split=True, warmup=0, min_reps=12,
                             stop_above_us=STEP_S * 1e6 * 1.5, stop_after=3)
    assert total.count == 3


def test_a_measurement_raced_against_a_far_better_time_stops_early_and_keeps_its_split():
    session = MeasureSession.for_device(detect(interpret=True))
    problem = Problem("rms_norm", 8, 96)
    config = default_config(problem)
    timing = Timing(warmup=0, min_reps=8, max_reps=8, budget_s=0.0, race_margin=1.10, race_after=2)
    full = session.measure(session.case(problem), config, timing=timing)
    raced = session.measure(session.case(problem), config, timing=timing, best_us=full.median_us / 100)
    assert full.status == raced.status == "ok"
    assert (full.reps, raced.reps) == (8, 2)
    assert raced.kernel_1_us is not None and raced.kernel_1_us > 0
    # A best within the margin of its own time does not stop it; neither does a preset without a margin.
    assert session.measure(session.case(problem), config, timing=timing, best_us=full.median_us * 10).reps == 8
    unraced = Timing(warmup=0, min_reps=8, max_reps=8, budget_s=0.0)
    assert session.measure(session.case(problem), config, timing=unraced, best_us=1e-9).reps == 8


PROBLEMS = [Problem("rms_norm", 40, 96, "bf16"), Problem("layer_norm", 24, 200, "bf16")]
INFO = DeviceInfo(name="cpu (triton interpreter)", key="interpret", compute_capability=None,
                  sm_count=INTERPRET_SM_COUNT, l2_bytes=0, memory_bytes=0, driver=None, cuda=None, torch="x",
                  triton="x", normtune="0", git_revision=None, host="test", python="3", interpret=True)


class RecordingMeasurer:
    """Answers at once with a time that depends on the trial's order; records the best each submission got."""

    log: list[tuple] = []

    def __init__(self, *args, **kwargs):
        self.phases = {}
        self._job = None

    def start(self):
        pass

    def submit(self, problem, config, best_us=None):
        n = len(RecordingMeasurer.log)
        RecordingMeasurer.log.append((problem, best_us))
        self._job = MeasureResult(status="ok", median_us=50.0 + (n * 37) % 29, reps=2, interpret=True) \
            if n % 5 != 3 else MeasureResult(status="incorrect", error="wrong", interpret=True)

    def ready(self):
        return True

    def collect(self, timeout_s):
        return self._job

    def interrupt(self):
        pass

    def close(self):
        pass


def test_each_trial_is_raced_against_the_best_its_worker_measured_for_its_problem(tmp_path, monkeypatch):
    monkeypatch.setattr(driver, "MeasuringProcess", RecordingMeasurer)
    RecordingMeasurer.log = []
    opts = SweepOptions(gpu_key="interpret", problems=PROBLEMS, trials=6, sampler="tpe", interpret=True,
                        compile_workers=0, heartbeat_interval=1, grace_period=5)
    with Store(f"sqlite:///{tmp_path / 'results.db'}") as store:
        driver.Sweep(opts, store, INFO).run()
    log = RecordingMeasurer.log
    assert len(log) == 12
    best: dict = {}
    for n, (problem, sent) in enumerate(log):
        assert sent == best.get(problem), (n, sent, best)  # the best of the problem's earlier ok results only
        if n % 5 != 3:
            best[problem] = min(best.get(problem, float("inf")), 50.0 + (n * 37) % 29)
    assert sum(sent is not None for _, sent in log) >= len(log) - len(PROBLEMS)  # all but each first trial


class _Held:
    def __init__(self, nbytes):
        import torch

        self.t = torch.empty(nbytes, dtype=torch.uint8)
        self.view = self.t[: nbytes // 2]  # the same storage, counted once


def test_the_case_cache_keeps_what_fits_passes_the_rest_and_drops_what_a_sweep_left():
    made = []

    def make(problem):
        made.append(problem)
        return _Held(1000), _Held(500)

    assert tensor_bytes(*make("p")) == 1500
    made.clear()
    cache = CaseCache(budget_bytes=3200, stale_s=30.0)
    a, b, c, d = "a", "b", "c", "d"
    for now, problem in enumerate([a, b, c, a, b, c, a]):  # c does not fit: passing, held until replaced
        cache.get(problem, make, now=float(now))
    assert made == [a, b, c] and len(cache) == 2 and cache.kept_bytes == 3000
    case, ref, was_made = cache.get(a, make, now=7.0)
    assert not was_made and isinstance(case, _Held)
    assert cache.get(c, make, now=8.0)[2] is False  # the one passing through serves every trial until replaced
    made.clear()
    cache.get(d, make, now=10.0)  # nothing stale: d passes in c's place, which is freed
    cache.get(c, make, now=11.0)
    assert made == [d, c]
    made.clear()
    cache.get(d, make, now=40.0)  # b unused since 4.0 and a since 7.0: both stale, d kept in their place
    assert made == [d] and len(cache) == 1 and cache.kept_bytes == 1500


def test_a_later_sweep_races_against_the_best_an_earlier_one_stored(tmp_path, monkeypatch):
    """Once a problem's first round ends, its best in the store (here an earlier sweep's, faster than anything
    this sweep measures) is what the rest of its trials race."""
    monkeypatch.setattr(driver, "MeasuringProcess", RecordingMeasurer)
    url = f"sqlite:///{tmp_path / 'results.db'}"
    problem = PROBLEMS[0]

    class Fast(RecordingMeasurer):
        def submit(self, problem, config, best_us=None):
            super().submit(problem, config, best_us)
            self._job = MeasureResult(status="ok", median_us=5.0, reps=2, interpret=True)

    monkeypatch.setattr(driver, "MeasuringProcess", Fast)
    opts = SweepOptions(gpu_key="interpret", problems=[problem], trials=4, sampler="random", interpret=True,
                        compile_workers=0, heartbeat_interval=1, grace_period=5)
    with Store(url) as store:
        driver.Sweep(opts, store, INFO).run()
    monkeypatch.setattr(driver, "MeasuringProcess", RecordingMeasurer)
    RecordingMeasurer.log = []
    with Store(url) as store:
        driver.Sweep(dataclasses.replace(opts, trials=16), store, INFO).run()
    sent = [best for _, best in RecordingMeasurer.log]
    assert len(sent) == 12 and sent[-1] == 5.0, sent  # the earlier sweep's 5 µs, below all of this sweep's 50+
