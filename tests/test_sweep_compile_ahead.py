"""The seeds a sweep worker will claim are compiled ahead of their claims (`tuner/sweep/compile_ahead.py`).

In-process sweeps with stand-ins for the GPU side: a measuring process that answers after a fixed time and a
compile pool of threads that take a fixed time per job and record what they were given. No timing is asserted:
only which jobs were submitted, in which order, how many ran at once, and that the trials took them over.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures

import pytest

from sweep_support import check_studies

from normtune.kernels.config import BackwardConfig, Problem
from normtune.kernels.device import INTERPRET_SM_COUNT
from normtune.tuner.gpu_info import DeviceInfo
from normtune.tuner.measure.harness import MeasureResult
from normtune.tuner.store.database import Store
from normtune.tuner.sweep import SweepOptions, costs_line, driver, study_name
from normtune.tuner.sweep.compile_ahead import CompileAhead, seeds_in_claim_order
from normtune.tuner.sweep.compiling import COMPILERS_PER_GPU
from normtune.tuner.sweep.costs import Costs
from normtune.tuner.sweep.options import FIRST_ROUND
from normtune.tuner.sweep.trials import problem_space, seed_configs

PROBLEMS = [Problem("rms_norm", 40, 96, "bf16"), Problem("layer_norm", 24, 200, "bf16"),
            Problem("rms_norm", 64, 512, "fp32")]
INFO = DeviceInfo(name="cpu (triton interpreter)", key="interpret", compute_capability=None,
                  sm_count=INTERPRET_SM_COUNT, l2_bytes=0, memory_bytes=0, driver=None, cuda=None, torch="x",
                  triton="x", normtune="0", git_revision=None, host="test", python="3", interpret=True)
COMPILE_S, MEASURE_S = 0.05, 0.005


class RecordingPool:
    """A compile pool of `workers` threads: each job sleeps COMPILE_S; it records every job's (problem key,
    config JSON) in submission order and the most jobs that ran at once."""

    def __init__(self, workers: int = 12):
        self._threads = ThreadPoolExecutor(workers)
        self.jobs: list[tuple[str, str]] = []
        self.futures: list = []
        self.running = self.peak = 0
        self._lock = threading.Lock()

    def submit(self, fn, problem: dict, config_json: str, sms: int):
        self.jobs.append((Problem.from_dict(problem).key, config_json))
        self.futures.append(self._threads.submit(self._compile))
        return self.futures[-1]

    def _compile(self):
        with self._lock:
            self.running += 1
            self.peak = max(self.peak, self.running)
        time.sleep(COMPILE_S)
        with self._lock:
            self.running -= 1
        return "ok", COMPILE_S, None

    def shutdown(self, wait: bool = False, cancel_futures: bool = True) -> None:
        self._threads.shutdown(wait=False, cancel_futures=cancel_futures)


class QuickMeasurer:
    """A measuring process that answers MEASURE_S after each submit, recording what it measured."""

    measured: list[tuple[str, str]] = []

    def __init__(self, *args, **kwargs):
        self.phases = {"inputs": 0.0, "gate": 0.0, "timing": MEASURE_S}

    def start(self):
        pass

    def submit(self, problem, config, best_us=None):
        QuickMeasurer.measured.append((problem.key, config.to_json()))
        self._due = time.perf_counter() + MEASURE_S

    def ready(self):
        return time.perf_counter() >= self._due

    def collect(self, timeout_s):
        time.sleep(max(0.0, self._due - time.perf_counter()))
        return MeasureResult(status="ok", median_us=10.0 + len(QuickMeasurer.measured) % 5, reps=2, interpret=True)

    def interrupt(self):
        pass

    def close(self):
        pass


def _sweep(url: str, trials: int, pool: RecordingPool) -> driver.Sweep:
    QuickMeasurer.measured = []
    opts = SweepOptions(gpu_key="interpret", problems=PROBLEMS, trials=trials, sampler="tpe", interpret=True,
                        compile_workers=0, heartbeat_interval=1, grace_period=5)
    with Store(url) as store:
        sweep = driver.Sweep(opts, store, INFO, helpers=(QuickMeasurer(), pool))
        sweep.run()
    return sweep


def _seeds(problem: Problem) -> list[BackwardConfig]:
    opts = SweepOptions(gpu_key="interpret", problems=PROBLEMS)
    return seed_configs(opts, problem, problem_space(problem, INFO.sm_count, interpret=True))


def test_every_seed_is_compiled_once_ahead_of_its_claim_and_its_trial_takes_the_job_over(tmp_path):
    url = f"sqlite:///{tmp_path / 'results.db'}"
    trials = FIRST_ROUND + 4  # two rounds: the first FIRST_ROUND slots of every problem, then the rest
    assert all(len(_seeds(p)) >= trials for p in PROBLEMS)  # every slot of these problems gets a seed
    pool = RecordingPool(workers=24)
    sweep = _sweep(url, trials, pool)
    check_studies(url, [study_name("interpret", p, interpret=True) for p in PROBLEMS], trials)
    # Each trial's config was compiled exactly once, and every trial took a job compiled ahead over.
    assert len(pool.jobs) == len(set(pool.jobs)) == trials * len(PROBLEMS)
    assert sweep.costs.compiles == {"ahead": trials * len(PROBLEMS), "at_claim": 0}
    pool_s = trials * len(PROBLEMS) * COMPILE_S  # each job's seconds in the compile processes, as the job says
    assert sweep.costs.to_dict()["compile_jobs_s"] == pytest.approx(pool_s)
    assert (f"compiles: {trials * len(PROBLEMS)} ahead of their trial's claim, 0 at it, {pool_s:.1f} s in the "
            "compile processes") in costs_line(sweep.costs.to_dict())
    assert sorted(pool.jobs) == sorted(QuickMeasurer.measured)
    # Submitted in the order the worker claims its slots: round one over every problem, then round two.
    expected = [(p.key, s.to_json()) for low, high in ((0, FIRST_ROUND), (FIRST_ROUND, trials))
                for p in PROBLEMS for s in _seeds(p)[low:high]]
    assert pool.jobs == expected
    # The pool ran more compiles at once than the trials held ahead of the measurement (the lookahead).
    assert pool.peak > sweep.held_ahead and pool.peak <= COMPILERS_PER_GPU + sweep.held_ahead


def test_a_resumed_sweep_compiles_only_the_seeds_of_slots_not_claimed_yet(tmp_path):
    url = f"sqlite:///{tmp_path / 'results.db'}"
    _sweep(url, 5, RecordingPool())
    pool = RecordingPool()
    sweep = _sweep(url, 8, pool)
    check_studies(url, [study_name("interpret", p, interpret=True) for p in PROBLEMS], 8)
    assert pool.jobs == [(p.key, s.to_json()) for p in PROBLEMS for s in _seeds(p)[5:8]]
    assert sweep.costs.compiles == {"ahead": 3 * len(PROBLEMS), "at_claim": 0}


def test_without_a_pool_nothing_is_compiled_ahead_and_seeds_are_not_computed():
    ahead = CompileAhead(None, 132, 4)
    computed = []
    ahead.warm(seeds_in_claim_order(PROBLEMS, [4], lambda p: computed.append(p) or [], lambda p: set()))
    ahead.refill()
    assert ahead.job(PROBLEMS[0], _seeds(PROBLEMS[0])[0]) is None and computed == []


def test_a_config_that_is_not_a_seed_gets_a_job_of_its_own_and_claimed_slots_are_skipped():
    pool, costs = RecordingPool(workers=2), Costs()
    ahead = CompileAhead(pool, 132, warm_jobs=2, costs=costs)
    problem = PROBLEMS[0]
    seeds = _seeds(problem)[:4]
    ahead.warm(seeds_in_claim_order([problem], [4], lambda p: seeds, lambda p: {1}))  # slot 1 is claimed
    assert [config for _, config in pool.jobs] == [seeds[0].to_json(), seeds[2].to_json()]  # two at a time
    assert ahead.job(problem, seeds[0]) is not None and len(pool.jobs) == 2  # taken over, not submitted
    wait_futures(pool.futures)  # both seed compiles done: two more may start
    ahead.refill()
    assert [config for _, config in pool.jobs][2:] == [seeds[3].to_json()]
    ahead.job(problem, seeds[1])  # a slot another worker gave back: compiled now
    assert pool.jobs[-1] == (problem.key, seeds[1].to_json()) and costs.compiles == {"ahead": 1, "at_claim": 1}
    ahead.stop()
    pool.shutdown()


def test_seed_compiles_that_finish_while_the_worker_waits_on_a_trials_compile_are_replaced():
    """`wait_compiled` (a trial waiting for its own compile) refills the seed compiles while it waits."""
    from concurrent.futures import Future

    from normtune.tuner.sweep.compiling import wait_compiled

    pool = RecordingPool(workers=4)
    ahead = CompileAhead(pool, 132, warm_jobs=2)
    problem = PROBLEMS[0]
    seeds = _seeds(problem)[:6]
    ahead.warm(seeds_in_claim_order([problem], [6], lambda p: seeds, lambda p: set()))
    assert len(pool.jobs) == 2
    slow: Future = Future()
    threading.Timer(1.5, slow.set_result, args=(("ok", 1.0, None),)).start()
    assert wait_compiled(slow, timeout_s=30, abandoned=lambda: False, tick=ahead.refill) == ("ok", 1.0, None)
    assert len(pool.jobs) == 6  # every seed was submitted during the wait, two at a time
    ahead.stop()
    pool.shutdown()


def test_a_worker_holds_two_trials_per_compile_process_ahead_within_an_eighth_of_its_share():
    many = SweepOptions(gpu_key="h100", problems=PROBLEMS * 10, trials=60)  # 1800 slots
    assert many.held_ahead(14) == 28 and many.held_ahead(0) == 2  # no pool: nothing compiles ahead
    assert many.held_ahead(200) == 225  # an eighth of its share
    assert SweepOptions(gpu_key="h100", problems=PROBLEMS * 10, trials=60, workers=4).held_ahead(64) == 56
    few = SweepOptions(gpu_key="h100", problems=PROBLEMS[:2], trials=5)  # 10 slots: another worker gets some
    assert few.held_ahead(14) == 2
    assert SweepOptions(gpu_key="h100", problems=PROBLEMS, trials=5, lookahead=9).held_ahead(0) == 9


def test_a_study_whose_seeds_start_after_its_first_slots_gets_them_in_those_slots():
    """A study seeded under an older seed version gives its missing seeds to the slots from `seed_base` on: the
    slots before have no seed to compile ahead."""
    problem = PROBLEMS[0]
    seeds = _seeds(problem)[:3]
    walked = list(seeds_in_claim_order([problem], [5], lambda p: [None, None] + seeds, lambda p: {3}))
    assert walked == [(problem, seeds[0]), (problem, seeds[2])]  # slots 2 and 4 (slot 3 is claimed)


class AnsweringMeasurer(QuickMeasurer):
    """A measuring process that has started: it compiles a trial itself when the trial's job is not done. It
    records whether each trial's compile job was done when the trial came."""

    def __init__(self, pool, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pool, self.job_done_at_submit, self.held_at_submit = pool, [], []
        self.held = lambda: 0  # the trials the worker holds (created, not stored)

    def answering(self):
        return True

    def submit(self, problem, config, best_us=None):
        job = self.pool.jobs.index((problem.key, config.to_json()))
        self.job_done_at_submit.append(self.pool.futures[job].done())
        self.held_at_submit.append(self.held())
        self.pool.released.set()  # the first trial came without its compile: let that compile end
        super().submit(problem, config)


class StartingPool(RecordingPool):
    """A pool whose processes are still starting (their drivers) until the measuring process gets its first trial
    (or for 60 s): no job ends before that."""

    def __init__(self, workers: int = 12):
        super().__init__(workers)
        self.released = threading.Event()

    def _compile(self):
        self.released.wait(60)
        return super()._compile()


def test_the_first_trial_goes_to_a_started_measuring_process_without_waiting_for_its_compile(tmp_path):
    """The compile processes may still be starting when the measuring process is ready: the worker's first trial
    is then compiled by the measuring process, and the later ones still wait for their own compiles."""
    pool = StartingPool()
    measurer = AnsweringMeasurer(pool)
    QuickMeasurer.measured = []
    opts = SweepOptions(gpu_key="interpret", problems=PROBLEMS[:1], trials=6, sampler="tpe", interpret=True,
                        compile_workers=0)
    with Store(f"sqlite:///{tmp_path / 'results.db'}") as store:
        sweep = driver.Sweep(opts, store, INFO, helpers=(measurer, pool))
        measurer.held = lambda: len(sweep.pending.running)
        sweep.run()
    assert measurer.job_done_at_submit == [False] + [True] * 5
    # It goes as soon as it exists: the trials after it are claimed and proposed while it measures.
    assert measurer.held_at_submit[0] == 1, measurer.held_at_submit


def test_the_samplers_proposals_made_ahead_compile_from_their_receipt_and_their_trials_take_the_jobs_over(
        tmp_path, monkeypatch):
    from test_sweep_proposer import AnsweringProposer

    monkeypatch.setattr(driver, "Proposer", AnsweringProposer)
    QuickMeasurer.measured = []
    problem, extra = PROBLEMS[0], 8
    trials = len(_seeds(problem)) + extra  # past its seeds: the sampler's trials, proposed ahead
    pool = RecordingPool(workers=24)
    opts = SweepOptions(gpu_key="interpret", problems=[problem], trials=trials, sampler="tpe", interpret=True,
                        compile_workers=0, propose_ahead=True)
    url = f"sqlite:///{tmp_path / 'results.db'}"
    with Store(url) as store:
        sweep = driver.Sweep(opts, store, INFO, helpers=(QuickMeasurer(), pool))
        summary = sweep.run()
    check_studies(url, [study_name("interpret", problem, interpret=True)], trials)
    taken = summary.costs["proposals"]["ahead"]  # the first sampled trial is the worker's own proposal
    assert taken >= extra - 2, summary.costs["proposals"]
    # every seed and every proposal taken from the proposer compiled before its trial was created
    assert sweep.costs.compiles["ahead"] >= len(_seeds(problem)) + taken - 1, sweep.costs.compiles
    assert sorted(set(QuickMeasurer.measured)) == sorted(set(QuickMeasurer.measured) & set(pool.jobs))


def test_a_workers_space_has_the_limits_of_its_own_device_not_the_current_one(monkeypatch):
    """A worker of `--devices` sweeps its device (`opts.device`) without making it the process's current device:
    its space reads that device's limits."""
    import torch

    from normtune.kernels import device as kernel_device
    from normtune.kernels.limits import REFERENCE

    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kernel_device, "device_limits", lambda device: asked.append(device.index) or REFERENCE)
    space = problem_space(PROBLEMS[0], INFO.sm_count, interpret=False, device=1)
    assert asked == [1] and space.limits == REFERENCE
    assert problem_space(PROBLEMS[0], INFO.sm_count, interpret=True, device=1).limits is None and asked == [1]
