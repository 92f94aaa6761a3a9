"""Many GPUs of one host: one sweep worker process per device (`--devices 0,1,…`), sharing only the database.

Each worker is a whole `Sweep` (its own measuring process, its own place to start in the problem list); they
coordinate through the store's trial claims only, so the same command on another host against the same
PostgreSQL database simply adds workers. The compile-ahead processes are the host's, one pool that every worker
of this launcher submits to (`host_pool`), sized from the host's cores.

Signals: the workers run in their own process group, so a terminal's Ctrl-C reaches this launcher only, which
passes every SIGINT/SIGTERM on to each worker once (first: finish the trial in flight; second: abandon it).
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import sys
import time
from typing import TYPE_CHECKING, Callable

from .compiling import share_of

if TYPE_CHECKING:  # this module is what a spawned worker imports first: torch and the kernels come later
    from .options import SweepOptions


def options_to_dict(opts: SweepOptions) -> dict:
    """A worker's options as plain data, to hand to a spawned process."""
    data = dataclasses.asdict(opts)
    data["problems"] = [p.to_dict() for p in opts.problems]
    return data


def options_from_dict(data: dict) -> SweepOptions:
    from normtune.kernels.config import Problem

    from ..measure.harness import Timing
    from .options import SweepOptions

    return SweepOptions(**{**data, "problems": [Problem.from_dict(p) for p in data["problems"]],
                           "timing": Timing(**data["timing"]) if data["timing"] is not None else None})


def _worker_main(device: int, interpret: bool, compile_workers: int, timing: dict | None, parent_pid: int,
                 spawned_at: float, handoff, compile_ends: tuple | None = None) -> None:
    """One device's worker: its helpers start and the heavy imports happen while the launcher sets up; then it
    waits for the sweep (`DeviceWorkers.hand_over`), or stops if the launcher closes `handoff` instead. Its
    `SweepSummary` goes back to the launcher through `handoff` once everything is stored."""
    os.setpgid(0, 0)
    from . import timeline

    timeline.mark("worker_spawned", at=spawned_at)
    timeline.mark("worker_started")
    from .lifeline import die_with_parent

    die_with_parent(parent_pid, signal.SIGTERM)  # a killed launcher: each worker finishes its trial and stops
    from .measuring import start_helpers

    # Started before this process imports torch and opens the database: their start-up overlaps all of it.
    measurer, pool = start_helpers(device, interpret, compile_workers, timing=timing)
    if compile_ends is not None:
        from .host_pool import RemoteCompilePool

        pool = RemoteCompilePool(compile_ends, device)
    from ..gpu_info import DeviceInfo, detect
    from ..store.database import Store
    from .driver import Sweep

    try:
        opts_dict, url, launcher_steps, info = handoff.recv()
    except (EOFError, OSError):  # the launcher refused the sweep (it said why) or is gone: nothing to do
        from .compiling import stop_pool

        measurer.close()
        stop_pool(pool)
        raise SystemExit(0) from None
    timeline.adopt(launcher_steps, prefix="launcher_")
    opts = options_from_dict(opts_dict)
    # The launcher's description of this device: detecting it here again costs a driver start-up in every worker
    # while the others' start, and the workers would then record different revisions of one sweep.
    info = DeviceInfo(**info) if info is not None else detect(opts.device, interpret=opts.interpret)
    with Store(url) as store:
        timeline.mark("store_open")
        summary = Sweep(opts, store, info, helpers=(measurer, pool)).run()
    try:
        handoff.send(summary)
    except OSError:  # the launcher is gone: the database holds everything
        pass
    handoff.close()
    # Everything is stored and the store is closed: the interpreter's teardown (torch's and Triton's modules, the
    # pool's threads) would only delay the launcher's end.
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(summary.exit_code)


def worker_options(opts: SweepOptions, devices: list[int]) -> list[SweepOptions]:
    """The options of each device's worker: its device, its place, and its share of the host's compile processes
    (the size of its own pool, or its share of the host's pool that serves it: the compiles it keeps running
    ahead). Whether it has a pool of its own was decided when it was spawned (`DeviceWorkers`)."""
    return [dataclasses.replace(opts, device=device, devices=None, worker_index=i, workers=len(devices),
                                compile_workers=share_of(opts.compile_workers or 0, len(devices), i))
            for i, device in enumerate(devices)]


def device_kinds(devices: list[int]) -> list[str]:
    """Each device's kind (name and compute capability): devices of one kind share compiled binaries."""
    import torch

    return [f"{torch.cuda.get_device_name(d)} sm_{''.join(map(str, torch.cuda.get_device_capability(d)))}"
            for d in devices]


