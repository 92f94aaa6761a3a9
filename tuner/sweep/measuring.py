"""The measuring process: the sweep's GPU side, in its own process so that a hung kernel can be killed.

This module imports neither torch nor the kernels (the measuring process does, once started): a sweep starts its
measuring process before it imports them itself, so that both processes' start-up overlaps.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import signal
import time
from typing import TYPE_CHECKING

from .lifeline import die_with_parent, ignore_stop_signals
from .timeline import mark, own_marks

if TYPE_CHECKING:
    from normtune.kernels.config import BackwardConfig, Problem

    from ..measure.harness import MeasureResult, Timing


def _result(**kwargs) -> "MeasureResult":
    from ..measure.results import MeasureResult

    return MeasureResult(**kwargs)


def _measure_loop(conn, parent_pid: int, device_index: int, interpret: bool, l2_bytes: int | None,
                  timing: "Timing | dict | None") -> None:
    """Body of the measuring process: owns the CUDA context and one `MeasureSession` (bandwidth, L2 flush, spin,
    timing), which keeps one problem's inputs at a time. It dies with the sweep that started it, and a sweep gone
    while it was busy (its pipe closed) ends it quietly: nothing is left to report to."""
    die_with_parent(parent_pid)
    ignore_stop_signals()
    try:
        _serve(conn, device_index, interpret, l2_bytes, timing)
    except (BrokenPipeError, EOFError, ConnectionResetError):
        os._exit(0)


def _session(device_index: int, interpret: bool, l2_bytes: int | None, timing: "Timing | dict | None"):
    """The measuring session of this process: the device's own L2 size when `l2_bytes` is None, and the sweep's
    timing preset when `timing` is None."""
    import torch

    from ..measure.harness import TIMING, MeasureSession, Timing

    mark("measurer_torch")
    if interpret:
        return MeasureSession("cpu")
    timing = Timing(**timing) if isinstance(timing, dict) else timing or TIMING["sweep"]
    torch.cuda.set_device(device_index)
    torch.empty(1, device=f"cuda:{device_index}")  # the CUDA context, made here so that its cost shows apart
    mark("measurer_cuda")
    if l2_bytes is None:
        l2_bytes = int(getattr(torch.cuda.get_device_properties(device_index), "L2_cache_size", 0) or 50 * 2**20)
    return MeasureSession(torch.device("cuda", device_index), l2_bytes=l2_bytes, timing=timing)


def _serve(conn, device_index: int, interpret: bool, l2_bytes: int | None, timing: "Timing | dict | None") -> None:
    if interpret:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        session = _session(device_index, interpret, l2_bytes, timing)
    except Exception as err:  # noqa: BLE001 - e.g. no such device: the sweep reports it (or has refused already)
        conn.send(("failed", f"{type(err).__name__}: {err}"))
        return
    from normtune.kernels.config import BackwardConfig as BC
    from normtune.kernels.config import Problem as P

    from ..measure.harness import MeasureResult, classify_exception

    conn.send(("ready", session.bandwidth_gbps, time.time(), own_marks()))
    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            return
        _, problem_dict, config_json, best_us = msg
        phases: dict[str, float] = {}
        try:
            result = session.measure_problem(P.from_dict(problem_dict), BC.from_json(config_json), phases, best_us)
        except Exception as err:  # noqa: BLE001 - the parent records it as the trial's failure
            result = MeasureResult(status=classify_exception(err), error=f"{type(err).__name__}: {err}",
                                   interpret=interpret)
        conn.send(("result", result.to_dict(), phases))


class MeasuringProcess:
    """The GPU side of the sweep, in its own process so that a hung kernel can be killed.

    `submit` hands it a trial and returns at once; `collect` waits for the result (`measure` does both). Between
    the two the sweep stores the previous result and proposes the next trials while the GPU measures. `phases`
    holds the measuring process's seconds per phase of the last result collected (see `costs`)."""

    def __init__(self, device_index: int, interpret: bool, l2_bytes: int | None = None,
                 timing: "Timing | dict | None" = None):
        """`l2_bytes` None: the device's own (read in the measuring process); `timing` None: the sweep's preset.
        Neither needs torch in this process, so that the measuring process may start before it is imported."""
        self._args = (device_index, interpret, l2_bytes, timing)
        self._proc = None
        self._conn = None
        self._ready = False
        self._failed: MeasureResult | None = None  # what `collect` returns when `submit` could not send
        self._sent_at = 0.0
        self.phases: dict[str, float] = {}
        self.bandwidth_gbps = math.nan

    def start(self) -> None:
        """Spawn the process without waiting for it: its start (importing torch, the CUDA context, measuring the
        copy bandwidth: seconds) overlaps the sweep's own setup and the first compiles. `measure` waits."""
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        self._proc = ctx.Process(target=_measure_loop, args=(child, os.getpid(), *self._args), daemon=True)
        self._proc.start()
        mark("measurer_spawned")
        self._conn, self._ready = parent, False

    def answering(self) -> bool:
        """Whether the process has started and said so (or failed to): `submit` would not wait for it."""
        return self._ready or (self._conn is not None and self._conn.poll(0))

    def _await_ready(self) -> None:
        if not self._conn.poll(600):
            raise RuntimeError("the measuring process did not start within 600 s")
        message = self._conn.recv()
        if message[0] == "failed":
            raise EOFError(message[1])
        _, self.bandwidth_gbps, ready_at, steps = message
        for name, at in steps.items():  # torch imported, CUDA context made (absolute times)
            mark(name, at=at)
        mark("measurer_ready", at=ready_at)
        self._ready = True

    def measure(self, problem: Problem, config: BackwardConfig, timeout_s: float,
                best_us: float | None = None) -> MeasureResult:
        self.submit(problem, config, best_us)
        return self.collect(timeout_s)

    def submit(self, problem: Problem, config: BackwardConfig, best_us: float | None = None) -> None:
        """Send one trial to be gated and timed (starting the process first when it is not running); `best_us`,
        the problem's best time so far, races it (`MeasureSession.measure`)."""
        self._failed, self.phases = None, {}
        if self._proc is None or not self._proc.is_alive():
            self.start()
        if not self._ready:
            try:
                self._await_ready()
            except EOFError as err:
                self.kill()
                self._failed = _result(status="error", interpret=self._args[1],
                                       error="the measuring process failed to start" + (f": {err}" if str(err) else ""))
                return
        try:
            self._conn.send(("measure", problem.to_dict(), config.to_json(), best_us))
            self._sent_at = time.monotonic()
        except (BrokenPipeError, ConnectionResetError):
            self.kill()
            self._failed = _result(status="error", error="the measuring process died (e.g. a device fault)",
                                   interpret=self._args[1])

    def ready(self) -> bool:
        """True when `collect` would return at once."""
        return self._failed is not None or self._conn is None or self._conn.poll(0)

    def collect(self, timeout_s: float) -> MeasureResult:
        """The submitted trial's result; a trial with none within `timeout_s` is killed (status timeout)."""
        if self._failed is not None:
            return self._failed
        if self._conn is None or not self._conn.poll(max(0.0, self._sent_at + timeout_s - time.monotonic())):
            self.kill()
            return _result(status="timeout", error=f"no result within {timeout_s:.0f} s (killed)",
                           interpret=self._args[1])
        try:
            _, data, self.phases = self._conn.recv()
        except (EOFError, ConnectionResetError):
            self.kill()
            return _result(status="error", error="the measuring process died (e.g. a device fault)",
                           interpret=self._args[1])
        return _result(**data)

    def interrupt(self) -> None:
        """Stop the measurement in flight now (safe in a signal handler): `measure` then returns an error."""
        proc = self._proc
        if proc is not None and proc.pid is not None:
            try:
                os.kill(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def discard_stale(self) -> None:
        """Replace the process when an answer that nobody collected waits in its pipe (a sweep that ended with a
        trial in flight), so that the next sweep's first `collect` gets its own trial's answer."""
        if self._ready and self._conn is not None and self._conn.poll(0):
            self.kill()

    def kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join(10)
        self._proc = self._conn = None
        self._ready = False

    def close(self, wait_s: float = 0.0) -> None:
        """End the process: asked to stop and given `wait_s` to exit, then killed. It holds nothing to save (the
        driver releases a killed process's CUDA context), so a sweep does not wait for its teardown."""
        if wait_s > 0 and self._proc is not None and self._proc.is_alive() and self._ready:
            try:
                self._conn.send(("stop",))
                self._proc.join(wait_s)
            except (OSError, BrokenPipeError):
                pass
        self.kill()


class _Synchronous:
    """A measurer with only `measure` (a stand-in of tests and experiments) behind `submit`/`collect`."""

    def __init__(self, inner):
        self._inner, self._job, self.phases = inner, None, {}

    def submit(self, problem, config, best_us=None) -> None:
        self._job = (problem, config)  # a stand-in measures every config in full

    def ready(self) -> bool:
        return True

    def collect(self, timeout_s: float) -> MeasureResult:
        problem, config = self._job
        return self._inner.measure(problem, config, timeout_s)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def asynchronous(measurer):
    """`measurer` with `submit`/`collect` (a stand-in with only `measure` is wrapped)."""
    return measurer if hasattr(measurer, "submit") else _Synchronous(measurer)


def start_helpers(device: int, interpret: bool, compile_workers: int, *, timing=None, l2_bytes: int | None = None,
                  measurer_class=MeasuringProcess) -> tuple:
    """Start a sweep worker's measuring process and compile-ahead processes, without waiting for them: they take
    seconds to start (importing torch, the CUDA context), which then overlaps whatever the caller does before
    `Sweep.run` (importing torch itself, opening the database and the studies). Needs neither torch nor the
    device's properties here. Returns (measurer, pool) for `Sweep(helpers=…)`."""
    from .compiling import compile_pool

    measurer = measurer_class(device, interpret, l2_bytes, timing)
    measurer.start()
    return measurer, (None if interpret else compile_pool(compile_workers, device))
