"""Compile-ahead workers: CPU processes that compile upcoming configs so that Triton's on-disk cache serves the
measuring process (the GPU never waits on a compiler). One sweep worker has a pool of its own; the workers of
`--devices` share the host's (`host_pool`)."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import threading
import time
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Callable

from .timeline import mark

log = logging.getLogger("normtune.sweep")


def compile_pool(workers: int, devices: int | list[int]) -> ProcessPoolExecutor | None:
    """`workers` compiling processes for the GPU `devices` (None: compile in the measuring process). Given several
    devices of one kind, the processes' CUDA contexts are spread over them, one device after another."""
    if workers <= 0:
        return None
    ctx = mp.get_context("spawn")
    devices = [devices] if isinstance(devices, int) else list(devices)
    pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_compile_init,
                               initargs=(devices, ctx.Value("i", 0), os.getpid()))
    left, lock = [workers], threading.Lock()

    def warmed(_future) -> None:  # the last warm-up done: the pool's start-up is over ("compilers_ready")
        with lock:
            left[0] -= 1
            if left[0] == 0:
                mark("compilers_ready")

    for _ in range(workers):  # start every process now (they start on demand), in parallel with the sweep's setup
        pool.submit(_warm_up).add_done_callback(warmed)
    return pool


# Compile processes per GPU by default, within the host's cores: from an empty Triton cache a config's compile
# takes far longer than its measurement, so a GPU is fed only by many compiles at once (the seeds compiled ahead
# of their claims, `compile_ahead.py`, keep that many busy).
COMPILERS_PER_GPU = 16


def default_compile_workers(gpus: int, cpus: int | None = None) -> int:
    """The host's compile processes for a sweep on `gpus` GPUs: COMPILERS_PER_GPU each, within the host's cores
    less two per GPU (its sweep worker and its measuring process). A shared budget that did not grow with the
    GPUs made every added GPU wait on the compilers."""
    cpus = cpus or usable_cpus()
    return max(1, min(COMPILERS_PER_GPU * gpus, cpus - 2 * gpus))


def usable_cpus() -> int:
    """The cores this process may run on (its affinity: `taskset`, a cgroup cpuset), else the host's count."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def share_of(total: int, workers: int, index: int) -> int:
    """Share `index` of `total` compile processes divided among `workers` pools (the host's kinds of GPU, or
    sweep workers with pools of their own): the host's cores are divided, not multiplied (at least one each when
    total > 0)."""
    if total <= 0:
        return 0
    return max(1, total // workers + (1 if index < total % workers else 0))


def wait_compiled(future: Future, timeout_s: float, abandoned: Callable[[], bool],
                  tick: Callable[[], None] = lambda: None, enough: Callable[[], bool] = lambda: False):
    """(status, seconds, error) of a compile-ahead job; None when `abandoned()` turns true while waiting. A broken
    pool, a compile past `timeout_s` or `enough()` turning true yields ("ok", None, None): the measuring process
    compiles it itself. `tick` is called, and `enough` asked, at every poll of the wait."""
    deadline = time.monotonic() + timeout_s
    if not future.done() and enough():
        return "ok", None, None
    while True:
        try:
            return future.result(timeout=0.05)
        except FutureTimeout:
            tick()
            if abandoned():
                future.cancel()
                return None
            if time.monotonic() > deadline or enough():
                return "ok", None, None
        except Exception as err:  # noqa: BLE001 - a broken pool: measure (and compile) in the measurer
            log.debug("compile-ahead failed: %s", err)
            return "ok", None, None


def pool_usable(pool) -> bool:
    """Whether a compile pool still takes jobs (none of its processes died, it was not shut down)."""
    return not (getattr(pool, "_broken", False) or getattr(pool, "_shutdown_thread", False))


def stop_pool(pool) -> None:
    """Stop a compile pool now: its processes killed (they hold nothing to save), queued jobs cancelled. The
    processes are taken before `shutdown`, which forgets them: left running, they would finish their compiles
    while the pool's thread waits for them, holding the pool's lock that a later `shutdown` call waits on."""
    if pool is None:
        return
    for proc in list((getattr(pool, "_processes", None) or {}).values()):
        try:
            proc.kill()
        except (OSError, ValueError, AttributeError):
            pass
    pool.shutdown(wait=False, cancel_futures=True)


# Why this compile process cannot compile (its device is unusable), else None: its jobs then answer "not compiled
# ahead" and the measuring process compiles (or reports the device's failure) itself.
_UNUSABLE: list[str] = []
_CHECKED: list[bool] = []


def _compile_init(devices: list[int], started, parent_pid: int) -> None:
    """Set up a compile process for the next of `devices` (`started` counts the pool's processes so far): that
    device is the only one it sees, and it touches the driver only when its first job needs the device's facts.
    A CUDA context per process made at once (hundreds of MiB each) serialized every process's driver start-up,
    the measuring processes' included; and the pool runs below the measuring and sweep processes' priority, so
    that compiling never delays the path to the GPU."""
    from .lifeline import die_with_parent, ignore_stop_signals

    die_with_parent(parent_pid)
    ignore_stop_signals()
    with started.get_lock():
        index, started.value = started.value, started.value + 1
    os.environ["CUDA_VISIBLE_DEVICES"] = visible_device(devices[index % len(devices)])
    try:
        os.nice(5)
    except OSError:
        pass


def visible_device(index: int, visible: str | None = None) -> str:
    """CUDA_VISIBLE_DEVICES naming device `index` of this process's own view (`visible`: that variable here,
    read from the environment when None), so that a child process sees that device alone, as its device 0."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    if visible is None or not visible.strip():
        return str(index)
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    return entries[index] if 0 <= index < len(entries) else str(index)


def _usable() -> bool:
    """Whether this process's device answers (checked on the first job; a failure is kept in _UNUSABLE)."""
    if not _CHECKED:
        _CHECKED.append(True)
        try:
            import torch

            torch.cuda.get_device_properties(0)
        except Exception as err:  # noqa: BLE001 - started before the sweep checked its device: no traceback here
            _UNUSABLE.append(f"{type(err).__name__}: {err}")
    return not _UNUSABLE


def _warm_up() -> None:
    """Import what compiling needs, so that the first config's compile does not pay for it. The driver starts
    with the first job: dozens of processes starting it at once here delayed the measuring processes' own start
    and the sweep's device detection by seconds."""
    import normtune.kernels.backward_launch  # noqa: F401


def compile_one(problem_dict: dict, config_json: str, sms: int) -> tuple[str, float, str | None]:
    """(status, seconds, error) of compiling a config ahead of its measurement; ("ok", None, None) where this
    process cannot compile (the measuring process then compiles it)."""
    if not _usable():
        return "ok", None, None
    from normtune.kernels.backward_launch import precompile
    from normtune.kernels.config import BackwardConfig as BC
    from normtune.kernels.config import Problem as P

    from ..measure.harness import classify_exception

    t = time.perf_counter()
    try:
        precompile(P.from_dict(problem_dict), BC.from_json(config_json), sms)
        return "ok", time.perf_counter() - t, None
    except Exception as err:  # noqa: BLE001
        return classify_exception(err), time.perf_counter() - t, f"{type(err).__name__}: {str(err)[:3000]}"
