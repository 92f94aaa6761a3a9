"""The first seeds' compiles are submitted when the sweep starts, before the worker exists
(`compiling.submit_first_seeds`), and the worker takes them over (`CompileAhead.adopt`); once the compile
processes have started, the first trial waits for its compile instead of compiling it again in the measuring
process.

Stand-ins for the GPU side: thread pools that record their jobs, a measuring process that answers at once. No
timing is asserted.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from normtune.kernels.config import BackwardConfig, Problem
from normtune.kernels.device import INTERPRET_SM_COUNT
from normtune.tuner.gpu_info import DeviceInfo
from normtune.tuner.measure.harness import MeasureResult
from normtune.tuner.store.database import Store
from normtune.tuner.sweep import SweepOptions, compiling, driver, launcher
from normtune.tuner.sweep.compile_ahead import CompileAhead
from normtune.tuner.sweep.costs import Costs
from normtune.tuner.sweep.trials import problem_space, seed_configs

PROBLEM = Problem("rms_norm", 40, 96, "bf16")
INFO = DeviceInfo(name="cpu (triton interpreter)", key="interpret", compute_capability=None,
                  sm_count=INTERPRET_SM_COUNT, l2_bytes=0, memory_bytes=0, driver=None, cuda=None, torch="x",
                  triton="x", normtune="0", git_revision=None, host="test", python="3", interpret=True)


def _seeds(opts: SweepOptions, sms: int = INTERPRET_SM_COUNT, interpret: bool = True) -> list[BackwardConfig]:
    return seed_configs(opts, PROBLEM, problem_space(PROBLEM, sms, interpret=interpret))


class Pool:
    """A compile pool of threads that records its jobs ((function name, args) in submission order); its processes
    count as started when `started` (the attribute `compiling.compile_pool` gives its pools). Every job of a
    config takes COMPILE_S; `gate`, when set, holds every job until it is set."""

    COMPILE_S = 0.05

    def __init__(self, started: bool = True):
        self._threads = ThreadPoolExecutor(8)
        self.normtune_started = threading.Event()
        if started:
            self.normtune_started.set()
        self.jobs: list[tuple[str, tuple]] = []
        self.futures: list[Future] = []
        self.gate: threading.Event | None = None

    def submit(self, fn, *args):
        self.jobs.append((fn.__name__, args))
        self.futures.append(self._threads.submit(self._compile))
        return self.futures[-1]

    def _compile(self):
        if self.gate is not None:
            self.gate.wait(60)
        time.sleep(self.COMPILE_S)
        return "ok", self.COMPILE_S, None

    def shutdown(self, wait: bool = False, cancel_futures: bool = True) -> None:
        self._threads.shutdown(wait=False, cancel_futures=cancel_futures)


def test_the_first_seeds_are_submitted_in_slot_order_with_only_what_their_seeds_depend_on():
    opts = SweepOptions(gpu_key="auto", problems=[PROBLEM], seed_limit=5,
                        extra_seeds={PROBLEM.key: [], "other": [{"strategy": "rows"}]})
    pool = Pool()
    futures = compiling.submit_first_seeds(pool, opts, PROBLEM, 3)
    assert len(futures) == 3
    assert [name for name, _ in pool.jobs] == ["compile_seed"] * 4
    # The first seed's kernels compile in two processes at once: its first launch's, and the rest.
    assert [args[2:] for _, args in pool.jobs] == [(0, range(0, 1)), (0, range(1, 2**16)), (1,), (2,)]
    problem_dict, seeding = pool.jobs[0][1][:2]
    assert Problem.from_dict(problem_dict) == PROBLEM
    assert seeding == {"sampler": "tpe", "seeded": True, "seed_limit": 5, "extra_seeds": {PROBLEM.key: []}}


@pytest.mark.parametrize("case", ["grid sampler", "unseeded", "a pool that does not say it started", "no pool"])
def test_no_first_seeds_are_submitted_where_there_are_none_or_the_pool_takes_other_jobs(case):
    opts = SweepOptions(gpu_key="auto", problems=[PROBLEM], sampler="grid" if case == "grid sampler" else "tpe",
                        seeded=case != "unseeded")
    pool = Pool()
    if case == "a pool that does not say it started":
        del pool.normtune_started
    assert compiling.submit_first_seeds(None if case == "no pool" else pool, opts, PROBLEM, 3) == []
    assert pool.jobs == []


def test_a_compile_process_compiles_the_seed_the_worker_gives_that_slot(monkeypatch):
    """The seed is computed in the compile process from its own device's SM count: the same config the worker
    computes for that slot from the same options (both on the same device)."""
    import torch

    sms = 132
    compiled = []
    monkeypatch.setattr(compiling, "_usable", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: type("P", (), {"multi_processor_count": sms}))
    monkeypatch.setattr(compiling, "compile_one", lambda p, config_json, s, launches: compiled.append(
        (config_json, s)) or ("ok", 0.1, None))
    opts = SweepOptions(gpu_key="auto", problems=[PROBLEM], seed_limit=4)
    seeding = compiling.seeding_of(opts, PROBLEM)
    expected = _seeds(opts, sms, interpret=False)
    for index in range(len(expected)):
        assert compiling.compile_seed(PROBLEM.to_dict(), seeding, index) == ("ok", 0.1, None)
    assert compiled == [(c.to_json(), sms) for c in expected]
    assert compiling.compile_seed(PROBLEM.to_dict(), seeding, len(expected)) == ("ok", None, None)


def test_a_worker_takes_the_first_seeds_compiles_over_and_submits_only_the_rest():
    opts = SweepOptions(gpu_key="interpret", problems=[PROBLEM], interpret=True)
    seeds = _seeds(opts)
    pool, costs = Pool(), Costs()
    early = [pool.submit(compiling.compile_seed, PROBLEM.to_dict(), {}, i) for i in range(2)]
    ahead = CompileAhead(pool, INFO.sm_count, 3, costs)
    ahead.adopt(opts, INFO, (PROBLEM, early))
    ahead.warm((PROBLEM, s) for s in seeds)
    # Two adopted and unfinished: one more seed submitted to keep three going.
    assert [name for name, _ in pool.jobs] == ["compile_seed"] * 2 + ["compile_one"]
    assert pool.jobs[2][1][1] == seeds[2].to_json()
    assert ahead.job(PROBLEM, seeds[0]) is early[0] and ahead.job(PROBLEM, seeds[1]) is early[1]
    assert costs.compiles["ahead"] == 2


class Measurer:
    """A measuring process that has started; it records whether each trial's compile job had ended when the trial
    came, and lets the held compiles end once the first trial came (were it to be compiled here)."""

    def __init__(self, pool: Pool):
        self.pool, self.phases, self.done_at_submit = pool, {"timing": 0.001}, []

    def answering(self):
        return True

    def submit(self, problem, config):
        job = next(f for (name, args), f in zip(self.pool.jobs, self.pool.futures)
                   if name == "compile_one" and args[1] == config.to_json() or name == "compile_seed" and
                   _seeds(SweepOptions(gpu_key="interpret", problems=[PROBLEM]))[args[2]] == config)
        self.done_at_submit.append(job.done())
        self.pool.gate.set()

    def ready(self):
        return True

    def collect(self, timeout_s):
        return MeasureResult(status="ok", median_us=10.0 + len(self.done_at_submit) % 3, reps=2, interpret=True)

    def interrupt(self):
        pass

    def close(self):
        pass


def _sweep(tmp_path, pool: Pool, early: tuple | None) -> Measurer:
    measurer = Measurer(pool)
    opts = SweepOptions(gpu_key="interpret", problems=[PROBLEM], trials=4, sampler="tpe", interpret=True,
                        compile_workers=0)
    with Store(f"sqlite:///{tmp_path / 'results.db'}") as store:
        driver.Sweep(opts, store, INFO, helpers=(measurer, pool), early_compiles=early).run()
    return measurer


def test_once_the_compile_processes_have_started_the_first_trial_waits_for_its_compile(tmp_path):
    """Its compile is under way there: compiling it again in the measuring process would start over. (While they
    are still starting, it goes at once: tests/test_sweep_compile_ahead.py.)"""
    pool = Pool(started=True)
    pool.gate = threading.Event()
    threading.Timer(0.5, pool.gate.set).start()  # the compiles end on their own
    measurer = _sweep(tmp_path, pool, None)
    assert measurer.done_at_submit == [True] * 4


def test_a_sweep_handed_the_first_seeds_compiles_measures_them_without_compiling_them_again(tmp_path):
    pool = Pool()
    pool.gate = threading.Event()
    threading.Timer(0.2, pool.gate.set).start()
    early = (PROBLEM, [pool.submit(compiling.compile_seed, PROBLEM.to_dict(), {}, i) for i in range(2)])
    measurer = _sweep(tmp_path, pool, early)
    assert measurer.done_at_submit == [True] * 4
    seeds = _seeds(SweepOptions(gpu_key="interpret", problems=[PROBLEM]))
    compiled_again = {args[1] for name, args in pool.jobs if name == "compile_one"}
    assert not compiled_again & {seeds[0].to_json(), seeds[1].to_json()}


def test_the_sweep_submits_the_first_problems_seeds_before_detecting_the_device(monkeypatch):
    """`run` on one device: the first problem of the worker's order, one seed per compile process (within the
    first round and the trials); none on the interpreter."""
    opts = SweepOptions(gpu_key="auto", problems=[PROBLEM, Problem("layer_norm", 8, 64, "fp32")], trials=40,
                        compile_workers=3, worker_index=1, workers=2)
    pool, prepared = Pool(), []
    measurer = type("Measurer", (), {"prepare": lambda self, problem: prepared.append(problem)})()
    problem, futures = launcher._first_compiles(opts, opts.problems, (measurer, pool))
    assert problem == opts.problems[1] and len(futures) == 3
    assert prepared == [problem]  # its inputs and reference are made while the first compiles run
    assert launcher._first_compiles(SweepOptions(gpu_key="auto", problems=[PROBLEM], interpret=True,
                                                 compile_workers=3), [PROBLEM], (measurer, pool)) is None
    assert len(pool.jobs) == 4 and len(prepared) == 1


def _ended(result) -> Future:
    future = Future()
    future.set_result(result)
    return future


@pytest.mark.parametrize("parts, whole", [
    ([("ok", 1.0, None), ("ok", 2.0, None)], ("ok", 2.0, None)),
    ([("ok", 1.0, None), ("compile_error", 0.5, "E")], ("compile_error", 0.5, "E")),
    ([("ok", None, None), ("ok", 2.0, None)], ("ok", None, None)),
])
def test_a_config_compiled_in_parts_ends_with_its_parts(parts, whole):
    pending = [Future() for _ in parts]
    joined = compiling.joined(pending)
    pending[0].set_result(parts[0])
    assert not joined.done()
    pending[1].set_result(parts[1])
    assert joined.result(0) == whole
    assert compiling.joined([_ended(p) for p in parts]).result(0) == whole


def test_cancelling_a_config_compiled_in_parts_cancels_the_parts_not_started():
    parts = [Future(), Future()]
    parts[0].set_running_or_notify_cancel()
    joined = compiling.joined(parts)
    assert joined.cancel()
    assert parts[1].cancelled() and not parts[0].cancelled()
    parts[0].set_result(("ok", 1.0, None))  # the started part ends later: nothing is raised
    assert joined.cancelled()


@pytest.mark.parametrize("prepared", [True, False])
def test_a_measuring_process_told_the_first_problem_has_its_inputs_made_before_the_first_trial(prepared):
    from normtune.kernels.config import default_config
    from normtune.tuner.sweep.measuring import MeasuringProcess

    measurer = MeasuringProcess(0, interpret=True)
    try:
        if prepared:
            measurer.prepare(PROBLEM)
        result = measurer.measure(PROBLEM, default_config(PROBLEM), timeout_s=120)
    finally:
        measurer.close()
    assert result.status == "ok", result.error
    assert ("inputs" in measurer.phases) is not prepared, measurer.phases


@pytest.mark.parametrize("index", [0, 1])
def test_the_pools_first_process_builds_tritons_driver_utilities_while_it_imports_torch(monkeypatch, index):
    """Only the first process builds them (into Triton's cache, for every process); a build that fails (no CUDA
    driver, as on this machine) is left to the first compile."""
    import triton.backends.nvidia.driver as nvidia

    built = []
    monkeypatch.setattr(nvidia, "CudaUtils", lambda: built.append(threading.current_thread().name))
    monkeypatch.setattr(compiling, "_INDEX", [index])
    compiling._warm_up()
    assert len(built) == (1 if index == 0 else 0)
    assert threading.current_thread().name not in built  # beside the imports, not before them

    def failing():
        raise RuntimeError("libcuda.so cannot found!")

    monkeypatch.setattr(nvidia, "CudaUtils", failing)
    compiling._warm_up()  # no error


def test_precompile_compiles_only_the_launches_asked_for(monkeypatch):
    import torch

    from normtune.kernels import backward_launch

    warmed = []

    class Step:
        def __init__(self, name):
            self.kernel = type("K", (), {"warmup": lambda _, *args, **kwargs: warmed.append(name)})()
            self.grid, self.kwargs = 1, {}

    plan = type("Plan", (), {"stage_1": [Step("kernel_1")], "stage_2": [Step("kernel_2"), Step("kernel_3")]})
    monkeypatch.setattr(backward_launch, "compile_ahead_args", lambda p, c, d: (plan, [(), (), ()]))
    config = BackwardConfig.from_json(_seeds(SweepOptions(gpu_key="auto", problems=[PROBLEM]))[0].to_json())
    for launches, expected in ((None, ["kernel_1", "kernel_2", "kernel_3"]), (range(0, 1), ["kernel_1"]),
                               (range(1, 2**16), ["kernel_2", "kernel_3"])):
        warmed.clear()
        backward_launch.precompile(PROBLEM, config, INTERPRET_SM_COUNT, torch.device("cpu"), launches=launches)
        assert warmed == expected
