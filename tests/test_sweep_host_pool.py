"""The host's compile pool shared by the `--devices` workers of one host: one pool, each job compiled once
whichever worker asks, and a worker whose launcher is gone compiles in its measuring process instead."""

from __future__ import annotations

import multiprocessing as mp
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from normtune.kernels.config import Problem
from normtune.tuner.sweep.compiling import wait_compiled
from normtune.tuner.sweep.device_workers import worker_options
from normtune.tuner.sweep.host_pool import HostCompiler, RemoteCompilePool
from normtune.tuner.sweep.options import SweepOptions

PROBLEM = {"norm": "rms_norm", "M": 8, "N": 64, "dtype": "bf16"}


class Compiler:
    """Stands in for `compile_one`: counts its calls per config; waits for `release` when it is cleared."""

    def __init__(self):
        self.calls: list[str] = []
        self.release = threading.Event()
        self.release.set()
        self._lock = threading.Lock()

    def __call__(self, problem, config_json, sms):
        self.release.wait(30)
        with self._lock:
            self.calls.append(config_json)
        return "ok", 0.5, None


def _host(compiler, devices=(0, 1)):
    executor = ThreadPoolExecutor(2)
    host = HostCompiler({d: executor for d in devices}, mp.get_context("spawn"), compile=compiler)
    clients = [RemoteCompilePool(host.connect(), d) for d in devices]
    host.start()
    return host, clients


def test_every_worker_submits_to_one_host_pool_and_a_job_is_compiled_once():
    compiler = Compiler()
    compiler.release.clear()  # the first jobs are still compiling when the duplicates arrive
    host, (a, b) = _host(compiler)
    try:
        first = [a.submit(None, PROBLEM, "cfg-1", 132), b.submit(None, PROBLEM, "cfg-1", 132),
                 b.submit(None, PROBLEM, "cfg-2", 132)]
        compiler.release.set()
        assert [f.result(30) for f in first] == [("ok", 0.5, None)] * 3
        later = a.submit(None, PROBLEM, "cfg-2", 132)  # compiled already: answered from the host's result
        assert later.result(30) == ("ok", 0.5, None)
        assert sorted(compiler.calls) == ["cfg-1", "cfg-2"] and host.compiles == 2
    finally:
        a.shutdown()
        b.shutdown()
        host.stop()


def test_a_worker_whose_launcher_is_gone_compiles_in_its_measuring_process():
    compiler = Compiler()
    compiler.release.clear()
    host, (a,) = _host(compiler, devices=(0,))
    try:
        pending = a.submit(None, PROBLEM, "cfg-1", 132)
        for reply, _ in host._replies.values():  # the launcher's ends close as it dies
            reply.close()
        assert wait_compiled(pending, timeout_s=30, abandoned=lambda: False) == ("ok", None, None)
    finally:
        compiler.release.set()
        a.shutdown()
        host.stop()


def test_each_worker_is_handed_its_share_of_the_hosts_compile_processes():
    """A worker keeps its share of the host's compile processes busy ahead (`CompileAhead`) and holds that many
    trials ahead, whether its own pool or the host's shared one serves it."""
    opts = SweepOptions(gpu_key="h100", problems=[Problem("rms_norm", 8, 64, "bf16")], compile_workers=14)
    assert [w.compile_workers for w in worker_options(opts, [0, 1, 2])] == [5, 5, 4]


def test_one_pool_per_kind_of_gpu_spread_over_its_devices(monkeypatch):
    from normtune.tuner.sweep import host_pool

    made = []
    monkeypatch.setattr(host_pool, "compile_pool", lambda n, devices: made.append((n, devices)) or (n, devices[0]))
    host = HostCompiler.for_devices([0, 1, 2, 3], 16, ["H100 sm_90"] * 3 + ["A100 sm_80"], mp.get_context("spawn"))
    assert made == [(8, [0, 1, 2]), (8, [3])]
    assert [host._pools[d] for d in range(4)] == [(8, 0)] * 3 + [(8, 3)]


def test_a_pools_processes_take_its_devices_in_turn_each_seeing_its_own_alone(monkeypatch):
    """Each compile process sees only its device (as its device 0), and makes no CUDA context at start: one per
    process at once serialized every process's driver start-up, the measuring processes' included."""
    from normtune.tuner.sweep import compiling

    seen, niced = [], []
    monkeypatch.setattr("torch.cuda.set_device", lambda d: pytest.fail("a compile process made a context at start"))
    monkeypatch.setattr("normtune.tuner.sweep.lifeline.die_with_parent", lambda *a: None)
    monkeypatch.setattr("normtune.tuner.sweep.lifeline.ignore_stop_signals", lambda: None)
    monkeypatch.setattr(compiling.os, "nice", niced.append)
    started = mp.get_context("spawn").Value("i", 0)
    for parent_view in (None, "4,5,6,7"):
        if parent_view is None:
            monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        for _ in range(5):
            if parent_view is not None:
                monkeypatch.setenv("CUDA_VISIBLE_DEVICES", parent_view)
            compiling._compile_init([2, 3], started, 0)
            seen.append(compiling.os.environ["CUDA_VISIBLE_DEVICES"])
    assert seen == ["2", "3", "2", "3", "2", "7", "6", "7", "6", "7"]
    assert niced == [5] * 10 and not compiling._UNUSABLE


def test_visible_device_names_the_parents_own_device():
    from normtune.tuner.sweep.compiling import visible_device

    assert visible_device(1, "") == "1" and visible_device(0, "GPU-a,GPU-b") == "GPU-a"
    assert visible_device(1, " 3 , 1 ") == "1" and visible_device(2, "5,6,7") == "7"


def _spawned_worker(ends, results):
    pool = RemoteCompilePool(ends, 0)
    futures = [pool.submit(None, PROBLEM, f"cfg-{i % 2}", 132) for i in range(4)]
    results.put([f.result(60) for f in futures])
    pool.shutdown()


def test_a_spawned_worker_reaches_the_host_pool_through_the_ends_it_was_given():
    compiler = Compiler()
    ctx = mp.get_context("spawn")
    host = HostCompiler({0: ThreadPoolExecutor(2)}, ctx, compile=compiler)
    ends = host.connect()
    results = ctx.Queue()
    worker = ctx.Process(target=_spawned_worker, args=(ends, results))
    host.start()
    try:
        worker.start()
        for end in ends:
            end.close()
        assert results.get(timeout=120) == [("ok", 0.5, None)] * 4
        worker.join(60)
        assert worker.exitcode == 0 and sorted(compiler.calls) == ["cfg-0", "cfg-1"]
    finally:
        if worker.is_alive():
            worker.kill()
        host.stop()
