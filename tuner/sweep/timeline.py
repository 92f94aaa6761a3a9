"""When a sweep's start-up steps happened, in seconds since its command started: the first time each step is
reached in this process (`mark`), kept with the worker's costs so that the stored breakdown shows what the
first measurement waited on.

The command's start is this process's own start (read from /proc on Linux, else the time this module was first
imported), or the start a parent process recorded in $NORMTUNE_SWEEP_STARTED for the processes it spawns (the
workers of `--devices`, the measuring processes): every process of one sweep counts from the same moment.
"""

from __future__ import annotations

import os
import threading
import time

ENV = "NORMTUNE_SWEEP_STARTED"
_IMPORTED_AT = time.time()
_marks: dict[str, float] = {}
_lock = threading.Lock()


def _process_start() -> float | None:
    """This process's start as a Unix time, from /proc (None where there is no /proc)."""
    try:
        with open("/proc/self/stat") as fh:
            ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as fh:
            uptime = float(fh.read().split()[0])
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def origin() -> float:
    """The command's start as a Unix time; recorded in the environment the first time it is asked for, so that
    the processes this one spawns count from it too."""
    text = os.environ.get(ENV)
    if text:
        try:
            return float(text)
        except ValueError:
            pass
    start = _process_start() or _IMPORTED_AT
    os.environ[ENV] = repr(start)
    return start


def start_command() -> float:
    """Record this process's start as the command's (whatever an earlier process recorded): the `normtune sweep`
    command calls it first, so that the processes it spawns count from it."""
    os.environ.pop(ENV, None)
    return origin()


def mark(name: str, at: float | None = None) -> None:
    """Record that step `name` happened now (or at the Unix time `at`); only its first time counts."""
    with _lock:
        if name not in _marks:
            _marks[name] = time.time() if at is None else at


def adopt(steps: dict[str, float], prefix: str) -> None:
    """Record another process's steps of this command (`marks()` there), named with `prefix`: a `--devices`
    worker keeps its launcher's, so that its stored timeline shows what it started before the launcher was done."""
    start = origin()
    for name, at in steps.items():
        mark(prefix + name, at=start + at)


def forget(names) -> None:
    """Drop the marks `names`: a sweep run in a process that ran one before records its own steps again."""
    with _lock:
        for name in names:
            _marks.pop(name, None)


def own_marks() -> dict[str, float]:
    """The steps reached so far as Unix times, for the process that started this one to `mark` as they are."""
    with _lock:
        return dict(_marks)


def marks() -> dict[str, float]:
    """The steps reached so far, in seconds since the command started, in the order they happened."""
    start = origin()
    with _lock:
        return {name: round(at - start, 3) for name, at in sorted(_marks.items(), key=lambda kv: kv[1])}


def line(names) -> str:
    """'name t, …' for the steps of `names` reached so far, in seconds since the command started (its closing
    steps, say); empty when none was reached."""
    steps = marks()
    return ", ".join(f"{name.replace('_', ' ')} {steps[name]:.1f}" for name in names if name in steps)
