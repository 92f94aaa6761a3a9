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
import os
import signal
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
                           "timing": Timing(**data["timing"])})


def _worker_main(opts_dict: dict, url: str, parent_pid: int, compile_ends: tuple | None = None) -> None:
    os.setpgid(0, 0)
    from .lifeline import die_with_parent

    die_with_parent(parent_pid, signal.SIGTERM)  # a killed launcher: each worker finishes its trial and stops
    from .measuring import start_helpers

    # Started before this process imports torch and opens the database: their start-up overlaps all of it.
    measurer, pool = start_helpers(opts_dict["device"], opts_dict["interpret"], opts_dict["compile_workers"],
                                   timing=opts_dict["timing"])
    if compile_ends is not None:
        from .host_pool import RemoteCompilePool

        pool = RemoteCompilePool(compile_ends, opts_dict["device"])
    helpers = (measurer, pool)
    from ..gpu_info import detect
    from ..store.database import Store
    from .driver import Sweep

    opts = options_from_dict(opts_dict)
    info = detect(opts.device, interpret=opts.interpret)
    with Store(url) as store:
        summary = Sweep(opts, store, info, helpers=helpers).run()
    raise SystemExit(summary.exit_code)


def worker_options(opts: SweepOptions, devices: list[int], shared_pool: bool = False) -> list[SweepOptions]:
    """The options of each device's worker: its device, its place, and its share of the compile processes (none
    of its own when the host's pool serves it)."""
    return [dataclasses.replace(opts, device=device, worker_index=i, workers=len(devices),
                                compile_workers=0 if shared_pool else share_of(opts.compile_workers, len(devices), i))
            for i, device in enumerate(devices)]


def device_kinds(devices: list[int]) -> list[str]:
    """Each device's kind (name and compute capability): devices of one kind share compiled binaries."""
    import torch

    return [f"{torch.cuda.get_device_name(d)} sm_{''.join(map(str, torch.cuda.get_device_capability(d)))}"
            for d in devices]


def run_on_devices(opts: SweepOptions, devices: list[int], url: str,
                   on_tick: Callable[[], None] | None = None) -> int:
    """Run one sweep worker per device on the database `url` and wait; returns the exit code the command should
    end with: 130/143 when a signal stopped it, 1 when a worker failed, else 0."""
    ctx = mp.get_context("spawn")
    host = None
    if opts.compile_workers > 0 and not opts.interpret:
        from .host_pool import HostCompiler

        host = HostCompiler.for_devices(devices, opts.compile_workers, device_kinds(devices), ctx)
    procs, passed = [], []
    for worker in worker_options(opts, devices, shared_pool=host is not None):
        ends = host.connect() if host is not None else None
        passed.append(ends or ())
        procs.append(ctx.Process(target=_worker_main, args=(options_to_dict(worker), url, os.getpid(), ends)))
    received: list[int] = []

    def forward(signum, frame):
        received.append(signum)
        for p in procs:
            if p.pid is not None and p.is_alive():
                os.kill(p.pid, signum)

    old = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        if host is not None:
            host.start()
        for p, ends in zip(procs, passed):
            p.start()
            for end in ends:  # the worker's ends are its own now: its exit closes them (the host sees it)
                end.close()
        while any(p.is_alive() for p in procs):
            if on_tick is not None:
                on_tick()
            time.sleep(1.0)
            for p in procs:
                p.join(0)
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        if host is not None:
            host.stop()
    codes = [p.exitcode for p in procs]
    if received:
        return 128 + received[0]
    signalled = [c for c in codes if c in (130, 143)]
    if signalled:
        return signalled[0]
    return 1 if any(codes) else 0