class DeviceWorkers:
    """One sweep worker process per device, and the host's compile pool, spawned as soon as the command's options
    are read: their start-up (torch, the measuring process, the CUDA contexts) overlaps the launcher's own set-up
    (torch, device detection, the database). `hand_over(opts, url)` gives them the sweep; `abandon()` stops the
    workers that never got it (the launcher refused the sweep), leaving no process behind. The measuring
    processes use `timing` (a `Timing` as a dict; None: the sweep's preset), which the options handed over must
    carry. `summaries` holds the `SweepSummary` of each worker that ended its sweep (none of one killed)."""

    def __init__(self, devices: list[int], compile_workers: int, interpret: bool, timing: dict | None = None):
        from . import timeline

        ctx = mp.get_context("spawn")
        self.devices, self.handed_over, self._abandoned = list(devices), False, False
        self.interpret, self.timing = interpret, timing
        self.host = None
        if compile_workers > 0 and not interpret:
            from .host_pool import HostCompiler

            # One pool for the host until the launcher knows the devices' kinds (`hand_over` regroups it).
            self.host = HostCompiler.for_devices(self.devices, compile_workers, None, ctx)
        self.procs, self._handoffs, self.summaries = [], [], []
        for i, device in enumerate(self.devices):
            ends = self.host.connect() if self.host is not None else None
            own = 0 if self.host is not None else share_of(compile_workers, len(self.devices), i)
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=_worker_main,
                               args=(device, interpret, own, timing, os.getpid(), time.time(), theirs, ends))
            proc.start()
            for end in (theirs, *(ends or ())):  # the worker's ends are its own now: its exit closes them
                end.close()
            self.procs.append(proc)
            self._handoffs.append(ours)
        timeline.mark("workers_spawned")

    def hand_over(self, opts: SweepOptions, url: str, infos: list | None = None) -> None:
        """Give each worker its options, the database `url` and its device's `DeviceInfo` (`infos`, one per
        device; None: each worker detects its own); the host's pool starts serving them."""
        from ..measure.harness import TIMING, Timing
        from . import timeline

        started = Timing(**self.timing) if self.timing else TIMING["sweep"]
        if not self.interpret and (opts.timing or TIMING["sweep"]) != started:
            raise ValueError(f"the sweep's timing {opts.timing} is not the one its workers' measuring processes "
                             f"were started with ({started})")
        if self.host is not None:
            self.host.regroup(self.devices, opts.compile_workers, device_kinds(self.devices))
            self.host.start()
        steps = timeline.marks()
        infos = infos or [None] * len(self.devices)
        for worker, info, send in zip(worker_options(opts, self.devices), infos, self._handoffs):
            try:
                send.send((options_to_dict(worker), url, steps, info and info.to_dict()))
            except OSError:  # that worker is gone already: its exit code says so
                pass
        self.handed_over = True

    def collect(self) -> None:
        """Read the summaries the exited workers sent (`summaries`)."""
        for conn in self._handoffs:
            try:
                while not conn.closed and conn.poll(0):
                    self.summaries.append(conn.recv())
            except (EOFError, OSError):  # that worker ended (and closed its end)
                conn.close()

    def abandon(self, wait_s: float = 30.0) -> None:
        """Stop workers that were not handed the sweep, and the host's pool; returns once they have exited. A
        worker not yet handed the sweep has no trial to finish: SIGTERM ends it (and its helpers with it)."""
        if self._abandoned:
            return
        self._abandoned = True
        for send in self._handoffs:
            send.close()
        if not self.handed_over:
            for proc in self.procs:
                if proc.is_alive():
                    os.kill(proc.pid, signal.SIGTERM)
            deadline = time.monotonic() + wait_s
            for proc in self.procs:
                proc.join(max(0.0, deadline - time.monotonic()))
                if proc.is_alive():
                    proc.kill()
                    proc.join()
        if self.host is not None:
            self.host.stop()


def run_on_devices(opts: SweepOptions, devices: list[int], url: str,
                   on_tick: Callable[[], None] | None = None, workers: DeviceWorkers | None = None,
                   infos: list | None = None, on_signal: Callable[[str], None] | None = None) -> int:
    """Run one sweep worker per device on the database `url` (the `workers` spawned ahead, else new ones; `infos`:
    each device's `DeviceInfo`, else each worker detects its own) and wait; the workers' summaries are in
    `workers.summaries` afterwards. Returns the exit code the command should end with: 130/143 when a signal
    stopped it, 1 when a worker failed, else 0. `on_signal(message)` hears what a signal does."""
    from . import timeline

    workers = workers or DeviceWorkers(devices, opts.compile_workers or 0, opts.interpret,
                                       opts.timing and dataclasses.asdict(opts.timing))
    procs = workers.procs
    received: list[int] = []

    def pass_on(signum):
        for p in procs:
            if p.pid is not None and p.is_alive():
                os.kill(p.pid, signum)

    def forward(signum, frame):
        received.append(signum)
        if on_signal is not None:
            name = signal.Signals(signum).name
            on_signal(f"{name}: each worker finishes its current trial, then stops (again to abandon it)"
                      if len(received) == 1 else f"{name}: each worker abandons its current trial")
        if workers.handed_over:  # before that, `abandon` stops the workers
            pass_on(signum)

    old = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        if not received:
            workers.hand_over(opts, url, infos)
            if received:  # a signal came while they were handed the sweep
                pass_on(received[0])
        running = [p for p in procs if p.is_alive()]
        while running:
            if on_tick is not None:
                on_tick()
            # Woken by a worker's exit at once (its sentinel), else once a second for `on_tick`.
            ended = mp.connection.wait([p.sentinel for p in running], timeout=1.0)
            for p in running:
                if p.sentinel in ended:
                    p.join()
            running = [p for p in running if p.is_alive()]
            workers.collect()  # a worker's summary is read as it ends: its pipe holds at most one
        timeline.mark("workers_exited")
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        workers.abandon()
        timeline.mark("helpers_stopped")
    codes = [p.exitcode for p in procs]
    if received:
        return 128 + received[0]
    signalled = [c for c in codes if c in (130, 143)]
    if signalled:
        return signalled[0]
    return 1 if any(codes) else 0
