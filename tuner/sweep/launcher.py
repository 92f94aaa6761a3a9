"""Many GPUs of one host: one sweep worker process per device (`--devices 0,1,…`), sharing only the database."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import signal

from normtune.kernels.config import Problem

from .options import SweepOptions


def _worker_main(opts_dict: dict, device: int, storage_url: str, log_path: str | None) -> None:
    """One sweep worker per GPU (`--devices 0,1,…`): same studies, its own device."""
    from ..device import detect
    from ..store import Store

    from .driver import Sweep

    opts = SweepOptions(**{**opts_dict, "device": device,
                           "problems": [Problem.from_dict(p) for p in opts_dict["problems"]]})
    info = detect(device, interpret=opts.interpret)
    store = Store(storage_url)
    try:
        Sweep(opts, store, info).run()
    finally:
        store.close()


def run_on_devices(opts: SweepOptions, devices: list[int]) -> list[int]:
    """Start one sweep process per device and wait; returns their exit codes."""
    ctx = mp.get_context("spawn")
    data = dataclasses.asdict(opts)
    data["problems"] = [p.to_dict() for p in opts.problems]
    procs = [ctx.Process(target=_worker_main, args=(data, d, opts.storage_url, None)) for d in devices]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join()
    except KeyboardInterrupt:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGINT)
        for p in procs:
            p.join()
    return [p.exitcode for p in procs]

