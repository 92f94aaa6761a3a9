"""The host's compile pool, shared by the sweep workers of one host (`--devices 0,1,…`).

The launcher holds one pool of compiling processes, sized from the host's cores (`HostCompiler`); each worker
submits its compile-ahead jobs to it through a pair of pipes (`RemoteCompilePool`, the worker's side, with the
`submit`/`shutdown` a `ProcessPoolExecutor` has), so that a busy GPU's jobs use the processes an idle one does
not need. A job the host has already compiled or is compiling -- the same problem and config, from any worker --
is compiled once: its later requests share the first one's result. Configs whose kernels compile to the same
binary share it through Triton's on-disk cache (the later compile is a cache lookup).

There is one pool per kind of GPU (name and compute capability): the binary does not depend on which of a
host's identical GPUs it is compiled on, so the pool's processes (and their CUDA contexts) are spread over them.
A worker whose launcher is gone gets its pending jobs failed, which makes the measuring process compile them
itself (`compiling.wait_compiled`).
"""

from __future__ import annotations

import json
import logging
import threading
from concurrent.futures import Future, InvalidStateError
from multiprocessing.connection import wait
from typing import Callable

from .compiling import compile_one, compile_pool, share_of

log = logging.getLogger("normtune.sweep")


class HostCompiler:
    """The launcher's side: `pools` maps a device index to the executor that compiles its jobs; `connect()`
    makes one worker's pair of pipes; `start()` serves them from a thread until `stop()`."""

    def __init__(self, pools: dict[int, object], ctx, compile: Callable = compile_one):
        self._pools, self._ctx, self._compile = pools, ctx, compile
        self._requests: list = []  # the launcher's end of each worker's request pipe
        self._replies: dict[int, tuple] = {}  # id(request end) -> (reply end, its lock)
        self._jobs: dict[tuple, Future] = {}  # job key -> the host's future of it
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.compiles = 0  # jobs handed to a pool (the others shared one)

    @classmethod
    def for_devices(cls, devices: list[int], processes: int, kinds: list[str] | None, ctx) -> "HostCompiler":
        """`processes` compile processes for the host, shared out among the kinds of GPU in `devices`
        (`kinds[i]` names device i's kind; None: all of one kind): one pool per kind, spread over its devices."""
        return cls(_pools_by_kind(devices, processes, kinds), ctx)

    def regroup(self, devices: list[int], processes: int, kinds: list[str]) -> None:
        """Before `start`: a pool made for devices of one kind is replaced by one pool per kind when `kinds` are
        not all the same (a binary compiled for one kind of GPU does not run on another)."""
        if len(set(kinds)) <= 1:
            return
        old, self._pools = self._pools, _pools_by_kind(devices, processes, kinds)
        _stop_pools(old)

    def connect(self) -> tuple:
        """(request end, reply end) for one worker, to pass to its process; this side keeps the other ends."""
        request_recv, request_send = self._ctx.Pipe(duplex=False)
        reply_recv, reply_send = self._ctx.Pipe(duplex=False)
        self._requests.append(request_recv)
        self._replies[id(request_recv)] = (reply_send, threading.Lock())
        return request_send, reply_recv

    def start(self) -> None:
        self._thread = threading.Thread(target=self._serve, daemon=True, name="normtune-host-compiler")
        self._thread.start()

    def stop(self) -> None:
        """Stop serving and stop the pools (their processes killed, queued jobs dropped)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        _stop_pools(self._pools)

    def _serve(self) -> None:
        open_ends = list(self._requests)
        while open_ends and not self._stop.is_set():
            for end in wait(open_ends, timeout=0.5):
                try:
                    message = end.recv()
                except (EOFError, OSError):  # that worker is gone
                    open_ends.remove(end)
                    continue
                self._submit(end, *message)

    def _submit(self, end, job_id: int, device: int, problem: dict, config_json: str, sms: int) -> None:
        key = (id(self._pools[device]), json.dumps(problem, sort_keys=True), config_json, sms)
        with self._lock:
            future = self._jobs.get(key)
            if future is None:
                future = self._pools[device].submit(self._compile, problem, config_json, sms)
                self._jobs[key] = future
                self.compiles += 1
        future.add_done_callback(lambda f: self._reply(end, job_id, f))

    def _reply(self, end, job_id: int, future: Future) -> None:
        try:
            outcome = ("ok", future.result())
        except BaseException as err:  # noqa: BLE001 - a broken pool or a cancelled job: the worker compiles it
            outcome = ("failed", f"{type(err).__name__}: {err}")
        reply, lock = self._replies[id(end)]
        try:
            with lock:
                reply.send((job_id, *outcome))
        except (OSError, ValueError):  # that worker is gone
            pass


def _pools_by_kind(devices: list[int], processes: int, kinds: list[str] | None) -> dict[int, object]:
    """Device index -> the executor compiling its jobs: `processes` shared out among the kinds of `devices`."""
    kinds = kinds or [""] * len(devices)
    of_kind: dict[str, list[int]] = {}
    for device, kind in zip(devices, kinds):
        of_kind.setdefault(kind, []).append(device)
    executors = {kind: compile_pool(share_of(processes, len(of_kind), i), group)
                 for i, (kind, group) in enumerate(of_kind.items())}
    return {device: executors[kind] for device, kind in zip(devices, kinds)}


def _stop_pools(pools: dict[int, object]) -> None:
    from .compiling import stop_pool

    for pool in {id(p): p for p in pools.values()}.values():
        if hasattr(pool, "_processes"):
            stop_pool(pool)
        else:
            pool.shutdown(wait=False, cancel_futures=True)


class RemoteCompilePool:
    """A worker's side of the host's compile pool: `submit(compile_one, problem, config_json, sms)` returns a
    Future that the host's reply fulfils; `shutdown` drops what is pending."""

    def __init__(self, ends: tuple, device: int):
        self._send, self._recv = ends
        self._device = device
        self._pending: dict[int, Future] = {}
        self._next = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._receive, daemon=True, name="normtune-compile-replies").start()

    def submit(self, fn, problem: dict, config_json: str, sms: int) -> Future:
        """A future of `fn(problem, config_json, sms)` compiled by the host (`fn` is `compile_one`)."""
        future: Future = Future()
        with self._lock:
            job_id, self._next = self._next, self._next + 1
            self._pending[job_id] = future
        try:
            self._send.send((job_id, self._device, problem, config_json, sms))
        except (OSError, ValueError) as err:  # the launcher is gone
            self._fail(job_id, err)
        return future

    def _receive(self) -> None:
        while True:
            try:
                job_id, status, value = self._recv.recv()
            except (EOFError, OSError) as err:  # the launcher is gone: every pending job fails
                for job_id in list(self._pending):
                    self._fail(job_id, err)
                return
            with self._lock:
                future = self._pending.pop(job_id, None)
            if future is None:
                continue
            try:
                if status == "ok":
                    future.set_result(tuple(value))
                else:
                    future.set_exception(RuntimeError(value))
            except InvalidStateError:  # cancelled meanwhile
                pass

    def _fail(self, job_id: int, err: BaseException) -> None:
        with self._lock:
            future = self._pending.pop(job_id, None)
        if future is not None and not future.done():
            try:
                future.set_exception(RuntimeError(f"the host's compile pool is gone: {err}"))
            except InvalidStateError:
                pass

    def shutdown(self, wait: bool = False, cancel_futures: bool = True) -> None:
        """Stop submitting: pending futures are cancelled, the request pipe closed (the host drops this worker)."""
        with self._lock:
            pending, self._pending = list(self._pending.values()), {}
        for future in pending:
            future.cancel()
        try:
            self._send.close()
        except OSError:
            pass
