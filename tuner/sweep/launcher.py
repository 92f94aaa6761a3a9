"""The sweep's one entry point: `run(options)` runs a whole sweep, on one device or on several (`devices`), and
returns a `SweepResult`. The `normtune sweep` command, `normtune tune` and the tests call it; it owns every
process the sweep starts:

    run (this process) ──► per-GPU worker (`Sweep`: claims, stores) ──► measuring process (the GPU)
                       └─► compile pool (compiles trials ahead)     └─► proposer process (TPE's proposals)

With one device this process is the worker; with `devices` it is the launcher of one worker process per GPU
(`device_workers`), sharing the host's compile pool. The helper processes start first, before this process
imports torch, detects the device and opens the database, so that their start-up overlaps all of that; a sweep
refused on the way (an unknown GPU, a database that cannot be opened) stops them again and leaves nothing running.

Signals: SIGINT/SIGTERM finish the trial in flight and stop (a second abandons it); the result says so
(`stopped`, `signal`, `exit_code` 130/143). Progress reaches the caller as events (`on_event(kind, data)`:
"opened", "problem", "trial", "problem_done", "signal", "finish") and through `view(url, targets)`, a context
manager entered around the measuring (the command's live view).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable

from . import timeline
from .options import SweepOptions, SweepSummary, check_problems, study_name

# When the run's end steps happened: the sweep done (one device), its last worker exited and the host's compile
# pool stopped (several), the caller's view closed, the store closed, the workers' summaries read; what a
# command's wall adds after the last is the interpreter's exit.
CLOSING_STEPS = ("sweep_returned", "workers_exited", "helpers_stopped", "view_closed", "store_closed",
                 "summary_read")


@dataclass
class SweepResult(SweepSummary):
    """What `run` returns: the sweep's summary (the `SweepSummary` figures; with several devices, summed over the
    workers that ended their sweep, per problem as the database holds it), and where it ran.

    `workers`: each device worker's own summary (empty with one device); `worker_lines`: one line per worker
    run of this sweep and where its time went, read from the database; `closing_steps`: when the run's end steps
    happened (`CLOSING_STEPS`); `code`: the exit code where it is not the signal's (a failed worker: 1)."""
    store: str = ""  # the database, as shown to the user (no password)
    devices: list[int] = field(default_factory=list)
    workers: list[SweepSummary] = field(default_factory=list)
    worker_lines: list[str] = field(default_factory=list)
    closing_steps: str = ""
    code: int | None = None

    @property
    def exit_code(self) -> int:
        return super().exit_code if self.code is None else self.code


Event = Callable[[str, dict], None]


def device_info(gpu: str, interpret: bool, device: int = 0):
    """The device to measure, checked against the GPU key asked for (`gpu`, or "auto")."""
    from ..gpu_info import check_gpu_key, detect

    info = detect(device, interpret=interpret)
    check_gpu_key(gpu, info)
    return info


def run(options: SweepOptions, *, on_event: Event | None = None, view: Callable | None = None,
        helpers=None) -> SweepResult:
    """Run the sweep `options` asks for (its `storage`, else the user's database: `user_database_url`; on its
    `devices` or its `device`) to its end, its time budget or a signal, and return what it did. Errors in what was
    asked (an unknown GPU, a database that cannot be opened) raise before anything is written, with every helper
    process stopped. `helpers`: an `engine.KeptHelpers` whose measuring process and compile pool a sweep on one
    device with the preset timing uses and leaves running (its owner stops them); otherwise the sweep starts and
    stops its own."""
    emit = on_event or (lambda kind, data: None)
    timeline.start_command()  # the processes started below count from the command's start
    timeline.forget(CLOSING_STEPS)  # a sweep run before in this process recorded its own
    timeline.mark("options")
    devices = list(options.devices or [options.device])
    if options.compile_workers is None:
        from .compiling import default_compile_workers

        options = dataclasses.replace(options, compile_workers=default_compile_workers(len(devices)))
    kept = helpers if len(devices) == 1 and options.timing is None else None  # lent ones time with the preset
    helpers = workers = None
    if len(devices) > 1:
        from .device_workers import DeviceWorkers

        workers = DeviceWorkers(devices, options.compile_workers, options.interpret)
    elif kept is not None:
        helpers = kept.lend()
    else:
        from .measuring import start_helpers

        helpers = start_helpers(devices[0], options.interpret, options.compile_workers)
    try:
        return _run(options, devices, helpers, workers, emit, view, keep=kept is not None)
    finally:  # refused before the sweep took them over: nothing is left running (lent ones stay with their owner)
        if helpers is not None and kept is None:
            from .compiling import stop_pool

            helpers[0].close()
            stop_pool(helpers[1])
        if workers is not None:
            workers.abandon()


def _run(options: SweepOptions, devices: list[int], helpers, workers, emit: Event, view,
         keep: bool = False) -> SweepResult:
    from ..store.database import Store, user_database_url

    started = time.monotonic() - (time.time() - timeline.origin())
    problems = options.problems() if callable(options.problems) else list(options.problems)
    check_problems(problems)
    info = device_info(options.gpu_key, options.interpret, devices[0])
    timeline.mark("device_detected")
    key = info.key if options.interpret or options.gpu_key == "auto" else options.gpu_key
    opts = dataclasses.replace(options, gpu_key=key, problems=problems, device=devices[0],
                               devices=devices if len(devices) > 1 else None)
    store = Store(options.storage if options.storage is not None else user_database_url())
    timeline.mark("store_open")
    targets = {study_name(key, p, opts.interpret, opts.study_prefix): opts.target_of(p.key) for p in problems}
    emit("opened", {"store": store.display_url, "problems": problems, "devices": devices, "gpu_key": key,
                    "default_store": options.storage is None})
    show = view(store.url, targets) if view is not None else nullcontext()
    if len(devices) == 1:
        from .driver import Sweep

        sweep = Sweep(opts, store, info, on_event=emit, helpers=helpers, keep_helpers=keep)
        helpers = None  # the sweep's now: it stops them
        try:
            with show:
                summary = sweep.run()
                timeline.mark("sweep_returned")
            timeline.mark("view_closed")
        finally:
            store.close()
        timeline.mark("store_closed")
        result = SweepResult(**vars(summary), store=store.display_url, devices=devices)
    else:
        result = _run_on_devices(opts, devices, store, info, workers, targets, emit, show, started)
    result.closing_steps = timeline.line(CLOSING_STEPS)
    return result


def _run_on_devices(opts: SweepOptions, devices: list[int], store, info, workers, targets: dict[str, int],
                    emit: Event, show, started: float) -> SweepResult:
    """One worker process per device; the result from their summaries and the database."""
    from ..store.database import Store
    from .device_workers import run_on_devices
    from .progress import snapshot, worker_lines
    from .trials import remaining

    t0 = time.perf_counter()
    url, shown = store.url, store.display_url
    store.close()
    infos = [info] + [device_info(opts.gpu_key, opts.interpret, d) for d in devices[1:]]
    with show:
        code = run_on_devices(opts, devices, url, workers=workers, infos=infos,
                              on_signal=lambda message: emit("signal", {"message": message}))
    timeline.mark("view_closed")
    summaries = list(workers.summaries)
    result = SweepResult(wall_s=time.perf_counter() - t0, store=shown, devices=devices, workers=summaries,
                         code=0 if code in (130, 143) else code)
    for s in summaries:
        result.measure_s += s.measure_s
        result.compile_s += s.compile_s
        result.compile_wait_s += s.compile_wait_s
        result.stopped = result.stopped or s.stopped
        result.signal = result.signal or s.signal
    if code in (130, 143):
        result.signal = result.signal or {130: "SIGINT", 143: "SIGTERM"}[code]
        result.stopped = result.stopped or "interrupted"
        result.code = None
    result.problems = _merged(opts, summaries)
    with Store.for_reading(url) as done:
        since = dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=time.monotonic() - started)
        result.worker_lines = worker_lines(snapshot(done, prefix="", targets=targets), since, costs=True)
        result.remaining = remaining(opts, opts.interpret, done, {})
    timeline.mark("summary_read")
    result.costs = {"workers": [s.costs for s in summaries]}
    return result


def _merged(opts: SweepOptions, summaries: list[SweepSummary]) -> list:
    """Per problem of the sweep, the workers' summaries as one: the study's trials (the largest count a worker
    read), what they measured now, their failures, the best time and the default's."""
    from .options import ProblemSummary

    out = []
    for problem in opts.problems:
        mine = [ps for s in summaries for ps in s.problems if ps.problem.key == problem.key]
        if not mine:
            continue
        ps = ProblemSummary(problem, mine[0].study, trials=max(p.trials for p in mine),
                            measured_now=sum(p.measured_now for p in mine))
        for p in mine:
            for status, n in p.failures.items():
                ps.failures[status] = ps.failures.get(status, 0) + n
            if p.best_us is not None and (ps.best_us is None or p.best_us < ps.best_us):
                ps.best_us, ps.best_config = p.best_us, p.best_config
            ps.default_us = ps.default_us or p.default_us
        out.append(ps)
    return out
